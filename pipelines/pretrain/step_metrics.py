"""What a pretraining step logs (the training loop's StepLog: every train.log_every steps and the last): every rank
checks the data's health (past data.max_bad_frac the run stops, `data_error`), rank 0 logs the loss and its parts,
the learning rate, the throughput, the data wait and the readers' skips, and shows them on its progress line; the
job's start-up time at the first step; at the end, every dataset's skips (`data_report`)."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from models.gather import World
from pipelines.data.stats import report_metrics
from pipelines.fit.data_wait import DataWait
from pipelines.fit.loop import Points
from pipelines.fit.progress import Progress
from pipelines.pretrain.data_health import DataHealth
from pipelines.console import ProgressLine


class StepMetrics:
    """`logger`, `data_health`: rank 0's (None on the others); `rows`: this rank's rows in the last step;
    `job_started_at`: the job's start (epoch s), for a run that starts at step 0."""

    def __init__(self, progress: Progress, world: World, rank: int, wait: DataWait, logger, data_health: DataHealth | None,
                 lr: Callable[[], float], rows: Callable[[], int], log_every: int, last_step: int,
                 job_started_at: float | None = None):
        self.progress, self.world, self.rank, self.wait = progress, world, rank, wait
        self.logger, self.data_health, self.lr, self.rows = logger, data_health, lr, rows
        self.due = Points(log_every, last=last_step)
        self.console = ProgressLine("train", last_step, unit="step") if rank == 0 else None
        self.job_started_at = job_started_at
        self.data_error: str | None = None  # the one line that stops the run (the driver raises BadDataError)

    def start(self) -> None:
        """The loop starts: the console's clock (its first line already has an ETA) and the data wait's window."""
        if self.console:
            self.console.line(self.progress.step)
        self.wait.start()

    def log(self, out: dict[str, torch.Tensor], samples_per_s: float) -> bool:
        """Every rank at a log step: True (stop) where the data check failed, else rank 0 logs the step."""
        if self._data_check():
            return True
        if self.logger:
            self._log_step(out, self.rows(), samples_per_s)
        return False

    def first_step(self, step: int) -> None:
        """Rank 0 of a run that starts at step 0: how long the job took from its start to the first step (start-up:
        Ray, the workers, their imports, the data pipeline), printed and logged as `startup_s` at step 1. A restarted
        or resumed run's workers say nothing: their first step is not the job's."""
        if self.job_started_at is None:
            return
        startup_s, self.job_started_at = time.time() - self.job_started_at, None
        if self.logger and step == 1:
            print(f"[train] first step {step} done {startup_s:.1f} s after the job started", flush=True)
            self.logger.log({"startup_s": startup_s}, step, event=True)

    def _log_step(self, out: dict[str, torch.Tensor], rows: int, rate: float) -> None:
        """Rank 0: the step's loss and its parts, learning rate, throughput, data wait and skips, logged and shown."""
        p = self.progress
        metrics = {k: v.item() for k, v in out.items() if v.numel() == 1}
        wait_frac, wait_ms = self.wait.window()
        metrics.update(lr=self.lr(), samples_per_s=rate, epoch=p.epoch, contrastive_batch=rows * self.world.size,
                       skipped_batches=p.skipped_batches, world_size=self.world.size,
                       data_wait_frac=wait_frac, data_wait_ms=wait_ms, **self.data_health.metrics())
        self.logger.log(metrics, p.step)
        self.console.update(p.step, loss=f"{metrics['loss']:.4f}", **{"samples/s": f"{rate:.0f}"},
                            **{"data wait": f"{wait_frac:.0%}"}, **self.data_health.fields())

    def _data_check(self) -> bool:
        """Collective: whether rank 0 found more of the training data skipped than data.max_bad_frac allows
        (`data_error` then says so in one line)."""
        verdict = [self.data_health.poll(self.progress.epoch > 0) if self.rank == 0 else None]
        if self.world.size > 1:
            torch.distributed.broadcast_object_list(verdict, src=0)
        self.data_error = verdict[0]
        return self.data_error is not None

    def data_wait_mean(self) -> dict[str, float]:
        """The run's mean data wait (`data_wait_frac_mean`, logged by rank 0), where the loop ran."""
        if self.wait.loop_s <= 0:
            return {}
        mean = {"data_wait_frac_mean": self.wait.mean()}
        if self.logger:
            self.logger.log(mean, self.progress.step)
        return mean

    def data_report(self) -> dict[str, Any]:
        """Rank 0: every dataset's skipped samples and files, logged (metrics and data/skipped.json) and returned for
        the final report ({"data_report": JSON}); a data_error is printed and tagged (probvlp.failure)."""
        reports = self.data_health.reports()
        self.logger.log({k: v for label, st in reports.items() for k, v in report_metrics(label, st).items()},
                        self.progress.step)
        with tempfile.TemporaryDirectory() as tmp:
            self.logger.artifact(DataHealth.write(reports, Path(tmp)), "data")
        if self.data_error:
            print(f"[probvlp] stopped at step {self.progress.step}: {self.data_error}", flush=True)
            self.logger.tag("probvlp.failure", self.data_error)
        return {"data_report": json.dumps(reports)}
