"""The whole optimizer state of a DeepSpeed ZeRO checkpoint, read from its files without DeepSpeed: the reference the
resharding tests hold the universal conversion (pipelines.zero.reshard) against."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from tests.small_runs import load_state


def gathered_partitions(tag_dir: Path) -> dict[str, torch.Tensor]:
    """fp32 master weights and Adam moments of every parameter, whole, gathered from the ranks' ZeRO partition files
    of a checkpoint (laid out as DeepSpeed's zero_to_fp32 reads them): the reference a conversion must reproduce."""
    files = load_state(str(tag_dir))
    ranks = sorted((n for n in files if n.endswith("optim_states.pt")), key=lambda n: int(n.split("_")[3]))
    optim = [files[n]["optimizer_state_dict"] for n in ranks]
    model = next(v for n, v in sorted(files.items()) if n.endswith("model_states.pt"))
    shapes, world, out = model["param_shapes"], len(optim), {}
    if "fp32_flat_groups" in optim[0]:  # ZeRO-3: each parameter split over the ranks, ceil(numel / world) each
        per_rank = {"fp32": [torch.cat(o["fp32_flat_groups"]) for o in optim]}
        for key in ("exp_avg", "exp_avg_sq"):
            states = [o["optimizer_state_dict"]["state"] for o in optim]
            per_rank[key] = [torch.cat([st[i][key] for i in sorted(st)]) for st in states]
        offset = 0
        for name, shape in ((k, v) for group in shapes for k, v in group.items()):
            part = math.ceil(shape.numel() / world)
            for key, flats in per_rank.items():
                out[f"{key}/{name}"] = torch.cat([f[offset:offset + part] for f in flats])[:shape.numel()].view(shape)
            offset += part
        return out
    # ZeRO-1/2: each group's flat vector split over the ranks
    for g, group in enumerate(shapes):
        fp32 = [o["single_partition_of_fp32_groups"][g] for o in optim]
        # the torch optimizer's state of the rank's flat partition; the last rank's ends in the group's padding
        flats = {"fp32": torch.cat(fp32), **{
            key: torch.cat([o["base_optimizer_state"]["state"][g][key][:f.numel()] for o, f in zip(optim, fp32)])
            for key in ("exp_avg", "exp_avg_sq")}}
        paddings = optim[0].get("param_alignment_paddings")
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            for key, flat in flats.items():
                out[f"{key}/{name}"] = flat[offset:offset + shape.numel()].view(shape)
            offset += shape.numel() + (paddings[g][i] if paddings else 0)
    return out


def universal_state(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The same tensors, flattened, from a universal folder (a folder per parameter, a file per state: a dict holding
    the tensor after ZeRO-1/2, the flat tensor itself after ZeRO-3)."""
    def flat(path: Path) -> torch.Tensor:
        saved = torch.load(path, weights_only=True)
        return (saved["param"] if isinstance(saved, dict) else saved).reshape(-1)

    return {f"{key}/{p.name}": flat(p / f"{key}.pt")
            for p in sorted((tag_dir / "zero").iterdir()) if p.is_dir() for key in ("fp32", "exp_avg", "exp_avg_sq")}
