"""A contrastive batch larger than one pass holds: feature-cache accumulation (GradCache, Gao et al. 2021).

A model's training forward is split in three (``SplitForward``):

- ``draw(images, tokens)``: every random choice of the step over the whole local batch, made once: ProLIP's masked
  rows, kept patches and [MASK] positions, PCME++'s mixed-sample augmentation (applied to the images here, so a
  mixed partner may come from any micro-batch). Returns the images to encode, per-row draws and batch-level outputs
  for the loss (MSDA's soft-label information);
- ``features(images, tokens, draws)``: per-sample embeddings of any slice of rows, given that slice of the draws;
- ``pair_out(features, world)``: what needs the whole batch at once before the loss (Llip's contextualised cosines
  against every worker's captions, with the mixer's parameters).

``CachedBatch`` runs one optimizer step's local batch of k micro-batches: the draws once; the features of every
micro-batch without a graph (the random state saved before each); the loss of the whole batch on the cached
features (gathered from all workers once) and its backward, which gives every cached feature its gradient and the
loss's and ``pair_out``'s parameters (scale, bias, mixer) their one gradient; then each micro-batch again with the
graph, the random state restored, back-propagating the cached gradient (the surrogate sum(features * gradient)).
The gradients equal those of one pass over the whole batch (tests/test_accumulation.py), with the activations of
one micro-batch. Pure PyTorch: ``forward`` and ``backward`` may be a DeepSpeed engine's.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from models.gather import World

# Feature keys holding row indices into their micro-batch: shifted by the micro-batch's first row when joined.
ROW_INDEX_KEYS = ("masked_rows",)


class SplitForward:
    """The training forward as draw -> features -> pair_out (mix in before nn.Module). A model defines
    ``features``; ``draw`` (no random choices) and ``pair_out`` (nothing across rows) default to no-ops."""

    def draw(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
        return images, {}, {}

    def pair_out(self, features: dict[str, torch.Tensor], world: World) -> dict[str, torch.Tensor]:
        return features

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, world: World | None = None) -> dict[str, torch.Tensor]:
        world = world or World.current()
        images, draws, batch_out = self.draw(images, tokens)
        return self.pair_out({**self.features(images, tokens, draws), **batch_out}, world)


def rng_state(device: torch.device) -> tuple:
    """The random state a pass on `device` draws from (the CPU generator, and the device's own on a GPU)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def slice_rows(draws: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in draws.items()}


def join_features(parts: list[dict[str, torch.Tensor]], sizes: list[int]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Micro-batch features concatenated along rows as one batch's (row indices shifted), and where each
    micro-batch's rows of every key lie in the result."""
    joined, spans = {}, [dict() for _ in parts]
    for key in parts[0]:
        pieces, start, row0 = [], 0, 0
        for i, (part, size) in enumerate(zip(parts, sizes)):
            value = part[key]
            pieces.append(value + row0 if key in ROW_INDEX_KEYS else value)
            spans[i][key] = slice(start, start + value.shape[0])
            start, row0 = start + value.shape[0], row0 + size
        joined[key] = torch.cat(pieces)
    return joined, spans


def surrogate(features: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum over keys of <features, cached gradient>: its gradient w.r.t. the parameters is the vector-Jacobian
    product the whole-batch backward would have taken through these features."""
    total = None
    for key, grad in grads.items():
        value = features[key]
        acc = torch.promote_types(value.dtype, torch.float32)  # bf16 products summed in float32
        term = (value.to(acc) * grad.to(acc)).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("no cached feature has a gradient: the loss does not depend on the model's features")
    return total


def micro_slices(rows: int, micro_batches: int) -> list[slice]:
    if micro_batches < 1 or rows % micro_batches:
        raise ValueError(f"{rows} rows do not split into {micro_batches} equal micro-batches")
    size = rows // micro_batches
    return [slice(i * size, (i + 1) * size) for i in range(micro_batches)]


class CachedBatch:
    """One optimizer step over `images`/`tokens` (this worker's whole batch) in `micro_batches` passes.

    objective: the module with ``model`` (a SplitForward) and the stages of ``models.objective.Objective``;
    forward: what runs its stages (the objective itself, or the DeepSpeed engine wrapping it: autocast, ZeRO-3
    parameter gathering). Construction runs the draws, the cached passes and the loss of the whole batch:
    ``out`` holds the loss and its logged parts. ``backward(fn)`` then runs the loss's backward and the
    micro-batches' gradient passes, each through ``fn(loss, last)``; skip it to drop the step (non-finite loss).
    """

    def __init__(self, objective, images: torch.Tensor, tokens: torch.Tensor, micro_batches: int,
                 world: World | None = None, forward: Callable[..., Any] | None = None):
        self.forward = forward or objective
        self.world = world or World.current()
        self.device = images.device
        self.slices = micro_slices(tokens.shape[0], micro_batches)
        # Random choices over the whole batch, once (as one pass over it would draw them)
        self.images, self.draws, batch_out = objective.model.draw(images, tokens)
        self.tokens = tokens
        self.states, parts = [], []
        with torch.no_grad():
            for sl in self.slices:
                self.states.append(rng_state(self.device))
                parts.append(self.forward(self.images[sl], tokens[sl], stage="features",
                                          draws=slice_rows(self.draws, sl)))
        self.after = rng_state(self.device)
        joined, self.spans = join_features(parts, [sl.stop - sl.start for sl in self.slices])
        self.leaves = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in joined.items()}
        self.out = self.forward({**self.leaves, **batch_out}, self.world, stage="loss")

    def backward(self, backward: Callable[[torch.Tensor, bool], Any] | None = None) -> None:
        backward = backward or (lambda loss, last: loss.backward())
        backward(self.out["loss"], False)  # the loss's own parameters, and every cached feature's gradient
        grads = {k: v.grad for k, v in self.leaves.items() if v.grad is not None}
        if not grads:
            raise ValueError("the loss gave no cached feature a gradient")
        for i, sl in enumerate(self.slices):
            set_rng_state(self.states[i], self.device)  # the cached pass's dropout / random choices again
            part_grads = {k: g[self.spans[i][k]] for k, g in grads.items()}
            loss = self.forward(self.images[sl], self.tokens[sl], stage="surrogate",
                                draws=slice_rows(self.draws, sl), grads=part_grads)
            backward(loss, i == len(self.slices) - 1)
        set_rng_state(self.after, self.device)
        self.leaves = None  # the cache is spent
