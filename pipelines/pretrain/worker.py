"""What each Ray Train worker runs (`train_loop`, a `TrainWorker`): DeepSpeed over the model+loss, Ray Data batches,
rank-0 MLflow logging. The driver side is `pipelines.pretrain.job`.

The loop is the training core's (pipelines.fit.loop.run_steps): the DeepSpeed engine is its Fit (`step.DeepSpeedFit`)
and the worker its Hooks, which hand each matter to the component that owns it: checkpoints (`checkpoints`: the
clock, the upload in flight, the one save order), notices of preemption (pipelines.fit.notices: when a notice's save
is due, the save's sequence, the guard, the watchers), the attempts' journal and heartbeat (pipelines.fit.attempts),
the data's health and wait (`data_health`, pipelines.fit.data_wait), evaluation on rank 0 (`evaluation`, the only
one that imports the evaluate stage), the saved model (`export`), the engine (`engine`), the faults put in on purpose
(pipelines.fit.faults)."""
from __future__ import annotations

import importlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import ray.train
import torch

from models.openclip_weights import load_openclip_weights, read_openclip_state
from models.gather import World
from pipelines.pretrain.config import TrainDocument
from pipelines.data.device_augment import model_images
from pipelines.data.eval_tasks import use_texts
from pipelines.data.worker_reader import dataset_shard, use_worker_datasets
from pipelines.data.stats import report_metrics
from pipelines.progress import ProgressLine
from pipelines import storage
from pipelines.fit import attempts
from pipelines.pretrain import export, state as train_state
from pipelines.pretrain.data_health import DataHealth
from pipelines.fit.data_wait import DataWait
from pipelines.pretrain.evaluation import Evaluation
from pipelines.fit.loop import EmptyEpoch, Hooks, epoch_batches, run_steps
from pipelines.fit.progress import Progress
from pipelines.data.eval_tasks import eval_dataset_name
from pipelines.fit.trainer import private
from pipelines.pretrain.engine import build_engine, full_state_dict, training_objective
from pipelines.fit.notices import Notices
from pipelines.fit.faults import ATTEMPT_START, EVALUATION, FINAL_EVALUATION, HOLDS, fail_once, hold_at
from pipelines.pretrain.checkpoints import Checkpoints
from pipelines.pretrain.step import DeepSpeedFit


def device_name(device: torch.device) -> str:
    """e.g. `cuda:0 (NVIDIA H200)` or `cpu`: where the run trained and evaluated."""
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


class TrainWorker(Hooks):
    """One worker's run: its DeepSpeed fit (`DeepSpeedFit`: the engine's steps), its data, and the loop's hooks
    (pipelines.fit.loop.Hooks: rank 0's logging, the evaluation, checkpoints behind training, a notice's save).
    `fault`: called with each step applied (train.fail_once_at_step); `hold`: rank 0's, called as the attempt begins
    and at the final evaluation (tests only): both pipelines.fit.faults."""

    def __init__(self, cfg: TrainDocument, mlflow_uri: str, run_id: str, fault: Callable[[int], None] | None = None,
                 job_started_at: float | None = None, job: str = "", hold: Callable[[str], None] | None = None):
        self.cfg, self.t = cfg, cfg.train
        self.rank = ray.train.get_context().get_world_rank()
        self.world = World.current()
        self.folder = storage.run_folder(cfg.run.storage_path, cfg.run.name)
        self.outbox_folder = storage.outbox_folder(cfg.run.storage_path, cfg.run.name)
        # first: a SIGTERM from here on is a notice (before the engine is built and the checkpoint restored)
        self.notices = Notices(cfg.run, self.world, self.rank, self.folder, self.outbox_folder)
        self.job_started_at = job_started_at
        self.use_gpu = self.t.use_gpu and torch.cuda.is_available()
        self.use_bf16 = self.t.precision == "bf16" or (self.t.precision == "auto" and self.use_gpu)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.use_gpu else torch.device("cpu")
        if not self.use_gpu:
            torch.set_num_threads(max(1, int(self.t.cpus_per_worker)))
        self.fault, self.hold = fault, hold
        self.eval_every, self.checkpoint_every = self.t.eval_every, self.t.checkpoint_every
        self.wait = DataWait()
        self.tasks = cfg.resolved_tasks()
        if self.rank == 0:  # MLflow's import (~1 CPU-s) while the engine is built: the other ranks' first step waits
            threading.Thread(target=importlib.import_module, args=("pipelines.tracking",), daemon=True).start()
        self.engine, self.scheduler = self._build_engine()
        train_state.remove_stale_snapshots(self.t.checkpoint_snapshot_dir)  # a killed process's, never uploaded
        self.progress, resharded = train_state.restore(self.engine) or (Progress(), None)
        self.restored_step = self.progress.step if ray.train.get_checkpoint() is not None else None
        self.notices.resumed(self.progress)
        self.ds_fit = DeepSpeedFit(self.engine, self.progress, self.t.grad_accum, self.world, self._flags)
        self.audit = open(cfg.run.audit_steps_to, "a") if cfg.run.audit_steps_to and self.rank == 0 else None
        self.logger = self.journal = self.heartbeat = None
        self.attempt = 0
        self.started = threading.Event()  # the attempt's first step is done
        if self.rank == 0:
            from pipelines.fit.step_log import rank0_logger  # deferred: MLflow in rank 0's process only

            self.journal = attempts.Journal.open(self.folder, job)
            checkpoint = ray.train.get_checkpoint()
            self.attempt = self.journal.begin(self.progress.step, checkpoint.path if checkpoint else None)["attempt"]
            self.notices.begin(self.attempt, self.journal, hold=self.hold)
            self.notices.guard(self.progress.step)
            self.notices.watch_start(self.started, self.progress.step)
            if self.hold:  # tests only (faults.hold_at): the attempt has begun, before its first step
                self.hold(ATTEMPT_START)
            cut = train_state.remove_cut_short(f"{cfg.run.storage_path.rstrip('/')}/{cfg.run.name}", self.progress.step,
                                               self.attempt)
            if cut:
                print(f"[checkpoint] removed {len(cut)} checkpoint upload(s) that a restart cut short: {', '.join(cut)}",
                      flush=True)
            self.heartbeat = attempts.Heartbeat(self.journal)
            # what an earlier attempt had not delivered, first; its steps after this checkpoint come again
            self.logger = rank0_logger(mlflow_uri, run_id, self.progress.step, cfg.tracking.flush_timeout_s,
                                       self.outbox_folder)
            self.notices.logger = self.logger
        self.checkpoints = Checkpoints(self.engine, self.t, self.rank, self.attempt, self.outbox_folder, self.logger,
                                       self.journal)
        self.console = ProgressLine("train", self.last_step, unit="step") if self.rank == 0 else None
        # what the readers skip (rank 0 polls it at log steps); a run past data.max_bad_frac stops with data_error
        self.data_health = DataHealth(run_id, ["train", *map(eval_dataset_name, self.tasks)],
                                      cfg.data.max_bad_frac) if self.rank == 0 else None
        self.data_error: str | None = None
        self.evaluation = Evaluation(cfg, self.tasks, self.device, self.use_bf16, self.logger) if self.rank == 0 else None
        if self.logger:
            # Where torch.distributed traffic goes (local runs must stay on loopback).
            self.logger.tag("probvlp.master_addr", os.environ.get("MASTER_ADDR", ""))
            self.logger.tag("probvlp.world_size", str(self.world.size))
            self.logger.tag("probvlp.device", device_name(self.device))
            if self.restored_step is not None:
                self.logger.tag("probvlp.resumed_from_step", str(self.progress.step))
                self._say_resumed()
            if resharded:  # a resize's universal conversion (world sizes, seconds, bytes), one tag per resize
                self.logger.tag(f"probvlp.resharded.step_{self.progress.step}", json.dumps(resharded))

    def _say_resumed(self) -> None:
        """Rank 0 of an attempt that did not start at step 0: one line (and tag probvlp.attempt.K) saying what it
        resumed and why: a restart within the job (after a notice, a failure, a lost node; the steps it runs again),
        or a new command on an earlier run's storage (and whether anything is left to train)."""
        p, journal = self.progress, self.journal
        prev = journal.previous
        checkpoint = journal.current["checkpoint"]
        record: dict[str, Any] = {"attempt": self.attempt, "resumed_from_step": p.step, "checkpoint": checkpoint}
        if prev is not None and prev["job"] == journal.job:
            why, reached = attempts.why_restarted(journal, journal.failures(prev))
            again = None if reached is None else max(0, reached - p.step)
            record.update(why=why, reached=reached, steps_again=again)
            print(f"[restart] attempt {self.attempt} of run {self.cfg.run.name}, after {why}: resumed from the "
                  f"checkpoint of step {p.step} ({checkpoint}); "
                  + (f"{again} step(s) to run again" if again is not None else "the steps it runs again are unknown"),
                  flush=True)
            if attempts.notices(journal.folder, prev):  # the steps between the notice and the checkpoint resumed from
                self.logger.log({"preemption_steps_lost": again}, p.step, event=True)
        else:
            left = self.last_step - p.step
            record.update(why="a new command on the run's storage", steps_left=max(0, left))
            print(f"[resume] resumed run {self.cfg.run.name} from step {p.step} of its storage "
                  f"({self.cfg.run.storage_path}): " + (f"{left} step(s) left to train" if left > 0 else
                                                        f"nothing left to train (train.steps {self.t.steps}); the "
                                                        "final evaluation and model again"), flush=True)
        self.logger.tag(f"probvlp.attempt.{self.attempt}", json.dumps(record))

    def _build_engine(self):
        cfg = self.cfg
        torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
        objective = training_objective(cfg)
        if cfg.model.init_from_openclip and ray.train.get_checkpoint() is None:  # a resume restores its own weights
            fresh = load_openclip_weights(objective.model, self._read_openclip_state(cfg.model.init_from_openclip))
            if self.rank == 0:
                print(f"[probvlp] towers from {cfg.model.init_from_openclip}; {len(fresh)} tensors keep their "
                      "own initialisation", flush=True)
        return build_engine(cfg, objective, self.use_bf16)

    def _read_openclip_state(self, source: str) -> dict[str, torch.Tensor]:
        """open_clip downloads into a per-machine cache: one rank per node fetches it, the others then read the cache."""
        if not source.startswith("open_clip:") or self.world.size == 1:
            return read_openclip_state(source)
        first_on_node = ray.train.get_context().get_local_rank() == 0
        state = read_openclip_state(source) if first_on_node else None
        torch.distributed.barrier()
        return state if first_on_node else read_openclip_state(source)

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
            self.data_error = str(err)

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

    def fit(self) -> None:
        """The steps to the last, on the training loop every job runs (pipelines.fit.loop.run_steps)."""
        p, t = self.progress, self.t
        if p.evaluate_at == p.step and p.step == self.restored_step:  # the notice's save came before its evaluation
            train_state.report({"step": p.step, **self.validate()})
        p.evaluate_at = -1
        if p.step >= self.last_step:
            return
        if self.console:
            self.console.line(p.step)  # starts the clock: the first printed line already has an ETA
        self.wait.start()
        self.checkpoints.restart_clock()
        run_steps(self.ds_fit, self.wait.timed(self.steps_input()), self.last_step, self,
                  max_bad_batches=t.max_bad_batches, micro_batches=t.grad_accum, log_every=t.log_every, log_first=False)

    def _flags(self) -> tuple[bool, bool]:
        """This rank's two flags for the step's all-reduce: a notice of preemption, and a checkpoint due by the clock
        (train.checkpoint_every_s)."""
        return self.notices.due(), self.checkpoints.clock_due()

    def on_step(self, step: int) -> None:
        self.started.set()
        self.notices.on_step()
        if self.audit:  # what this attempt really applied (the engine's own count)
            self.audit.write(f"{self.attempt} {self.engine.global_steps} {time.time():.3f}\n")
            self.audit.flush()
        if self.heartbeat:
            self.heartbeat.step = step
        if self.job_started_at is not None:
            self._first_step()
        if self.fault:
            self.fault(step)

    def log(self, out: dict[str, torch.Tensor], samples_per_s: float) -> bool:
        """Every rank at a log step: True (stop) where the data check failed, else rank 0 logs the step."""
        if self._data_check():
            return True
        if self.logger:
            self._log_step(out, self.ds_fit.rows_in_step, samples_per_s)
        return False

    def noticed(self) -> bool:
        return self.ds_fit.noticed

    def checkpoint_due(self) -> bool:
        return self.ds_fit.clock_due

    def evaluate(self, step: int) -> dict[str, float] | None:
        return self.validate(stoppable=True)

    def checkpoint(self, metrics: dict[str, Any]) -> None:
        self.checkpoints.save(self.progress, metrics, behind=True)

    def report(self, metrics: dict[str, Any]) -> None:
        train_state.report(metrics)

    def _log_step(self, out: dict[str, torch.Tensor], rows: int, rate: float) -> None:
        """Rank 0: the step's loss and its parts, learning rate, throughput, data wait and skips, logged and shown."""
        p = self.progress
        metrics = {k: v.item() for k, v in out.items() if v.numel() == 1}
        wait_frac, wait_ms = self.wait.window()
        metrics.update(lr=self.scheduler.get_last_lr()[0], samples_per_s=rate, epoch=p.epoch,
                       contrastive_batch=rows * self.world.size,
                       skipped_batches=p.skipped_batches, world_size=self.world.size,
                       data_wait_frac=wait_frac, data_wait_ms=wait_ms, **self.data_health.metrics())
        self.logger.log(metrics, p.step)
        self.console.update(p.step, loss=f"{metrics['loss']:.4f}", **{"samples/s": f"{rate:.0f}"},
                            **{"data wait": f"{wait_frac:.0%}"}, **self.data_health.fields())

    def _first_step(self) -> None:
        """Rank 0 of a run that starts at step 0: how long the job took from its start to the first step (start-up:
        Ray, the workers, their imports, the data pipeline), printed and logged as `startup_s` at step 1. A restarted
        or resumed run's workers say nothing: their first step is not the job's."""
        startup_s, self.job_started_at = time.time() - self.job_started_at, None
        if self.logger and self.progress.step == 1:
            print(f"[train] first step {self.progress.step} done {startup_s:.1f} s after the job started", flush=True)
            self.logger.log({"startup_s": startup_s}, self.progress.step, event=True)

    def _data_check(self) -> bool:
        """Collective: whether rank 0 found more of the training data skipped than data.max_bad_frac allows
        (self.data_error then says so in one line)."""
        verdict = [self.data_health.poll(self.progress.epoch > 0) if self.rank == 0 else None]
        if self.world.size > 1:
            torch.distributed.broadcast_object_list(verdict, src=0)
        self.data_error = verdict[0]
        return self.data_error is not None

    def save_on_notice(self, step: int, evaluate: bool = False) -> None:
        """Every rank, at the step where they agreed that some node has a notice of preemption (or, training on after
        one, its last save is due): pipelines.fit.notices, with this stage's checkpoint (its one save order) and
        evaluation. Training goes on from here after it (on to the last save, or after a false alarm)."""
        p = self.progress
        self.notices.save(p, evaluate, lambda metrics, due: self.checkpoints.save(p, metrics, evaluate_at=due),
                          lambda: train_state.report({"step": p.step, **self.validate()}))
        self.restored_step = None

    def abandon(self, err: BaseException) -> None:
        """This attempt fails (any rank): its one-line error for the next attempt; rank 0 hands over its queue."""
        try:
            attempts.record_failure(self.folder, self.attempt or attempts.current_attempt(self.folder), self.rank, err,
                                    self.progress.step)
        except Exception as failure:  # noqa: BLE001 - the run's own error is the one that matters
            print(f"[probvlp] could not record rank {self.rank}'s failure: {failure}", flush=True)
        if self.logger:
            try:
                self.logger.persist(self.outbox_folder)
            except Exception as failure:  # noqa: BLE001
                print(f"[tracking] could not hand over what was not delivered: {failure}", flush=True)

    def close(self) -> None:
        self.started.set()  # the start's notice watcher ends with the attempt
        self.notices.close()
        if self.heartbeat:
            self.heartbeat.close()
        if self.audit:
            self.audit.close()

    def _data_report(self) -> dict[str, Any]:
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

    def _gathered_weights(self) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
        """The model's and the loss's complete weights on rank 0's device (collective; None on other ranks). ZeRO-0/1/2
        ranks hold whole parameters, so only rank 0 copies them; ZeRO-3 gathers on every rank."""
        if self.rank != 0 and self.engine.zero_optimization_stage() != 3:
            return None, None
        module = self.engine.module
        weights = full_state_dict(self.engine, module.model, self.device)
        loss_weights = full_state_dict(self.engine, module.loss, self.device)
        return (weights, loss_weights) if self.rank == 0 else (None, None)

    def validate(self, stoppable: bool = False) -> dict[str, float] | None:
        """Every eval task's metrics (collective: rank 0 evaluates gathered weights, all ranks get them; a failing
        task gives NaNs, pipelines.pretrain.evaluation). `stoppable` (an evaluation between steps, which may outlast a
        notice's deadline): a notice on any rank during it stops it, None on every rank (the notice's save is due
        now): rank 0 checks its own notices before each batch, the other ranks, waiting for its answer in a
        collective, record theirs in the run's storage, which rank 0 reads then too, at most once a second
        (pipelines.fit.notices)."""
        weights, loss_weights = self._gathered_weights()
        step = self.progress.step
        waiting = self.notices.watch_evaluation(step) if stoppable and self.rank != 0 else threading.Event()
        try:
            if stoppable and self.hold:  # tests only: a notice "during the evaluation" lands here
                self.hold(EVALUATION)
            result = [self.evaluation.validate(weights, loss_weights, self.progress.step,
                                               self.notices.evaluation_stop(step) if stoppable else None)
                      if self.rank == 0 else None]
            del weights, loss_weights
            torch.distributed.broadcast_object_list(result, src=0)
        finally:
            waiting.set()
        return result[0]

    def finish(self) -> None:
        """The final checkpoint (all ranks; before judging: a notice from here on costs no step, and a restart only
        evaluates and saves the model), then the final weights, saved model and evaluation (rank 0) and the final
        report. A notice meanwhile is still handed to Ray (a watcher), so that its restart counts as a preemption."""
        p = self.progress
        report: dict[str, Any] = {"step": p.step, "epoch": p.epoch}
        if self.data_error:  # the driver raises BadDataError
            self.checkpoints.save(p, {**report, **(self._data_report() if self.data_health else {}),
                                      "data_error": self.data_error})
            return
        if self.restored_step != p.step:
            self.checkpoints.save(p, dict(report))
        watcher = self.notices.watch_final(p.step)
        try:
            if self.wait.loop_s > 0:
                report["data_wait_frac_mean"] = self.wait.mean()
                if self.logger:
                    self.logger.log({"data_wait_frac_mean": report["data_wait_frac_mean"]}, p.step)
            if p.step >= self.t.steps:
                weights, loss_weights = self._gathered_weights()
                if self.rank == 0:
                    report.update(self._final_artifacts(weights, loss_weights))
                del weights, loss_weights
            if self.data_health:  # what the readers skipped, the final evaluation's reads included
                report.update(self._data_report())
            shared = [report]  # every rank reports the same metrics
            torch.distributed.broadcast_object_list(shared, src=0)
            if self.rank == 0:  # the driver's result (Ray Train's holds the final checkpoint's metrics)
                storage.write_json(f"{self.folder}/final_report.json", {"job": self.journal.job, **shared[0]})
            ray.train.report(shared[0])
        finally:
            watcher.set()

    def _final_artifacts(self, weights, loss_weights) -> dict[str, Any]:
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


def train_loop(config: dict[str, Any]) -> None:
    job = private(config)
    cfg = TrainDocument.from_dict(job["config"])
    use_texts(config.get("texts", {}))
    use_worker_datasets(config.get("worker_datasets", {}))
    worker = None
    try:
        fault = fail_once(cfg.train.fail_once_at_step, config.get("failure_marker"))
        worker = TrainWorker(cfg, job["mlflow_uri"], config["mlflow_run_id"], fault,
                             config.get("job_started_at"), config.get("job", ""), hold_at(config.get(HOLDS)))
        worker.fit()
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
