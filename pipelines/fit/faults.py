"""The fault every stage that trains on Ray Train can be given on purpose, to try its recovery: train.fail_once_at_step
(`fail_once`). The worker is handed the hook, None unless the run's config turns it on, and calls it with each step
applied; the driver names the marker file that makes it fire once per MLflow run. Pretraining's other faults (the
tests' holds) are pipelines.train.faults'."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import ray.train


def fail_once(step: int | None, marker: str | None) -> Callable[[int], None] | None:
    """The hook of the last rank (None on the others, or without train.fail_once_at_step): raises at `step`, unless
    `marker` (a file per MLflow run, written before raising) says it did already."""
    context = ray.train.get_context()
    if step is None or not marker or context.get_world_rank() != context.get_world_size() - 1:
        return None

    def fault(applied: int) -> None:
        if applied != step or Path(marker).exists():
            return
        Path(marker).parent.mkdir(parents=True, exist_ok=True)
        Path(marker).write_text(str(applied))
        raise RuntimeError(f"injected failure at step {applied} (train.fail_once_at_step)")

    return fault
