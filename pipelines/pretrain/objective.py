"""Pretraining's objective (the registry's model and loss with train.grad_checkpointing and train.compile; the towers
from open_clip's weights where model.init_from_openclip asks) and the DeepSpeed engine over it (pipelines.zero)."""
from __future__ import annotations

import ray.train
import torch

from models.gather import World
from models.objective import Objective, build_training_objective
from models.openclip_weights import load_openclip_weights, read_openclip_state
from pipelines.pretrain.config import TrainDocument
from pipelines.zero.engine import build_engine


def training_objective(cfg: TrainDocument) -> Objective:
    """cfg's model and loss with train.grad_checkpointing and train.compile applied."""
    return build_training_objective(cfg, grad_checkpointing=cfg.train.grad_checkpointing, compile=cfg.train.compile)


def pretraining_engine(cfg: TrainDocument, world: World, rank: int, use_bf16: bool):
    """(engine, its scheduler) on every rank: the same initial weights everywhere (run.seed), the towers from open_clip
    where asked and no checkpoint is restored after (a resume restores its own weights)."""
    torch.manual_seed(cfg.run.seed)
    objective = training_objective(cfg)
    source = cfg.model.init_from_openclip
    if source and ray.train.get_checkpoint() is None:
        fresh = load_openclip_weights(objective.model, read_once_per_node(source, world))
        if rank == 0:
            print(f"[probvlp] towers from {source}; {len(fresh)} tensors keep their own initialisation", flush=True)
    return build_engine(cfg.train, objective, use_bf16)


def read_once_per_node(source: str, world: World) -> dict[str, torch.Tensor]:
    """open_clip downloads into a per-machine cache: one rank per node fetches it, the others then read the cache."""
    if not source.startswith("open_clip:") or world.size == 1:
        return read_openclip_state(source)
    first_on_node = ray.train.get_context().get_local_rank() == 0
    state = read_openclip_state(source) if first_on_node else None
    torch.distributed.barrier()
    return state if first_on_node else read_openclip_state(source)
