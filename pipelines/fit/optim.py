"""The optimizer every fit steps with, built from its LoopConfig: AdamW (fused) over two parameter groups (no weight
decay on gains, biases and vectors), the learning rate's linear warm-up then cosine to 0 at `steps`, a function of the
step alone (a resumed fit needs no scheduler state)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from pipelines.fit.config import LoopConfig


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on gains, biases, embeddings-like vectors and learnable scalars (ndim < 2)."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "positional_embedding" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(params, **kwargs) -> torch.optim.AdamW:
    """torch's AdamW as one fused kernel: on CPU its step is ~3.5x faster than the default per-tensor loop
    (150M parameters: 0.19 s vs 0.70 s), ~7% of a ViT-B/16 step there."""
    return torch.optim.AdamW(params, fused=True, **kwargs)


def optimizer_for(module: nn.Module, cfg: LoopConfig) -> torch.optim.AdamW:
    """AdamW over `module`'s trainable parameters with cfg's learning rate, weight decay, betas and epsilon."""
    return adamw(param_groups(module, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def warmup_cosine_factor(step: int, warmup: int, total: int) -> float:
    """The learning rate at optimizer step `step` (from 0) as a fraction of train.lr: linear warm-up over `warmup`
    steps, then cosine annealing to 0 at `total` (and 0 after)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def lr_at(cfg: LoopConfig, step: int) -> float:
    """The learning rate of optimizer step `step` (from 0) under cfg's schedule."""
    return cfg.lr * warmup_cosine_factor(step, cfg.warmup_steps, cfg.steps)


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine_factor(step, warmup, total))


def schedule_for(optimizer: torch.optim.Optimizer, cfg: LoopConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """cfg's schedule as the scheduler an engine steps (DeepSpeed's: it saves and restores the step count)."""
    return warmup_cosine(optimizer, cfg.warmup_steps, cfg.steps)
