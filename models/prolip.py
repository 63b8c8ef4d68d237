"""ProLIP (Chun et al. 2024, arXiv:2410.18857): [CLS] gives mu, [UNC] gives log sigma^2, in both towers; masked copies for inclusion.

Image tower: [CLS] and [UNC] at the start of the sequence. Text tower: [UNC] and [CLS] appended at
the end (CLIP's text encoder pools at the end, not at a leading [CLS]). Both outputs are linearly
projected; the [UNC] projection's bias starts at -10. In training mode the forward also encodes
masked copies of a random ``mask_fraction`` of the pairs (``mask_ratio`` of the patch tokens dropped,
of the words replaced by [MASK]) for the inclusion loss inc(x in masked x) (ProLIP Eq. 6).
``image_mask_ratio``, ``text_mask``, ``mask_counts`` and ``image_mask`` select official ProLIP's masking
instead, ``text_unc_from`` its text variance (docs/FIDELITY.md).
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.distributions import csd, sigma_sq_sum
from models.accumulate import SplitForward
from models.gather import World
from models.heads import unc_projection
from models.towers import MASK_COUNTS, TEXT_MASK_MODES, TowerConfig, masked_count, random_keep, random_text_mask


def prompt_ensemble(template_out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """(C, T, D) per-template mu / logvar -> per class: mean of mu (renormalised), mean of sigma^2."""
    # ProLIP Sec. 4.2: class embedding = mean of the template means and mean of the template variances
    mu = F.normalize(template_out["mu"].float().mean(dim=1), dim=-1)
    logvar = torch.logsumexp(template_out["logvar"].float(), dim=1) - math.log(template_out["logvar"].shape[1])
    return {"mu": mu, "logvar": logvar}


def negative_csd(image_out: dict[str, torch.Tensor], class_out: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, C) scores -CSD(image, class): the smallest closed-form sampled distance wins."""
    # PCME++ Eq. 1 / ProLIP Sec. 4.2: zero-shot by the smallest CSD
    return -csd(image_out["mu"].float(), image_out["logvar"].float(), class_out["mu"].float(),
                class_out["logvar"].float())


def masked_rows(batch: int, fraction: float, device=None, counts: str = "round") -> torch.Tensor:
    """Random rows (sorted) for the masked copies: round(fraction * batch), at least 1 when fraction > 0
    (``counts="floor"``: official ProLIP's int(fraction * batch), which may be 0)."""
    n = masked_count(batch, fraction, counts)
    return torch.randperm(batch, device=device)[:n].sort().values


class ProLIP(SplitForward, nn.Module):
    """Options (paper defaults first; official ProLIP's second, docs/FIDELITY.md):
    image_mask_ratio (None: = mask_ratio | 0.25); text_mask "exact" | "bernoulli" (each word with
    probability mask_ratio); mask_counts "round" (round(share n), at least 1, for the masked rows and the
    kept patches) | "floor" (int(share n)); image_mask "per_row" (a random patch subset per masked image) |
    "batch" (one subset for all masked images); text_unc_from "unc" (the text [UNC] output) | "pooled"
    (the uncertainty projection of the projected [CLS] output, before normalisation).
    """

    # encode_* return log sigma^2 ("logvar") beside mu: scored by CSD, calibrated in evaluation
    probabilistic = True

    def __init__(self, towers: TowerConfig = TowerConfig(), *, unc_bias_init: float = -10.0,
                 mask_fraction: float = 0.125, mask_ratio: float = 0.75, image_mask_ratio: float | None = None,
                 text_mask: Literal["exact", "bernoulli"] = "exact", mask_counts: Literal["round", "floor"] = "round",
                 image_mask: Literal["per_row", "batch"] = "per_row",
                 text_unc_from: Literal["unc", "pooled"] = "unc"):
        super().__init__()
        image_mask_ratio = mask_ratio if image_mask_ratio is None else image_mask_ratio
        if not 0.0 <= mask_fraction <= 1.0 or not 0.0 <= mask_ratio < 1.0 or not 0.0 <= image_mask_ratio < 1.0:
            raise ValueError("mask_fraction must be in [0, 1], mask_ratio and image_mask_ratio in [0, 1)")
        if text_mask not in TEXT_MASK_MODES:
            raise ValueError(f"text_mask must be one of {TEXT_MASK_MODES}, got {text_mask!r}")
        if mask_counts not in MASK_COUNTS or image_mask not in ("per_row", "batch") \
                or text_unc_from not in ("unc", "pooled"):
            raise ValueError(f"mask_counts: {' | '.join(MASK_COUNTS)}, image_mask: per_row | batch, "
                             f"text_unc_from: unc | pooled; got {mask_counts!r}, {image_mask!r}, {text_unc_from!r}")
        t = towers
        self.visual = t.image_tower(**self.image_prefix())
        self.text = t.text_tower(append_tokens=2, mask_token=True)
        self.image_proj = nn.Linear(t.vision_width, t.embed_dim, bias=False)
        self.image_unc_proj = unc_projection(t.vision_width, t.embed_dim, unc_bias_init)
        self.text_proj = nn.Linear(t.text_width, t.embed_dim, bias=False)
        # text sigma^2 from the [UNC] output (text_width wide), or official ProLIP's from the projected [CLS] output
        unc_in = t.embed_dim if text_unc_from == "pooled" else t.text_width
        self.text_unc_proj = unc_projection(unc_in, t.embed_dim, unc_bias_init)
        self.context_length, self.img_size = t.context_length, t.img_size
        self.mask_fraction, self.mask_ratio = mask_fraction, mask_ratio
        self.image_mask_ratio, self.text_mask = image_mask_ratio, text_mask
        self.mask_counts, self.image_mask, self.text_unc_from = mask_counts, image_mask, text_unc_from

    def image_prefix(self) -> dict:
        """ImageTower prefix layout: [CLS] then [UNC]."""
        return {"extra_tokens": 1}

    def encode_image(self, images: torch.Tensor, keep: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        x = self.visual(images, keep)  # [CLS], [UNC], patches
        return {"mu": F.normalize(self.image_proj(x[:, 0]), dim=-1), "logvar": self.image_unc_proj(x[:, 1])}

    def encode_text(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        x = self.text(tokens, mask)  # ..., [UNC], [CLS]
        pooled = self.text_proj(x[:, -1])
        # ProLIP Sec. 3.1: log sigma^2 from the [UNC] output (official code: from the projected [CLS] output)
        logvar = self.text_unc_proj(pooled if self.text_unc_from == "pooled" else x[:, -2])
        return {"mu": F.normalize(pooled, dim=-1), "logvar": logvar}

    def masked_inputs(self, images: torch.Tensor, tokens: torch.Tensor):
        """Rows with masked copies, kept patch indices for them, and their text [MASK] positions."""
        rows = masked_rows(images.shape[0], self.mask_fraction, images.device, self.mask_counts)
        keep = random_keep(len(rows), self.visual.num_patches, self.image_mask_ratio, images.device,
                           self.mask_counts, shared=self.image_mask == "batch")
        return rows, keep, random_text_mask(tokens[rows], self.mask_ratio, self.text_mask)

    def draw(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
        """The masked copies' choices for the whole batch, per row (models.accumulate): "masked" (B,) bool,
        "keep" (B, kept patches) and "text_mask" (B, L), meaningful on the masked rows."""
        return self._draw(images, tokens)[:3]

    def _draw(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, dict, dict, torch.Tensor | None]:
        """``draw`` and the masked rows it chose (None: no masked copies)."""
        if not (self.training and self.mask_fraction > 0):
            return images, {}, {}, None
        rows, keep, text_mask = self.masked_inputs(images, tokens)
        b = tokens.shape[0]
        masked = torch.zeros(b, dtype=torch.bool, device=tokens.device)
        masked[rows] = True
        keep_rows = keep.new_zeros(b, keep.shape[1])
        keep_rows[rows] = keep
        text_rows = torch.zeros_like(tokens, dtype=torch.bool)
        text_rows[rows] = text_mask
        return images, {"masked": masked, "keep": keep_rows, "text_mask": text_rows}, {}, rows

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, world: World | None = None) -> dict[str, torch.Tensor]:
        # one pass over the whole batch: its masked rows are known here, where a micro-batch's (features from
        # sliced draws) need a nonzero, a host sync
        world = world or World.current()
        images, draws, batch_out, rows = self._draw(images, tokens)
        return self.pair_out({**self.features(images, tokens, draws, rows), **batch_out}, world)

    def features(self, images: torch.Tensor, tokens: torch.Tensor, draws: dict,
                 rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``rows``: the masked rows of ``draws["masked"]`` where the caller knows them (else found by a nonzero)."""
        b = tokens.shape[0]
        if draws:
            rows = torch.nonzero(draws["masked"]).flatten() if rows is None else rows
            keep, text_mask = draws["keep"][rows], draws["text_mask"][rows]
            # masked captions share the full captions' pass (same length): one batch of B + M rows. Text first:
            # its padding trim reads the batch's length on the host, before the image towers' work is queued.
            no_mask = torch.zeros_like(tokens, dtype=torch.bool)
            both = self.encode_text(torch.cat([tokens, tokens[rows]]), torch.cat([no_mask, text_mask]))
            img, img_m = self.encode_image(images), self.encode_image(images[rows], keep)
            txt = {k: v[:b] for k, v in both.items()}
            masked = {"masked_rows": rows, "image_masked_mu": img_m["mu"], "image_masked_logvar": img_m["logvar"],
                      "text_masked_mu": both["mu"][b:], "text_masked_logvar": both["logvar"][b:]}
        else:
            txt, masked = self.encode_text(tokens), {}
            img = self.encode_image(images)
        # image_* / text_*: mu, logvar (and the probabilistic Llip's mixture tokens, image_mix)
        return {**{f"image_{k}": v for k, v in img.items()}, **{f"text_{k}": v for k, v in txt.items()}, **masked}

    # zero-shot: prompt ensemble per class, scored by the negative CSD
    class_embeddings = staticmethod(prompt_ensemble)
    class_scores = staticmethod(negative_csd)



__all__ = ["ProLIP", "prompt_ensemble", "negative_csd", "masked_rows", "sigma_sq_sum"]
