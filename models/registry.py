"""Create models by name, like timm's `create_model`: every `{method}_{size}` from a method x size table.

A registry name fixes a model class, its tower sizes (a `TowerConfig` preset), the method's extra
constructor defaults at that size and its default loss. `create_model(name, **overrides)` takes
flat keyword overrides: `TowerConfig` fields (`vision_depth`, `embed_dim`, ...) replace the preset's,
anything else goes to the model class (`mixture_tokens`, `tau`, `unc_bias_init`, ...). Model files
(`models.model_file`) and configs (`model.overrides`) store exactly these names and overrides.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from models.clip import CLIP
from models.llip import Llip
from models.pcmepp import PCMEPP
from models.prob_llip import ProbLlip
from models.probvlm import ADAPTERS, AdaptedModel, adapter_kind, adapter_model_name
from models.prolip import ProLIP
from models.towers import TowerConfig

# Size presets. tiny: CPU tests and the demo (no ln_pre: from scratch it holds a 2-block ViT at
# loss = log(batch) for ~100 steps; vision_pre_norm=True to load CLIP weights).
# vit_b16: the papers' ViT-B/16 with a 12-layer 512-wide text transformer, 768-d embeddings and a
# 64-token text context (ProLIP App. B.1): the TowerConfig defaults.
TINY = TowerConfig(img_size=32, patch_size=8, vision_width=64, vision_depth=2, vision_heads=2, vision_pre_norm=False,
                   context_length=16, text_width=64, text_depth=2, text_heads=2, embed_dim=64)
VIT_B16 = TowerConfig()
SIZES: dict[str, TowerConfig] = {"tiny": TINY, "vit_b16": VIT_B16}
TOWER_FIELDS = frozenset(f.name for f in dataclasses.fields(TowerConfig))


@dataclass(frozen=True)
class Method:
    """One row of the table: a model class, its default loss, and per-size extras."""

    arch: type[nn.Module]
    default_loss: str
    # size -> extra constructor defaults at that size (Llip's mixture-token count)
    extras: dict[str, dict[str, Any]] = field(default_factory=dict)
    # size -> text between the method and the size in the name (Llip's "64" in llip64_vit_b16)
    tags: dict[str, str] = field(default_factory=dict)


_MIXTURE = {"tiny": {"mixture_tokens": 8}, "vit_b16": {"mixture_tokens": 64}}
METHODS: dict[str, Method] = {
    "clip": Method(CLIP, "infonce"),
    "siglip": Method(CLIP, "siglip"),
    "pcmepp": Method(PCMEPP, "pml"),
    "prolip": Method(ProLIP, "prolip"),
    "llip": Method(Llip, "llip", _MIXTURE, {"vit_b16": "64"}),
    "prolip_llip": Method(ProbLlip, "prob_llip", _MIXTURE, {"vit_b16": "64"}),
}


@dataclass(frozen=True)
class ModelEntry:
    arch: type[nn.Module]
    towers: TowerConfig | None  # None: a model without towers of its own (an adapter over a registry model)
    defaults: dict[str, Any]
    default_loss: str

    def arguments(self, overrides: dict[str, Any]) -> tuple[TowerConfig | None, dict[str, Any]]:
        """The tower sizes and the constructor keywords `overrides` give (an adapter: no towers; the keywords name
        its source), after checking every override is one the model takes."""
        unknown = sorted(set(overrides) - set(override_types_of(self.arch, self.defaults)))
        if unknown:
            raise TypeError(f"{self.arch.__name__}: unknown overrides {', '.join(unknown)}")
        if self.towers is None:
            kwargs = {**self.defaults, **overrides}
            if "source" not in kwargs:
                raise TypeError(f"{self.arch.__name__}: the override `source` (the registry model it adapts) is required")
            return None, kwargs
        towers = dataclasses.replace(self.towers, **{k: v for k, v in overrides.items() if k in TOWER_FIELDS})
        return towers, {**self.defaults, **{k: v for k, v in overrides.items() if k not in TOWER_FIELDS}}

    def build(self, **overrides) -> nn.Module:
        towers, kwargs = self.arguments(overrides)
        if towers is None:  # an adapter: the registry builds the model it adapts
            return self.arch(create_model(kwargs["source"], **(kwargs.get("source_overrides") or {})), **kwargs)
        return self.arch(towers, **kwargs)


_MODELS: dict[str, ModelEntry] = {}


def register_model(name: str, entry: ModelEntry) -> None:
    """Add a model name; a name registered twice is an error (a clear ValueError, not a silent replacement)."""
    if name in _MODELS:
        raise ValueError(f"model {name!r} registered twice")
    _MODELS[name] = entry


for _method, _row in METHODS.items():
    for _size, _towers in SIZES.items():
        register_model(f"{_method}{_row.tags.get(_size, '')}_{_size}",
                       ModelEntry(_row.arch, _towers, _row.extras.get(_size, {}), _row.default_loss))

# Post-hoc adapters over a frozen registry model (ProbVLM, arXiv:2307.00398 Sec. 3) are `{head}_adapter` for every
# head of models.probvlm.ADAPTERS (`_entry`); the override `source` names the model and so the size.


def _entry(name: str) -> ModelEntry:
    if name in _MODELS:
        return _MODELS[name]
    head = name.removesuffix("_adapter")
    if name.endswith("_adapter") and head in ADAPTERS:  # a head of models.probvlm.register_adapter, whenever added
        return ModelEntry(AdaptedModel, None, {"head": head}, ADAPTERS[head].loss)
    raise KeyError(f"unknown model {name!r}; known: {', '.join(list_models())}")


def create_model(name: str, **overrides) -> nn.Module:
    """Build a registered model; `overrides` replace the entry's tower sizes and constructor defaults."""
    return _entry(name).build(**overrides)


def tower_config(name: str, **overrides) -> TowerConfig:
    """The tower sizes `create_model(name, **overrides)` would build (an adapter: its source model's), read from the
    table without building anything: what a job's driver needs (the text context its readers tokenize to)."""
    towers, kwargs = _entry(name).arguments(overrides)
    return towers or tower_config(kwargs["source"], **(kwargs.get("source_overrides") or {}))


class _OptionsChecked(Exception):
    """Raised by `_CheckOnly`'s first tower: the model's own option checks, which come before its towers, passed."""


class _CheckOnly(TowerConfig):
    """Tower sizes that build nothing: a model constructed on them runs its option checks and stops at its first
    tower (see check_overrides)."""

    def image_tower(self, *args, **kwargs):
        raise _OptionsChecked

    text_tower = projections = image_tower


def check_overrides(name: str, **overrides) -> None:
    """Run the option checks of the model `create_model(name, **overrides)` would build (its constructor's
    ValueErrors: `mixture_tokens >= 1`, a mask ratio below 1, ...) without building it or importing timm, as a
    config is checked before any process starts. Every model class checks its options before its first tower
    (tests/test_models.py). An adapter's own options are checked where pipelines.adapt builds it."""
    entry = _entry(name)
    towers, kwargs = entry.arguments(overrides)
    if towers is None:
        return check_overrides(kwargs["source"], **(kwargs.get("source_overrides") or {}))
    try:
        entry.arch(_CheckOnly(**dataclasses.asdict(towers)), **kwargs)
    except _OptionsChecked:
        return
    raise RuntimeError(f"{entry.arch.__name__} was built without a tower: its options cannot be checked this way")


def default_loss(name: str) -> str:
    return _entry(name).default_loss


def model_arch(name: str) -> type[nn.Module]:
    """The class a registered model is an instance of (e.g. to read ``probabilistic`` without building it)."""
    return _entry(name).arch


def override_types_of(arch: type[nn.Module], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every override a model class takes and its annotated type: the TowerConfig fields (models built on
    towers), then its own keywords; for an adapter entry (``defaults`` names its head) the head's options too."""
    params = inspect.signature(arch.__init__).parameters
    out: dict[str, Any] = {}
    if "towers" in params:
        hints = typing.get_type_hints(TowerConfig)
        out = {f.name: hints[f.name] for f in dataclasses.fields(TowerConfig)}
    own = typing.get_type_hints(arch.__init__)
    for pname, param in params.items():
        if pname not in ("self", "towers") and param.kind == param.KEYWORD_ONLY:
            out[pname] = own.get(pname, Any)
    if defaults and "head" in defaults:
        kind = adapter_kind(defaults["head"])
        hints = typing.get_type_hints(kind.module.__init__)
        out.update({o: hints.get(o, Any) for o in kind.options})
    return out


def override_types(name: str) -> dict[str, Any]:
    """The valid `model.overrides` keys of a registered model and their types."""
    entry = _entry(name)
    return override_types_of(entry.arch, entry.defaults)


def list_models() -> list[str]:
    return sorted([*_MODELS, *(adapter_model_name(h) for h in ADAPTERS)])
