"""One optimizer step of the DeepSpeed engine: a global batch forward and backward (one pass, or micro-batch
accumulation), applied only where its loss is finite on every rank."""
from __future__ import annotations

from typing import Callable

import torch

from models.accumulate import CachedBatch
from models.gather import World
from pipelines.fit.step import agree


def cached_step(engine, images: torch.Tensor, tokens: torch.Tensor, micro_batches: int, world: World,
                finite: Callable[[torch.Tensor], bool]) -> dict[str, torch.Tensor] | None:
    """One optimizer step's forward and backward by feature-cache accumulation (models.accumulate): the loss of
    this worker's `micro_batches` x batch_size rows against every worker's, computed at once, with one
    micro-batch's activations. Returns the loss and its parts, or None (nothing applied) where `finite` rejects the
    loss. The gradient exchange happens once, after the last backward: ZeRO-1/2/3 through DeepSpeed's
    ``coalesce_grad_reduction`` (every backward inside keeps its gradients local, the exit reduces them once), ZeRO-0
    through the accumulation boundary set on the last backward only (its all-reduce runs at the boundary)."""
    step = CachedBatch(engine.module, images, tokens, micro_batches, world, forward=engine)
    if not finite(step.out["loss"]):
        return None
    if engine.zero_optimization_stage() == 0:
        def backward(loss: torch.Tensor, last: bool) -> None:
            engine.set_gradient_accumulation_boundary(last)
            engine.backward(loss)

        step.backward(backward)
    else:
        with engine.coalesce_grad_reduction():
            step.backward(lambda loss, last: engine.backward(loss))
    engine.step()
    return step.out


def train_step(engine, images: torch.Tensor, tokens: torch.Tensor, grad_accum: int, world: World,
               notice: bool = False, clock: bool = False) -> tuple[dict[str, torch.Tensor] | None, bool, bool]:
    """Forward, backward and optimizer step of one global batch (this worker's `grad_accum` micro-batches, joined):
    its loss and parts, or None where its loss was not finite on some rank (nothing applied); whether some rank had a
    notice of preemption (`notice`: this rank's); whether some rank's checkpoint clock is due (`clock`: this rank's)."""
    agreed = (True, False, False)

    def finite(loss: torch.Tensor) -> bool:
        nonlocal agreed
        agreed = agree(loss, world, notice, clock)
        return agreed[0]

    if grad_accum > 1:
        return cached_step(engine, images, tokens, grad_accum, world, finite), agreed[1], agreed[2]
    out = engine(images, tokens, world)
    if not finite(out["loss"]):
        return None, agreed[1], agreed[2]
    engine.backward(out["loss"])
    engine.step()
    return out, agreed[1], agreed[2]


class DeepSpeedFit:
    """The pretraining engine as the loop's Fit (pipelines.fit.loop): one `train_step` per batch, this rank's flags
    (`flags()`: a notice, the checkpoint clock) on its all-reduce, and what every rank agreed there (`noticed`,
    `clock_due`) for the loop's hooks."""

    def __init__(self, engine, progress, grad_accum: int, world: World, flags: Callable[[], tuple[bool, bool]]):
        self.engine, self.progress, self.grad_accum, self.world, self.flags = engine, progress, grad_accum, world, flags
        self.noticed = self.clock_due = False
        self.rows_in_step = 0  # this rank's rows in the last step (its contrastive batch is this x the world)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """One optimizer step, or None where the loss was not finite on some rank (skipped on every rank)."""
        self.rows_in_step = batch[1].shape[0]
        out, self.noticed, self.clock_due = train_step(self.engine, *batch, self.grad_accum, self.world, *self.flags())
        return out

    def rows(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return batch[1].shape[0] * self.world.size
