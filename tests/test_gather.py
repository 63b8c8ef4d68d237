"""Global negatives: 2 gloo workers x batch B give the loss and gradients of 1 process x batch 2B."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from models import create_model
from models.gather import World
from models.losses import create_loss
from models.objective import Objective
from models.tokenizer import tokenize
from tests.helpers import free_port, spawn

B = 6
TINY = dict(vision_depth=1, text_depth=1)


def inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    images = torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64)
    tokens = tokenize([f"the digit {i} drawn number {i * 7}" for i in range(n)], 16)
    return images, tokens


def objective() -> Objective:
    torch.manual_seed(0)
    return Objective(create_model("clip_tiny", **TINY), create_loss("infonce")).double()


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def _worker(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        obj = objective()
        images, tokens = inputs(world * B)
        rows = slice(rank * B, (rank + 1) * B)
        loss = obj(images[rows], tokens[rows], World.current())["loss"]
        loss.backward()
        # What the data-parallel optimizer sees: gradients and losses averaged over workers.
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        g = grads(obj)
        for t in g.values():
            dist.all_reduce(t)
            t /= world
        if rank == 0:
            torch.save({"loss": mean_loss / world, "grads": g}, out_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_two_workers_equal_one_process_full_batch(tmp_path):
    out_path = str(tmp_path / "dist.pt")
    spawn(_worker, (2, free_port(), out_path), 2)
    dist_result = torch.load(out_path, weights_only=True)

    obj = objective()
    images, tokens = inputs(2 * B)
    loss = obj(images, tokens, World())["loss"]
    loss.backward()
    ref = grads(obj)

    assert torch.allclose(dist_result["loss"], loss.detach(), atol=1e-5, rtol=0)
    assert set(dist_result["grads"]) == set(ref) and len(ref) > 10
    for name, g in ref.items():
        assert torch.allclose(dist_result["grads"][name], g, atol=1e-5, rtol=1e-5), name
    # The comparison has teeth: without gathering, each worker only sees local negatives.
    local = objective()(images[:B], tokens[:B], World())["loss"]
    assert not torch.allclose(local, loss, atol=1e-3)
