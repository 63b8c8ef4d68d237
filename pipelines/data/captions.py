"""Which caption a training sample gets: one drawn per sample from the levels in its json.

A sample's json may hold ``{"captions": {"specific": [...], "mid": [...], "general": [...],
"instance": [...]}}`` (the bundled digits do; see `pipelines.digits.dataset` for the levels). The
probabilistic losses need the same image paired with captions of different generality.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CaptionSampler:
    """Probabilities of a mid / general / instance caption; the rest of the mass goes to "specific"."""

    mid: float = 0.0
    general: float = 0.0
    instance: float = 0.0

    def draw(self, meta: dict, fallback: str, rng: np.random.Generator) -> str:
        """A caption of the drawn level (or "specific" when the sample lacks it); `fallback` without captions."""
        caps = meta.get("captions")
        if not caps or not isinstance(caps, dict):  # a user's json may carry anything under "captions"
            return fallback
        u = rng.random()
        level = "specific"
        for name, share in (("general", self.general), ("mid", self.mid), ("instance", self.instance)):
            if u < share:
                level = name
                break
            u -= share
        options = caps.get(level) or caps.get("specific")
        if not isinstance(options, list) or not options:
            return fallback
        return str(options[rng.integers(len(options))])
