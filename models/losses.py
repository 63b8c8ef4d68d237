"""Contrastive and probabilistic losses. Every pairwise loss computes local rows x global columns.

Interface (every loss): ``create_loss(name, **params)`` builds an ``nn.Module`` whose constructor
takes plain typed scalars (the papers' hyperparameter names); ``forward(out, world=None)`` reads
the model's output dict and returns ``{"loss": scalar with grad, <part>: detached scalars}``.

Distributed contract: ``out`` holds this worker's B_local rows. Columns (negatives) are gathered
from all workers with gradient (``World.gather``); each worker's loss is a mean over its local
rows, so the mean of the workers' losses, and the averaged gradients, equal the single-process
full-batch loss and gradients (tests/test_losses_distributed.py).

Learnable scales are stored as logs and clamped in the forward (``max_scale``), never by editing
parameter data, which stays correct under DeepSpeed ZeRO-3. Inputs in half precision are
upcast to float32 and autocast is disabled inside the losses.

Keys read from ``out`` (B = local batch, N = global batch, D = embedding width):
  image_mu, text_mu                 (B, D) L2-normalised means
  image_logvar, text_logvar         (B, D) log sigma^2                      (probabilistic losses)
  masked_rows                       (M,) long, rows of the local batch that have masked copies
  image_masked_mu/_logvar, text_masked_mu/_logvar   (M, D)                  (ProLIP, optional)
  mix_lambda (B,) float, mix_partner (B,) long      PCME++ MSDA soft labels   (PML, optional)
  pair_cos                          (B, N) Llip contextualised cosines (models.llip_mixer.LlipMixer)
  image_hat/_alpha/_beta/_target, text_hat/_alpha/_beta/_target   (B, D)   (ProbVLM)
  image_mu/_logvar, text_mu/_logvar of row-matched pairs           (B, D)   (PFE-style baseline)
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.distributions import (
    GGD_APPROX_FORMS,
    VIB_FORMS,
    check_inclusion_form,
    contextual_ppcl_logits,
    ggd_nll,
    inclusion_test,
    negative_mls,
    pml_logits,
    ppcl_logits,
    vib_kl,
)
from models.gather import World

_LOSSES: dict[str, type[nn.Module]] = {}


def register_loss(name: str):
    """Class decorator adding a loss under `name`; a name registered twice is a ValueError."""
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _LOSSES:
            raise ValueError(f"loss {name!r} registered twice")
        _LOSSES[name] = cls
        cls.loss_name = name
        return cls

    return wrap


def create_loss(name: str, **params) -> nn.Module:
    if name not in _LOSSES:
        raise KeyError(f"unknown loss {name!r}; known: {', '.join(sorted(_LOSSES))}")
    return _LOSSES[name](**params)


def loss_class(name: str) -> type[nn.Module]:
    if name not in _LOSSES:
        raise KeyError(f"unknown loss {name!r}; known: {', '.join(sorted(_LOSSES))}")
    return _LOSSES[name]


def list_losses() -> list[str]:
    return sorted(_LOSSES)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _fp(x: torch.Tensor) -> torch.Tensor:
    """Upcast half/bfloat16 to float32 (losses are computed in >= float32)."""
    return x.float() if x.is_floating_point() and x.element_size() < 4 else x


def _no_autocast(x: torch.Tensor):
    return torch.autocast(device_type=x.device.type, enabled=False) if x.device.type in ("cpu", "cuda") else contextlib.nullcontext()


def _need(out: dict[str, torch.Tensor], loss: nn.Module, *keys: str) -> list[torch.Tensor]:
    missing = [k for k in keys if k not in out]
    if missing:
        raise KeyError(f"loss {getattr(loss, 'loss_name', type(loss).__name__)!r} needs out[{missing}]")
    return [_fp(out[k]) for k in keys]


def scalar_parameter(value: float) -> nn.Parameter:
    """A learnable scalar stored with shape (1,): DeepSpeed cannot broadcast 0-dim parameters."""
    return nn.Parameter(torch.tensor(float(value)).reshape(1))


def as_scalar(param: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (1,)-shaped parameter as a 0-dim tensor in `like`'s dtype."""
    return param.to(like.dtype).reshape(())


def _positive_columns(rows: int, world: World, device) -> torch.Tensor:
    """Global column index of each local row's matching pair."""
    return torch.arange(rows, device=device) + world.offset(rows)


def sigmoid_pair_loss(logits: torch.Tensor, pos_cols: torch.Tensor) -> torch.Tensor:
    """-sum_ij log sigmoid(y_ij logit_ij) / B_local, y = +1 at (i, pos_cols[i]), -1 elsewhere."""
    # SigLIP (Zhai et al. 2023) Eq. 1 / ProLIP Eq. 2 / Llip Eq. 3: sum of -log sigmoid(y * logit), / |B|
    rows = torch.arange(logits.shape[0], device=logits.device)
    pos = logits[rows, pos_cols]
    neg_all = F.softplus(logits)  # -log sigmoid(-x) for every pair ...
    total = neg_all.sum() - neg_all[rows, pos_cols].sum() + F.softplus(-pos).sum()  # ... positives swapped
    return total / logits.shape[0]


def inclusion_loss(
    mu1: torch.Tensor, logvar1: torch.Tensor, mu2: torch.Tensor, logvar2: torch.Tensor, eps: float, c: float, form: str
) -> torch.Tensor:
    """Mean over rows and dimensions of -log sigmoid(c * H(Z1 in Z2))."""
    return inclusion_losses([(mu1, logvar1, mu2, logvar2)], eps, c, form)[0]


def inclusion_losses(pairs: list[tuple[torch.Tensor, ...]], eps: float, c: float, form: str) -> list[torch.Tensor]:
    """``inclusion_loss`` of each row-paired (mu1, logvar1, mu2, logvar2) set, all sets' rows in one elementwise
    pass (ProLIP's three inclusion terms: one chain of ~30 small ops instead of three)."""
    mu1, lv1, mu2, lv2 = (torch.cat(parts) if len(pairs) > 1 else parts[0] for parts in zip(*pairs))
    # ProLIP Eq. 5: L_inclusion = -log 1 / (1 + exp(-c H(Z1 in Z2)))
    per = F.softplus(-c * inclusion_test(mu1, lv1, mu2, lv2, eps=eps, form=form))
    out, start = [], 0
    for p in pairs:
        out.append(per[start : start + p[0].shape[0]].mean())
        start += p[0].shape[0]
    return out


class _ScaleBias(nn.Module):
    """Learnable logit scale s = exp(t) (clamped at max_scale in the forward) and bias b."""

    def __init__(self, init_scale: float, init_bias: float, max_scale: float):
        super().__init__()
        if init_scale <= 0 or max_scale <= 0:
            raise ValueError("init_scale and max_scale must be > 0")
        self.logit_scale = scalar_parameter(math.log(init_scale))
        self.logit_bias = scalar_parameter(init_bias)
        self.max_scale = float(max_scale)

    def scale_bias(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return as_scalar(self.logit_scale.exp().clamp(max=self.max_scale), like), as_scalar(self.logit_bias, like)


# --------------------------------------------------------------------------------------------
# deterministic baselines
# --------------------------------------------------------------------------------------------
@register_loss("infonce")
class InfoNCELoss(nn.Module):
    """CLIP's symmetric InfoNCE with a learnable temperature (Radford et al. 2021).

    Params: init_temperature (0.07), max_logit_scale (100, clamp in the forward).
    Reads image_mu, text_mu. Returns loss, i2t, t2i, logit_scale.
    """

    def __init__(self, init_temperature: float = 0.07, max_logit_scale: float = 100.0):
        super().__init__()
        self.logit_scale = scalar_parameter(math.log(1.0 / init_temperature))
        self.max_logit_scale = max_logit_scale

    def scale(self) -> torch.Tensor:
        # Clamping in the forward (not by editing the parameter) stays correct under ZeRO-3 sharding.
        return self.logit_scale.exp().clamp(max=self.max_logit_scale)

    def forward(self, out: dict[str, torch.Tensor], world: World | None = None) -> dict[str, torch.Tensor]:
        world = world or World.current()
        img, txt = _need(out, self, "image_mu", "text_mu")
        with _no_autocast(img):
            img_all, txt_all = world.gather(img), world.gather(txt)
            target = _positive_columns(img.shape[0], world, img.device)
            s = as_scalar(self.scale(), img)
            i2t = F.cross_entropy(s * img @ txt_all.T, target)  # InfoNCE (CLIP Eq. in Fig. 3)
            t2i = F.cross_entropy(s * txt @ img_all.T, target)
            loss = (i2t + t2i) / 2
        return {"loss": loss, "i2t": i2t.detach(), "t2i": t2i.detach(), "logit_scale": s.detach()}


@register_loss("siglip")
class SigLIPLoss(_ScaleBias):
    """SigLIP sigmoid loss on s * mu_v.mu_t + b (Zhai et al. 2023), s = exp(t), init 10 / -10.

    Params: init_scale (10), init_bias (-10), max_scale (100). Reads image_mu, text_mu.
    Returns loss, siglip, scale, bias.
    """

    def __init__(self, init_scale: float = 10.0, init_bias: float = -10.0, max_scale: float = 100.0):
        super().__init__(init_scale, init_bias, max_scale)

    def forward(self, out: dict[str, torch.Tensor], world: World | None = None) -> dict[str, torch.Tensor]:
        world = world or World.current()
        img, txt = _need(out, self, "image_mu", "text_mu")
        with _no_autocast(img):
            s, b = self.scale_bias(img)
            # SigLIP Eq. 1 logits: t * x_i . y_j + b
            logits = torch.addmm(b.reshape(1, 1), img * s, world.gather(txt).T)
            loss = sigmoid_pair_loss(logits, _positive_columns(img.shape[0], world, img.device))
        return {"loss": loss, "siglip": loss.detach(), "scale": s.detach(), "bias": b.detach()}


# --------------------------------------------------------------------------------------------
# ProLIP
# --------------------------------------------------------------------------------------------
@register_loss("ppcl")
class PPCLLoss(_ScaleBias):
    """ProLIP's probabilistic pairwise contrastive loss (Eq. 2): sigmoid loss on
    s * (mu_v.mu_t - (tr Sigma_v + tr Sigma_t) / 2) + b, with learnable s, b (init 10, -10).

    Params: init_scale (10), init_bias (-10), max_scale (100).
    Reads image_mu, image_logvar, text_mu, text_logvar. Returns loss, ppcl, scale, bias.
    """

    def __init__(self, init_scale: float = 10.0, init_bias: float = -10.0, max_scale: float = 100.0):
        super().__init__(init_scale, init_bias, max_scale)

    def ppcl(self, out: dict[str, torch.Tensor], world: World) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        img_mu, img_lv, txt_mu, txt_lv = _need(out, self, "image_mu", "image_logvar", "text_mu", "text_logvar")
        s, b = self.scale_bias(img_mu)
        logits = ppcl_logits(img_mu, img_lv, world.gather(txt_mu), world.gather(txt_lv), s, b)
        return sigmoid_pair_loss(logits, _positive_columns(img_mu.shape[0], world, img_mu.device)), s, b

    def forward(self, out: dict[str, torch.Tensor], world: World | None = None) -> dict[str, torch.Tensor]:
        world = world or World.current()
        with _no_autocast(out["image_mu"]):
            loss, s, b = self.ppcl(out, world)
        return {"loss": loss, "ppcl": loss.detach(), "scale": s.detach(), "bias": b.detach()}


@register_loss("inclusion")
class InclusionLoss(nn.Module):
    """ProLIP inclusion loss (Eq. 3-5) for image-in-its-caption, mean over rows and dimensions.

    Params: eps (-10; inverse variances scaled by e^eps), c (10; paper's main runs: eps=-20, c=1000),
    form ("paper": Eq. 3 as printed; "exact": the exact log-integral), guard (inf: none; official ProLIP:
    1e5, the loss counts 0 while it exceeds it).
    Reads image_mu, image_logvar, text_mu, text_logvar. Returns loss, inclusion_v_t.
    """

    def __init__(self, eps: float = -10.0, c: float = 10.0, form: str = "paper", guard: float = math.inf):
        super().__init__()
        check_inclusion_form(form)
        self.eps, self.c, self.form, self.guard = float(eps), float(c), form, guard

    def pair(self, mu1: torch.Tensor, lv1: torch.Tensor, mu2: torch.Tensor, lv2: torch.Tensor) -> torch.Tensor:
        """The loss for Z1 in Z2 (mean over rows and dimensions), zeroed past the guard."""
        return self.pairs([(mu1, lv1, mu2, lv2)])[0]

    def pairs(self, sets: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        """``pair`` of each (mu1, lv1, mu2, lv2) set, computed together."""
        return [guarded(v, self.guard) for v in inclusion_losses(sets, self.eps, self.c, self.form)]

    def forward(self, out: dict[str, torch.Tensor], world: World | None = None) -> dict[str, torch.Tensor]:
        img_mu, img_lv, txt_mu, txt_lv = _need(out, self, "image_mu", "image_logvar", "text_mu", "text_logvar")
        with _no_autocast(img_mu):
            loss = self.pair(img_mu, img_lv, txt_mu, txt_lv)
        return {"loss": loss, "inclusion_v_t": loss.detach()}


def guarded(value: torch.Tensor, limit: float) -> torch.Tensor:
    """`value`, or 0 (no gradient) while it exceeds `limit` (official ProLIP / PCME++ explosion guards)."""
    if math.isinf(limit):
        return value
    return torch.where(value.detach() > limit, torch.zeros_like(value), value)


@register_loss("vib")
class VIBLoss(nn.Module):
    """Variational information bottleneck, beta * (KL_image + KL_text) against N(0, I).

    Params: beta (1e-4); form ("standard" | "half_logvar": official ProLIP's KL at l/2, see ``vib_kl``);
    guard (inf: none; official ProLIP / PCME++: 1e4, each modality's KL counts 0 while it exceeds it).
    Reads image_mu, image_logvar, text_mu, text_logvar. Returns loss, vib (unweighted).
    """

    def __init__(self, beta: float = 1e-4, form: str = "standard",
                 guard: float = math.inf):
        super().__init__()
        if form not in VIB_FORMS:
            raise ValueError(f"vib form must be one of {VIB_FORMS}, got {form!r}")
        self.beta, self.form, self.guard = float(beta), form, guard

    def kl(self, img_mu: torch.Tensor, img_lv: torch.Tensor, txt_mu: torch.Tensor, txt_lv: torch.Tensor) -> torch.Tensor:
        """KL_image + KL_text (unweighted), each zeroed past the guard."""
        return (guarded(vib_kl(img_mu, img_lv, self.form), self.guard)
                + guarded(vib_kl(txt_mu, txt_lv, self.form), self.guard))

    def forward(self, out: dict[str, torch.Tensor], world: World | None = None) -> dict[str, torch.Tensor]:
        img_mu, img_lv, txt_mu, txt_lv = _need(out, self, "image_mu", "image_logvar", "text_mu", "text_logvar")
        with _no_autocast(img_mu):
            vib = self.kl(img_mu, img_lv, txt_mu, txt_lv)
        return {"loss": self.beta * vib, "vib": vib.detach()}


@register_loss("prolip")
class ProLIPLoss(PPCLLoss):
    """ProLIP's objective (Eq. 6):
    PPCL + alpha1 * inc(image in caption) + alpha2 * [inc(x in masked x), images + texts] + beta * VIB.

    Params: init_scale (10; official ProLIP: 1/0.07 unless its SigLIP flag), init_bias (-10), max_scale (100),
    alpha1 (1e-7), alpha2 (1e-3), beta (1e-4), eps (-10), c (10), form ("paper" | "exact"),
    vib_form ("standard" | "half_logvar"), vib_guard (inf | 1e4), inclusion_guard (inf | 1e5):
    see VIBLoss and InclusionLoss; inf (no guard) is the paper's, the numbers official ProLIP's.
    Reads image_mu/_logvar, text_mu/_logvar and, when present, masked_rows,
    image_masked_mu/_logvar, text_masked_mu/_logvar. The masked term is 0 when they are absent.
    Returns loss, ppcl, inclusion_v_t, inclusion_masked (= image + text), inclusion_masked_image,
    inclusion_masked_text, vib (all unweighted), scale, bias.
    """

    def __init__(
        self,
        init_scale: float = 10.0,
        init_bias: float = -10.0,
        max_scale: float = 100.0,
        alpha1: float = 1e-7,
        alpha2: float = 1e-3,
        beta: float = 1e-4,
        eps: float = -10.0,
        c: float = 10.0,
        form: str = "paper",
        vib_form: str = "standard",
        vib_guard: float = math.inf,
        inclusion_guard: float = math.inf,
    ):
        super().__init__(init_scale, init_bias, max_scale)
        self.alpha1, self.alpha2 = float(alpha1), float(alpha2)
        self.inclusion = InclusionLoss(eps, c, form, inclusion_guard)
        self.vib = VIBLoss(beta, vib_form, vib_guard)

    eps = property(lambda self: self.inclusion.eps)
    c = property(lambda self: self.inclusion.c)
    form = property(lambda self: self.inclusion.form)
    beta = property(lambda self: self.vib.beta)

    def pairwise(self, out: dict[str, torch.Tensor], world: World):
        return self.ppcl(out, world)

    def forward(self, out: dict[str, torch.Tensor], world: World | None = None) -> dict[str, torch.Tensor]:
        world = world or World.current()
        img_mu, img_lv, txt_mu, txt_lv = _need(out, self, "image_mu", "image_logvar", "text_mu", "text_logvar")
        with _no_autocast(img_mu):
            pair, s, b = self.pairwise(out, world)
            # inc(v in t) and the masked copies' inc(x in masked x): one pass over all their rows
            sets = {"vt": (img_mu, img_lv, txt_mu, txt_lv)}
            if "masked_rows" in out and out["masked_rows"].numel() > 0:
                rows = out["masked_rows"].long()
                if "image_masked_mu" in out:
                    sets["img"] = (img_mu[rows], img_lv[rows], *_need(out, self, "image_masked_mu", "image_masked_logvar"))
                if "text_masked_mu" in out:
                    sets["txt"] = (txt_mu[rows], txt_lv[rows], *_need(out, self, "text_masked_mu", "text_masked_logvar"))
            inc = dict(zip(sets, self.inclusion.pairs(list(sets.values()))))
            zero = img_mu.new_zeros(())
            inc_vt, inc_img, inc_txt = inc["vt"], inc.get("img", zero), inc.get("txt", zero)
            vib = self.vib.kl(img_mu, img_lv, txt_mu, txt_lv)
            # ProLIP Eq. 6: PPCL + alpha1 inc(v in t) + alpha2 (inc(v in v_masked) + inc(t in t_masked)) + beta VIB
            loss = pair + self.alpha1 * inc_vt + self.alpha2 * (inc_img + inc_txt) + self.beta * vib
        return {
            "loss": loss,
            self._pair_name: pair.detach(),
            "inclusion_v_t": inc_vt.detach(),
            "inclusion_masked": (inc_img + inc_txt).detach(),
            "inclusion_masked_image": inc_img.detach(),
            "inclusion_masked_text": inc_txt.detach(),
            "vib": vib.detach(),
            "scale": s.detach(),
            "bias": b.detach(),
        }

    _pair_name = "ppcl"


# --------------------------------------------------------------------------------------------
# PCME++
# --------------------------------------------------------------------------------------------
def match_labels(rows: int, cols: int, offset: int, out: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Soft match labels m_ij (B_local, N): 1 on (i, offset + i), or with MSDA lambda_i there and
    1 - lambda_i on (i, offset + mix_partner[i])."""
    m = like.new_zeros(rows, cols)
    r = torch.arange(rows, device=like.device)
    if "mix_lambda" in out:
        lam = out["mix_lambda"].detach().to(like.dtype)
        partner = out["mix_partner"].long().to(like.device)
        # PCME++ Sec. 2.4: m_vt = lambda for the image's own caption, 1 - lambda for the mixed-in one
        m.index_put_((r, r + offset), lam)
        m.index_put_((r, partner + offset), 1.0 - lam, accumulate=True)
    else:
        m[r, r + offset] = 1.0
    return m


def caption_match_labels(rows: int, offset: int, out: dict[str, torch.Tensor], world: World,
                         like: torch.Tensor) -> torch.Tensor:
    """The labels of the local captions' rows, (B_local, N): m_T[j, i] = m[i, offset + j] of ``match_labels``
    over the global images (their MSDA lambdas and partners gathered from every worker)."""
    cols = rows * world.size
    m = like.new_zeros(rows, cols)
    if "mix_lambda" not in out:
        r = torch.arange(rows, device=like.device)
        m[r, r + offset] = 1.0
        return m
    lam = world.gather(out["mix_lambda"].detach().to(like.dtype))
    partner = world.gather(out["mix_partner"].long().to(like.device) + offset)  # global partner index
    image = torch.arange(cols, device=like.device)
    own = (image >= offset) & (image < offset + rows)  # images whose own caption is local
    m.index_put_((image[own] - offset, image[own]), lam[own])
    mixed_in = (partner >= offset) & (partner < offset + rows)
    m.index_put_((partner[mixed_in] - offset, image[mixed_in]), 1.0 - lam[mixed_in], accumulate=True)
    return m


def smooth_labels(labels: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Official PCME++ label smoothing: 1 -> 1 - s, 0 -> s, linear in between (mixed labels)."""
    return labels if smoothing == 0.0 else smoothing + (1.0 - 2.0 * smoothing) * labels


def soft_bce(logits: torch.Tensor, labels: torch.Tensor, n_cols: int,
             softplus: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over local rows of mean-over-columns BCE with logits, divided by B_local * N. ``softplus``:
    F.softplus(logits) where the caller has it already (the match and pseudo-match terms share it)."""
    softplus = F.softplus(logits) if softplus is None else softplus
    # PCME++ Eq. 2: -m log sigmoid(logit) - (1 - m) log sigmoid(-logit)
    return (softplus - labels * logits).sum() / (logits.shape[0] * n_cols)


# A tie between logits is decided within this many units in the last place of the row's largest (at_least)
TIE_ULPS = 64


def at_least(values: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """values >= reference (a column per row), where a value equal to the reference up to rounding counts as equal.

    The same caption twice in a batch scores exactly the ground truth's logit in exact arithmetic; computed, the two
    differ by a few ulps whose sign depends on the CPU's vector kernels, the device and how the batch was split
    (feature-cache accumulation). A tie is therefore decided within TIE_ULPS ulps of the row's largest logit
    (float64 1.4e-14, float32 7.6e-6 of it): features moved by 16 ulps each still decide every tie alike
    (tests/test_accumulation.py), and a real gap between two captions' logits is far wider."""
    scale = values.abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
    return values >= reference - TIE_ULPS * torch.finfo(values.dtype).eps * scale


def pseudo_match(logits: torch.Tensor, labels: torch.Tensor,
                 softplus: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PCME++ pseudo-positive loss of the rows, and pseudo-positives per row (mean)."""
    with torch.no_grad():
        # PCME++ Sec. 2.3: columns scoring >= the row's ground truth get the ground truth's label
        gt_label, gt_idx = labels.max(dim=1)
        pp = at_least(logits, logits.gather(1, gt_idx[:, None]))
        pp_labels = torch.where(pp, gt_label[:, None].expand_as(labels), labels)
        n_pseudo = (pp.sum(1) - 1).to(logits.dtype).mean()
    return soft_bce(logits, pp_labels, logits.shape[1], softplus), n_pseudo


@register_loss("pml")
class PMLLoss(nn.Module):
    """PCME++ objective: probabilistic matching loss (Eq. 2) with logits -a * CSD + b (a, b learnable,
    init 5 / 5), soft labels (MSDA), pseudo-positives weighted alpha, and beta * VIB (Eq. 3).

    Pseudo-positives (Sec. 2.3, Fig. A.2): in each image row, captions whose logit is >= the
    ground-truth caption's logit get the ground-truth label; the loss recomputed with those
    labels is added with weight alpha. BCE is a mean over all (image, caption) pairs.

    Params: init_a (5), init_b (5), alpha (0.1), beta (1e-4); the official code's choices (paper
    defaults first): match_weight (1 | 2), pseudo_rows ("image" | "both": caption rows too),
    label_smoothing (0 | 1e-4), vib_form ("standard"), vib_guard (inf | 1e4) (see VIBLoss).
    Reads image_mu/_logvar, text_mu/_logvar, and optionally mix_lambda, mix_partner.
    Returns loss, pml, pseudo_match (image rows + caption rows), vib (unweighted), a, b,
    n_pseudo (pseudo-positives per image row, mean).
    """

    def __init__(self, init_a: float = 5.0, init_b: float = 5.0, alpha: float = 0.1, beta: float = 1e-4,
                 match_weight: float = 1.0, pseudo_rows: str = "image",
                 label_smoothing: float = 0.0, vib_form: str = "standard",
                 vib_guard: float = math.inf):
        super().__init__()
        if pseudo_rows not in ("image", "both"):
            raise ValueError(f"pseudo_rows must be 'image' or 'both', got {pseudo_rows!r}")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
        self.a, self.b = scalar_parameter(init_a), scalar_parameter(init_b)
        self.alpha, self.match_weight = float(alpha), float(match_weight)
        self.pseudo_rows, self.label_smoothing = pseudo_rows, float(label_smoothing)
        self.vib = VIBLoss(beta, vib_form, vib_guard)

    beta = property(lambda self: self.vib.beta)

    def forward(self, out: dict[str, torch.Tensor], world: World | None = None) -> dict[str, torch.Tensor]:
        world = world or World.current()
        img_mu, img_lv, txt_mu, txt_lv = _need(out, self, "image_mu", "image_logvar", "text_mu", "text_logvar")
        with _no_autocast(img_mu):
            a, b = as_scalar(self.a, img_mu), as_scalar(self.b, img_mu)
            logits = pml_logits(img_mu, img_lv, world.gather(txt_mu), world.gather(txt_lv), a, b)
            rows, cols = logits.shape
            labels = smooth_labels(match_labels(rows, cols, world.offset(rows), out, logits), self.label_smoothing)
            softplus = F.softplus(logits)  # one pass for both BCE terms
            match = soft_bce(logits, labels, cols, softplus)
            pseudo = logits.new_zeros(())
            n_pseudo = logits.new_zeros(())
            if self.alpha != 0.0:
                pseudo, n_pseudo = pseudo_match(logits, labels, softplus)
                if self.pseudo_rows == "both":
                    # official PCME++: the same rule on the caption rows (local captions x all images)
                    t_logits = pml_logits(txt_mu, txt_lv, world.gather(img_mu), world.gather(img_lv), a, b)
                    t_labels = smooth_labels(caption_match_labels(rows, world.offset(rows), out, world, t_logits),
                                             self.label_smoothing)
                    pseudo = pseudo + pseudo_match(t_logits, t_labels)[0]
            vib = self.vib.kl(img_mu, img_lv, txt_mu, txt_lv)
            # PCME++ Eq. 3: L_match + alpha L_pseudo-match + beta L_VIB (official code: 2 L_match, caption rows too)
            loss = self.match_weight * match + self.alpha * pseudo + self.beta * vib
        return {
            "loss": loss,
            "pml": match.detach(),
            "pseudo_match": pseudo.detach(),
            "vib": vib.detach(),
            "a": a.detach(),
            "b": b.detach(),
            "n_pseudo": n_pseudo,
        }


# --------------------------------------------------------------------------------------------
# Llip
# --------------------------------------------------------------------------------------------
@register_loss("llip")
class LlipLoss(_ScaleBias):
    """Llip's sigmoid loss (Eq. 3) on contextualised cosines s * cos(z_hat_ij, z_hat'_j) + b.

    The cosines come from ``models.llip_mixer.LlipMixer`` in the model's forward (where the mixer's
    temperature ``tau`` and ``heads`` are set): out["pair_cos"] is (B_local, N_global), local
    image rows against all captions gathered with gradient. Positives are (i, offset + i).
    Params: init_scale (10), init_bias (-10), max_scale (100) (SigLIP's initialisation, as in Llip).
    Returns loss, llip, scale, bias.
    """

    def __init__(self, init_scale: float = 10.0, init_bias: float = -10.0, max_scale: float = 100.0):
        super().__init__(init_scale, init_bias, max_scale)

    def forward(self, out: dict[str, torch.Tensor], world: World | None = None) -> dict[str, torch.Tensor]:
        world = world or World.current()
        (cos,) = _need(out, self, "pair_cos")
        with _no_autocast(cos):
            s, b = self.scale_bias(cos)
            # Llip Eq. 3: sigmoid loss on a z_hat_ij . z_hat'_j + b
            loss = sigmoid_pair_loss(s * cos + b, _positive_columns(cos.shape[0], world, cos.device))
        return {"loss": loss, "llip": loss.detach(), "scale": s.detach(), "bias": b.detach()}


@register_loss("prob_llip")
class ProbLlipLoss(ProLIPLoss):
    """Probabilistic Llip (beyond the papers): ProLIP's objective with PPCL's mean term mu_v.mu_t
    replaced by Llip's contextualised cosine out["pair_cos"] (B_local, N_global); variances from
    image_logvar / text_logvar ([UNC]), inclusion and VIB on image_mu / text_mu as in ProLIP.

    Params and returned parts as ``prolip``, with "prob_llip" in place of "ppcl".
    """

    _pair_name = "prob_llip"

    def pairwise(self, out: dict[str, torch.Tensor], world: World):
        cos, img_lv, txt_lv = _need(out, self, "pair_cos", "image_logvar", "text_logvar")
        s, b = self.scale_bias(cos)
        logits = contextual_ppcl_logits(cos, img_lv, world.gather(txt_lv), s, b)
        return sigmoid_pair_loss(logits, _positive_columns(cos.shape[0], world, cos.device)), s, b


# --------------------------------------------------------------------------------------------
# ProbVLM
# --------------------------------------------------------------------------------------------
@register_loss("probvlm")
class ProbVLMLoss(nn.Module):
    """ProbVLM adapter objective (Eq. 3, 7, 8): L_rec^V + L_rec^T + lambda_cross * L_cross,
    each a generalized-Gaussian NLL averaged over rows and dimensions, plus an optional L1
    reconstruction term l1 * (|z_hat_V - z_V|.mean() + |z_hat_T - z_T|.mean()).

    Params: lambda_cross (1e-4, ProbVLM's released training script), l1 (0.0; that script uses
    1.0 with ggd 0.05), ggd (1.0, weight of the three GGD terms), approx (False; True uses Eq. 16).
    The official code's choices (paper defaults first): approx_form ("eq16" | "linear": beta r / alpha
    without 1 - beta), stabilise (False | True: +1e-4 on 1/alpha and beta, power term clamped to
    [1e-4, 1e3]; see ``models.distributions.ggd_nll``), l1_cross (False | True: the L1 term also on
    the cross-modal pairs, weighted like the cross-modal GGD terms: official ProbVLM's criterion is
    T1 L1 + T2 GGD per call and its cross-modal calls are multiplied by lambda_cross, so with l1 = T1 and
    ggd = T2 the loss is T2 (L_rec^V + L_rec^T + lambda L_cross) + T1 (L1^V + L1^T + lambda L1_cross)).
    Reads image_hat, image_alpha, image_beta, image_target, text_hat, text_alpha, text_beta,
    text_target, all (B, D): z_hat, alpha_hat > 0, beta_hat > 0 predicted by the adapter, and the
    frozen encoder's embedding z. Returns loss, rec_image, rec_text, cross, l1 (own-modality pairs),
    l1_cross (cross-modal pairs |z_hat_V - z_T|.mean() + |z_hat_T - z_V|.mean()), all unweighted.
    """

    def __init__(self, lambda_cross: float = 1e-4, l1: float = 0.0, ggd: float = 1.0, approx: bool = False,
                 approx_form: str = "eq16", stabilise: bool = False, l1_cross: bool = False):
        super().__init__()
        if approx_form not in GGD_APPROX_FORMS:
            raise ValueError(f"approx_form must be one of {GGD_APPROX_FORMS}, got {approx_form!r}")
        self.lambda_cross, self.l1, self.ggd, self.approx = float(lambda_cross), float(l1), float(ggd), bool(approx)
        self.approx_form, self.stabilise, self.l1_cross = approx_form, bool(stabilise), bool(l1_cross)

    def nll(self, target: torch.Tensor, mu: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        return ggd_nll(target, mu, alpha, beta, self.approx, self.approx_form, self.stabilise).mean()

    def forward(self, out: dict[str, torch.Tensor], world: World | None = None) -> dict[str, torch.Tensor]:
        keys = [f"{m}_{k}" for m in ("image", "text") for k in ("hat", "alpha", "beta", "target")]
        i_hat, i_alpha, i_beta, i_z, t_hat, t_alpha, t_beta, t_z = _need(out, self, *keys)
        with _no_autocast(i_hat):
            rec_i = self.nll(i_z, i_hat, i_alpha, i_beta)
            rec_t = self.nll(t_z, t_hat, t_alpha, t_beta)
            # ProbVLM Eq. 7: L_cross = GGD NLL of z_T under (z_hat_V, alpha_V, beta_V) + z_V under the text's
            cross = self.nll(t_z, i_hat, i_alpha, i_beta) + self.nll(i_z, t_hat, t_alpha, t_beta)
            l1 = (i_hat - i_z).abs().mean() + (t_hat - t_z).abs().mean()
            l1_cross = (i_hat - t_z).abs().mean() + (t_hat - i_z).abs().mean()
            l1_total = l1 + self.lambda_cross * l1_cross if self.l1_cross else l1
            # ProbVLM Eq. 8: L = L_rec^V + L_rec^T + lambda_cross L_cross (+ optional L1 term, its cross part alike)
            loss = self.ggd * (rec_i + rec_t + self.lambda_cross * cross) + self.l1 * l1_total
        return {
            "loss": loss,
            "rec_image": rec_i.detach(),
            "rec_text": rec_t.detach(),
            "cross": cross.detach(),
            "l1": l1.detach(),
            "l1_cross": l1_cross.detach(),
        }


@register_loss("pfe_mls")
class PFELoss(nn.Module):
    """PFE-style baseline of ProbVLM's Table 1 ("PFE*"): the means stay the frozen embeddings and only the
    variances learn, from the mutual likelihood score of each matching image-caption pair (PFE Eq. 3),
    averaged over rows and dimensions. Reads image_mu, image_logvar, text_mu, text_logvar (B, D), row-matched.
    """

    def forward(self, out: dict[str, torch.Tensor], world: World | None = None) -> dict[str, torch.Tensor]:
        i_mu, i_lv, t_mu, t_lv = _need(out, self, "image_mu", "image_logvar", "text_mu", "text_logvar")
        with _no_autocast(i_mu):
            loss = negative_mls(_fp(i_mu), _fp(i_lv), _fp(t_mu), _fp(t_lv)).mean()
        return {"loss": loss}
