"""Train a ProbVLM adapter on a frozen deterministic model's embeddings (Ray Data + Ray Train), then score it.

    python -m jobs.adapt --config configs/probvlm_demo.yaml [--set train.steps=300 ...] [--out DIR]

Writes {out}/model.safetensors (the adapted model: frozen source + adapter, a probabilistic model that
`jobs.evaluate --model` scores like any other), {out}/baseline.safetensors (with adapter.baseline: pfe),
{out}/embeddings (the source's embeddings of the training pairs), {out}/metrics.json and {out}/plots,
and logs them to MLflow. The same command with the same `run.name` resumes an interrupted fit (or one stopped
by `train.stop_at_step`) from its latest checkpoint; for a finished fit it re-scores the saved adapter.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jobs.cli import config_parser, job_main
from pipelines.adapt.config import load_adapt_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = config_parser("jobs.adapt", __doc__, "adapter YAML (see configs/probvlm_*.yaml)", "train.steps=300")
    parser.add_argument("--out", default=None, help="outputs (default .probvlp/adapt/<run name>)")
    return parser.parse_args(argv)


@job_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_adapt_config(args.config, args.overrides)

    from pipelines.adapt.scoring import summary_lines  # deferred: a config error or --help answers before torch, Ray and MLflow load
    from pipelines.adapt.job import run_adapt

    result = run_adapt(cfg, Path(args.out) if args.out else None)
    if result.model_file is None:
        print(f"stopped at step {int(result.train.get('step', 0))} of {cfg.train.steps} (train.stop_at_step); the same "
              f"command with --set run.name={result.run_name} continues from there")
        return 0
    print(f"adapted model: {result.model_file} (MLflow run {result.mlflow_run_id}, runs:/{result.mlflow_run_id}/model)")
    print(f"trained on {result.pairs} pairs of {result.source.name} embeddings: "
          f"{result.train.get('samples_per_s', float('nan')):.0f} samples/s, source weights unchanged")
    models = ["adapter"] + (["baseline"] if result.baseline_file else [])
    for line in summary_lines(result.metrics, [t.name for t in cfg.resolved_tasks()], models):
        print(line)
    print(f"evaluate on other tasks: python -m jobs.evaluate --model {result.model_file} --config <config with eval.tasks>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
