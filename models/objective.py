"""The module DeepSpeed trains: a model and its loss, so the loss's learnable scale/bias are trained too."""
from __future__ import annotations

import torch
import torch.nn as nn

from models.gather import World


class Objective(nn.Module):
    def __init__(self, model: nn.Module, loss: nn.Module):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, world: World | None = None) -> dict[str, torch.Tensor]:
        return self.loss(self.model(images, tokens), world or World.current())
