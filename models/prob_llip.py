"""Probabilistic Llip (beyond the papers): Llip's text-conditioned mixture tokens give the mean,
ProLIP's [UNC] tokens give the variance.

Image tower: [UNC] then K mixture tokens (no [CLS]); text tower as ProLIP's ([UNC], [CLS] appended).
The loss (``prob_llip``) is ProLIP's objective with PPCL's mu_v . mu_t replaced by the contextualised
cosine ``pair_cos``; inclusion and VIB use the uncontextualised image mean (normalised mean of the
projected mixture tokens) with the [UNC] variance. Masked copies as in ProLIP. Zero-shot: negative
CSD with the contextualised cosine, -(2 - 2 cos_ic + tr Sigma_i + tr Sigma_c), class mean and
variance from the prompt ensemble, the class mean being the query.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models.distributions import sigma_sq_sum
from models.gather import World
from models.llip_mixer import LlipMixer
from models.prolip import ProLIP
from models.towers import TowerConfig


class ProbLlip(ProLIP):
    def __init__(self, towers: TowerConfig = TowerConfig(), *, unc_bias_init: float = -10.0,
                 mask_fraction: float = 0.125, mask_ratio: float = 0.75, mixture_tokens: int = 64,
                 mixer_heads: int = 8, tau: float = 5.0):
        if mixture_tokens < 1:
            raise ValueError("mixture_tokens must be >= 1")
        self.mixture_tokens = mixture_tokens  # read by image_prefix() while ProLIP builds the towers
        super().__init__(towers, unc_bias_init=unc_bias_init, mask_fraction=mask_fraction, mask_ratio=mask_ratio)
        self.mixer = LlipMixer(towers.embed_dim, heads=mixer_heads, tau=tau)

    def image_prefix(self) -> dict:
        """[UNC] + K mixture tokens, no [CLS]."""
        return {"extra_tokens": 1 + self.mixture_tokens, "class_token": False}

    def encode_image(self, images: torch.Tensor, keep: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        x = self.visual(images, keep)  # [UNC], K mixture tokens, patches
        mix = self.image_proj(x[:, 1 : 1 + self.mixture_tokens])
        return {"mu": F.normalize(mix.mean(dim=1), dim=-1), "logvar": self.image_unc_proj(x[:, 0]), "mix": mix}

    def pair_out(self, features: dict[str, torch.Tensor], world: World) -> dict[str, torch.Tensor]:
        """The contextualised cosines of the local images' mixture tokens against every worker's captions."""
        text_all = world.gather(features["text_mu"])
        return {**features, "pair_cos": self.mixer(features["image_mix"], text_all, text_all)}

    def class_scores(self, image_out: dict[str, torch.Tensor], class_out: dict[str, torch.Tensor]) -> torch.Tensor:
        cls = class_out["mu"].to(image_out["mix"].dtype)
        cos = self.mixer(image_out["mix"], cls, cls).float()
        # CSD (PCME++ Eq. 1) with mu_i . mu_c := Llip's contextualised cosine (beyond the papers)
        tr_i, tr_c = sigma_sq_sum(image_out["logvar"].float()), sigma_sq_sum(class_out["logvar"].float())
        return -(2.0 - 2.0 * cos + tr_i[:, None] + tr_c[None, :])

