"""Embedding a task's data in process, on the model's device: the training run's evaluation, the run summary,
the uncertainty analyses' extra captions, and the single-process reference for Ray Data batch inference."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from models.preprocess import to_device
from models.tokenizer import tokenize
from pipelines.config import EvalTask
from pipelines.data.eval_reader import parse_levels
from pipelines.data.eval_tasks import zeroshot_prompts


@dataclass
class TaskEmbeddings:
    """One task's embeddings: images with their captions / class, and the texts scored against them
    (retrieval: the distinct captions; zeroshot: every class's prompts, flat, `prompt_counts` per class)."""

    keys: list[str]
    image: dict[str, torch.Tensor]
    captions: list[list[str]]
    cls: torch.Tensor
    texts: list[str]
    text: dict[str, torch.Tensor]
    prompt_counts: list[int] | None = None
    classnames: list[str] | None = None
    # per image, its captions by generality level (json "captions": level -> captions); None: the data has none
    levels: list[dict[str, list[str]]] | None = None


def distinct_captions(captions: list[list[str]]) -> list[str]:
    """Every caption string once, in order of first appearance."""
    return list(dict.fromkeys(c for caps in captions for c in caps))


def split_captions(column: Iterable[str]) -> list[list[str]]:
    return [[c for c in str(s).split("\n") if c] for s in column]


def embed_images(model: torch.nn.Module, batches: Iterable[dict]) -> tuple[list[str], dict[str, torch.Tensor],
                                                                           list[list[str]], torch.Tensor]:
    """Decoded eval batches (pipelines.data.eval_reader) -> keys, stacked image outputs, captions, classes (sorted by key)."""
    return _embed_images(model, batches)[:4]


def model_device(model: torch.nn.Module) -> torch.device:
    return next(iter(model.parameters()), torch.empty(0)).device


def on_device(out: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in out.items()}


def autocast(device: torch.device, bf16: bool):
    """The training run's autocast (bf16 matmuls in the towers), or none."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16)


@torch.no_grad()
def _embed_images(model: torch.nn.Module, batches: Iterable[dict], bf16: bool = False):
    """embed_images, plus each image's caption levels (None when no sample has any). The model runs on its own
    device (under bf16 autocast if asked); the outputs come back to the CPU as float32."""
    device = model_device(model)
    keys, outs, captions, classes, levels = [], [], [], [], []
    for batch in batches:
        if len(batch["key"]) == 0:
            continue
        with autocast(device, bf16):
            out = model.encode_image(to_device(torch.as_tensor(batch["image"]), device))
        outs.append({k: v.float().cpu() for k, v in out.items()})
        keys += [str(k) for k in batch["key"]]
        captions += split_captions(batch["captions"])
        classes.append(torch.as_tensor(np.asarray(batch["cls"], dtype=np.int64)))
        levels += [parse_levels(v) for v in batch.get("levels", [""] * len(batch["key"]))]
    if not keys:
        raise ValueError("no decodable images")
    # canonical order (by key), whatever order the batches came in: Ray Data batch inference gives the same
    order = sorted(range(len(keys)), key=keys.__getitem__)
    idx = torch.tensor(order, dtype=torch.long)
    image = {k: torch.cat([o[k] for o in outs])[idx] for k in outs[0]}
    ordered_levels = [levels[i] for i in order] if any(levels) else None
    return [keys[i] for i in order], image, [captions[i] for i in order], torch.cat(classes)[idx], ordered_levels


@torch.no_grad()
def embed_texts(model: torch.nn.Module, texts: list[str], batch_size: int = 256, bf16: bool = False) -> dict[str, torch.Tensor]:
    device = model_device(model)
    outs = []
    for i in range(0, len(texts), batch_size):
        with autocast(device, bf16):
            out = model.encode_text(to_device(tokenize(texts[i : i + batch_size], model.context_length), device))
        outs.append({k: v.float().cpu() for k, v in out.items()})
    return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}


def task_texts(task: EvalTask, captions: list[list[str]]) -> tuple[list[str], list[int] | None, list[str] | None]:
    """The texts a task scores: distinct captions (retrieval) or the flat prompts (zeroshot)."""
    if task.kind == "zeroshot":
        classnames, prompts = zeroshot_prompts(task)
        return [p for per_class in prompts for p in per_class], [len(p) for p in prompts], classnames
    texts = distinct_captions(captions)
    if not texts:
        raise ValueError(f"eval task {task.name!r} (retrieval): no image has a caption")
    return texts, None, None


def embed_task_locally(model: torch.nn.Module, task: EvalTask, batches: Iterable[dict],
                       batch_size: int = 256, bf16: bool = False) -> TaskEmbeddings:
    """In-process embeddings of a task's decoded batches (the training run's evaluation, and the
    single-process reference for Ray Data batch inference), on the model's device; the embeddings on the CPU."""
    keys, image, captions, cls, levels = _embed_images(model, batches, bf16)
    texts, counts, classnames = task_texts(task, captions)
    return TaskEmbeddings(keys, image, captions, cls, texts, embed_texts(model, texts, batch_size, bf16), counts,
                          classnames, levels)
