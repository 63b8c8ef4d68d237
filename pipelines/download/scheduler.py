"""Run the download's parts as Ray tasks: a bounded number in flight, and a watchdog per part.

A part that raises, crashes its worker or runs longer than ``part_timeout_s`` (force-cancelled) is
a failed `PartResult`, never an exception: the run goes on and a re-run retries it.
"""
from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipelines.download.config import DownloadConfig
from pipelines.download.shard import PartResult, download_part, shard_name
from pipelines.console import ProgressLine


def _slots(cfg: DownloadConfig) -> int:
    if cfg.max_parts_in_flight:
        return cfg.max_parts_in_flight
    return max(1, int(ray.cluster_resources().get("CPU", 1) // cfg.cpus_per_task))


def _task(cfg: DownloadConfig, local_only: bool):
    options: dict[str, Any] = {"num_cpus": cfg.cpus_per_task, "max_retries": 1, "retry_exceptions": False}
    if local_only:  # URLs on this machine's loopback: keep the tasks on this node

        # and ask for no CPU: the driver's node may offer none (a cluster head runs no work), and a task pinned
        # there would never start
        options["num_cpus"] = 0
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                        soft=False)
    return ray.remote(download_part).options(**options)


def _failure(part: dict, err: Exception, seconds: float) -> PartResult:
    first = str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__
    return PartResult(part["shard"], part["rows"], False, error=f"{type(err).__name__}: {first}", seconds=seconds)


def run_parts(cfg: DownloadConfig, manifest: dict, todo: list[dict], local_only: bool = False,
              log=print) -> list[PartResult]:
    """Every part of `todo` once, in order of submission; one log line per finished part."""
    task = _task(cfg, local_only)
    settings = cfg.model_dump(mode="json")
    pending, inflight, results = list(todo), {}, []
    progress = ProgressLine("download", len(todo), unit="part")
    progress.line(0)  # the clock starts with the first part

    def finish(result: PartResult) -> None:
        results.append(result)
        _log_part(log, progress, result, len(results), manifest["shard_digits"])

    while pending or inflight:
        while pending and len(inflight) < _slots(cfg):
            part = pending.pop(0)
            ref = task.remote(settings, part, manifest["shard_digits"], manifest["key_digits"])
            inflight[ref] = (part, time.monotonic())
        ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
        for ref in ready:
            part, started = inflight.pop(ref)
            try:
                result = PartResult(**ray.get(ref))
            except RayError as err:
                result = _failure(part, err, time.monotonic() - started)
            finish(result)
        now = time.monotonic()
        for ref, (part, started) in list(inflight.items()):  # the watchdog
            if now - started > cfg.part_timeout_s:
                ray.cancel(ref, force=True)
                del inflight[ref]
                finish(PartResult(part["shard"], part["rows"], False, seconds=now - started,
                                  error=f"timed out after {cfg.part_timeout_s:g}s"))
    return results


def _log_part(log, progress, r: PartResult, done: int, digits: int) -> None:
    name = shard_name(r.shard, digits)
    if r.ok:
        s = r.stats
        shard = f"{name}: {s.get('successes', 0)}/{s.get('count', 0)} written in {r.seconds:.1f}s"
    else:
        shard = f"{name}: FAILED ({r.error}); its {r.rows} URLs count as failed, re-run to retry"
    log(progress.line(done, shard=shard))
