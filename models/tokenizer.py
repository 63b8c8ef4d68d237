"""CLIP BPE tokenizer (open_clip's, which ships its vocabulary)."""
from __future__ import annotations

from functools import lru_cache

import torch
from open_clip.tokenizer import SimpleTokenizer

VOCAB_SIZE = 49408
EOT_TOKEN = 49407


@lru_cache(maxsize=4)
def _tokenizer(context_length: int) -> SimpleTokenizer:
    return SimpleTokenizer(context_length=context_length)


def tokenize(texts: list[str], context_length: int) -> torch.Tensor:
    """(N, context_length) int64 token ids: [SOT] ... [EOT] 0-padded, truncated to fit (EOT kept)."""
    return _tokenizer(context_length)([str(t) for t in texts], context_length=context_length)
