"""Closed-form quantities between diagonal Gaussian (and generalized-Gaussian) embeddings.

Conventions: ``mu`` is (N, D), ``logvar`` is ``l = log sigma^2`` of the same shape, sums run over
the D embedding dimensions. Papers: PCME++ (arXiv:2305.18171), ProLIP (arXiv:2410.18857), Llip
(arXiv:2405.00740), ProbVLM (Upadhyay et al., ICCV 2023).

Every pairwise quantity is an (N1, N2) matrix computed with ONE matrix product of augmented
(N, D + 2) operands, never through an (N1, N2, D) intermediate: the squared-distance and
trace terms are folded in as extra columns ("row/column sums"). That keeps time within a few
percent of a plain ``mu1 @ mu2.T`` and memory at O(N1 N2 + (N1 + N2) D).

Numerical notes (what is clamped, and where):
- ``csd`` clamps the final distance at >= 0 (rounding can make ``||mu1 - mu2||^2`` of identical
  means a tiny negative number); logits built from it (``pml_logits``) are not clamped.
- ``inclusion_test`` has no clamp: it is written in log-space / ratio form, finite as long as
  ``eps - max(l1, l2)`` stays below ~88 in float32 (e.g. |l| <= 30 with eps <= 0 is safe).
- ``ggd_nll`` returns 0 (with zero gradient) for the power term where the residual is exactly 0,
  instead of the NaN that ``0 ** beta`` gives in backward for beta < 1.
- ``ggd_nll(..., stabilise=True)`` is official ProbVLM's guarded form (offsets on 1/alpha and beta,
  power term clamped to [1e-4, 1e3]); the default is the paper's formula, unclamped.
- Functions that exponentiate ``logvar`` overflow float32 beyond l ~ 88; nothing is clamped.
"""
from __future__ import annotations

import math

import torch

_LN2 = math.log(2.0)


def _as_tensor(x: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=like.dtype, device=like.device)


def sigma_sq_sum(logvar: torch.Tensor) -> torch.Tensor:
    """tr(Sigma) = sum_d sigma_d^2 per row, shape (N,)."""
    return logvar.exp().sum(-1)


def csd_affine(
    mu1: torch.Tensor,
    logvar1: torch.Tensor,
    mu2: torch.Tensor,
    logvar2: torch.Tensor,
    scale: torch.Tensor | float = 1.0,
    shift: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """``scale * d_CSD(Z1_i, Z2_j) + shift`` for all pairs, (N1, N2), by one matrix product.

    d = ||mu1||^2 + ||mu2||^2 - 2 mu1.mu2 + sum sigma1^2 + sum sigma2^2, valid for any mu.
    ``scale``/``shift`` may be tensors with gradient (PML's -a and b).
    """
    # PCME++ Eq. 1: d(Z1, Z2) = ||mu1 - mu2||^2 + ||sigma1^2 + sigma2^2||_1, expanded into a product
    r1 = mu1.pow(2).sum(-1) + sigma_sq_sum(logvar1)
    r2 = mu2.pow(2).sum(-1) + sigma_sq_sum(logvar2)
    scale, shift = _as_tensor(scale, mu1), _as_tensor(shift, mu1)
    # [s mu1, s r1 + shift, s] . [-2 mu2, 1, r2] = s d + shift: one plain product, no bias pass
    left = torch.cat([mu1 * scale, (scale * r1 + shift)[:, None], scale.expand(r1.shape[0], 1)], dim=1)
    right = torch.cat([-2.0 * mu2, torch.ones_like(r2)[:, None], r2[:, None]], dim=1)
    return left @ right.T


def csd(mu1: torch.Tensor, logvar1: torch.Tensor, mu2: torch.Tensor, logvar2: torch.Tensor) -> torch.Tensor:
    """Closed-form sampled distance E||Z1 - Z2||^2 for all pairs, (N1, N2). Clamped at >= 0."""
    return csd_affine(mu1, logvar1, mu2, logvar2).clamp_min(0.0)


def pml_logits(
    mu1: torch.Tensor,
    logvar1: torch.Tensor,
    mu2: torch.Tensor,
    logvar2: torch.Tensor,
    a: torch.Tensor | float,
    b: torch.Tensor | float,
) -> torch.Tensor:
    """PCME++ matching logits -a * d_CSD + b, (N1, N2)."""
    # PCME++ Eq. 2: logit = -a * d(Z_v, Z_t) + b
    return csd_affine(mu1, logvar1, mu2, logvar2, scale=-_as_tensor(a, mu1), shift=b)


def ppcl_logits(
    mu1: torch.Tensor,
    logvar1: torch.Tensor,
    mu2: torch.Tensor,
    logvar2: torch.Tensor,
    scale: torch.Tensor | float,
    bias: torch.Tensor | float,
) -> torch.Tensor:
    """ProLIP logits s * (mu1.mu2 - (tr Sigma1 + tr Sigma2) / 2) + b, (N1, N2), one matrix product."""
    # ProLIP Eq. 2: logit = a (mu_v^T mu_t - 1/2 tr(Sigma_v + Sigma_t)) + b
    s1, s2 = sigma_sq_sum(logvar1), sigma_sq_sum(logvar2)
    scale, bias = _as_tensor(scale, mu1), _as_tensor(bias, mu1)
    # [s mu1, b - s s1 / 2, s] . [mu2, 1, -s2 / 2]: one plain product, no bias pass
    left = torch.cat([mu1 * scale, (bias - 0.5 * scale * s1)[:, None], scale.expand(s1.shape[0], 1)], dim=1)
    right = torch.cat([mu2, torch.ones_like(s2)[:, None], -0.5 * s2[:, None]], dim=1)
    return left @ right.T


def contextual_ppcl_logits(
    pair_cos: torch.Tensor,
    logvar1: torch.Tensor,
    logvar2: torch.Tensor,
    scale: torch.Tensor | float,
    bias: torch.Tensor | float,
) -> torch.Tensor:
    """PPCL logits with mu_v.mu_t replaced by a given (N1, N2) similarity (probabilistic Llip)."""
    # ProLIP Eq. 2 with mu_v^T mu_t := Llip Eq. 2's contextualised cosine (beyond the papers)
    s1, s2 = sigma_sq_sum(logvar1), sigma_sq_sum(logvar2)
    return scale * (pair_cos - 0.5 * (s1[:, None] + s2[None, :])) + bias


def log_inclusion(
    mu1: torch.Tensor,
    logvar1: torch.Tensor,
    mu2: torch.Tensor,
    logvar2: torch.Tensor,
    eps: float = 0.0,
    form: str = "paper",
) -> torch.Tensor:
    """Per-dimension log inclusion inc(Z1, Z2) for row-paired inputs, (N, D).

    ``form="exact"``: log of the integral of p1(x)^2 p2(x) dx, constants included (at eps=0).
    ``form="paper"``: ProLIP Eq. 3 as printed: -2 l1 - l2 - 1/2 log A + B^2/4A - C (no constants).
    ``eps`` multiplies the inverse variances inside A, B, C by e^eps: a log-scale offset (ProLIP's
    -20, -10, -5), as in the paper's scaled inverse variances (Eq. 3-5).
    """
    # ProLIP Eq. 3: inc = -2 log s1^2 - log s2^2 - 1/2 log A + B^2/4A - C, A = p1 + p2/2 (p = e^eps / sigma^2)
    check_inclusion_form(form)
    # log A = eps + log(1/v1 + 1/(2 v2)); B^2/4A - C = -(mu1 - mu2)^2 e^eps / (2 (v2 + v1/2))
    log_a = eps + torch.logaddexp(-logvar1, -logvar2 - _LN2)
    mean_term = -0.5 * (mu1 - mu2).pow(2) * torch.exp(eps - torch.logaddexp(logvar2, logvar1 - _LN2))
    if form == "paper":
        return -2.0 * logvar1 - logvar2 - 0.5 * log_a + mean_term
    const = -1.5 * math.log(2 * math.pi) + 0.5 * math.log(math.pi)
    return const - logvar1 - 0.5 * logvar2 - 0.5 * log_a + mean_term


def inclusion_test(
    mu1: torch.Tensor,
    logvar1: torch.Tensor,
    mu2: torch.Tensor,
    logvar2: torch.Tensor,
    eps: float = 0.0,
    form: str = "paper",
) -> torch.Tensor:
    """Per-dimension inclusion hypothesis H(Z1 in Z2) = inc(Z1, Z2) - inc(Z2, Z1), (N, D).

    Written without cancellation: with v = sigma^2, m = max(l1, l2), u = v / e^m (so max u = 1),
    H = w (l2 - l1) + 1/2 log(A21 / A12) - 1/2 (mu1 - mu2)^2 e^(eps - m) (u1 - u2) / (2 (u2 + u1/2)(u1 + u2/2)),
    w = 1 for the printed Eq. 3 ("paper"), 1/2 for the exact log-integral ("exact").
    """
    # ProLIP Eq. 4: H(Z1 in Z2) = log int p1^2 p2 - log int p1 p2^2 (with Eq. 3 for each term)
    check_inclusion_form(form)
    weight = 1.0 if form == "paper" else 0.5
    log_ratio = torch.logaddexp(-logvar2, -logvar1 - _LN2) - torch.logaddexp(-logvar1, -logvar2 - _LN2)
    m = torch.maximum(logvar1, logvar2).detach()  # H does not depend on m: detaching it is exact
    u1, u2 = torch.exp(logvar1 - m), torch.exp(logvar2 - m)
    delta = logvar1 - logvar2
    # u1 - u2 without cancellation (the larger of u1, u2 is exactly 1); both branches stay bounded
    pos = delta >= 0
    zero = torch.zeros_like(delta)
    d_pos, d_neg = torch.where(pos, delta, zero), torch.where(pos, zero, delta)  # (clamp has 0 grad at 0)
    diff = torch.where(pos, -u1 * torch.expm1(-d_pos), u2 * torch.expm1(d_neg))
    mean_term = (mu1 - mu2).pow(2) * torch.exp(eps - m) * diff / (2.0 * (u2 + 0.5 * u1) * (u1 + 0.5 * u2))
    return weight * (logvar2 - logvar1) + 0.5 * log_ratio - 0.5 * mean_term


def check_inclusion_form(form: str) -> None:
    if form not in ("paper", "exact"):
        raise ValueError(f"inclusion form must be 'paper' or 'exact', got {form!r}")


VIB_FORMS = ("standard", "half_logvar")


def vib_kl(mu: torch.Tensor, logvar: torch.Tensor, form: str = "standard") -> torch.Tensor:
    """KL(N(mu, sigma^2) || N(0, I)), mean over batch and dimensions (scalar).

    ``form="half_logvar"``: official ProLIP's ``kl_divergence``, which halves l and then uses the half in
    both places, -1/2 mean(1 + l/2 - mu^2 - e^(l/2)): the standard formula at l/2, smallest at sigma^2 = 1
    like the standard one, with half the slope in l.
    """
    if form not in VIB_FORMS:
        raise ValueError(f"vib form must be one of {VIB_FORMS}, got {form!r}")
    lv = logvar if form == "standard" else 0.5 * logvar
    # PCME++ Sec. 2.2 / ProLIP Eq. 6 (VIB): KL = -1/2 mean(1 + l - mu^2 - e^l)
    return -0.5 * (1.0 + lv - mu.pow(2) - lv.exp()).mean()


GGD_APPROX_FORMS = ("eq16", "linear")
# Official ProbVLM's guards (``stabilise=True``): offsets on 1/alpha and beta, clamp of the power term.
GGD_OFFSET, GGD_POWER_MIN, GGD_POWER_MAX = 1e-4, 1e-4, 1e3


def ggd_nll(
    target: torch.Tensor,
    mu: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    approx: bool = False,
    approx_form: str = "eq16",
    stabilise: bool = False,
) -> torch.Tensor:
    """Elementwise generalized-Gaussian NLL (the constant log 2 dropped).

    (|mu - target| / alpha)^beta - log(beta / alpha) + log Gamma(1 / beta); with ``approx=True``
    the power term is ProbVLM's first-order Taylor form 1 - beta + beta |mu - target| / alpha
    (``approx_form="eq16"``) or official ProbVLM's beta |mu - target| / alpha (``"linear"``).
    ``stabilise=True`` is official ProbVLM's guarded form: 1/alpha and beta each get +1e-4 (in
    every term) and the power term is clamped to [1e-4, 1e3] (no gradient outside).
    """
    if approx_form not in GGD_APPROX_FORMS:
        raise ValueError(f"approx_form must be one of {GGD_APPROX_FORMS}, got {approx_form!r}")
    if stabilise:
        inv_alpha, beta = 1.0 / alpha + GGD_OFFSET, beta + GGD_OFFSET
        log_alpha = -torch.log(inv_alpha)
    else:
        inv_alpha, log_alpha = 1.0 / alpha, torch.log(alpha)
    ratio = (mu - target).abs() * inv_alpha
    if approx:
        # ProbVLM Eq. 16: (r/alpha)^beta ~= 1 - beta + beta r/alpha (official code: beta r/alpha)
        power = beta * ratio + (1.0 - beta if approx_form == "eq16" else 0.0)
    else:
        # 0 ** beta has a NaN gradient in autograd for beta < 1: take 0 (and zero gradient) there.
        positive = ratio > 0
        power = torch.where(positive, torch.where(positive, ratio, torch.ones_like(ratio)).pow(beta), torch.zeros_like(ratio))
    if stabilise:
        power = power.clamp(GGD_POWER_MIN, GGD_POWER_MAX)
    # ProbVLM Eq. 3: L = (|z_hat - z| / alpha)^beta - log(beta / alpha) + log Gamma(1 / beta)
    return power - torch.log(beta) + log_alpha + torch.lgamma(1.0 / beta)


def ggd_variance(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Aleatoric variance of a generalized Gaussian, alpha^2 Gamma(3/beta) / Gamma(1/beta)."""
    # ProbVLM Sec. 3 (uncertainty quantification): sigma^2 = alpha^2 Gamma(3/beta) / Gamma(1/beta)
    return torch.exp(2.0 * torch.log(alpha) + torch.lgamma(3.0 / beta) - torch.lgamma(1.0 / beta))


def negative_mls(mu1: torch.Tensor, logvar1: torch.Tensor, mu2: torch.Tensor, logvar2: torch.Tensor) -> torch.Tensor:
    """Elementwise negative mutual likelihood score of row-paired diagonal Gaussians, (N, D):
    -log N(mu1 - mu2; 0, sigma1^2 + sigma2^2) per dimension (the PFE-style baseline's loss)."""
    log_v = torch.logaddexp(logvar1, logvar2)
    # PFE (Shi & Jain 2019) Eq. 3: -s = 1/2 sum ((mu1 - mu2)^2 / (s1^2 + s2^2) + log(s1^2 + s2^2) + log 2 pi)
    return 0.5 * ((mu1 - mu2).pow(2) * torch.exp(-log_v) + log_v + math.log(2 * math.pi))


__all__ = [
    "contextual_ppcl_logits",
    "csd",
    "csd_affine",
    "ggd_nll",
    "ggd_variance",
    "inclusion_test",
    "log_inclusion",
    "negative_mls",
    "pml_logits",
    "ppcl_logits",
    "sigma_sq_sum",
    "vib_kl",
]
