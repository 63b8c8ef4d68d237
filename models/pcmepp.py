"""PCME++ (Chun 2024, arXiv:2305.18171): mu and log sigma^2 heads on CLIP towers, GPO pooling, mixed-sample augmentation.

Architecture (Sec. 2.5): the towers share all but their last transformer block; the mu head is the
last block (loaded with the backbone's weights when fine-tuning from CLIP), the log sigma^2 head a
randomly initialised duplicate of it. Each head's tokens are projected to the embedding space and
pooled by its own GPO (text: over the tokens up to EOT). In training mode the forward applies
Mixup or CutMix (chosen per batch) to a random ``msda_fraction`` of the images (Sec. 2.4) and
returns the soft-label information ``mix_lambda`` / ``mix_partner`` for the PML loss.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.gather import World
from models.heads import GPO
from models.prolip import negative_csd, prompt_ensemble
from models.towers import TowerConfig, reset_linear_and_norm


def mixed_sample(images: torch.Tensor, fraction: float, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PCME++ MSDA: Mixup or CutMix (one of them per batch, with probability 1/2) on a random `fraction`
    of the images, lambda ~ Beta(beta, beta). Returns mixed images, lambda (B,) (1 for untouched rows;
    for CutMix the pasted area's exact complement) and each row's partner (B,) (itself if untouched)."""
    # PCME++ Sec. 2.4: mixed image labels: lambda for its own caption, 1 - lambda for the partner's
    b = images.shape[0]
    n = max(1, int(round(fraction * b))) if fraction > 0 else 0
    lam = images.new_ones(b, dtype=torch.float32)
    partner = torch.arange(b, device=images.device)
    if n == 0:
        return images, lam, partner
    rows = torch.randperm(b, device=images.device)[:n]
    other = torch.randint(0, b, (n,), device=images.device)
    draw = torch.distributions.Beta(torch.tensor(float(beta)), torch.tensor(float(beta))).sample((n,)).to(images.device)
    src, dst = images[rows], images[other]
    if torch.rand(()) < 0.5:  # Mixup (Zhang et al. 2018)
        w = draw.to(images.dtype).view(-1, 1, 1, 1)
        mixed = w * src + (1 - w) * dst
        row_lam = draw
    else:  # CutMix (Yun et al. 2019): a box with area ~ (1 - lambda) from the partner
        h, w = images.shape[-2:]
        cut = (1.0 - draw).sqrt()
        cy, cx = torch.rand(n, device=images.device) * h, torch.rand(n, device=images.device) * w
        y0, y1 = (cy - cut * h / 2).clamp(0, h), (cy + cut * h / 2).clamp(0, h)
        x0, x1 = (cx - cut * w / 2).clamp(0, w), (cx + cut * w / 2).clamp(0, w)
        ys = torch.arange(h, device=images.device).view(1, h, 1) + 0.5
        xs = torch.arange(w, device=images.device).view(1, 1, w) + 0.5
        box = ((ys >= y0.view(-1, 1, 1)) & (ys < y1.view(-1, 1, 1)) & (xs >= x0.view(-1, 1, 1)) & (xs < x1.view(-1, 1, 1)))
        mixed = torch.where(box.unsqueeze(1), dst, src)
        row_lam = 1.0 - box.float().mean(dim=(1, 2))
    images = images.clone()
    images[rows] = mixed
    lam[rows] = row_lam.float()
    partner[rows] = other
    return images, lam, partner


class PCMEPP(nn.Module):
    # encode_* return log sigma^2 ("logvar") beside mu: scored by CSD, calibrated in evaluation
    probabilistic = True

    def __init__(self, towers: TowerConfig = TowerConfig(), *, logvar_bias_init: float = -5.0,
                 msda_fraction: float = 0.25, msda_beta: float = 2.0):
        super().__init__()
        if not 0.0 <= msda_fraction <= 1.0 or msda_beta <= 0:
            raise ValueError("msda_fraction must be in [0, 1] and msda_beta > 0")
        self.visual = towers.image_tower()
        self.text = towers.text_tower()
        # log sigma^2 heads: duplicates of the last block, freshly initialised, with their own final norm
        self.image_var_block = copy.deepcopy(self.visual.vit.blocks[-1])
        self.image_var_norm = copy.deepcopy(self.visual.vit.norm)
        self.text_var_block = copy.deepcopy(self.text.blocks[-1])
        self.text_var_norm = copy.deepcopy(self.text.ln_final)
        for m in (self.image_var_block, self.image_var_norm, self.text_var_block, self.text_var_norm):
            reset_linear_and_norm(m)
        self.image_proj, self.text_proj = towers.projections()
        self.image_var_proj, self.text_var_proj = towers.projections(bias=True)
        for proj in (self.image_var_proj, self.text_var_proj):
            nn.init.constant_(proj.bias, logvar_bias_init)
        self.image_gpo, self.image_var_gpo, self.text_gpo, self.text_var_gpo = (GPO() for _ in range(4))
        self.context_length, self.img_size = towers.context_length, towers.img_size
        self.msda_fraction, self.msda_beta = msda_fraction, msda_beta

    def encode_image(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        vit = self.visual.vit
        h = self.visual.embed(images)
        for blk in vit.blocks[:-1]:
            h = blk(h)
        mu = self.image_gpo(self.image_proj(vit.norm(vit.blocks[-1](h))))
        logvar = self.image_var_gpo(self.image_var_proj(self.image_var_norm(self.image_var_block(h))))
        return {"mu": F.normalize(mu, dim=-1), "logvar": logvar}

    def encode_text(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        x, attn = self.text.embed(tokens)
        h = self.text.run(x, self.text.blocks[:-1], attn)
        lengths = self.text.eot_index(tokens) + 1  # tokens up to and including EOT
        mu_tokens = self.text.ln_final(self.text.run(h, self.text.blocks[-1:], attn))
        var_tokens = self.text_var_norm(self.text.run(h, [self.text_var_block], attn))
        mu = self.text_gpo(self.text_proj(mu_tokens), lengths)
        logvar = self.text_var_gpo(self.text_var_proj(var_tokens), lengths)
        return {"mu": F.normalize(mu, dim=-1), "logvar": logvar}

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, world: World | None = None) -> dict[str, torch.Tensor]:
        out = {}
        if self.training and self.msda_fraction > 0:
            images, lam, partner = mixed_sample(images, self.msda_fraction, self.msda_beta)
            out.update(mix_lambda=lam, mix_partner=partner)
        img, txt = self.encode_image(images), self.encode_text(tokens)
        return {"image_mu": img["mu"], "image_logvar": img["logvar"], "text_mu": txt["mu"],
                "text_logvar": txt["logvar"], **out}

    # zero-shot: prompt ensemble per class, scored by the negative CSD
    class_embeddings = staticmethod(prompt_ensemble)
    class_scores = staticmethod(negative_csd)

