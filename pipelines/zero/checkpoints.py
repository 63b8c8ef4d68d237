"""A DeepSpeed attempt's checkpoints, on every rank: when one is due by the clock (train.checkpoint_every_s), the
upload in flight, and the one order of every save, the periodic ones, a notice's and the final one:

1. rank 0's MLflow calls not delivered yet, into the run's storage beside the checkpoint about to be written (whichever
   checkpoint a restart resumes from, the metrics up to its step travel with it);
2. a periodic save waits for the upload before it to be registered (one upload in flight);
3. each rank's shard written to a snapshot of its node and reported to Ray Train, which uploads it and registers the
   checkpoint once every rank's part is in: behind training for a periodic save, before the save returns otherwise;
4. rank 0's journal of attempts: the step reached and the last registered checkpoint, one write a save.

The shard itself, the upload and its wait are pipelines.zero.checkpoint_files's."""
from __future__ import annotations

import os
import time
from typing import Any

from pipelines.fit.progress import Progress
from pipelines.zero import checkpoint_files
from pipelines.zero.config import ZeroConfig


class Checkpoints:
    """One attempt's saves (every rank). `logger`, `journal`: rank 0's (None on the others); `attempt`: rank 0's
    number of the attempt, which names its checkpoint folders (the other ranks' names do not count)."""

    def __init__(self, engine, progress: Progress, t: ZeroConfig, rank: int, attempt: int, outbox_folder: str,
                 logger=None, journal=None):
        self.engine, self.progress, self.t, self.rank, self.attempt = engine, progress, t, rank, attempt
        self.outbox_folder, self.logger, self.journal = outbox_folder, logger, journal
        self.upload: tuple[int, str] | None = None  # the checkpoint whose upload may be in flight: (step, snapshot)
        self.saved_at = time.monotonic()  # the clock of train.checkpoint_every_s (restarted by every save)
        self.names: set[str] = set()
        self.agreed = False  # the ranks' clocks at the last step (pipelines.fit.step.agree): some rank's is due

    def restart_clock(self) -> None:
        """The loop starts (or goes on after a phase that is not training): the clock counts training from now."""
        self.saved_at = time.monotonic()

    def vote(self) -> bool:
        """This rank's clock says a checkpoint is due (train.checkpoint_every_s; the step's all-reduce joins the
        ranks' clocks: pipelines.fit.step.agree)."""
        every_s = self.t.checkpoint_every_s
        return bool(every_s) and time.monotonic() - self.saved_at >= every_s

    def due(self, step: int) -> bool:
        """The loop's question after a step: every train.checkpoint_every steps, or some rank's clock."""
        return (bool(self.t.checkpoint_every) and step % self.t.checkpoint_every == 0) or self.agreed

    def save(self, metrics: dict[str, Any], *, at_once: bool = False, evaluate_at: bool = False) -> float:
        """The checkpoint of the step in the one order (the module's). Between steps (the loop's): the loop goes on
        once the shard's snapshot is written on this node, its upload behind training, after the previous upload is
        whole. `at_once` (a notice's, the final one): it returns once Ray Train registered it and every one before
        it. `evaluate_at`: the checkpoint records that the evaluation due at its step has not run (a restart
        evaluates first). Logged: `checkpoint_blocked_s` (what the loop lost: waiting for the previous upload,
        writing the snapshot or, at once, the upload too), `checkpoint_wait_s` (of it, waiting for the previous
        upload). Returns the seconds blocked."""
        progress, behind = self.progress, not at_once
        step, start = progress.step, time.perf_counter()
        if self.logger:  # 1
            self.logger.persist(self.outbox_folder)
        waited, registered = self._wait_for_upload(step) if behind else (0.0, {})  # 2
        progress.evaluate_at = step if evaluate_at else -1
        try:  # 3
            snapshot = checkpoint_files.save(self.engine, progress, metrics, behind=behind, name=self._name(step),
                                        snapshots=self.t.checkpoint_snapshot_dir,
                                        upload_timeout_s=self.t.upload_timeout_s)
        finally:
            progress.evaluate_at = -1
        blocked = time.perf_counter() - start
        self.upload = (step, snapshot) if snapshot else None  # a save at once waited for every upload before it
        self.saved_at = time.monotonic()
        if self.journal:  # 4
            self.journal.update(reached=step, **registered, **({} if behind else {"checkpoint_step": step}))
        if self.logger:
            self.logger.log({"checkpoint_blocked_s": blocked, "checkpoint_wait_s": waited}, step, event=True)
        return blocked

    def _wait_for_upload(self, step: int) -> tuple[float, dict[str, Any]]:
        """Every rank, before a snapshot: until the previous checkpoint is uploaded and registered (its snapshot
        folder, which Ray Train deletes once uploaded, still there says so on rank 0, in one line and the journal).
        Returns the seconds waited and the journal's fields for the registered checkpoint (for the save's write)."""
        if self.upload is None:
            return 0.0, {}
        previous, snapshot = self.upload
        start = time.perf_counter()
        slow = self.rank == 0 and os.path.exists(snapshot)
        if slow:
            print(f"[checkpoint] step {step}: the checkpoint of step {previous} is still uploading; waiting for it "
                  "(one upload at a time: train.checkpoint_every or checkpoint_every_s shorter than an upload?)",
                  flush=True)
            self.journal.update(waiting_for_upload=previous)
        checkpoint_files.wait_for_uploads(previous, self.t.upload_timeout_s)
        self.upload = None
        registered = {"checkpoint_step": previous, **({"waiting_for_upload": None} if slow else {})}
        return time.perf_counter() - start, registered

    def _name(self, step: int) -> str | None:
        """The checkpoint's folder in the run's storage (rank 0's counts; pipelines.zero.checkpoint_files.checkpoint_name)."""
        if self.rank != 0:
            return None
        name = base = checkpoint_files.checkpoint_name(step, self.attempt)
        while name in self.names:  # the same step saved twice (a notice at a step that applied nothing)
            name = f"{base}_{len(self.names)}"
        self.names.add(name)
        return name
