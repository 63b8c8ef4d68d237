"""The pretraining workers' DeepSpeed engine for a benchmark's ranks (torch.distributed already set up): a model of the
registry, its training objective, AdamW and the warmup + cosine schedule, the workers' DeepSpeed config (fp32)."""
from __future__ import annotations

import torch


def build_engine(model: str, stage: int, world: int):
    """(engine, model) on every rank, with the same initial weights."""
    import deepspeed

    from pipelines.train.config import TrainDocument
    from pipelines.train.optim import adamw, param_groups, training_objective, warmup_cosine
    from pipelines.train.worker import deepspeed_config, skip_inference_comm_op

    skip_inference_comm_op()
    cfg = TrainDocument.from_dict({"model": {"name": model}, "train": {"num_workers": world, "zero_stage": stage}})
    torch.manual_seed(0)
    objective = training_objective(cfg)
    t = cfg.train
    optimizer = adamw(param_groups(objective, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    engine, *_ = deepspeed.initialize(model=objective, optimizer=optimizer,
                                      lr_scheduler=warmup_cosine(optimizer, t.warmup_steps, t.steps),
                                      config=deepspeed_config(cfg, False), dist_init_required=False)
    return engine, objective.model


def random_batch(model, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images at the model's size and one caption, tokenized at its context length."""
    from models.tokenizer import tokenize

    images = torch.randn(batch, 3, model.img_size, model.img_size)
    return images, tokenize(["a photo of a digit"] * batch, model.context_length)
