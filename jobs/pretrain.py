"""Pretrain a (probabilistic) vision-language model with Ray Train + DeepSpeed.

    python -m jobs.pretrain --config configs/demo.yaml [--set train.steps=100 ...]
"""
from __future__ import annotations

import argparse
import sys

from pipelines.config import ConfigError, load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.pretrain", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="experiment YAML (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.steps=100 (repeatable)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)  # fail fast, before Ray starts
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2

    from pipelines.trainer import fit

    try:
        result = fit(cfg)
    except ConfigError as err:  # eval data that lacks what a task needs, found once the data is prepared
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print(f"MLflow run {result.mlflow_run_id} in experiment {result.experiment!r} at {result.mlflow_uri}")
    print(f"  see it with: mlflow ui --backend-store-uri {result.mlflow_uri} --host 127.0.0.1")
    for line in headline(result.metrics):
        print(line)
    return 0


HEADLINE = ("top1", "top5", "i2t_R1", "t2i_R1", "rsum", "loss", "i2t_calib_score", "t2i_calib_score", "top1_calib_score")


def headline(metrics: dict) -> list[str]:
    """One line per eval task with its main numbers."""
    tasks: dict[str, list[str]] = {}
    for key, value in metrics.items():
        task, _, name = key.partition("/")
        if name in HEADLINE and isinstance(value, (int, float)):
            tasks.setdefault(task, []).append(f"{name} {value:.4g}")
    return [f"  {task}: {', '.join(parts)}" for task, parts in tasks.items()]


if __name__ == "__main__":
    sys.exit(main())
