"""Embed a shard set with a saved model (Ray Data batch inference), for indexing or the ProbVLM adapter.

    python -m jobs.embed --model <file.safetensors | runs:/<run_id>/model | run id> --data DIR_OR_URI
        [--split test] --out DIR_OR_URI [--actors 2] [--gpus-per-actor 0] [--no-texts] [--index hnsw|ivf]

Writes {out}/images/*.parquet (key, captions, cls, mu[, logvar][, mix]), one row per sample with a readable image;
{out}/skipped.json: every sample left out (its file and key, by reason: no image, undecodable image, image too
large, unreadable json) and every broken tar file, so no row disappears unseen. Unless --no-texts, the
distinct captions' embeddings in {out}/texts/*.parquet (index, text, mu[, logvar]). With --index, a faiss
index on the images' mu (rows in key order, as `read_embeddings(folder, "key")` returns them) in
{out}/images.faiss: search it with models.scoring.ann.MeanIndex.load and re-rank the candidates by CSD
(models.scoring.ann.pair_scores).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jobs.cli import job_main, job_parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = job_parser("jobs.embed", __doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="folder or URI with *.tar (or with {split}/*.tar, see --split)")
    parser.add_argument("--split", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--gpus-per-actor", type=float, default=0.0)
    parser.add_argument("--no-texts", action="store_true", help="images only")
    parser.add_argument("--index", choices=["hnsw", "ivf"], default=None, help="also write a faiss index on the images' mu")
    parser.add_argument("--tracking-uri", default=None, help="MLflow store of a run id (default as jobs.pretrain)")
    return parser.parse_args(argv)


@job_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pipelines.evaluate.job import run_embed  # deferred: a config error or --help answers before torch, Ray and MLflow load
    from pipelines.evaluate.inference import InferenceOptions

    opts = InferenceOptions(concurrency=args.actors, batch_size=args.batch_size, num_gpus=args.gpus_per_actor)
    out = args.out if "://" in args.out else Path(args.out).resolve()  # a URI: object storage, written there
    run_embed(args.model, args.data, args.split, out, opts, args.tracking_uri,
              texts=not args.no_texts, index=args.index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
