"""One optimizer step of the DeepSpeed engine: a global batch forward and backward (one pass, or micro-batch
accumulation), applied only where its loss is finite on every rank."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from models.accumulate import CachedBatch
from models.gather import World
from pipelines.fit.step import Voter, agree


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
               voters: Sequence[Voter] = ()) -> dict[str, torch.Tensor] | None:
    """Forward, backward and optimizer step of one global batch (this worker's `grad_accum` micro-batches, joined):
    its loss and parts, or None where its loss was not finite on some rank (nothing applied). `voters` (a notice of
    preemption, the checkpoint clock: pipelines.fit.step.agree) ride on the finiteness all-reduce."""
    def finite(loss: torch.Tensor) -> bool:
        return agree(loss, world, voters)

    if grad_accum > 1:
        return cached_step(engine, images, tokens, grad_accum, world, finite)
    out = engine(images, tokens, world)
    if not finite(out["loss"]):
        return None
    engine.backward(out["loss"])
    engine.step()
    return out


class DeepSpeedFit:
    """The pretraining engine as the loop's Fit (pipelines.fit.loop): one `train_step` per batch, the voters' matters
    (a notice, the checkpoint clock) agreed on its all-reduce."""

    def __init__(self, engine, progress, grad_accum: int, world: World, voters: Sequence[Voter] = ()):
        self.engine, self.progress, self.grad_accum, self.world, self.voters = engine, progress, grad_accum, world, voters
        self.rows_in_step = 0  # this rank's rows in the last step (its contrastive batch is this x the world)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """One optimizer step, or None where the loss was not finite on some rank (skipped on every rank)."""
        self.rows_in_step = batch[1].shape[0]
        return train_step(self.engine, *batch, self.grad_accum, self.world, self.voters)

    def rows(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return batch[1].shape[0] * self.world.size
