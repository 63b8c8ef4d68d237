"""The module DeepSpeed trains: a model and its loss, so the loss's learnable scale/bias are trained too.

Training-step features live in the models' forward (pure PyTorch, active in training mode only):
ProLIP-style masked copies (``masked_rows``, ``image_masked_mu``/``_logvar``, ``text_masked_mu``/
``_logvar``), PCME++'s mixed-sample augmentation (``mix_lambda``, ``mix_partner``) and Llip's
contextualised cosines against all workers' captions (``pair_cos``, gathered with ``world``). The
Objective passes ``world`` to the model and the loss and adds sigma^2 statistics for logging. Its stages split
a step for feature-cache accumulation (``models.accumulate``, ``train.grad_accum``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from models.accumulate import surrogate
from models.gather import World
from models.losses import create_loss
from models.registry import create_model, default_loss
from models.towers import compile_blocks, set_grad_checkpointing


class Objective(nn.Module):
    """Model + loss. ``forward(images, tokens, world)`` is one pass over a batch; the other stages (``stage=``)
    are the pieces of ``models.accumulate.CachedBatch``, routed through ``forward`` so that a DeepSpeed engine
    wrapping this module runs each of them under its autocast and ZeRO-3 parameter gathering."""

    def __init__(self, model: nn.Module, loss: nn.Module):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, *args, stage: str = "batch", **kwargs) -> dict[str, torch.Tensor] | torch.Tensor:
        if stage not in STAGES:
            raise ValueError(f"unknown objective stage {stage!r}; known: {', '.join(STAGES)}")
        return getattr(self, STAGES[stage])(*args, **kwargs)

    def batch_loss(self, images: torch.Tensor, tokens: torch.Tensor, world: World | None = None) -> dict[str, torch.Tensor]:
        world = world or World.current()
        return self.loss_of(self.model(images, tokens, world), world)

    def loss_of(self, out: dict[str, torch.Tensor], world: World) -> dict[str, torch.Tensor]:
        return {**self.loss(out, world), **uncertainty_stats(out)}

    def features(self, images: torch.Tensor, tokens: torch.Tensor, draws: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-sample features of a micro-batch (its slice of the batch's draws)."""
        return self.model.features(images, tokens, draws)

    def cached_loss(self, features: dict[str, torch.Tensor], world: World | None = None) -> dict[str, torch.Tensor]:
        """The loss of the whole batch from its (cached) features."""
        world = world or World.current()
        return self.loss_of(self.model.pair_out(features, world), world)

    def surrogate(self, images: torch.Tensor, tokens: torch.Tensor, draws: dict[str, torch.Tensor],
                  grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """A micro-batch's features again, with graph, dotted with their cached gradients (models.accumulate)."""
        return surrogate(self.model.features(images, tokens, draws), grads)


STAGES = {"batch": "batch_loss", "features": "features", "loss": "cached_loss", "surrogate": "surrogate"}


def loss_name(cfg: Any) -> str:
    """The loss a config trains: ``loss.name``, or the model's method's default loss."""
    return cfg.loss.name or default_loss(cfg.model.name)


def build_objective(cfg: Any) -> Objective:
    """A fresh model and loss for a config (``pipelines.pretrain.config.TrainDocument``, or anything with ``model.name``,
    ``model.overrides``, ``loss.name`` and ``loss.params``)."""
    return Objective(create_model(cfg.model.name, **cfg.model.overrides), create_loss(loss_name(cfg), **cfg.loss.params))


def build_training_objective(cfg: Any, *, grad_checkpointing: bool, compile: bool) -> Objective:
    """``build_objective`` with the training-only knobs: ``grad_checkpointing`` (activation checkpointing of the
    towers' blocks) and ``compile`` (torch.compile of every block). Evaluation builds its objective with
    ``build_objective``: no backward to save memory for, no compile time to pay."""
    objective = build_objective(cfg)
    set_grad_checkpointing(objective.model, grad_checkpointing)
    if compile:
        compile_blocks(objective.model)
    return objective


@torch.no_grad()
def uncertainty_stats(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """sigma^2 statistics per modality, for logging (empty for deterministic models)."""
    stats = {}
    for side in ("image", "text"):
        logvar = out.get(f"{side}_logvar")
        if logvar is not None:
            var = logvar.float().exp().mean(dim=-1)
            stats.update({f"{side}_sigma2_mean": var.mean(), f"{side}_sigma2_min": var.min(),
                          f"{side}_sigma2_max": var.max()})
    return stats
