"""What each Ray Train worker runs: DeepSpeed over the model+loss, Ray Data batches, rank-0 MLflow logging."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import deepspeed
import ray.train
import torch

from safetensors.torch import save_file

from models import create_model, default_loss
from models.checkpoint import save_model
from models.gather import World
from models.losses import create_loss
from models.objective import Objective
from models.zeroshot import class_embeddings, zero_shot_accuracy
from pipelines.config import Config
from pipelines.digits import NAMES, specific_captions
from pipelines.optim import param_groups, warmup_cosine
from pipelines.tracking import StepLogger


def deepspeed_config(cfg: Config, use_bf16: bool) -> dict[str, Any]:
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": use_bf16},
        # torch's AdamW is a client optimizer: DeepSpeed's fused/CPU Adam would JIT-compile C++ first.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def full_state_dict(engine, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Complete weights of `module` on every rank (collective: all ranks must call it, any ZeRO stage)."""
    if engine.zero_optimization_stage() == 3:
        params = list(module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def evaluate_zero_shot(model: torch.nn.Module, ds, context_length: int, batch_size: int) -> float:
    model.eval()
    prompts = [specific_captions(label) for label in range(len(NAMES))]
    classes = class_embeddings(model, prompts, context_length)
    batches = ((b["image"], b["label"]) for b in ds.iter_torch_batches(batch_size=batch_size, dtypes=None))
    return zero_shot_accuracy(model, classes, batches)


@torch.no_grad()
def embedding_probe(model: torch.nn.Module, ds, n: int = 8) -> dict[str, torch.Tensor]:
    """A few inputs and the embeddings the trained model gives them, to check that saved models reload exactly."""
    batch = next(iter(ds.iter_torch_batches(batch_size=n)))
    tokens = batch["text"]
    return {"images": batch["image"].contiguous(), "tokens": tokens.contiguous(),
            **{f"image_{k}": v.contiguous() for k, v in model.encode_image(batch["image"]).items()},
            **{f"text_{k}": v.contiguous() for k, v in model.encode_text(tokens).items()}}


def train_loop(config: dict[str, Any]) -> None:
    cfg = Config.from_dict(config["config"])
    run_id, uri = config["mlflow_run_id"], config["mlflow_uri"]
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    use_gpu = cfg.train.use_gpu and torch.cuda.is_available()
    use_bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and use_gpu)
    device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
    if not use_gpu:
        torch.set_num_threads(max(1, int(cfg.train.cpus_per_worker)))
    torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank

    model = create_model(cfg.model.name, **cfg.model.overrides)
    loss = create_loss(cfg.loss.name or default_loss(cfg.model.name), **cfg.loss.params)
    objective = Objective(model, loss)
    t = cfg.train
    optimizer = torch.optim.AdamW(param_groups(objective, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    engine, _, _, scheduler = deepspeed.initialize(
        model=objective, optimizer=optimizer, lr_scheduler=warmup_cosine(optimizer, t.warmup_steps, t.steps),
        config=deepspeed_config(cfg, use_bf16), dist_init_required=False,
    )
    world = World.current()
    dtype = torch.bfloat16 if use_bf16 else torch.float32
    logger = StepLogger(uri, run_id) if rank == 0 else None
    if logger:
        # Where torch.distributed traffic goes (local runs must stay on loopback).
        logger.tag("probvlp.master_addr", os.environ.get("MASTER_ADDR", ""))
        logger.tag("probvlp.world_size", str(world.size))
    shard = ray.train.get_dataset_shard("train")

    step, epoch, seen, t0 = 0, 0, 0, time.perf_counter()
    while step < t.steps:
        for batch in shard.iter_torch_batches(batch_size=t.batch_size, drop_last=True, device=device,
                                              local_shuffle_buffer_size=4 * t.batch_size,
                                              local_shuffle_seed=cfg.run.seed + epoch):
            images, tokens = batch["image"].to(dtype), batch["text"]
            out = engine(images, tokens, world)
            engine.backward(out["loss"])
            engine.step()
            step += 1
            seen += images.shape[0] * world.size
            if logger and (step % t.log_every == 0 or step == t.steps):
                elapsed = time.perf_counter() - t0
                metrics = {k: v.item() for k, v in out.items() if v.numel() == 1}
                metrics.update(lr=scheduler.get_last_lr()[0], samples_per_s=seen / elapsed, epoch=epoch)
                logger.log(metrics, step)
            if step >= t.steps:
                break
        epoch += 1

    weights = full_state_dict(engine, engine.module.model)
    loss_weights = full_state_dict(engine, engine.module.loss)
    report: dict[str, Any] = {"step": step, "epoch": epoch}
    if rank == 0:
        eval_model = create_model(cfg.model.name, **cfg.model.overrides)
        eval_model.load_state_dict(weights)
        top1 = evaluate_zero_shot(eval_model, ray.train.get_dataset_shard("eval"), eval_model.context_length,
                                  cfg.eval.batch_size)
        report[f"zero_shot_top1_{cfg.eval.split}"] = top1
        logger.log({f"zero_shot_top1_{cfg.eval.split}": top1}, step)
        logger.flush()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.safetensors"
            save_model(weights, path, cfg.model.name, cfg.model.overrides)
            logger.artifact(path, "model")
            probe = embedding_probe(eval_model, ray.train.get_dataset_shard("eval"))
            save_file(probe, str(Path(tmp) / "probe.safetensors"))
            logger.artifact(Path(tmp) / "probe.safetensors", "model")
            save_file({k: v.contiguous() for k, v in loss_weights.items()}, str(Path(tmp) / "loss.safetensors"))
            logger.artifact(Path(tmp) / "loss.safetensors", "model")
    # Every rank reports the same metrics (Ray may surface any rank's report).
    shared = [report]
    torch.distributed.broadcast_object_list(shared, src=0)
    ray.train.report(shared[0])
