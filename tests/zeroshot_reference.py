"""A plain zero-shot loop (no Ray, no evaluation pipeline): the reference the evaluation's zeroshot task is
checked against in tests/test_evaluation.py."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from models.tokenizer import tokenize


@torch.no_grad()
def prompt_class_embeddings(model: nn.Module, prompts: list[list[str]], context_length: int) -> dict[str, torch.Tensor]:
    """prompts[c] are class c's templated captions (same count per class) -> the model's class embeddings."""
    n_cls, n_tpl = len(prompts), len(prompts[0])
    if any(len(p) != n_tpl for p in prompts):
        raise ValueError("every class needs the same number of prompts")
    out = model.encode_text(tokenize([p for per_class in prompts for p in per_class], context_length))
    return model.class_embeddings({k: v.reshape(n_cls, n_tpl, *v.shape[1:]) for k, v in out.items()})


@torch.no_grad()
def zero_shot_accuracy(model: nn.Module, classes: dict[str, torch.Tensor],
                       batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    correct = total = 0
    for images, labels in batches:
        scores = model.class_scores(model.encode_image(images), classes)
        correct += (scores.argmax(dim=-1) == labels).sum().item()
        total += labels.numel()
    if total == 0:
        raise ValueError("zero-shot evaluation got no images")
    return correct / total
