"""Tokenize each distinct caption once per worker process: templated captions repeat a lot."""
from __future__ import annotations

import numpy as np

from models.tokenizer import tokenize

_MAX_ENTRIES = 200_000  # bounds a worker's memory when captions are mostly unique
_TOKEN_CACHE: dict[tuple[str, int], np.ndarray] = {}


def tokenize_cached(texts: list[str], context_length: int) -> np.ndarray:
    """(len(texts), context_length) int64 tokens."""
    missing = list({t for t in texts if (t, context_length) not in _TOKEN_CACHE})
    if missing:
        if len(_TOKEN_CACHE) > _MAX_ENTRIES:
            _TOKEN_CACHE.clear()
        for text, row in zip(missing, tokenize(missing, context_length).numpy()):
            _TOKEN_CACHE[(text, context_length)] = row
    if not texts:
        return np.zeros((0, context_length), np.int64)
    return np.stack([_TOKEN_CACHE[(t, context_length)] for t in texts])
