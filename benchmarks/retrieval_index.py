"""Approximate retrieval on a large probabilistic gallery: faiss on the means + CSD re-ranking vs exact CSD.

Run:

    .venv/bin/python -m benchmarks.retrieval_index                       # 100k gallery, writes docs/BENCHMARKS.md
    .venv/bin/python -m benchmarks.retrieval_index --gallery 20000 --quick   # prints only

The gallery: synthetic probabilistic embeddings (unit means: `gallery / 50` cluster centres in a
16-dimensional latent space mapped into D = 64 (the tiny models' width) plus isotropic noise; per
dimension sigma^2 log-uniform over a decade, so the CSD ranking differs from the means' ranking through
tr Sigma of the gallery item). Queries are drawn the same way. The exact ranking is the top 10 by CSD
over the whole gallery (models.distributions.csd, chunked); the approximate one takes `candidates`
items per query from a faiss index on the means (models.scoring.ann.MeanIndex: HNSW and IVF) and re-ranks them
by CSD (models.scoring.ann.pair_scores). Reported: recall@10 of the approximate top 10 against the exact top 10,
and the per-query time of each (index build time apart), single-threaded (torch and faiss), side by side.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from models.scoring.ann import MeanIndex, pair_scores, rerank
from models.distributions import csd


LATENT = 16  # learned embeddings are far from isotropic: the means vary mostly in a few directions


def gallery(n: int, dim: int, seed: int) -> dict[str, torch.Tensor]:
    """Means: clustered points of a LATENT-dimensional space mapped into `dim` (one fixed map for every call)
    plus a little isotropic noise, normalised; sigma^2 per dimension log-uniform over a decade."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(LATENT, dim, generator=torch.Generator().manual_seed(1234))
    centres = torch.randn(max(1, n // 50), LATENT, generator=g)
    latent = centres[torch.randint(len(centres), (n,), generator=g)] + 0.5 * torch.randn(n, LATENT, generator=g)
    mu = F.normalize(latent @ basis + 0.5 * torch.randn(n, dim, generator=g), dim=-1)
    return {"mu": mu, "logvar": math.log(2e-3) + math.log(10.0) * torch.rand(n, dim, generator=g)}


def exact_top(queries: dict, items: dict, k: int, chunk: int = 256) -> torch.Tensor:
    return torch.cat([(-csd(queries["mu"][a : a + chunk], queries["logvar"][a : a + chunk], items["mu"], items["logvar"]))
                      .topk(k, dim=1).indices for a in range(0, len(queries["mu"]), chunk)])


def recall(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float(np.mean([len(set(a.tolist()) & set(e.tolist())) / exact.shape[1] for a, e in zip(approx, exact)]))


def run(n: int, dim: int, n_queries: int, candidates: int) -> list[dict]:
    import faiss

    faiss.omp_set_num_threads(1)
    torch.set_num_threads(1)
    items, queries = gallery(n, dim, 0), gallery(n_queries, dim, 1)
    t0 = time.perf_counter()
    want = exact_top(queries, items, 10)
    exact_s = (time.perf_counter() - t0) / n_queries
    rows = [{"method": "exact CSD (all items)", "build_s": 0.0, "query_ms": 1e3 * exact_s, "recall": 1.0, "ratio": 1.0}]
    for kind, nprobe in (("hnsw", None), ("ivf", 16), ("ivf", 64)):
        t0 = time.perf_counter()
        index = MeanIndex(items["mu"], kind=kind, **({"nprobe": nprobe} if nprobe else {}))
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        cand = index.search(queries["mu"], candidates)
        _, ranked = rerank(pair_scores(queries, items, cand), cand)
        per_query = (time.perf_counter() - t0) / n_queries
        name = f"faiss {kind.upper()}" + (f" (nprobe {nprobe})" if nprobe else "")
        rows.append({"method": f"{name} on mu, top {candidates} re-ranked by CSD", "build_s": build,
                     "query_ms": 1e3 * per_query, "recall": recall(ranked[:, :10], want), "ratio": per_query / exact_s})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| method | index build (s) | per query (ms) | time vs exact | recall@10 vs exact CSD |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['build_s']:.1f} | {r['query_ms']:.3f} | {r['ratio']:.3f}x | {r['recall']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.retrieval_index", description=__doc__.splitlines()[0])
    parser.add_argument("--gallery", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="print the table, write nothing")
    args = parser.parse_args(argv)
    rows = run(args.gallery, args.dim, args.queries, args.candidates)
    text = table(rows)
    print(text)
    if not args.quick:
        import faiss

        from benchmarks.report import machine, write_section

        write_section("retrieval_index", (
            f"## Retrieval index: faiss on the means + CSD re-ranking vs exact CSD (`benchmarks/retrieval_index.py`)\n\n"
            f"`.venv/bin/python -m benchmarks.retrieval_index` ({machine()}, faiss {faiss.__version__}, one thread "
            f"each). Gallery: {args.gallery:,} synthetic probabilistic embeddings, D = {args.dim} (means from a "
            f"{LATENT}-dimensional latent space plus noise), sigma^2 per dimension log-uniform over a decade; {args.queries} queries; the exact top 10 by CSD over every item "
            "is the reference. Index defaults (`index: faiss` in a retrieval task): HNSW M 32, efSearch 256; IVF "
            f"sqrt(N) lists, nprobe 64. Per-query time excludes the index build.\n\n{text}\n"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
