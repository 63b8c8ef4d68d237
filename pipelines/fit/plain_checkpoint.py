"""A plain fit's checkpoint (no DeepSpeed: the adapter's) as one flat dict of tensors, written as safetensors (no
pickle): the weights under a prefix of the fit's choosing, AdamW's per-parameter state, and the Progress counters."""
from __future__ import annotations

from dataclasses import asdict, fields

import torch

from pipelines.fit.progress import Progress


def fit_state(weights: dict[str, torch.Tensor], prefix: str, optimizer: torch.optim.Optimizer,
              progress: Progress) -> dict[str, torch.Tensor]:
    """`weights` as `{prefix}{name}`, the optimizer's state as `optimizer.{i}.{key}`, the progress as `progress.{key}`."""
    state = {f"{prefix}{k}": v.detach().cpu().contiguous() for k, v in weights.items()}
    for i, entries in optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            state[f"optimizer.{i}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    for key, value in asdict(progress).items():
        state[f"progress.{key}"] = torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)
    return state


def load_fit_state(state: dict[str, torch.Tensor], prefix: str, optimizer: torch.optim.Optimizer
                   ) -> tuple[dict[str, torch.Tensor], Progress]:
    """`fit_state`'s inverse: the optimizer restored in place; returns the weights (prefix removed) and the progress
    (counters a file lacks keep their defaults)."""
    entries: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key.startswith("optimizer."):
            _, i, name = key.split(".", 2)
            entries.setdefault(int(i), {})[name] = value
    # torch puts each entry where its parameter is (the step count too where the optimizer is fused)
    optimizer.load_state_dict({"state": entries, "param_groups": optimizer.state_dict()["param_groups"]})
    defaults = Progress()
    progress = Progress(**{f.name: type(getattr(defaults, f.name))(state[f"progress.{f.name}"].item())
                           for f in fields(Progress) if f"progress.{f.name}" in state})
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, progress
