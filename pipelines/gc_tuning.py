"""CPython's garbage collector tuned for processes that import much at start-up (no Ray, no torch here: a job's
driver sets it before anything heavy loads)."""
from __future__ import annotations

import gc

# CPython collects its youngest generation every 700 net allocations of container objects. A process's start-up
# allocates millions as it imports (a training worker: torch, Ray Train, DeepSpeed, timm, MLflow), and those
# collections, each scanning objects that live as long as the process, took ~15% of the imports' CPU
# (benchmarks/import_gc.py; docs/BENCHMARKS.md). Every 50,000 instead: the few cycles a run leaves are still
# collected, later, and the older generations keep their thresholds.
YOUNG_GC_THRESHOLD = 50_000


def collect_less() -> None:
    """CPython's youngest generation collected every YOUNG_GC_THRESHOLD allocations (never more often than it was):
    in a job's driver (jobs.cli.job_main) and in every Ray worker (pipelines.cluster.runtime.worker_setup)."""
    young, *older = gc.get_threshold()
    if young:  # 0: the process turned collection off itself, and it stays off
        gc.set_threshold(max(young, YOUNG_GC_THRESHOLD), *older)
