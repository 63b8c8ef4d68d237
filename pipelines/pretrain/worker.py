"""What each Ray Train worker runs (`train_loop`, a `TrainWorker`): DeepSpeed over the model+loss, Ray Data batches,
rank-0 MLflow logging. The driver side is `pipelines.pretrain.job`.

The loop is the training core's (pipelines.fit.loop.run_steps): the DeepSpeed engine is its Fit (`pipelines.zero.fit.DeepSpeedFit`)
and the worker composes the components it asks, each of which owns its state and says when it is due: the step's
metrics (`step_metrics`: the log, the data's health and wait), the evaluation between steps (`step_evaluation`, over
rank 0's `evaluation`), the checkpoints (`checkpoints`: the clock, the upload in flight, the one save order), the
notices of preemption (pipelines.fit.notices: a notice's save, the guard, the watchers), the attempt
(pipelines.fit.attempts: the journal, the heartbeat, the resume line, the hand-over on failure) and the final phase
(`final`: the final checkpoint, the saved model, the final evaluation and report). What remains here is pretraining's
own: the engine and its restore, the data's micro-batches, the start of an attempt in order."""
from __future__ import annotations

import importlib
import json
import os
import threading
from typing import Any, Callable

import ray.train
import torch

from models.gather import World
from pipelines import storage
from pipelines.data.device_augment import model_images
from pipelines.data.eval_tasks import eval_dataset_name, use_texts
from pipelines.data.worker_reader import dataset_shard, use_worker_datasets
from pipelines.fit.attempts import Attempt
from pipelines.fit.data_wait import DataWait
from pipelines.fit.faults import HOLDS, fail_once, hold_at
from pipelines.fit.loop import EmptyEpoch, epoch_batches, run_steps
from pipelines.fit.notices import Notices
from pipelines.fit.progress import Progress
from pipelines.fit.trainer import FromDriver
from pipelines.pretrain.config import TrainDocument
from pipelines.pretrain.data_health import DataHealth
from pipelines.pretrain.evaluation import Evaluation
from pipelines.pretrain.final import FinalPhase
from pipelines.pretrain.objective import pretraining_engine
from pipelines.pretrain.step_evaluation import StepEvaluation
from pipelines.pretrain.step_metrics import StepMetrics
from pipelines.zero import checkpoint_files
from pipelines.zero.checkpoints import Checkpoints
from pipelines.zero.fit import DeepSpeedFit


def device_name(device: torch.device) -> str:
    """e.g. `cuda:0 (NVIDIA H200)` or `cpu`: where the run trained and evaluated."""
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


class TrainWorker:
    """One worker's run: its DeepSpeed fit (`DeepSpeedFit`: the engine's steps), its data, and the components the loop
    asks (the module's). `fault`: called with each step applied (train.fail_once_at_step); `hold`: rank 0's, called as
    the attempt begins and at the evaluations (tests only): both pipelines.fit.faults."""

    def __init__(self, cfg: TrainDocument, mlflow_uri: str, run_id: str, fault: Callable[[int], None] | None = None,
                 job_started_at: float | None = None, job: str = "", hold: Callable[[str], None] | None = None):
        self.cfg, self.t = cfg, cfg.train
        self.rank = ray.train.get_context().get_world_rank()
        self.world = World.current()
        self.folder = storage.run_folder(cfg.run.storage_path, cfg.run.name)
        self.outbox_folder = storage.outbox_folder(cfg.run.storage_path, cfg.run.name)
        # first: a SIGTERM from here on is a notice (before the engine is built and the checkpoint restored)
        self.notices = Notices(cfg.run, self.world, self.rank, self.folder, self.outbox_folder)
        self.use_gpu = self.t.use_gpu and torch.cuda.is_available()
        self.use_bf16 = self.t.precision == "bf16" or (self.t.precision == "auto" and self.use_gpu)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.use_gpu else torch.device("cpu")
        if not self.use_gpu:
            torch.set_num_threads(max(1, int(self.t.cpus_per_worker)))
        self.fault, self.hold = fault, hold
        tasks = cfg.resolved_tasks()
        if self.rank == 0:  # MLflow's import (~1 CPU-s) while the engine is built: the other ranks' first step waits
            threading.Thread(target=importlib.import_module, args=("pipelines.tracking",), daemon=True).start()
        self.engine, self.scheduler = pretraining_engine(cfg, self.world, self.rank, self.use_bf16)
        checkpoint_files.remove_stale_snapshots(self.t.checkpoint_snapshot_dir)  # a killed process's, never uploaded
        self.progress, resharded = checkpoint_files.restore(self.engine) or (Progress(), None)
        checkpoint = ray.train.get_checkpoint()
        self.restored_step = self.progress.step if checkpoint is not None else None
        self.notices.resumed(self.progress)
        self.attempt = Attempt(self.folder, job, self.rank, self.progress.step, checkpoint.path if checkpoint else None,
                               cfg.run.audit_steps_to)
        self.logger = None
        self.started = threading.Event()  # the attempt's first step is done
        if self.rank == 0:
            self._begin(mlflow_uri, run_id)
        self.checkpoints = Checkpoints(self.engine, self.progress, self.t, self.rank, self.attempt.number,
                                       self.outbox_folder, self.logger, self.attempt.journal)
        self.ds_fit = DeepSpeedFit(self.engine, self.progress, self.t.grad_accum, self.world,
                                   (self.notices, self.checkpoints))
        # what the readers skip (rank 0 polls it at log steps); a run past data.max_bad_frac stops with data_error
        data_health = DataHealth(run_id, ["train", *map(eval_dataset_name, tasks)],
                                 cfg.data.max_bad_frac) if self.rank == 0 else None
        self.metrics = StepMetrics(self.progress, self.world, self.rank, DataWait(), self.logger, data_health,
                                   lambda: self.scheduler.get_last_lr()[0], lambda: self.ds_fit.rows_in_step,
                                   self.t.log_every, self.last_step, job_started_at)
        evaluation = Evaluation(cfg, tasks, self.device, self.use_bf16, self.logger) if self.rank == 0 else None
        self.evaluation = StepEvaluation(self.engine, self.progress, evaluation, self.notices, self.rank, self.device,
                                         self.t.eval_every, hold)
        self.notices.save_with(self.progress, self._save_on_notice, lambda: checkpoint_files.report(
            {"step": self.progress.step, **self.evaluation()}))
        self.final = FinalPhase(cfg, self.engine, self.progress, self.rank, self.device, self.folder, job,
                                self.checkpoints, self.notices, self.metrics, evaluation, self.logger, hold)
        if self.logger:
            # Where torch.distributed traffic goes (local runs must stay on loopback).
            self.logger.tag("probvlp.master_addr", os.environ.get("MASTER_ADDR", ""))
            self.logger.tag("probvlp.world_size", str(self.world.size))
            self.logger.tag("probvlp.device", device_name(self.device))
            if self.restored_step is not None:
                self.logger.tag("probvlp.resumed_from_step", str(self.progress.step))
                self.attempt.say_resumed(self.progress.step, self.logger, cfg.run.name, cfg.run.storage_path,
                                         self.last_step - self.progress.step,
                                         f"nothing left to train (train.steps {self.t.steps}); the final evaluation "
                                         "and model again")
            if resharded:  # a resize's universal conversion (world sizes, seconds, bytes), one tag per resize
                self.logger.tag(f"probvlp.resharded.step_{self.progress.step}", json.dumps(resharded))

    def _begin(self, mlflow_uri: str, run_id: str) -> None:
        """Rank 0, the attempt begun: the core's order (Notices.begin), with pretraining's removal of the uploads a
        restart cut short before the heartbeat."""
        from pipelines.fit.step_log import rank0_logger  # deferred: MLflow in rank 0's process only

        cfg, step = self.cfg, self.progress.step

        def remove_cut_uploads() -> None:
            cut = checkpoint_files.remove_cut_short(f"{cfg.run.storage_path.rstrip('/')}/{cfg.run.name}", step,
                                                    self.attempt.number)
            if cut:
                print(f"[checkpoint] removed {len(cut)} checkpoint upload(s) that a restart cut short: "
                      f"{', '.join(cut)}", flush=True)

        self.logger = self.notices.begin(
            self.attempt, step, lambda: rank0_logger(mlflow_uri, run_id, step, cfg.tracking.flush_timeout_s,
                                                     self.outbox_folder),
            started=self.started, hold=self.hold, then=remove_cut_uploads)

    @property
    def last_step(self) -> int:
        return self.t.last_step

    def batches(self):
        """This worker's micro-batches from the current position on (skips what the epoch already consumed)."""
        shard = dataset_shard("train")

        def stream(epoch: int):
            return shard.iter_torch_batches(
                batch_size=self.t.batch_size, drop_last=True, device=self.device, pin_memory=self.use_gpu,
                prefetch_batches=self.cfg.data.prefetch_batches,
                local_shuffle_buffer_size=4 * self.t.batch_size, local_shuffle_seed=self.cfg.run.seed + epoch,
            )

        try:
            yield from epoch_batches(stream, self.progress)
        except EmptyEpoch as err:  # every file broken or every sample skipped
            self.metrics.data_error = str(err)

    def steps_input(self):
        """Per optimizer step: the images and tokens of this worker's train.grad_accum micro-batches, joined (the
        device augmentation applied per micro-batch as it arrives, once)."""
        micro: list = []
        for batch in self.batches():
            # uint8 from the reader, augmented here when it shipped the parameters; bf16: the engine's autocast casts
            micro.append((model_images(batch, self.cfg.data.image_size), batch["text"]))
            if len(micro) == self.t.grad_accum:
                images, tokens = micro[0] if len(micro) == 1 else (torch.cat(x) for x in zip(*micro))
                micro = []
                yield images, tokens

    def train(self) -> None:
        """The steps to the last, on the training loop every job runs (pipelines.fit.loop.run_steps), asking each
        component."""
        p = self.progress
        if p.evaluate_at == p.step and p.step == self.restored_step:  # the notice's save came before its evaluation
            checkpoint_files.report({"step": p.step, **self.evaluation()})
        p.evaluate_at = -1
        if p.step >= self.last_step:
            return
        self.metrics.start()
        self.checkpoints.restart_clock()
        on_step = [lambda step: self.started.set(), lambda step: self.notices.on_step(),
                   lambda step: self.attempt.on_step(step, self.engine.global_steps), self.metrics.first_step,
                   *([self.fault] if self.fault else [])]
        run_steps(self.ds_fit, self.metrics.wait.timed(self.steps_input()), self.last_step, on_step=on_step,
                  log=self.metrics, evaluation=self.evaluation, checkpoints=self.checkpoints, notices=self.notices,
                  max_bad_batches=self.t.max_bad_batches, micro_batches=self.t.grad_accum)

    def _save_on_notice(self, metrics: dict[str, Any], evaluate: bool) -> None:
        """A notice's checkpoint (pipelines.fit.notices: every rank, at the step where they agreed on it): at once, in
        the one save order. Training goes on from here after it (on to the last save, or after a false alarm)."""
        self.checkpoints.save(metrics, at_once=True, evaluate_at=evaluate)
        self.restored_step = None

    def finish(self) -> None:
        """The final phase (pipelines.pretrain.final), its checkpoint not saved again at the step a restart resumed."""
        self.final.run(saved=self.restored_step == self.progress.step)

    def abandon(self, err: BaseException) -> None:
        """This attempt fails (any rank): its one-line error for the next attempt; rank 0 hands over its queue."""
        self.attempt.abandon(err, self.progress.step, self.logger, self.outbox_folder)

    def close(self) -> None:
        self.started.set()  # the start's notice watcher ends with the attempt
        self.notices.close()
        self.attempt.close()


def train_loop(config: dict[str, Any]) -> None:
    sent = FromDriver.read(config)
    cfg, stage = TrainDocument.from_dict(sent.config), sent.stage
    use_texts(stage.get("texts", {}))
    use_worker_datasets(stage.get("worker_datasets", {}))
    worker = None
    try:
        fault = fail_once(cfg.train.fail_once_at_step, sent.failure_marker)
        worker = TrainWorker(cfg, sent.mlflow_uri, sent.mlflow_run_id, fault, stage.get("job_started_at"), sent.job,
                             hold_at(stage.get(HOLDS)))
        worker.train()
        worker.finish()
    except BaseException as err:
        # for the next attempt's line; what rank 0 had not delivered goes to the run's storage (its steps after the
        # last checkpoint come again with the restart)
        if worker is not None:
            worker.abandon(err)
        raise
    finally:
        if worker is not None:
            worker.close()
    if worker.logger:  # released: the driver delivers what the store has not taken yet
        worker.logger.close(keep_to=worker.outbox_folder)
