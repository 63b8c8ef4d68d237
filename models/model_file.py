"""Model files in safetensors: weights plus the registry name and overrides needed to rebuild them."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.registry import create_model


def save_model(state_dict: dict[str, torch.Tensor], path: str | Path, name: str, overrides: dict | None = None) -> None:
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    meta = {"model": name, "overrides": json.dumps(overrides or {}), "format": "probvlp-1"}
    save_file(tensors, str(path), metadata=meta)


def load_model(path: str | Path, map_location: str = "cpu") -> nn.Module:
    """Rebuild the model from the registry and load weights; never unpickles anything."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "model" not in meta:
        raise ValueError(f"{path}: not a probvlp model file (no 'model' metadata)")
    model = create_model(meta["model"], **json.loads(meta.get("overrides", "{}")))
    model.load_state_dict(load_file(str(path), device=map_location))
    return model.eval()
