"""Evaluation metrics: multi-positive retrieval (R@K, mAP@R, R-Precision), zero-shot accuracy, and
the uncertainty calibration of PCME++ / ProbVLM. Pure PyTorch / numpy / scipy; no model code."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Ranked:
    """Per query: 0-based position of the first positive in the ranking, AP@R and R-Precision."""

    first_hit: torch.Tensor  # (Q,) int64
    map_at_r: torch.Tensor  # (Q,) float64
    r_precision: torch.Tensor  # (Q,) float64

    @staticmethod
    def cat(parts: list["Ranked"]) -> "Ranked":
        return Ranked(*(torch.cat([getattr(p, f) for p in parts]) for f in ("first_hit", "map_at_r", "r_precision")))

    def recall_at(self, k: int) -> float:
        return float((self.first_hit < k).double().mean())


def rank_queries(scores: torch.Tensor, positives: torch.Tensor) -> Ranked:
    """(Q, G) scores (larger ranks first) and (Q, G) boolean positives; every query needs a positive.

    Ties are broken by gallery index (stable sort). mAP@R and R-Precision as PCME++ B.1 (after Musgrave
    et al. 2020): with R = the query's number of positives, R-P = positives in the top R / R and
    AP@R = (1/R) sum_{i<=R} P@i * rel_i."""
    if positives.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and positives {tuple(positives.shape)} differ")
    n_pos = positives.sum(dim=1)
    if bool((n_pos == 0).any()):
        raise ValueError("every query needs at least one positive")
    order = torch.sort(scores.float(), dim=1, descending=True, stable=True).indices
    rel = torch.gather(positives, 1, order).double()  # (Q, G) relevance in ranked order
    first_hit = rel.argmax(dim=1)
    hits = rel.cumsum(dim=1)
    position = torch.arange(1, scores.shape[1] + 1, dtype=torch.float64)
    within_r = position[None, :] <= n_pos[:, None]
    r = n_pos.double()
    map_at_r = (rel * hits / position * within_r).sum(dim=1) / r
    r_precision = torch.gather(hits, 1, (n_pos - 1)[:, None]).squeeze(1) / r
    return Ranked(first_hit, map_at_r, r_precision)


def rank_candidates(rows: torch.Tensor, positive_keys: torch.Tensor, n_pos: torch.Tensor, gallery: int) -> Ranked:
    """Ranked candidate lists (Q, K) of gallery rows, best first (-1: none), -> the same measures as
    `rank_queries`, counting every item outside the list as ranked after it: a query whose positives are
    all outside gets first_hit = K, and AP@R / R-Precision count only the positives inside the top R.

    positive_keys: sorted query * gallery + item of every positive pair; n_pos: (Q,) positives per query."""
    if bool((n_pos == 0).any()):
        raise ValueError("every query needs at least one positive")
    q, k = rows.shape
    keys = torch.arange(q, dtype=torch.int64)[:, None] * gallery + rows
    rel = (torch.isin(keys, positive_keys) & (rows >= 0)).double()
    found = rel.sum(dim=1) > 0
    first_hit = torch.where(found, rel.argmax(dim=1), torch.full((q,), k, dtype=torch.int64))
    hits = rel.cumsum(dim=1)
    position = torch.arange(1, k + 1, dtype=torch.float64)
    r = n_pos.double()
    map_at_r = (rel * hits / position * (position[None, :] <= r[:, None])).sum(dim=1) / r
    at_r = (n_pos.clamp_max(k) - 1)[:, None]
    r_precision = torch.gather(hits, 1, at_r).squeeze(1) / r
    return Ranked(first_hit, map_at_r, r_precision)


def retrieval_summary(direction: str, ranked: Ranked, ks=(1, 5, 10)) -> dict[str, float]:
    out = {f"{direction}_R{k}": ranked.recall_at(k) for k in ks}
    out[f"{direction}_mAP_R"] = float(ranked.map_at_r.mean())
    out[f"{direction}_R_precision"] = float(ranked.r_precision.mean())
    return out


def topk_accuracy(scores: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    k = min(k, scores.shape[1])
    top = scores.topk(k, dim=1).indices
    return float((top == labels[:, None]).any(dim=1).double().mean())


def mean_per_class_recall(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean over the classes present in `labels` of the fraction of their images predicted correctly."""
    classes = labels.unique()
    return float(torch.stack([(predicted[labels == c] == c).double().mean() for c in classes]).mean())


@dataclass
class Calibration:
    """Queries sorted by uncertainty into equal-count bins; the metric per bin and how it tracks the bin."""

    bin_uncertainty: np.ndarray  # mean uncertainty of each bin, ascending
    bin_metric: np.ndarray  # e.g. R@1 of each bin's queries
    rho: float  # Spearman rank correlation between bin index and metric
    r2: float  # R^2 of a line through (bin index, metric)

    @property
    def score(self) -> float:
        """-rho * R^2 (ProbVLM Sec. 4.1): large when the metric falls steadily as uncertainty grows."""
        return -self.rho * self.r2


def calibration(uncertainty: np.ndarray, correct: np.ndarray, bins: int = 10) -> Calibration:
    """PCME++ Sec. 3.4 / ProbVLM Sec. 4.1: bin queries by uncertainty (equal counts), metric per bin,
    Spearman rho and R^2 between bin level and metric. NaN where the bins' metric is constant."""
    uncertainty, correct = np.asarray(uncertainty, np.float64), np.asarray(correct, np.float64)
    if len(uncertainty) < bins:
        raise ValueError(f"calibration needs at least {bins} queries (one per bin), got {len(uncertainty)}")
    order = np.argsort(uncertainty, kind="stable")
    groups = np.array_split(order, bins)
    bin_u = np.array([uncertainty[g].mean() for g in groups])
    bin_m = np.array([correct[g].mean() for g in groups])
    level = np.arange(bins, dtype=np.float64)
    if np.ptp(bin_m) == 0:
        return Calibration(bin_u, bin_m, float("nan"), float("nan"))
    # deferred: 0.4 s to import, for the few calibration curves a run computes
    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rho = float(stats.spearmanr(level, bin_m).statistic)
        r2 = float(stats.linregress(level, bin_m).rvalue ** 2)
    return Calibration(bin_u, bin_m, rho, r2)
