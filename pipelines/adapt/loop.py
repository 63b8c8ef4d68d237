"""What each Ray Train worker runs for `jobs.adapt`: the adapter (and the optional baseline) on embedding pairs.

The frozen source model is not here at all: the workers see only its embeddings, so no gradient or
optimizer can reach its weights. The loop, the optimizer, the schedule and the step are the training core's
(`pipelines.fit`: the place in the data, skipped non-finite steps, logging points, AdamW from the train section); what
is the adapter's own is its objective (`AdapterSet`). Rank 0 logs step metrics to MLflow through the training core's
outbox logger (`pipelines.fit.step_log`): the fit never waits for the tracking store, a restart never reads it, and
each step lands once, where a restart after a failed worker trains steps again. Every rank reports a Ray Train
checkpoint every `train.checkpoint_every` steps and at the end: the adapters, AdamW's moments and the progress counters
(safetensors), rank 0's undelivered MLflow calls written to the run's storage before it. A run started again under
the same `run.name` gets that checkpoint back from Ray Train and continues from its step (a finished one trains no
further unless `train.steps` was raised).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from models.gather import World
from models.losses import create_loss
from models.probvlm import adapter_kind, adapter_options, build_adapter
from pipelines.adapt.config import AdaptTrainConfig, adapt_config_from_dict
from pipelines.storage import outbox_folder, run_folder
from pipelines.tracking import StepLogger
from pipelines.fit.attempts import Attempt
from pipelines.fit.config import LoopConfig
from pipelines.fit.faults import fail_once
from pipelines.fit.loop import Points, epoch_batches, run_steps
from pipelines.fit.notices import Notices
from pipelines.fit.optim import lr_at, optimizer_for
from pipelines.fit.trainer import FromDriver
from pipelines.fit.plain_checkpoint import fit_state, load_fit_state
from pipelines.fit.progress import Progress
from pipelines.fit.registered import wait_for_uploads
from pipelines.fit.step import agree, plain_step
from pipelines.fit.step_log import rank0_logger

ADAPTER_FILE = "adapters.safetensors"


class AdapterSet(nn.Module):
    """The adapters trained side by side on the same batches; the loss is the sum of their losses."""

    def __init__(self, adapters: dict[str, nn.Module], losses: dict[str, nn.Module]):
        super().__init__()
        self.adapters = nn.ModuleDict(adapters)
        self.losses = nn.ModuleDict(losses)

    def forward(self, image_z: torch.Tensor, text_z: torch.Tensor) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        total = image_z.new_zeros(())
        for name, adapter in self.adapters.items():
            parts = self.losses[name](adapter(image_z, text_z))
            total = total + parts["loss"]
            out.update({f"{name}/{k}": v.detach() for k, v in parts.items()})
        out["loss"] = total
        return out


def build_adapter_set(cfg, dim: int) -> AdapterSet:
    """The configured adapter ("adapter") and, with adapter.baseline: pfe, the PFE-style baseline ("baseline")."""
    a = cfg.adapter
    heads = {"adapter": a.head, **({"baseline": a.baseline} if a.baseline != "none" else {})}
    adapters = {k: build_adapter(h, dim, **adapter_options(h, a)) for k, h in heads.items()}
    # the adapter's loss as the config names it, with its params; the baseline's own, with its defaults
    losses = {k: create_loss(cfg.loss_name(), **cfg.loss.params) if k == "adapter" else create_loss(adapter_kind(h).loss)
              for k, h in heads.items()}
    return AdapterSet(adapters, losses)


class AdapterFit:
    """The adapters under the training core's optimizer and step (pipelines.fit: AdamW, warm-up + cosine learning
    rate, clipping, non-finite steps skipped on every rank, all from cfg), one `step` per batch for
    `pipelines.fit.loop.run_steps`, and the whole training state as a flat dict of tensors (safetensors: no pickle)
    that `load` restores, so a fit resumes where it stopped."""

    def __init__(self, net: AdapterSet, cfg: LoopConfig, seed: int = 0, rank: int = 0,
                 forward: nn.Module | None = None, world: World | None = None):
        self.net, self.forward = net, forward or net  # forward: the DDP wrapper on Ray Train workers
        self.cfg, self.seed, self.rank = cfg, seed, rank
        self.world = world or World()
        self.optimizer = optimizer_for(net, cfg)
        self.parameters = list(net.parameters())  # what the step clips
        self.progress = Progress()
        self.voters: tuple = ()  # what the ranks agree on with each step (the notices: pipelines.fit.step.agree)

    def lr(self) -> float:
        return lr_at(self.cfg, self.progress.step)

    def step(self, pairs: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """One optimizer step on a (B, 2, D) batch of (image, caption) embedding pairs; None (nothing applied) where
        the loss was not finite on some rank."""
        # dropout masks from (seed, rank, step): a resumed fit draws the ones an uninterrupted fit would have
        torch.manual_seed((self.seed * 1_000_003 + self.rank) * 1_000_003 + self.progress.step)
        out = self.forward(pairs[:, 0], pairs[:, 1])
        finite = agree(out["loss"], self.world, self.voters)
        return plain_step(out, out["loss"].backward, self.optimizer, self.parameters, self.cfg, self.progress.step,
                          self.world, agreed=finite)

    def rows(self, pairs: torch.Tensor) -> int:
        return pairs.shape[0] * self.world.size

    def state(self) -> dict[str, torch.Tensor]:
        return fit_state(self.net.adapters.state_dict(), "adapters.", self.optimizer, self.progress)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        if "progress.step_count" in state:  # its optimizer entries are numbered in another parameter order
            raise ValueError("an adapter checkpoint of the older layout (its optimizer state in another parameter "
                             "order) does not resume: start the fit under a new run.name")
        weights, self.progress = load_fit_state(state, "adapters.", self.optimizer)
        self.net.adapters.load_state_dict(weights)


STATE_FILE = "state.safetensors"


class AdapterLog:
    """The adapter's step log (the training loop's StepLog): at the first step of the attempt, every
    `train.log_every` and the last, rank 0 logs the step's losses to MLflow (`logger`: None on the others)."""

    def __init__(self, fit: AdapterFit, t: AdaptTrainConfig, logger: StepLogger | None):
        self.fit, self.logger, self.loss = fit, logger, float("nan")
        self.due = Points(t.log_every, first=fit.progress.step + 1, last=t.last_step)

    def log(self, out: dict[str, torch.Tensor], samples_per_s: float) -> bool:
        p = self.fit.progress
        self.loss = out["loss"].item()
        if self.logger:
            self.logger.log({**{k: v.item() for k, v in out.items()}, "lr": self.fit.lr(), "samples_per_s": samples_per_s,
                             "epoch": p.epoch, "skipped_batches": p.skipped_batches}, p.step)
        return False


class AdapterCheckpoints:
    """The adapter's checkpoints (the training loop's Saver): every `train.checkpoint_every` steps and at the end,
    every rank reports a Ray Train checkpoint of the fit's whole state; a notice's (`at_once`) is registered before
    any rank goes on. `outbox`: the run's folder for rank 0's undelivered MLflow calls
    (pipelines.storage.outbox_folder); `log`: the step log, whose last loss each checkpoint reports."""

    def __init__(self, fit: AdapterFit, t: AdaptTrainConfig, logger: StepLogger | None, outbox: str, log: AdapterLog):
        self.fit, self.t, self.logger, self.outbox, self.log = fit, t, logger, outbox, log
        self.due = Points(t.checkpoint_every)
        self.first_step, self.start = fit.progress.step, time.perf_counter()

    def save(self, metrics: dict[str, Any] | None = None, *, final: bool = False, at_once: bool = False) -> None:
        """Every rank reports; rank 0's report carries the checkpoint (the adapters are the same on every rank), in the
        one order of every save: what MLflow has not got yet first, into the run's storage, then the checkpoint, so
        that whichever checkpoint a restart resumes from, the metrics up to its step travel with it. `at_once` (a
        notice's): every rank returns once Ray Train has registered it. The loop's `metrics` (its step, no
        evaluation between steps here) give way to the fit's own report."""
        p, world = self.fit.progress, self.fit.world
        seconds = time.perf_counter() - self.start
        done = p.step - self.first_step
        metrics = {"step": p.step, "epoch": p.epoch, "samples": p.samples, "skipped_batches": p.skipped_batches,
                   "steps_this_run": done, "train_seconds": seconds,
                   "samples_per_s": done * self.t.batch_size * world.size / seconds if done else 0.0,
                   "loss": self.log.loss}
        if world.rank != 0:
            ray.train.report(metrics)
            if at_once:
                torch.distributed.barrier()  # rank 0's registration
            return
        if final:
            self.logger.log({"train_seconds": seconds, "samples_per_s_overall": metrics["samples_per_s"]}, p.step)
        self.logger.persist(self.outbox)
        with tempfile.TemporaryDirectory() as tmp:
            state = self.fit.state()
            save_file(state, str(Path(tmp) / STATE_FILE))
            # the adapters alone, as the driver builds the adapted models from them
            save_file({k.removeprefix("adapters."): v for k, v in state.items() if k.startswith("adapters.")},
                      str(Path(tmp) / ADAPTER_FILE))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        if at_once:
            wait_for_uploads(p.step)
            if world.size > 1:
                torch.distributed.barrier()


def adapt_loop(config: dict[str, Any]) -> None:
    sent = FromDriver.read(config)
    cfg = adapt_config_from_dict(sent.config)
    t = cfg.train
    rank, world = ray.train.get_context().get_world_rank(), World.current()
    outbox = outbox_folder(cfg.run.storage_path, cfg.run.name)
    # first: a SIGTERM from here on is a notice of preemption (before the checkpoint is restored)
    folder = run_folder(cfg.run.storage_path, cfg.run.name)
    notices = Notices(cfg.run, world, rank, folder, outbox)
    if not t.use_gpu:
        torch.set_num_threads(max(1, int(t.cpus_per_worker)))
    torch.manual_seed(cfg.run.seed)  # the same initial adapters on every rank
    net = build_adapter_set(cfg, int(sent.stage["dim"]))
    model = ray.train.torch.prepare_model(net)  # DDP across workers; the device of this worker
    fit = AdapterFit(net, t, cfg.run.seed, rank, forward=model, world=world)
    checkpoint = ray.train.get_checkpoint()  # set when this run name was trained before (or a worker failed)
    if checkpoint:
        with checkpoint.as_directory() as local:
            fit.load(load_file(str(Path(local) / STATE_FILE)))
    notices.resumed(fit.progress)
    # the journal of attempts, the guard against notices that never clear, the resume line: the training core's
    attempt = Attempt(folder, sent.job, rank, fit.progress.step, checkpoint.path if checkpoint else None,
                      cfg.run.audit_steps_to)
    logger = None
    if rank == 0:
        # the core's order (the guard, the heartbeat, then the logger: what an earlier attempt had not delivered
        # first; the steps after the checkpoint come again, and what MLflow has of them is not logged twice)
        logger = notices.begin(attempt, fit.progress.step, lambda: rank0_logger(
            sent.mlflow_uri, sent.mlflow_run_id, fit.progress.step, cfg.tracking.flush_timeout_s, outbox))
        if checkpoint:
            attempt.say_resumed(fit.progress.step, logger, cfg.run.name, cfg.run.storage_path,
                                t.last_step - fit.progress.step, f"nothing left to train (train.steps {t.steps})")
    log = AdapterLog(fit, t, logger)
    checkpoints = AdapterCheckpoints(fit, t, logger, outbox, log)
    fit.voters = (notices,)
    # a notice's save: the checkpoint at once (no evaluation between steps here)
    notices.save_with(fit.progress, lambda metrics, due: checkpoints.save(at_once=True), lambda: None)
    fault = fail_once(t.fail_once_at_step, sent.failure_marker)
    on_step = [lambda step: notices.on_step(), lambda step: attempt.on_step(step, step), *([fault] if fault else [])]
    shard = ray.train.get_dataset_shard("train")

    def pairs(epoch: int):
        for batch in shard.iter_torch_batches(batch_size=t.batch_size, drop_last=True, device=fit_device(net),
                                              pin_memory=t.use_gpu, local_shuffle_buffer_size=8 * t.batch_size,
                                              local_shuffle_seed=cfg.run.seed + epoch):
            yield batch["data"].float()

    try:
        run_steps(fit, epoch_batches(pairs, fit.progress), t.last_step, on_step=on_step, log=log,
                  checkpoints=checkpoints, notices=notices, max_bad_batches=t.max_bad_batches)
        checkpoints.save(final=True)
    except BaseException as err:
        # for the next attempt's line; what rank 0 had not delivered goes to the run's storage: the next attempt
        # delivers it first (its steps after the checkpoint it resumes from come again with the restart)
        attempt.abandon(err, fit.progress.step, logger, outbox)
        raise
    finally:
        notices.close()
        attempt.close()
    if logger:  # released: the driver delivers what the store has not taken yet
        logger.close(keep_to=outbox)


def fit_device(net: nn.Module) -> torch.device:
    return next(net.parameters()).device
