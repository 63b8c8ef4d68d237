"""Fault injection for trying a run's recovery (train.fail_once_at_step): one worker raises once when a step is
applied, once per MLflow run, as a crashed worker would; Ray Train restarts the group from the last checkpoint
(run.max_failures). Outside the worker's own code: it is handed the hook, which the run's config alone turns on."""
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
