"""PCME++ (Chun 2024, arXiv:2305.18171): mu and log sigma^2 heads on CLIP towers, GPO pooling, mixed-sample augmentation.

Architecture (Sec. 2.5): the towers share all but their last transformer block; the mu head is the
last block (loaded with the backbone's weights when fine-tuning from CLIP), the log sigma^2 head a
randomly initialised duplicate of it. Each head's tokens are projected to the embedding space and
pooled by its own GPO (text: over the tokens up to EOT). In training mode the forward applies
Mixup or CutMix to a share ``msda_fraction`` of the images (Sec. 2.4; ``msda_selection``,
``msda_partner``, ``msda_switch`` choose the paper's or the official code's way, docs/FIDELITY.md)
and returns the soft-label information ``mix_lambda`` / ``mix_partner`` for the PML loss.
"""
from __future__ import annotations

import copy
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.accumulate import SplitForward
from models.heads import GPO, Float32Linear, gpo_tables
from models.prolip import negative_csd, prompt_ensemble
from models.towers import TowerConfig, reset_linear_and_norm


MSDA_SELECTIONS, MSDA_PARTNERS, MSDA_SWITCHES = ("exact", "bernoulli"), ("random", "reversed"), ("batch", "image")


def mixed_sample(images: torch.Tensor, fraction: float, beta: float, selection: str = "exact",
                 partner: str = "random", switch: str = "batch") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PCME++ MSDA: Mixup or CutMix on a share `fraction` of the images, lambda ~ Beta(beta, beta).

    selection: "exact" mixes round(fraction * B) random images (at least 1), "bernoulli" each image with
    probability `fraction` (official PCME++). partner: "random" (any image) or "reversed" (image B-1-i,
    official). switch: Mixup or CutMix (probability 1/2) drawn once per "batch" or per "image" (official).
    Returns mixed images, lambda (B,) (1 for untouched rows; for CutMix the pasted area's exact
    complement) and each row's partner (B,) (itself if untouched)."""
    # PCME++ Sec. 2.4: mixed image labels: lambda for its own caption, 1 - lambda for the partner's
    if selection not in MSDA_SELECTIONS or partner not in MSDA_PARTNERS or switch not in MSDA_SWITCHES:
        raise ValueError(f"MSDA: selection in {MSDA_SELECTIONS}, partner in {MSDA_PARTNERS}, switch in {MSDA_SWITCHES}; "
                         f"got {selection!r}, {partner!r}, {switch!r}")
    b, device = images.shape[0], images.device
    lam = images.new_ones(b, dtype=torch.float32)
    partners = torch.arange(b, device=device)
    if selection == "exact":
        n = max(1, int(round(fraction * b))) if fraction > 0 else 0
        rows = torch.randperm(b, device=device)[:n]
    else:
        rows = torch.nonzero(torch.rand(b, device=device) < fraction).flatten()
        n = len(rows)
    if n == 0:
        return images, lam, partners
    other = torch.randint(0, b, (n,), device=device) if partner == "random" else b - 1 - rows
    # Host-drawn values reach the device without non_blocking's stream sync (a pageable copy is staged at once)
    beta_t = torch.tensor(float(beta))
    draw = torch.distributions.Beta(beta_t, beta_t, validate_args=False).sample((n,)).to(device, non_blocking=True)
    src, dst = images[rows], images[other]
    if switch == "batch":
        coin = torch.rand(()) >= 0.5  # on the host
        use_cut = coin.expand(n).to(device, non_blocking=True)
    else:
        use_cut = torch.rand(n, device=device) >= 0.5
    # Whether to build the CutMix box at all: the batch's coin is read on the host (no device sync), the per-image
    # switch reads the device (a sync); compiled, always built (a branch on a value would break the graph)
    any_cut = True if torch.compiler.is_compiling() else bool(coin) if switch == "batch" else bool(use_cut.any())
    # Mixup (Zhang et al. 2018)
    w = draw.to(images.dtype).view(-1, 1, 1, 1)
    mixed, row_lam = w * src + (1 - w) * dst, draw
    if any_cut:  # CutMix (Yun et al. 2019): a box with area ~ (1 - lambda) from the partner
        h, wd = images.shape[-2:]
        cut = (1.0 - draw).sqrt()
        cy, cx = torch.rand(n, device=device) * h, torch.rand(n, device=device) * wd
        y0, y1 = (cy - cut * h / 2).clamp(0, h), (cy + cut * h / 2).clamp(0, h)
        x0, x1 = (cx - cut * wd / 2).clamp(0, wd), (cx + cut * wd / 2).clamp(0, wd)
        ys = torch.arange(h, device=device).view(1, h, 1) + 0.5
        xs = torch.arange(wd, device=device).view(1, 1, wd) + 0.5
        box = ((ys >= y0.view(-1, 1, 1)) & (ys < y1.view(-1, 1, 1)) & (xs >= x0.view(-1, 1, 1)) & (xs < x1.view(-1, 1, 1)))
        cutmixed = torch.where(box.unsqueeze(1), dst, src)
        mixed = torch.where(use_cut.view(-1, 1, 1, 1), cutmixed, mixed)
        row_lam = torch.where(use_cut, 1.0 - box.float().mean(dim=(1, 2)), draw)
    images = images.clone()
    images[rows] = mixed
    lam[rows] = row_lam.float()
    partners[rows] = other
    return images, lam, partners


class PCMEPP(SplitForward, nn.Module):
    # encode_* return log sigma^2 ("logvar") beside mu: scored by CSD, calibrated in evaluation
    probabilistic = True

    def __init__(self, towers: TowerConfig = TowerConfig(), *, logvar_bias_init: float = -5.0,
                 msda_fraction: float = 0.25, msda_beta: float = 2.0,
                 msda_selection: Literal["exact", "bernoulli"] = "exact",
                 msda_partner: Literal["random", "reversed"] = "random",
                 msda_switch: Literal["batch", "image"] = "batch"):
        super().__init__()
        if not 0.0 <= msda_fraction <= 1.0 or msda_beta <= 0:
            raise ValueError("msda_fraction must be in [0, 1] and msda_beta > 0")
        if msda_selection not in MSDA_SELECTIONS or msda_partner not in MSDA_PARTNERS or msda_switch not in MSDA_SWITCHES:
            raise ValueError(f"msda_selection in {MSDA_SELECTIONS}, msda_partner in {MSDA_PARTNERS}, "
                             f"msda_switch in {MSDA_SWITCHES}")
        self.msda = {"selection": msda_selection, "partner": msda_partner, "switch": msda_switch}
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
        # float32 heads: bf16 would hold log sigma^2 near its init in 6% steps of sigma^2 (models.heads)
        self.image_var_proj = Float32Linear(towers.vision_width, towers.embed_dim)
        self.text_var_proj = Float32Linear(towers.text_width, towers.embed_dim)
        for proj in (self.image_var_proj, self.text_var_proj):
            nn.init.constant_(proj.bias, logvar_bias_init)
        self.image_gpo, self.image_var_gpo, self.text_gpo, self.text_var_gpo = (GPO() for _ in range(4))
        self.context_length, self.img_size = towers.context_length, towers.img_size
        self.msda_fraction, self.msda_beta = msda_fraction, msda_beta

    def encode_image(self, images: torch.Tensor, tables: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """``tables``: the mean and variance GPOs' weight tables (``features`` makes all four GPOs' in one pass)."""
        mu_table, var_table = tables or (None, None)
        vit, run = self.visual.vit, self.visual.run  # run: the tower's block loop (checkpointed if set)
        h = run(self.visual.embed(images), vit.blocks[:-1])
        mu = self.image_gpo(self.image_proj(vit.norm(run(h, vit.blocks[-1:]))), table=mu_table)
        logvar = self.image_var_gpo(self.image_var_proj(self.image_var_norm(run(h, [self.image_var_block]))),
                                    table=var_table)
        return {"mu": F.normalize(mu, dim=-1), "logvar": logvar}

    def encode_text(self, tokens: torch.Tensor, tables: list[torch.Tensor] | None = None,
                    embedded: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
        """``embedded``: ``self.text.embed(tokens)`` where the caller has it; ``tables`` as ``encode_image``'s."""
        mu_table, var_table = tables or (None, None)
        x, attn = self.text.embed(tokens) if embedded is None else embedded
        h = self.text.run(x, self.text.blocks[:-1], attn)
        lengths = self.text.eot_index(tokens) + 1  # tokens up to and including EOT
        mu_tokens = self.text.ln_final(self.text.run(h, self.text.blocks[-1:], attn))
        var_tokens = self.text_var_norm(self.text.run(h, [self.text_var_block], attn))
        mu = self.text_gpo(self.text_proj(mu_tokens), lengths, mu_table)
        logvar = self.text_var_gpo(self.text_var_proj(var_tokens), lengths, var_table)
        return {"mu": F.normalize(mu, dim=-1), "logvar": logvar}

    def draw(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
        """MSDA over the whole batch (a partner may be any of its images): the mixed images, and mix_lambda /
        mix_partner (batch row indices) for the loss's soft labels."""
        if not (self.training and self.msda_fraction > 0):
            return images, {}, {}
        images, lam, partner = mixed_sample(images, self.msda_fraction, self.msda_beta, **self.msda)
        return images, {}, {"mix_lambda": lam, "mix_partner": partner}

    def features(self, images: torch.Tensor, tokens: torch.Tensor, draws: dict) -> dict[str, torch.Tensor]:
        embedded = self.text.embed(tokens)  # first: its padding trim reads the batch's length on the host
        # (on a GPU, before the towers' work is queued). Off the CPU the four GPOs take their weights from one GRU
        # pass: a GPU launches kernels per sequential step, 2 x 197 + 2 x 64 of them at ViT-B/16 one by one, 197
        # together. On a CPU that saves little, and autograd would keep the 4x-wide recurrent weight at every step.
        tables = [None] * 4
        if images.device.type != "cpu":
            n_image, n_text = self.visual.num_prefix + self.visual.num_patches, embedded[0].shape[1]
            tables = gpo_tables([(self.image_gpo, n_image, False), (self.image_var_gpo, n_image, False),
                                 (self.text_gpo, n_text, True), (self.text_var_gpo, n_text, True)], images.device)
        txt = self.encode_text(tokens, tables[2:], embedded)
        img = self.encode_image(images, tables[:2])
        return {"image_mu": img["mu"], "image_logvar": img["logvar"], "text_mu": txt["mu"],
                "text_logvar": txt["logvar"]}

    # zero-shot: prompt ensemble per class, scored by the negative CSD
    class_embeddings = staticmethod(prompt_ensemble)
    class_scores = staticmethod(negative_csd)

