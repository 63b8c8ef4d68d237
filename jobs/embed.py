"""Embed a shard set with a saved model (Ray Data batch inference), for indexing or the ProbVLM adapter.

    python -m jobs.embed --model <file.safetensors | runs:/<run_id>/model | run id> --data DIR_OR_URI
        [--split test] --out DIR [--actors 2] [--gpus-per-actor 0] [--no-texts] [--index hnsw|ivf]

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
import json
import sys
import uuid
from pathlib import Path

from jobs.cli import job_main, job_parser
from pipelines.config import InputError


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
    from models.model_file import load_model  # deferred: a config error or --help answers before torch, Ray and MLflow load
    from models.scoring.ann import MeanIndex
    from pipelines.cluster.runtime import init_ray, local_cpus
    from pipelines.data.reader import shard_paths
    from pipelines.data.stats import drop_stats, reader_stats, report_lines, skipped_keys
    from pipelines.evaluate.in_process import distinct_captions, split_captions
    from pipelines.evaluate.inference import (InferenceOptions, read_embeddings, write_image_embeddings,
                                              write_text_embeddings)
    from pipelines.tracking import resolve_model, tracking_uri

    out = Path(args.out).resolve()
    try:
        source = resolve_model(args.model, tracking_uri(args.tracking_uri), out / "source")
        paths = shard_paths(args.data, args.split)
    except (ValueError, FileNotFoundError) as err:
        raise InputError(str(err)) from None
    init_ray(num_cpus=local_cpus(args.actors, 1))  # a local Ray keeps CPUs beside the actors for decoding
    model = load_model(source["model"])
    opts = InferenceOptions(concurrency=args.actors, batch_size=args.batch_size, num_gpus=args.gpus_per_actor)
    stats_name = f"embed-{uuid.uuid4().hex[:12]}"  # this run's own reader counts
    folder = write_image_embeddings(str(source["model"]), paths, model.img_size, out, opts, stats_name=stats_name)
    skipped = {**reader_stats(stats_name), "samples": skipped_keys(stats_name)}
    drop_stats(stats_name)
    (out / "skipped.json").write_text(json.dumps(skipped, indent=1, sort_keys=True))
    cols, outputs = read_embeddings(folder, "key", getattr(model, "mixture_tokens", None))
    print(f"{len(cols['key'])} image embeddings in {folder}")
    for line in report_lines("embed", skipped):
        print(line)
    if skipped["skipped_unique"] or skipped["files"]:
        print(f"skipped samples and files: {out / 'skipped.json'}")
    if args.index:
        MeanIndex(outputs["mu"], kind=args.index).save(out / "images.faiss")
        print(f"faiss {args.index} index on the image means in {out / 'images.faiss'}")
    if not args.no_texts:
        texts = distinct_captions(split_captions(cols["captions"]))
        if texts:
            print(f"{len(texts)} caption embeddings in "
                  f"{write_text_embeddings(str(source['model']), texts, out, opts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
