"""Cross-worker feature gathering with gradient, so every worker sees global negatives.

Each worker computes its local rows against the global columns. With the all-gather backward
summing gradients across workers and the optimizer averaging them, this gives exactly the
single-process full-batch gradient (see tests/test_gather.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size()
        ctx.rank, ctx.rows = dist.get_rank(), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # Every worker's loss depends on every worker's features: sum those gradients.
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = ctx.rank * ctx.rows
        return grad[start : start + ctx.rows]


@dataclass(frozen=True)
class World:
    """Where this process sits among the data-parallel workers."""

    rank: int = 0
    size: int = 1

    @classmethod
    def current(cls) -> "World":
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate `x` from all workers along dim 0, differentiably. Local batches must be equal."""
        if self.size == 1:
            return x
        return _AllGatherWithGrad.apply(x)

    def offset(self, local_rows: int) -> int:
        """Index of this worker's first local row among the gathered rows."""
        return self.rank * local_rows
