"""Llip (Lavoie et al. 2024, arXiv:2405.00740): K visual mixture tokens mixed per caption by a text-conditioned cross-attention.

The image tower carries K learnable mixture tokens instead of [CLS]; their outputs, projected to
the embedding width, are the keys and values of ``models.llip_mixer.LlipMixer`` (8 heads, temperature
tau, output projection), whose queries are the captions' embeddings (Eq. 1-2). The forward computes
the contextualised cosines of the local images against the captions of ALL workers
(``world.gather``, with gradient) inside the module's forward, as ZeRO-3 requires, for the sigmoid
loss (Eq. 3). Zero-shot contextualises every image with each class's template-averaged query.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.gather import World
from models.llip_mixer import LlipMixer
from models.towers import TowerConfig


class Llip(nn.Module):
    # encode_* return mu (and the mixture tokens); scored by the contextualised cosine
    probabilistic = False

    def __init__(self, towers: TowerConfig = TowerConfig(), *, mixture_tokens: int = 64, mixer_heads: int = 8,
                 tau: float = 5.0):
        super().__init__()
        if mixture_tokens < 1:
            raise ValueError("mixture_tokens must be >= 1")
        self.visual = towers.image_tower(extra_tokens=mixture_tokens, class_token=False)
        self.text = towers.text_tower()
        self.image_proj, self.text_proj = towers.projections()
        self.mixer = LlipMixer(towers.embed_dim, heads=mixer_heads, tau=tau)
        self.context_length, self.img_size, self.mixture_tokens = towers.context_length, towers.img_size, mixture_tokens

    def encode_image(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """"mix": (B, K, D) projected mixture tokens; "mu": their normalised mean (uncontextualised summary)."""
        mix = self.image_proj(self.visual(images)[:, : self.mixture_tokens])
        return {"mu": F.normalize(mix.mean(dim=1), dim=-1), "mix": mix}

    def encode_text(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.text(tokens)
        pooled = x[torch.arange(x.shape[0], device=x.device), self.text.eot_index(tokens)]
        return {"mu": F.normalize(self.text_proj(pooled), dim=-1)}

    def pair_cos(self, mix: torch.Tensor, text_mu: torch.Tensor, world: World) -> torch.Tensor:
        """(B_local, N_global) contextualised cosines; the captions are gathered from every worker."""
        text_all = world.gather(text_mu)
        return self.mixer(mix, text_all, text_all)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, world: World | None = None) -> dict[str, torch.Tensor]:
        world = world or World.current()
        img, txt = self.encode_image(images), self.encode_text(tokens)
        return {"image_mu": img["mu"], "text_mu": txt["mu"], "pair_cos": self.pair_cos(img["mix"], txt["mu"], world)}

    @staticmethod
    def class_embeddings(template_out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Template-averaged caption embedding per class: the query and the target of the contextualisation."""
        return {"mu": F.normalize(template_out["mu"].float().mean(dim=1), dim=-1)}

    def class_scores(self, image_out: dict[str, torch.Tensor], class_out: dict[str, torch.Tensor]) -> torch.Tensor:
        """(N, C) cosines of each image contextualised by each class's query (Llip Sec. 5, zero-shot)."""
        cls = class_out["mu"].to(image_out["mix"].dtype)
        return self.mixer(image_out["mix"], cls, cls)

