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

    from pipelines.train_driver import fit

    try:
        result = fit(cfg)
    except ConfigError as err:  # eval data that lacks what a task needs, found once the data is prepared
        print(f"config error: {err}", file=sys.stderr)
        return 2
    from pipelines.showcase import run_summary

    for line in run_summary(cfg, result):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
