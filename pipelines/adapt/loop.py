"""What each Ray Train worker runs for `jobs.adapt`: the adapter (and the optional baseline) on embedding pairs.

The frozen source model is not here at all: the workers see only its embeddings, so no gradient or
optimizer can reach its weights. Rank 0 logs step metrics to MLflow and reports a Ray Train checkpoint
every `train.checkpoint_every` steps and at the end: the adapters, AdamW's moments and the step / epoch
counters (safetensors). A run started again under the same `run.name` gets that checkpoint back from Ray
Train and continues from its step (a finished one trains no further unless `train.steps` was raised).
"""
from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from models.losses import create_loss
from models.probvlm import build_adapter
from pipelines.adapt.config import adapt_config_from_dict
from pipelines.tracking import StepLogger

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
    adapters = {"adapter": build_adapter(a.head, dim, a.hidden, a.dropout, a.mc_samples, a.mc_seed)}
    if a.baseline != "none":
        adapters["baseline"] = build_adapter(a.baseline, dim, a.hidden)
    loss_params = {"probvlm": cfg.loss.model_dump(), "pfe_mls": {}}
    losses = {k: create_loss(m.loss_name, **loss_params[m.loss_name]) for k, m in adapters.items()}
    return AdapterSet(adapters, losses)


class AdapterFit:
    """The adapters, AdamW and the cosine learning rate, one `step` per batch, and the whole training state as
    a flat dict of tensors (safetensors: no pickle) that `load` restores, so a fit resumes where it stopped."""

    def __init__(self, net: AdapterSet, lr: float, weight_decay: float, steps: int, seed: int = 0, rank: int = 0,
                 forward: nn.Module | None = None):
        self.net, self.forward = net, forward or net  # forward: the DDP wrapper on Ray Train workers
        self.base_lr, self.steps, self.seed, self.rank = lr, steps, seed, rank
        self.optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
        self.step_count = self.epoch = self.batch_in_epoch = self.samples = 0

    def lr(self) -> float:
        # closed-form cosine annealing to 0 over train.steps (CosineAnnealingLR, eta_min 0), a function of the step
        # alone, so a resumed fit (or one whose train.steps was raised) needs no scheduler state
        return self.base_lr * 0.5 * (1.0 + math.cos(math.pi * min(self.step_count, self.steps) / self.steps))

    def step(self, pairs: torch.Tensor, world: int = 1) -> dict[str, torch.Tensor]:
        """One optimizer step on a (B, 2, D) batch of (image, caption) embedding pairs."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr()
        # dropout masks from (seed, rank, step): a resumed fit draws the ones an uninterrupted fit would have
        torch.manual_seed((self.seed * 1_000_003 + self.rank) * 1_000_003 + self.step_count)
        out = self.forward(pairs[:, 0], pairs[:, 1])
        if not torch.isfinite(out["loss"]):
            raise FloatingPointError(f"adapter loss is not finite at step {self.step_count} ({out['loss'].item()}); "
                                     "lower train.lr or check the embeddings")
        self.optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        self.optimizer.step()
        self.step_count += 1
        self.batch_in_epoch += 1
        self.samples += pairs.shape[0] * world
        return out

    def end_epoch(self) -> None:
        self.epoch += 1
        self.batch_in_epoch = 0

    def state(self) -> dict[str, torch.Tensor]:
        state = {f"adapters.{k}": v.detach().cpu().contiguous() for k, v in self.net.adapters.state_dict().items()}
        params = list(self.net.parameters())
        for i, p in enumerate(params):
            for key, value in self.optimizer.state.get(p, {}).items():
                state[f"optimizer.{i}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
        for key in COUNTERS:
            state[f"progress.{key}"] = torch.tensor(getattr(self, key), dtype=torch.int64)
        return state

    def load(self, state: dict[str, torch.Tensor]) -> None:
        prefix = "adapters."
        self.net.adapters.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        params = list(self.net.parameters())
        device = params[0].device
        for i, p in enumerate(params):
            entries = {k.split(".", 2)[2]: v for k, v in state.items() if k.startswith(f"optimizer.{i}.")}
            if entries:
                # AdamW keeps its step count on the CPU unless capturable / fused
                self.optimizer.state[p] = {k: v.to(device) if v.dim() else v.clone() for k, v in entries.items()}
        for key in COUNTERS:
            setattr(self, key, int(state[f"progress.{key}"]))


COUNTERS = ("step_count", "epoch", "batch_in_epoch", "samples")
STATE_FILE = "state.safetensors"


def adapt_loop(config: dict[str, Any]) -> None:
    cfg = adapt_config_from_dict(config["config"])
    t = cfg.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if not t.use_gpu:
        torch.set_num_threads(max(1, int(t.cpus_per_worker)))
    torch.manual_seed(cfg.run.seed)  # the same initial adapters on every rank
    net = build_adapter_set(cfg, int(config["dim"]))
    model = ray.train.torch.prepare_model(net)  # DDP across workers; the device of this worker
    fit = AdapterFit(net, t.lr, t.weight_decay, t.steps, cfg.run.seed, rank, forward=model)
    checkpoint = ray.train.get_checkpoint()  # set when this run name was trained before (or a worker failed)
    if checkpoint:
        with checkpoint.as_directory() as folder:
            fit.load(load_file(str(Path(folder) / STATE_FILE)))
    first_step, last_step = fit.step_count, min(t.steps, t.stop_at_step or t.steps)
    logger = StepLogger(config["mlflow_uri"], config["mlflow_run_id"], flush_every=500) if rank == 0 else None
    shard = ray.train.get_dataset_shard("train")

    def report(final: bool) -> None:
        seconds = time.perf_counter() - start
        done = fit.step_count - first_step
        metrics = {"step": fit.step_count, "epoch": fit.epoch, "samples": fit.samples, "steps_this_run": done,
                   "train_seconds": seconds, "samples_per_s": done * t.batch_size * world / seconds if done else 0.0,
                   "loss": loss}
        if rank != 0:
            ray.train.report(metrics)
            return
        if final:
            logger.log({"train_seconds": seconds, "samples_per_s_overall": metrics["samples_per_s"]}, fit.step_count)
        logger.flush()
        with tempfile.TemporaryDirectory() as tmp:
            state = fit.state()
            save_file(state, str(Path(tmp) / STATE_FILE))
            # the adapters alone, as the driver builds the adapted models from them
            save_file({k.removeprefix("adapters."): v for k, v in state.items() if k.startswith("adapters.")},
                      str(Path(tmp) / ADAPTER_FILE))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))

    start, loss = time.perf_counter(), float("nan")
    while fit.step_count < last_step:
        skip = fit.batch_in_epoch  # a resume in the middle of an epoch: that epoch's batches already trained on
        for batch in shard.iter_torch_batches(batch_size=t.batch_size, drop_last=True, device=fit_device(net),
                                              pin_memory=t.use_gpu,
                                              local_shuffle_buffer_size=8 * t.batch_size,
                                              local_shuffle_seed=cfg.run.seed + fit.epoch):
            if skip:
                skip -= 1
                continue
            out = fit.step(batch["data"].float(), world)
            loss = out["loss"].item()
            step = fit.step_count
            if logger and (step == first_step + 1 or step % t.log_every == 0 or step == last_step):
                rate = (fit.step_count - first_step) * t.batch_size * world / (time.perf_counter() - start)
                logger.log({**{k: v.item() for k, v in out.items()}, "lr": fit.lr(), "samples_per_s": rate,
                            "epoch": fit.epoch}, step)
            if step >= last_step:
                break
            if step % t.checkpoint_every == 0:
                report(final=False)
        else:
            fit.end_epoch()
    report(final=True)


def fit_device(net: nn.Module) -> torch.device:
    return next(net.parameters()).device
