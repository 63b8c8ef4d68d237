"""The pretraining workers' DeepSpeed engine for a benchmark's ranks (torch.distributed already set up): a model of the
registry and the engine the workers build (pipelines.zero.engine), in fp32."""
from __future__ import annotations

import torch


def build_engine(model: str, stage: int, world: int):
    """(engine, model) on every rank, with the same initial weights."""
    from pipelines.pretrain.config import TrainDocument
    from pipelines.pretrain.objective import training_objective
    from pipelines.zero.engine import build_engine as zero_engine

    cfg = TrainDocument.from_dict({"model": {"name": model}, "train": {"num_workers": world, "zero_stage": stage}})
    torch.manual_seed(0)
    objective = training_objective(cfg)
    return zero_engine(cfg.train, objective)[0], objective.model


def random_batch(model, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images at the model's size and one caption, tokenized at its context length."""
    from models.tokenizer import tokenize

    images = torch.randn(batch, 3, model.img_size, model.img_size)
    return images, tokenize(["a photo of a digit"] * batch, model.context_length)
