"""Evaluate a saved model on the eval tasks of a config (retrieval, zero-shot, loss, calibration).

    python -m jobs.evaluate --model <file.safetensors | runs:/<run_id>/model | run id> --config configs/demo.yaml
        [--set eval.split=val ...] [--out DIR] [--actors 2] [--gpus-per-actor 0]

Embeddings come from Ray Data batch inference (an actor pool) and are kept as parquet under --out;
results go to {out}/results.json and a new MLflow run tagged with the source run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jobs.cli import config_parser, job_main
from pipelines.evaluate.config import load_evaluate_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = config_parser("jobs.evaluate", __doc__, "YAML whose eval section lists the tasks (e.g. configs/demo.yaml)",
                           "eval.split=val")
    parser.add_argument("--model", required=True, help="model.safetensors, runs:/<run_id>/model, or an MLflow run id")
    parser.add_argument("--out", default=None, help="embeddings and results (default .probvlp/eval/<time>)")
    parser.add_argument("--actors", type=int, default=2, help="embedding actors (model copies)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--gpus-per-actor", type=float, default=0.0)
    return parser.parse_args(argv)


@job_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_evaluate_config(args.config, args.overrides)

    from pipelines.evaluate.headline import headline  # deferred: a config error or --help answers before torch, Ray and MLflow load
    from pipelines.evaluate.inference import InferenceOptions
    from pipelines.evaluate.job import run_evaluate

    opts = InferenceOptions(concurrency=args.actors, batch_size=args.batch_size, num_gpus=args.gpus_per_actor)
    result = run_evaluate(cfg, args.model, Path(args.out) if args.out else None, opts)
    from pipelines.tracking import hide_credentials

    print(f"results: {result.out / 'results.json'}; MLflow run {result.mlflow_run_id} at "
          f"{hide_credentials(result.mlflow_uri)}")
    for line in headline(result.metrics):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
