"""Every method's training step takes no host sync beyond the one its baseline takes.

A host sync (``.item()``, ``nonzero``, a boolean mask, a blocking copy between host and device, a Python branch on
a tensor) stops the host until the GPU has drained its queue; it can be counted on the CPU. ``benchmarks.step_counts``
runs one full step (forward with the method's masked copies or MSDA, backward, AdamW) on the meta device, where every
model tensor stands for a GPU tensor, with the data-dependent values replayed from a real CPU step, and names the
project file of each sync. The one sync every method takes is the text tower's padding trim (the batch's longest
caption, read on the host before any tower's work is queued).
"""
from __future__ import annotations

import collections

import pytest

from benchmarks.step_counts import count_step
from benchmarks.train_step import LABEL
from models.registry import TINY

TRIM = ("_local_scalar_dense", "models/towers.py")
# (op, file) -> count per method's step: the trim only
EXPECTED = {name: {TRIM: 1} for name in LABEL}


@pytest.mark.parametrize("name", list(LABEL))
def test_training_step_takes_no_extra_host_sync(name):
    counter = count_step(name, TINY, batch=8)
    found = collections.Counter()
    for (op, where), k in counter.syncs.items():
        found[op, where.rsplit(":", 1)[0]] += k
    assert dict(found) == EXPECTED[name], f"{LABEL[name]}: host syncs {dict(counter.syncs)} (op, file:line)"
