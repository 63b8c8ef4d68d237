"""Download a URL table into webdataset shards with img2dataset, spread over the Ray cluster.

1. **Plan** (`pipelines.download.plan`, Ray Data for big tables): read the table
   (`pipelines.download.urls`), de-duplicate URLs and split the rows into deterministic parts of about
   ``rows_per_shard`` rows, one per output shard, recorded in a manifest that a re-run reuses.
2. **Download** (`pipelines.download.scheduler` running `pipelines.download.shard` as Ray tasks): every
   part not yet finished becomes one shard; a re-run skips shards whose ``.tar`` and ``_stats.json``
   exist. A part that fails, crashes its worker or times out is counted as failed (its rows under
   ``part failed: ...``) and retried by the next run. Nothing else stops the run.
3. **Summary** (`pipelines.download.summary`): input rows, duplicates removed, rows without URL,
   written, failed by reason, shard counts and throughput; printed, saved as ``_summary.json``, and
   logged to MLflow (`log_download`) when tracking is set.

`run_download` is `jobs.download`; `download_shards` the download alone, on a running Ray (the bundled digits use it).
"""
from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Callable

from pipelines.cluster.runtime import init_ray
from pipelines.download.config import DownloadConfig, DownloadDocument
from pipelines.download.plan import plan
from pipelines.download.shard import TMP_DIR, shard_done, shard_name
from pipelines.download.summary import summarize_download
from pipelines.storage import fs_path, write_bytes_atomic
from pipelines.download.scheduler import run_parts
from pipelines.result import JobResult

SUMMARY_FILE = "_summary.json"


def run_download(cfg: DownloadDocument, show: Callable[[dict[str, Any]], None] = lambda summary: None) -> JobResult:
    """`jobs.download`: Ray started (or joined), the shards downloaded, the summary given to `show`, then logged to
    MLflow when tracking is set. `metrics`: the summary (pipelines.download.summary); `out`: download.output;
    `mlflow_run_id` None without tracking."""
    init_ray(cfg.ray.address, cfg.ray.num_cpus)
    summary = download_shards(cfg.download)
    show(summary)  # before MLflow is reached: a tracking store that fails leaves the summary on screen
    uri, run_id = log_download(cfg, summary)
    return JobResult(metrics=summary, mlflow_uri=uri, mlflow_run_id=run_id, run_name=cfg.run.name,
                     out=cfg.download.output)


def download_shards(cfg: DownloadConfig, local_only: bool = False, log=print) -> dict[str, Any]:
    """Plan (or reuse the plan), download every unfinished part, write and return the summary.

    Needs a running Ray (`pipelines.cluster.runtime.init_ray`). `local_only` pins the tasks to this node
    (for URLs served on this machine's loopback).
    """
    t0 = time.perf_counter()
    fs, out = fs_path(cfg.output)
    fs.makedirs(out, exist_ok=True)
    manifest = plan(cfg)
    todo, skipped = [], 0
    for part in manifest["parts"]:
        if shard_done(fs, out, shard_name(part["shard"], manifest["shard_digits"])):
            skipped += 1
        else:
            todo.append(part)
    log(f"{len(manifest['parts'])} shards planned from {manifest['input_rows']} rows: {skipped} already finished, "
        f"{len(todo)} to download")
    t1 = time.perf_counter()
    results = run_parts(cfg, manifest, todo, local_only=local_only, log=log)
    summary = summarize_download(cfg, manifest, results, skipped, time.perf_counter() - t1)
    summary["plan_seconds"] = round(t1 - t0, 3)
    if fs.exists(f"{out}/{TMP_DIR}") and not fs.ls(f"{out}/{TMP_DIR}"):
        fs.rm(f"{out}/{TMP_DIR}", recursive=True)
    write_bytes_atomic(fs, f"{out}/{SUMMARY_FILE}", json.dumps(summary, indent=1).encode())
    return summary


def log_download(cfg: DownloadDocument, summary: dict[str, Any]) -> tuple[str | None, str | None]:
    """One MLflow run per download invocation, when tracking is configured (tracking.uri or $MLFLOW_TRACKING_URI)."""
    if not (cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")):
        return None, None
    # deferred: MLflow loads only when tracking is set
    from pipelines.tracking import finish_with_results, git_commit, start_run, tracking_uri

    uri = tracking_uri(cfg.tracking.uri)
    params = {f"download.{k}": v for k, v in cfg.download.model_dump(mode="json").items()}
    tags = {"probvlp.job": "download", "mlflow.source.git.commit": git_commit() or ""}
    run_id = start_run(uri, cfg.run.experiment, f"{cfg.run.name}-download", params, cfg.to_yaml(), tags)
    numeric = {k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for reason, n in summary["failed_by_reason"].items():
        numeric[f"failed.{re.sub(r'[^0-9A-Za-z_.-]+', '_', reason).strip('_')[:200]}"] = float(n)
    finish_with_results(uri, run_id, numeric, texts={"download_summary.json": json.dumps(summary, indent=1)})
    return uri, run_id
