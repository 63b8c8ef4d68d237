"""Approximate nearest neighbours on the means, re-ranked by the model's own score (PCME++ C.5).

A faiss index (HNSW or IVF, L2 on mu) proposes `candidates` gallery items per query; the candidates are
re-ranked by the pair score of the embeddings: -CSD for probabilistic embeddings (with sigma^2 = 0 it is
-||mu_q - mu_g||^2), the dot product of the means for deterministic ones. CSD = ||mu_q - mu_g||^2 +
tr Sigma_q + tr Sigma_g, so its ranking differs from the means' only through tr Sigma_g: an index on mu
with enough candidates finds the CSD top-K (docs/BENCHMARKS.md measures the recall).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch


def _faiss():
    try:
        import faiss
    except ImportError as err:  # pragma: no cover - faiss-cpu is a project dependency
        raise ImportError("index: faiss needs the faiss-cpu package (pip install faiss-cpu)") from err
    return faiss


class MeanIndex:
    """A faiss index over the gallery means; `search` returns candidate gallery rows per query."""

    def __init__(self, mu: torch.Tensor | np.ndarray, kind: str = "hnsw", hnsw_m: int = 32, ef_construction: int = 80,
                 ef_search: int = 256, nlist: int | None = None, nprobe: int = 64, seed: int = 0):
        faiss = _faiss()
        data = np.ascontiguousarray(np.asarray(mu, dtype=np.float32))
        if data.ndim != 2 or len(data) == 0:
            raise ValueError(f"an index needs a (N, D) gallery of means, got shape {data.shape}")
        n, d = data.shape
        if kind == "hnsw":
            index = faiss.IndexHNSWFlat(d, hnsw_m)
            index.hnsw.efConstruction = ef_construction
            index.hnsw.efSearch = ef_search
        elif kind == "ivf":
            lists = min(nlist or max(1, int(math.sqrt(n))), n)
            index = faiss.IndexIVFFlat(faiss.IndexFlatL2(d), d, lists)
            rng = np.random.default_rng(seed)
            train = data if n <= 256 * lists else data[rng.choice(n, 256 * lists, replace=False)]
            index.train(train)
            index.nprobe = min(nprobe, lists)
        else:
            raise ValueError(f"index kind must be 'hnsw' or 'ivf', got {kind!r}")
        index.add(data)
        self.index, self.kind, self.size = index, kind, n

    def search(self, queries: torch.Tensor | np.ndarray, k: int) -> torch.Tensor:
        """(Q, D) query means -> (Q, min(k, N)) gallery rows, nearest first; -1 where the index found fewer."""
        q = np.ascontiguousarray(np.asarray(queries, dtype=np.float32))
        _, rows = self.index.search(q, min(k, self.size))
        return torch.from_numpy(rows.astype(np.int64))

    def save(self, path: str | Path) -> None:
        _faiss().write_index(self.index, str(path))

    @classmethod
    def load(cls, path: str | Path) -> "MeanIndex":
        obj = cls.__new__(cls)
        obj.index = _faiss().read_index(str(path))
        obj.kind = "ivf" if "IVF" in type(obj.index).__name__ else "hnsw"
        obj.size = obj.index.ntotal
        return obj


def pair_scores(query: dict[str, torch.Tensor], gallery: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """(Q, K) scores of each query against its K candidate gallery rows (-1 rows score -inf)."""
    if "mix" in query or "mix" in gallery:
        raise ValueError("index: faiss re-ranks by a score of two embeddings; Llip's contextualised score needs the "
                         "whole query-gallery pair (use index: exact)")
    valid = rows >= 0
    safe = rows.clamp_min(0)
    mu_q, mu_g = query["mu"].float(), gallery["mu"].float()[safe]  # (Q, D), (Q, K, D)
    dot = torch.einsum("qd,qkd->qk", mu_q, mu_g)
    if "logvar" in query and "logvar" in gallery:
        tr_q = query["logvar"].float().exp().sum(-1)
        tr_g = gallery["logvar"].float().exp().sum(-1)[safe]
        # PCME++ Eq. 1: CSD = ||mu_q - mu_g||^2 + tr Sigma_q + tr Sigma_g
        dist = mu_q.pow(2).sum(-1)[:, None] + mu_g.pow(2).sum(-1) - 2.0 * dot + tr_q[:, None] + tr_g
        scores = -dist.clamp_min(0.0)
    else:
        scores = dot
    return scores.masked_fill(~valid, float("-inf"))


def rerank(scores: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates sorted by score, best first (ties by index order): (scores, rows)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return torch.gather(scores, 1, order), torch.gather(rows, 1, order)
