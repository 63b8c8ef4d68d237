"""Download a URL table (parquet/csv/tsv/jsonl) into webdataset shards with img2dataset on Ray.

    python -m jobs.download --config configs/download_example.yaml [--set download.rows_per_shard=5000 ...]

Re-running the same command continues an interrupted download: finished shards are skipped.
Exit status: 0 when every shard is finished, 3 when some shards failed (re-run to retry them),
2 for a configuration or input problem.
"""
from __future__ import annotations

import sys

from jobs.cli import config_parser, job_main
from pipelines.download.config import load_download_config


@job_main
def main(argv: list[str] | None = None) -> int:
    args = config_parser("jobs.download", __doc__, "YAML with a `download:` section (see configs/)",
                         "download.image_size=128").parse_args(argv)
    cfg = load_download_config(args.config, args.overrides)  # fail fast, before Ray starts

    from pipelines.download.job import run_download  # deferred: a config error or --help answers before torch, Ray and MLflow load
    from pipelines.download.summary import format_summary
    from pipelines.download.urls import DownloadError

    def show(summary: dict) -> None:
        print(format_summary(summary))
        print(f"summary saved to {cfg.download.output.rstrip('/')}/_summary.json")

    try:
        result = run_download(cfg, show)
    except DownloadError as err:
        print(f"download error: {err}", file=sys.stderr)
        return 2
    if result.mlflow_run_id:
        print(f"MLflow run {result.mlflow_run_id} in experiment {cfg.run.experiment!r}")
    return 0 if result.metrics["shards_complete"] == result.metrics["shards"] else 3


if __name__ == "__main__":
    sys.exit(main())
