"""Every rank's side of an evaluation during pretraining (the training loop's Evaluator: every train.eval_every
steps; a notice's save and a restart's first one too): the weights gathered, rank 0 evaluates them
(`evaluation.Evaluation`), every rank gets its metrics."""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from pipelines.fit.faults import EVALUATION
from pipelines.fit.loop import Points
from pipelines.fit.notices import Notices
from pipelines.pretrain.evaluation import Evaluation
from pipelines.zero import checkpoint_files
from pipelines.zero.engine import gathered_weights


class StepEvaluation:
    """`evaluation`: rank 0's (None on the others); `hold`: rank 0's, at an evaluation between steps (tests only:
    pipelines.fit.faults)."""

    def __init__(self, engine, progress, evaluation: Evaluation | None, notices: Notices, rank: int,
                 device: torch.device, eval_every: int, hold: Callable[[str], None] | None = None):
        self.engine, self.progress, self.evaluation, self.notices = engine, progress, evaluation, notices
        self.rank, self.device, self.hold = rank, device, hold
        self.due = Points(eval_every)

    def evaluate(self, step: int) -> dict[str, float] | None:
        """The loop's evaluation between steps: stopped by a notice on any rank (None on every rank: the notice's
        save is due now)."""
        return self(stoppable=True)

    def report(self, metrics: dict[str, Any]) -> None:
        checkpoint_files.report(metrics)

    def __call__(self, stoppable: bool = False) -> dict[str, float] | None:
        """Every eval task's metrics (collective: rank 0 evaluates gathered weights, all ranks get them; a failing
        task gives NaNs, pipelines.pretrain.evaluation). `stoppable` (an evaluation between steps, which may outlast a
        notice's deadline): a notice on any rank during it stops it, None on every rank (the notice's save is due
        now): rank 0 checks its own notices before each batch, the other ranks, waiting for its answer in a
        collective, record theirs in the run's storage, which rank 0 reads then too, at most once a second
        (pipelines.fit.notices)."""
        weights, loss_weights = gathered_weights(self.engine, self.rank, self.device)
        step = self.progress.step
        waiting = self.notices.watch_evaluation(step) if stoppable and self.rank != 0 else threading.Event()
        try:
            if stoppable and self.hold:  # tests only: a notice "during the evaluation" lands here
                self.hold(EVALUATION)
            result = [self.evaluation.validate(weights, loss_weights, step,
                                               self.notices.evaluation_stop(step) if stoppable else None)
                      if self.rank == 0 else None]
            del weights, loss_weights
            torch.distributed.broadcast_object_list(result, src=0)
        finally:
            waiting.set()
        return result[0]
