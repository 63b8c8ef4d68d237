"""The bundled digits as in-process arrays and a config's caption mix: what `pipelines.digits_fit`
trains on (tests and studies that need trained embeddings fast)."""
from __future__ import annotations

import numpy as np
import torch

from models.preprocess import to_model_input
from pipelines.config import DataDocument
from pipelines.data.captions import CaptionSampler
from pipelines.digits.dataset import iter_digits


def digit_arrays(split: str):
    """(images as model input, labels, sample metadata) of one split of the bundled digits at 32 px."""
    samples = [s for s in iter_digits(32) if s.split == split]
    images = torch.from_numpy(to_model_input(np.stack([np.asarray(s.image) for s in samples])))
    return images, torch.tensor([s.label for s in samples]), [s.meta for s in samples]


def config_sampler(cfg: DataDocument) -> CaptionSampler:
    """The caption mix of cfg.data, as a Ray Train fit of cfg draws it."""
    d = cfg.data
    return CaptionSampler(d.mid_caption_prob, d.general_caption_prob, d.instance_caption_prob)
