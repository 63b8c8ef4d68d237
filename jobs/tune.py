"""Sweep hyperparameters with Ray Tune; every trial is a Ray Train run logged to MLflow.

    python -m jobs.tune --config configs/tune_prolip_llip.yaml [--set tune.num_samples=16 ...]

Re-running the same command resumes an interrupted sweep: finished trials are kept, not rerun.
"""
from __future__ import annotations

import sys
from pathlib import Path

from jobs.cli import config_parser, job_main


@job_main
def main(argv: list[str] | None = None) -> int:
    parser = config_parser("jobs.tune", __doc__, "sweep YAML (see configs/tune_*.yaml)", "tune.num_samples=8")
    parser.add_argument("--best-config-out", default=None, help="where to write the best config YAML "
                        "(default: .probvlp/tune/<name>_best.yaml)")
    args = parser.parse_args(argv)

    from pipelines.tune.config import load_tune_config  # deferred: --help answers before torch loads

    sweep, base = load_tune_config(args.config, args.overrides)  # the whole space is checked before Ray loads

    from pipelines.tune.job import run_tune  # deferred: a config error answers before Ray and MLflow load

    # a ConfigError here: eval data that lacks what a task needs, found once the data is prepared
    result = run_tune(sweep, base, Path(args.config).read_text(), args.best_config_out)
    summary = result.summary
    if summary is None:
        print(f"sweep {sweep.tune.name!r} interrupted, its state saved: run the same command again to resume it "
              "(trials that ended are kept)", file=sys.stderr)
        return 130  # the shell's status for Ctrl-C
    out = result.out
    print(summary["table"].to_string(index=False))
    print(f"best {sweep.tune.metric} = {summary['best_metric']:.4f} with {summary['best_params']}")
    print(f"best config: {out}  (run it: python -m jobs.pretrain --config {out})")
    print(f"MLflow parent run {result.mlflow_run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
