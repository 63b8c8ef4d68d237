"""A DeepSpeed stage's engine: any objective (a module whose forward returns the loss) under the training core's AdamW
and schedule (pipelines.fit.optim), DeepSpeed's config from a ZeroConfig, and the full weights of a (possibly
partitioned) module."""
from __future__ import annotations

from typing import Any

import torch

from models._imports import without
from pipelines.compat.deepspeed_private import import_muon_with_deferred_compile, skip_shm_comm_op_build
from pipelines.fit.optim import optimizer_for, schedule_for
from pipelines.zero.checkpoint_files import use_weights_only_loading
from pipelines.zero.config import ZeroConfig

# DeepSpeed tries MLflow for its autotuner as it loads (a second of CPU in every worker): only rank 0 logs, and
# it imports MLflow itself (pipelines.tracking, when it builds its logger).
with without("mlflow"):
    import deepspeed


def build_engine(t: ZeroConfig, objective: torch.nn.Module, use_bf16: bool = False):
    """(engine, its scheduler): DeepSpeed over `objective` with t's AdamW and schedule, checkpoints loaded
    weights-only. torch.distributed already set up on every rank."""
    optimizer = optimizer_for(objective, t)
    skip_inference_comm_op()
    import_muon_with_deferred_compile()  # ZeRO asks for it at the first step: a CPU-second of torch._inductor saved
    engine, _, _, scheduler = deepspeed.initialize(
        model=objective, optimizer=optimizer, lr_scheduler=schedule_for(optimizer, t),
        config=deepspeed_config(t, use_bf16), dist_init_required=False)
    use_weights_only_loading(engine)
    return engine, scheduler


def skip_inference_comm_op() -> None:
    """On CPU, DeepSpeed's communication backend JIT-compiles its shared-memory all-reduce (C++, about a minute on
    2 cores, again whenever the build command changes) before the first step. Only its `inference_all_reduce`
    calls that op; training all-reduces through torch.distributed (gloo), so the build is skipped."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        skip_shm_comm_op_build()


def deepspeed_config(t: ZeroConfig, use_bf16: bool) -> dict[str, Any]:
    """bf16 is DeepSpeed's torch autocast, not its bf16 engine: the engine casts every parameter to bf16
    (its keep_in_fp32_modules keeps buffers only), where the sigma heads, the mixer and the losses'
    scale / bias must stay float32 (models.heads); under autocast the parameters stay float32 and the
    towers' matmuls run in bf16 (their gradients are reduced in bf16)."""
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        # train.grad_accum is ours (feature-cache accumulation, `cached_step`): DeepSpeed sees one backward per
        # micro-batch that it must neither divide by the accumulation count nor reduce before the step's last
        "gradient_accumulation_steps": 1,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "torch_autocast": {"enabled": use_bf16, "dtype": "bfloat16"},
        # torch's AdamW is a client optimizer: DeepSpeed's fused/CPU Adam would JIT-compile C++ first.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def full_state_dict(engine, module: torch.nn.Module, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Complete fp32 weights of `module`, copied to `device` (default: where the parameters live). Collective: all
    ranks call it, any ZeRO stage (ZeRO-3 gathers the partitions for the copy and releases them after)."""
    def copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.detach().to(device=device, dtype=torch.float32, copy=True) for k, v in state.items()}

    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return copy(module.state_dict())
    return copy(module.state_dict())


def gathered_weights(engine, rank: int, device: torch.device
                     ) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
    """The model's and the loss's complete weights on rank 0's `device` (collective; None on other ranks). ZeRO-0/1/2
    ranks hold whole parameters, so only rank 0 copies them; ZeRO-3 gathers on every rank."""
    if rank != 0 and engine.zero_optimization_stage() != 3:
        return None, None
    module = engine.module
    weights = full_state_dict(engine, module.model, device)
    loss_weights = full_state_dict(engine, module.loss, device)
    return (weights, loss_weights) if rank == 0 else (None, None)
