"""One step of a fit, as every rank takes it: the ranks agree whether it is applied (`agree`), and a plain fit (no
DeepSpeed: the adapter's, the in-process one) applies it the way DeepSpeed's engine does for pretraining (backward,
clipping at cfg.grad_clip, the learning rate of the step, AdamW)."""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from models.gather import World
from pipelines.fit.config import LoopConfig
from pipelines.fit.optim import lr_at


class Voter(Protocol):
    """A component whose matter every rank votes on with each step (a notice of preemption, a checkpoint's clock):
    `vote()` is this rank's, `agreed` what the ranks agreed at the last step (any rank's vote)."""

    agreed: bool

    def vote(self) -> bool: ...


def agree(loss: torch.Tensor, world: World, voters: Sequence[Voter] = ()) -> bool:
    """Collective, once a step: whether the loss is finite on every rank (a NaN/inf on one rank is skipped on all of
    them, or the ranks' weights part ways), and each voter's `agreed`: whether any rank voted for it (the same
    voters on every rank). The votes ride on the all-reduce the step makes anyway, so every rank acts at the same
    step."""
    flags = torch.tensor([0.0 if torch.isfinite(loss).all() else 1.0, *(float(v.vote()) for v in voters)],
                         device=loss.device)
    if world.size > 1:
        torch.distributed.all_reduce(flags)
    bad, *votes = flags.tolist()
    for voter, vote in zip(voters, votes):
        voter.agreed = vote > 0
    return bad == 0


def plain_step(out: dict[str, torch.Tensor], backward: Callable[[], None], optimizer: torch.optim.Optimizer,
               parameters: list[torch.nn.Parameter], cfg: LoopConfig, step: int, world: World,
               agreed: bool | None = None) -> dict[str, torch.Tensor] | None:
    """Apply the step whose forward gave `out`: None (nothing applied) where its loss is not finite on some rank
    (`agreed`: the fit's own `agree` already said whether it is, beside its flags); otherwise `backward()` (the fit's: its loss, its sign, its micro-batches), the gradient clipped to cfg.grad_clip
    (0: not clipped), the learning rate of optimizer step `step` (from 0), and AdamW's update."""
    if not (agree(out["loss"], world) if agreed is None else agreed):
        return None
    optimizer.zero_grad(set_to_none=True)
    backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(parameters, cfg.grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(cfg, step)
    optimizer.step()
    return out
