"""The end of a pretraining attempt, on every rank: the final checkpoint first (from there a notice costs no step,
and a restart only evaluates and saves the model), then the final weights, the saved model and the final evaluation
(rank 0: save before judging), what the readers skipped, and the final report (Ray Train's result and the run's
final_report.json, which the driver matches to its job). A notice meanwhile is still handed to Ray (a watcher), so
that its restart counts as a preemption."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Callable

import ray.train
import torch

from pipelines.fit import attempts
from pipelines.fit.faults import FINAL_EVALUATION
from pipelines.fit.notices import Notices
from pipelines.pretrain import export
from pipelines.pretrain.config import TrainDocument
from pipelines.pretrain.evaluation import Evaluation
from pipelines.pretrain.step_metrics import StepMetrics
from pipelines.zero.checkpoints import Checkpoints
from pipelines.zero.engine import gathered_weights


class FinalPhase:
    """`evaluation`, `logger`: rank 0's (None on the others); `job`: the command's (pipelines.fit.launch.Launch.job);
    `hold`: rank 0's, before the final evaluation (tests only: pipelines.fit.faults)."""

    def __init__(self, cfg: TrainDocument, engine, progress, rank: int, device: torch.device, folder: str, job: str,
                 checkpoints: Checkpoints, notices: Notices, metrics: StepMetrics, evaluation: Evaluation | None,
                 logger, hold: Callable[[str], None] | None = None):
        self.cfg, self.engine, self.progress, self.rank, self.device = cfg, engine, progress, rank, device
        self.folder, self.job, self.hold = folder, job, hold
        self.checkpoints, self.notices, self.metrics = checkpoints, notices, metrics
        self.evaluation, self.logger = evaluation, logger

    def run(self, saved: bool) -> None:
        """`saved`: the checkpoint of this step is there already (a restart at the last step): not saved again."""
        p, metrics = self.progress, self.metrics
        report: dict[str, Any] = {"step": p.step, "epoch": p.epoch}
        if metrics.data_error:  # the driver raises BadDataError
            self.checkpoints.save({**report, **(metrics.data_report() if self.rank == 0 else {}),
                                   "data_error": metrics.data_error}, at_once=True)
            return
        if not saved:
            self.checkpoints.save(dict(report), at_once=True)
        watcher = self.notices.watch_final(p.step)
        try:
            report.update(metrics.data_wait_mean())
            if p.step >= self.cfg.train.steps:
                weights, loss_weights = gathered_weights(self.engine, self.rank, self.device)
                if self.rank == 0:
                    report.update(self._artifacts(weights, loss_weights))
                del weights, loss_weights
            if self.rank == 0:  # what the readers skipped, the final evaluation's reads included
                report.update(metrics.data_report())
            shared = [report]  # every rank reports the same metrics
            torch.distributed.broadcast_object_list(shared, src=0)
            if self.rank == 0:  # the driver's result (Ray Train's holds the final checkpoint's metrics)
                attempts.write_final_report(self.folder, self.job, shared[0])
            ray.train.report(shared[0])
        finally:
            watcher.set()

    def _artifacts(self, weights, loss_weights) -> dict[str, Any]:
        """Save before judging: the model file, the MLflow model, the loss weights and the probe reach MLflow before
        the final evaluation. A failing evaluation returns {"eval_error": one line naming the task}."""
        objective = self.evaluation.objective(weights, loss_weights)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            probe = self.evaluation.probe(objective.model)
            export.save_trained_model(self.logger, self.cfg, objective.model, weights, loss_weights, probe, tmp)
            if self.hold:
                self.hold(FINAL_EVALUATION)
            metrics, results, error = self.evaluation.final(objective, self.progress.step)
            export.save_model_card(self.logger, self.cfg, metrics, self.progress.step, tmp)
            if error:
                return {"eval_error": error}
            self.evaluation.save_results(metrics, results, tmp)
        # the driver prints them (pipelines.pretrain.run_summary) without loading the model itself
        return {**metrics, "sample_predictions": json.dumps(self.evaluation.samples(objective.model))}
