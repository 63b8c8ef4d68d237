"""Create models by name, like timm's `create_model`."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn


@dataclass(frozen=True)
class ModelEntry:
    build: Callable[..., nn.Module]
    default_loss: str
    # The class the builder instantiates: its constructor's parameters are the valid overrides.
    arch: type[nn.Module] | None = None


_MODELS: dict[str, ModelEntry] = {}
# Imported on the first lookup: each registers its models (importing them costs seconds: timm, the towers).
_BUILTIN_MODULES = ("models.clip", "models.llip_model", "models.pcmepp", "models.prob_llip", "models.probvlm",
                    "models.prolip")
_builtin_loaded = False


def _load_builtin() -> None:
    global _builtin_loaded
    if not _builtin_loaded:
        _builtin_loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)


def register_model(name: str, *, default_loss: str, arch: type[nn.Module] | None = None):
    def wrap(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _MODELS:
            raise ValueError(f"model {name!r} registered twice")
        _MODELS[name] = ModelEntry(fn, default_loss, arch)
        return fn

    return wrap


def _entry(name: str) -> ModelEntry:
    _load_builtin()
    if name not in _MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(_MODELS))}")
    return _MODELS[name]


def create_model(name: str, **overrides) -> nn.Module:
    """Build a registered model; `overrides` replace the entry's default constructor arguments."""
    return _entry(name).build(**overrides)


def default_loss(name: str) -> str:
    return _entry(name).default_loss


def model_arch(name: str) -> type[nn.Module] | None:
    return _entry(name).arch


def list_models() -> list[str]:
    _load_builtin()
    return sorted(_MODELS)
