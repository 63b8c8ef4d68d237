"""Where a fit stands, saved with every checkpoint of every stage."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    """Where training stands; saved with every checkpoint. `batch_in_epoch` counts micro-batches."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    samples: int = 0
    skipped_batches: int = 0
    preemptions: int = 0  # notices of preemption the run saved on (pipelines.fit.preemption)
    notice_file_mtime: float = 0.0  # the last notice file a save consumed (a file no newer is not a notice)
    evaluate_at: int = -1  # a notice's save at an evaluation step, before evaluating: a restart there evaluates first
