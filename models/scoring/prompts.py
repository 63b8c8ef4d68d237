"""Zero-shot prompt weights from uncertainty: Bayesian prompt re-weighting and uncertainty filtering.

A class embedding is the weighted prompt ensemble Z_new = sum_n pi_n Z_n (ProLIP A.5): mu the weighted
mean of the prompts' mu (renormalised), sigma^2 the weighted mean of their sigma^2; uniform weights give
the models' own prompt ensemble (ProLIP Sec. 4.2).

- `filter_weights`: the k prompts of smallest tr(Sigma) per class share the weight (PCME++ C.6, ProLIP 3.4).
- `bprw_weights`: pi of a mixture of the class's prompt Gaussians fitted by EM to points sampled from
  images, with a Dirichlet(alpha) prior on pi and pi initialised to the normalised 1 / tr(Sigma)
  (ProLIP A.5, Algorithm 1; hyperparameters in C.5).

Pure PyTorch; float64 inside the EM (D-dimensional Gaussian log-densities differ by hundreds of nats).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def weighted_ensemble(template_out: dict[str, torch.Tensor], weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """(C, T, D) per-prompt mu (and logvar) and (C, T) weights summing to 1 per class -> one embedding per class."""
    unknown = set(template_out) - {"mu", "logvar"}
    if unknown:
        raise ValueError(f"weighted prompt ensembles take mu and logvar outputs; the model also gives {sorted(unknown)}")
    w = weights.to(template_out["mu"].dtype)
    # ProLIP A.5: Z_new = sum_n pi_n Z_n (mu renormalised as in the Sec. 4.2 ensemble)
    out = {"mu": F.normalize((w[..., None] * template_out["mu"].float()).sum(dim=1), dim=-1)}
    if "logvar" in template_out:
        out["logvar"] = torch.logsumexp(template_out["logvar"].float() + w.float().log()[..., None], dim=1)
    return out


def filter_weights(logvar: torch.Tensor, keep: int) -> torch.Tensor:
    """(C, T, D) prompt logvar -> (C, T) weights: 1/k on the k prompts of smallest tr(Sigma) per class, else 0."""
    k = min(keep, logvar.shape[1])
    # PCME++ C.6 / ProLIP 3.4: drop the most uncertain prompts, tr(Sigma) = sum_d sigma_d^2
    order = logvar.float().exp().sum(-1).argsort(dim=1, stable=True)
    weights = torch.zeros(logvar.shape[:2], dtype=torch.float32)
    weights.scatter_(1, order[:, :k], 1.0 / k)
    return weights


def gaussian_log_density(x: torch.Tensor, mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """(C, M, D) points, (C, T, D) means and variances (diagonal) -> (C, M, T) log N(x_m; mu_t, diag var_t)."""
    inv = 1.0 / var
    # sum_d (x - mu)^2 / v = x^2 . (1/v) - 2 x . (mu/v) + sum mu^2 / v, as batched products
    quad = (x * x) @ inv.transpose(1, 2) - 2.0 * x @ (mu * inv).transpose(1, 2) + (mu * mu * inv).sum(-1)[:, None, :]
    log_norm = var.log().sum(-1) + mu.shape[-1] * math.log(2 * math.pi)
    return -0.5 * (quad + log_norm[:, None, :])


def bprw_em(points: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor, alpha: float, eps: float,
            iters: int = 100, tol: float = 1e-6) -> torch.Tensor:
    """MAP mixing proportions of the prompt Gaussians for each class's observations.

    points (C, M', D): the observations; mu, logvar (C, T, D): the class's prompt distributions.
    Returns (C, T) weights pi (>= 0, summing to 1)."""
    x, mu, var = points.double(), mu.double(), logvar.double().exp()
    n_obs, n_prompts = x.shape[1], mu.shape[1]
    # ProLIP A.5, Algorithm 1 line 5: pi_n <- (1 / tr Sigma_n) / sum_n' (1 / tr Sigma_n')
    pi = 1.0 / var.sum(-1)
    pi = pi / pi.sum(dim=1, keepdim=True)
    # line 6: Sigma_n <- Sigma_n + eps I, after the prior
    log_f = gaussian_log_density(x, mu, var + eps)
    for _ in range(iters):
        # E-step: gamma_jn = pi_n f_n(x_j) / sum_i pi_i f_i(x_j)
        gamma = torch.softmax(log_f + pi.log()[:, None, :], dim=2)
        # M-step with the Dirichlet prior: pi_n = (N_n + alpha - 1) / (M' + N (alpha - 1))
        new = (gamma.sum(dim=1) + alpha - 1.0) / (n_obs + n_prompts * (alpha - 1.0))
        # "ensure pi_n >= 0 and sum pi_n = 1" (alpha < 1 can push a component below 0)
        new = new.clamp_min(0.0)
        new = new / new.sum(dim=1, keepdim=True)
        done = bool((new - pi).abs().max() < tol)
        pi = new
        if done:
            break
    return pi.float()


def bprw_observations(image: dict[str, torch.Tensor], class_scores: torch.Tensor, images: int, samples: int,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Per class, the `images` images scoring highest against its prompt-ensemble embedding and `samples`
    points drawn from each image's Gaussian: (C, images * samples, D) (ProLIP C.5, zero-shot without labels)."""
    if "logvar" not in image:
        raise ValueError("BPRW samples image embeddings: it needs a probabilistic model (image sigma^2)")
    m = min(images, class_scores.shape[0])
    nearest = class_scores.topk(m, dim=0).indices.T  # (C, m)
    mu, std = image["mu"].float()[nearest], (0.5 * image["logvar"].float()[nearest]).exp()  # (C, m, D)
    noise = torch.randn((*mu.shape[:2], samples, mu.shape[-1]), generator=generator)
    points = mu[:, :, None, :] + std[:, :, None, :] * noise
    return points.reshape(mu.shape[0], m * samples, mu.shape[-1])
