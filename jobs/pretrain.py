"""Pretrain a (probabilistic) vision-language model with Ray Train + DeepSpeed.

    python -m jobs.pretrain --config configs/demo.yaml [--set train.steps=100 ...]
"""
from __future__ import annotations

import sys

from jobs.cli import config_parser, job_main
from pipelines.pretrain.config import load_train_config


@job_main
def main(argv: list[str] | None = None) -> int:
    args = config_parser("jobs.pretrain", __doc__, "experiment YAML (see configs/)", "train.steps=100").parse_args(argv)
    cfg = load_train_config(args.config, args.overrides)  # fail fast, before Ray starts

    from pipelines.console import process_started_at
    from pipelines.pretrain.job import run_pretrain  # deferred: a config error or --help answers before torch, Ray and MLflow load
    from pipelines.pretrain.run_summary import run_summary

    # start-up timed from this process's start; a ConfigError here: eval data that lacks what a task needs, found
    # once the data is prepared
    result = run_pretrain(cfg, started_at=process_started_at())
    for line in run_summary(cfg, result):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
