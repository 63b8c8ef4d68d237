"""Faults put into a run on purpose, to try its recovery, outside the worker's own code: the worker is handed each
hook, None unless something outside the product's jobs turns it on, and calls it where the fault belongs. Every
stage that trains on Ray Train can be given them.

- train.fail_once_at_step (`fail_once`): one worker raises once when a step is applied, once per MLflow run, as a
  crashed worker would; Ray Train restarts the group from the last checkpoint (run.max_failures). The run's config
  alone turns it on; the driver names the marker file that makes it fire once per MLflow run.
- Holds (`hold_at`, tests only): rank 0 stops at a named point of the run (FINAL_EVALUATION: the final evaluation,
  after the final checkpoint and the saved model; ATTEMPT_START: an attempt that has begun, its journal entry written
  and its progress checked, before its first step; NOTICE_SAVED: a notice's checkpoint registered, before its
  evaluation, its file taken and its hand-over to Ray) until the test lets it go, at every stop or at one (the n-th
  stop there, counted over the attempts; EVALUATION: the start of an evaluation between steps, where a notice may stop
  it). What a test does "during" that point (a notice, a kill) then happens there
  by construction, whatever the machine's speed: the phase cannot end before the test has acted and seen the run's
  answer. Turned on by the training loop's config (key HOLDS: point -> a folder), which no job of the product sets: a
  test adds it (tests/helpers.py, `pretrain_beside(..., holds=...)`). Off, it is one dictionary look-up per attempt
  and a None hook; the worker calls it once per point and attempt, never in a step.
"""
from __future__ import annotations

import os
import time
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


# The training loop's config key that turns holds on (point -> folder), and the points the worker holds at.
HOLDS = "holds"
FINAL_EVALUATION = "final_evaluation"
EVALUATION = "evaluation"
ATTEMPT_START = "attempt_start"
NOTICE_SAVED = "notice_saved"
# How often a held rank 0 looks for its release.
HOLD_POLL_S = 0.05


def held_file(folder: str | Path, point: str) -> Path:
    """Written by rank 0 as it stops at `point` (a line per stop: pid and time): the proof that the phase runs."""
    return Path(folder) / f"{point}.held"


def released_file(folder: str | Path, point: str, stop: int | None = None) -> Path:
    """Written by the test to let rank 0 go on from `point` (now and at every later stop there), or, with `stop`,
    from the stop-th stop there only (1: the first; a line of `held_file` each)."""
    return Path(folder) / (f"{point}.released" if stop is None else f"{point}.released.{stop}")


def hold_at(points: dict[str, str] | None) -> Callable[[str], None] | None:
    """The hook of rank 0 (None on the others, or with no point armed, as in every job of the product): at a point of
    `points` (point -> a folder on rank 0's node), it writes `held_file` and waits until `released_file` exists,
    for every stop or for this one; at any other point it returns at once. A restart that kills the held worker ends
    the wait with it."""
    if not points or ray.train.get_context().get_world_rank() != 0:
        return None

    def hold(point: str) -> None:
        folder = points.get(point)
        if folder is None:
            return
        with open(held_file(folder, point), "a") as f:
            f.write(f"{os.getpid()} {time.time():.3f}\n")
        stop = len(held_file(folder, point).read_text().splitlines())
        print(f"[fault] rank 0 held at {point} (stop {stop}) until {released_file(folder, point)} or "
              f"{released_file(folder, point, stop).name} exists", flush=True)
        while not (released_file(folder, point).exists() or released_file(folder, point, stop).exists()):
            time.sleep(HOLD_POLL_S)

    return hold
