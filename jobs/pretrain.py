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

    result = fit(cfg)
    top1 = result.metrics.get(f"zero_shot_top1_{cfg.eval.split}")
    print(f"MLflow run {result.mlflow_run_id} in experiment {result.experiment!r} at {result.mlflow_uri}")
    print(f"  see it with: mlflow ui --backend-store-uri {result.mlflow_uri} --host 127.0.0.1")
    if top1 is not None:
        print(f"held-out zero-shot top-1 ({cfg.eval.split} split): {top1:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
