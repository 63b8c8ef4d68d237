"""What each Ray Train worker runs for `jobs.adapt`: the adapter (and the optional baseline) on embedding pairs.

The frozen source model is not here at all: the workers see only its embeddings, so no gradient or
optimizer can reach its weights. Rank 0 logs step metrics to MLflow and hands the adapter weights back
through the final Ray Train checkpoint (safetensors).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from models.losses import create_loss
from models.probvlm import build_adapter

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


def adapt_loop(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    from safetensors.torch import save_file

    from pipelines.adapt_config import adapt_config_from_dict
    from pipelines.tracking import StepLogger

    cfg = adapt_config_from_dict(config["config"])
    t = cfg.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if not t.use_gpu:
        torch.set_num_threads(max(1, int(t.cpus_per_worker)))
    torch.manual_seed(cfg.run.seed)  # the same initial adapters on every rank
    net = build_adapter_set(cfg, int(config["dim"]))
    model = ray.train.torch.prepare_model(net)  # DDP across workers; the device of this worker
    device = next(net.parameters()).device
    optimizer = torch.optim.AdamW(net.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t.steps)
    logger = StepLogger(config["mlflow_uri"], config["mlflow_run_id"], flush_every=500) if rank == 0 else None
    shard = ray.train.get_dataset_shard("train")

    step, epoch, samples, start = 0, 0, 0, time.perf_counter()
    while step < t.steps:
        for batch in shard.iter_torch_batches(batch_size=t.batch_size, drop_last=True, device=device,
                                              local_shuffle_buffer_size=8 * t.batch_size,
                                              local_shuffle_seed=cfg.run.seed + epoch):
            pairs = batch["data"].float()
            out = model(pairs[:, 0], pairs[:, 1])
            if not torch.isfinite(out["loss"]):
                raise FloatingPointError(f"adapter loss is not finite at step {step} ({out['loss'].item()}); "
                                         "lower train.lr or check the embeddings")
            optimizer.zero_grad(set_to_none=True)
            out["loss"].backward()
            optimizer.step()
            schedule.step()
            step += 1
            samples += pairs.shape[0] * world
            if logger and (step == 1 or step % t.log_every == 0 or step == t.steps):
                rate = samples / (time.perf_counter() - start)
                logger.log({**{k: v.item() for k, v in out.items()}, "lr": schedule.get_last_lr()[0],
                            "samples_per_s": rate, "epoch": epoch}, step)
            if step >= t.steps:
                break
        epoch += 1
    seconds = time.perf_counter() - start
    metrics = {"step": step, "epoch": epoch, "samples": samples, "train_seconds": seconds,
               "samples_per_s": samples / seconds, "loss": out["loss"].item()}
    if rank == 0:
        logger.log({"train_seconds": seconds, "samples_per_s_overall": samples / seconds}, step)
        logger.flush()
        with tempfile.TemporaryDirectory() as tmp:
            state = {k: v.detach().cpu().contiguous() for k, v in net.adapters.state_dict().items()}
            save_file(state, str(Path(tmp) / ADAPTER_FILE))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    else:
        ray.train.report(metrics)
