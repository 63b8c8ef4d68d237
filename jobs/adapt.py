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
import time
from pathlib import Path

from pipelines.adapt.config import load_adapt_config
from pipelines.config import ConfigError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.adapt", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="adapter YAML (see configs/probvlm_*.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=None, help="outputs (default .probvlp/adapt/<run name>)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_adapt_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2

    from pipelines.adapt.run import adapt
    from pipelines.adapt.evaluate import summary_lines
    from pipelines.adapt.source import AdaptError
    from pipelines.evaluate.tasks import EvaluationError
    from pipelines.tracking import LOCAL_DIR

    if cfg.run.name is None:
        cfg.run.name = f"adapt-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(args.out or LOCAL_DIR / "adapt" / cfg.run.name).resolve()
    try:
        result = adapt(cfg, out)
    except AdaptError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except EvaluationError as err:  # the adapter is saved; the message says where
        print(f"evaluation error: {err}", file=sys.stderr)
        return 1
    if result.model_file is None:
        print(f"stopped at step {int(result.train.get('step', 0))} of {cfg.train.steps} (train.stop_at_step); the same "
              f"command with --set run.name={cfg.run.name} continues from there")
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
