"""Deterministic CLIP / SigLIP dual encoder, and the model sizes every method shares."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.gather import World
from models.registry import register_model
from models.towers import ImageTower, TextTower


class CLIP(nn.Module):
    """[CLS] of a ViT and EOT token of a causal text transformer, linearly projected and L2-normalised."""
    # encode_* return mu only
    probabilistic = False

    def __init__(
        self, *, img_size: int = 224, patch_size: int = 16, vision_width: int = 768, vision_depth: int = 12,
        vision_heads: int = 12, vision_pre_norm: bool = True, context_length: int = 64, text_width: int = 512,
        text_depth: int = 12, text_heads: int = 8, embed_dim: int = 768,
    ):
        super().__init__()
        self.visual = ImageTower(img_size, patch_size, vision_width, vision_depth, vision_heads,
                                 pre_norm=vision_pre_norm)
        self.text = TextTower(context_length, text_width, text_depth, text_heads)
        self.image_proj = nn.Linear(vision_width, embed_dim, bias=False)
        self.text_proj = nn.Linear(text_width, embed_dim, bias=False)
        self.context_length = context_length
        self.img_size = img_size

    def encode_image(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = self.visual(images)
        return {"mu": F.normalize(self.image_proj(tokens[:, 0]), dim=-1)}

    def encode_text(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.text(tokens)
        pooled = x[torch.arange(x.shape[0], device=x.device), self.text.eot_index(tokens)]
        return {"mu": F.normalize(self.text_proj(pooled), dim=-1)}

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, world: World | None = None) -> dict[str, torch.Tensor]:
        img, txt = self.encode_image(images), self.encode_text(tokens)
        return {"image_mu": img["mu"], "text_mu": txt["mu"]}

    @staticmethod
    def class_embeddings(template_out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """(C, T, D) per-template text outputs -> one embedding per class (mean of mu, renormalised)."""
        return {"mu": F.normalize(template_out["mu"].mean(dim=1), dim=-1)}

    @staticmethod
    def class_scores(image_out: dict[str, torch.Tensor], class_out: dict[str, torch.Tensor]) -> torch.Tensor:
        """(N, C) scores, larger is more likely."""
        return image_out["mu"] @ class_out["mu"].T


# Tiny: CPU tests and the demo (no ln_pre, see ImageTower; vision_pre_norm=True to load CLIP weights).
# B16: the papers' ViT-B/16 with a 12-layer 512-wide text transformer, 768-d embeddings and a 64-token text context (ProLIP B.1).
TINY = dict(img_size=32, patch_size=8, vision_width=64, vision_depth=2, vision_heads=2, vision_pre_norm=False,
            context_length=16, text_width=64, text_depth=2, text_heads=2, embed_dim=64)
B16 = dict(img_size=224, patch_size=16, vision_width=768, vision_depth=12, vision_heads=12,
           context_length=64, text_width=512, text_depth=12, text_heads=8, embed_dim=768)


@register_model("clip_tiny", default_loss="infonce", arch=CLIP)
def clip_tiny(**overrides) -> CLIP:
    return CLIP(**{**TINY, **overrides})


@register_model("clip_vit_b16", default_loss="infonce", arch=CLIP)
def clip_vit_b16(**overrides) -> CLIP:
    return CLIP(**{**B16, **overrides})


@register_model("siglip_tiny", default_loss="siglip", arch=CLIP)
def siglip_tiny(**overrides) -> CLIP:
    return CLIP(**{**TINY, **overrides})


@register_model("siglip_vit_b16", default_loss="siglip", arch=CLIP)
def siglip_vit_b16(**overrides) -> CLIP:
    return CLIP(**{**B16, **overrides})
