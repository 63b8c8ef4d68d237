"""Deterministic CLIP / SigLIP dual encoder."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.accumulate import SplitForward
from models.towers import TowerConfig


class CLIP(SplitForward, nn.Module):
    """[CLS] of a ViT and EOT token of a causal text transformer, linearly projected and L2-normalised."""
    # encode_* return mu only
    probabilistic = False

    def __init__(self, towers: TowerConfig = TowerConfig()):
        super().__init__()
        self.visual = towers.image_tower()
        self.text = towers.text_tower()
        self.image_proj, self.text_proj = towers.projections()
        self.context_length, self.img_size = towers.context_length, towers.img_size

    def encode_image(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = self.visual(images)
        return {"mu": F.normalize(self.image_proj(tokens[:, 0]), dim=-1)}

    def encode_text(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.text(tokens)
        pooled = x[torch.arange(x.shape[0], device=x.device), self.text.eot_index(tokens)]
        return {"mu": F.normalize(self.text_proj(pooled), dim=-1)}

    def features(self, images: torch.Tensor, tokens: torch.Tensor, draws: dict) -> dict[str, torch.Tensor]:
        txt = self.encode_text(tokens)  # first: its padding trim reads the batch's length on the host
        img = self.encode_image(images)  # (on a GPU, before the image tower's work is queued)
        return {"image_mu": img["mu"], "text_mu": txt["mu"]}

    @staticmethod
    def class_embeddings(template_out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """(C, T, D) per-template text outputs -> one embedding per class (mean of mu, renormalised)."""
        return {"mu": F.normalize(template_out["mu"].mean(dim=1), dim=-1)}

    @staticmethod
    def class_scores(image_out: dict[str, torch.Tensor], class_out: dict[str, torch.Tensor]) -> torch.Tensor:
        """(N, C) scores, larger is more likely."""
        return image_out["mu"] @ class_out["mu"].T

