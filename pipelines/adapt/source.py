"""The frozen source model of `jobs.adapt`: a probvlp model (file, MLflow run) or open_clip CLIP weights,
always ending as a probvlp model file, checked to be deterministic before any work starts."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch.nn as nn
from safetensors import safe_open

from models.model_file import load_model, save_model
from models.openclip_weights import load_openclip_weights, read_openclip_state
from models.probvlm import source_problem
from models.registry import create_model
from pipelines.adapt.config import SourceConfig
from pipelines.config import InputError
from pipelines.tracking import resolve_model

# open_clip architecture -> our registry model and the overrides that give it the same shapes
# (open_clip's 77-token text context is cut to ours: its first rows are kept).
OPENCLIP_ARCHS: dict[str, tuple[str, dict]] = {
    "ViT-B-16": ("clip_vit_b16", {"embed_dim": 512}),
    "ViT-B-32": ("clip_vit_b16", {"embed_dim": 512, "patch_size": 32}),
    "ViT-L-14": ("clip_vit_b16", {"embed_dim": 768, "patch_size": 14, "vision_width": 1024, "vision_depth": 24,
                                  "vision_heads": 16, "text_width": 768, "text_heads": 12}),
}


class AdaptError(InputError):
    """Bad input to the adapter job, phrased as one line naming what is wrong."""


@dataclass
class Source:
    path: Path  # a probvlp model file
    name: str  # registry name
    overrides: dict
    model: nn.Module = field(repr=False)
    run_id: str | None = None
    sha256: str = ""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def model_metadata(path: Path) -> dict | None:
    """The probvlp metadata (registry name, overrides) of a safetensors file, or None if it is not one."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:  # noqa: BLE001 - any unreadable file is "not a probvlp model file"
        return None
    if "model" not in meta:
        return None
    return {"name": meta["model"], "overrides": json.loads(meta.get("overrides", "{}"))}


def _from_openclip(spec: SourceConfig, folder: Path) -> Source:
    arch = spec.model.removeprefix("open_clip:").split("/")[0]
    name, overrides = spec.build, dict(spec.overrides)
    if name is None:
        if arch not in OPENCLIP_ARCHS:
            raise AdaptError(f"source.model: no registry model known for open_clip architecture {arch!r} "
                             f"(known: {', '.join(OPENCLIP_ARCHS)}); set source.build and source.overrides")
        name, base = OPENCLIP_ARCHS[arch]
        overrides = {**base, **overrides}
    where = spec.weights or spec.model
    try:
        state = read_openclip_state(where)
    except Exception as err:  # noqa: BLE001 - a corrupt file, a pickle, a failed download: one line
        raise AdaptError(f"source.weights: cannot read open_clip weights from {where!r} ({_first_line(err)})") from None
    if not isinstance(state, dict) or not state or not all(hasattr(v, "shape") for v in state.values()):
        raise AdaptError(f"source.weights: {where!r} holds no state dict of tensors")
    try:
        model = create_model(name, **overrides)
        fresh = load_openclip_weights(model, state)
    except (ValueError, KeyError, TypeError) as err:
        raise AdaptError(f"source.weights: {where!r} does not fit {name} {overrides or ''} ({_first_line(err)})") from None
    if fresh:
        raise AdaptError(f"source.weights: {where!r} left {len(fresh)} tensors of {name} unset (e.g. {fresh[0]}): "
                         "not a complete CLIP")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "source.safetensors"
    save_model(model.state_dict(), path, name, overrides)
    return Source(path, name, overrides, model.eval())


def resolve_source(spec: SourceConfig, tracking_uri: str, folder: Path) -> Source:
    """The source as a probvlp model file + its model, or AdaptError naming the problem (no Ray needed)."""
    if spec.model.startswith("open_clip:"):
        source = _from_openclip(spec, folder)
    else:
        try:
            resolved = resolve_model(spec.model, tracking_uri, folder)
        except ValueError as err:
            raise AdaptError(f"source.model: {str(err).removeprefix('--model ')} (or open_clip:<arch> with "
                             "source.weights)") from None
        meta = model_metadata(resolved["model"])
        if meta is None:
            raise AdaptError(f"source.model: {spec.model!r} is neither a probvlp model file (safetensors with probvlp "
                             "metadata) nor open_clip:<arch>; for open_clip weights set source.model: open_clip:<arch> "
                             "and source.weights: <file>")
        try:
            model = load_model(resolved["model"])
        except Exception as err:  # noqa: BLE001 - unknown registry name, wrong tensors
            raise AdaptError(f"source.model: cannot rebuild {meta['name']} from {spec.model!r} ({_first_line(err)})") from None
        source = Source(Path(resolved["model"]), meta["name"], meta["overrides"], model, resolved["run_id"])
    problem = source_problem(source.model, source.name)
    if problem:
        raise AdaptError(f"source.model: {problem}")
    source.sha256 = file_sha256(source.path)
    return source
