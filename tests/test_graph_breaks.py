"""Every method's training forward (model + loss) traces as one graph under torch.compile.

The text trim, PCME++'s CutMix branch and GRU, ProLIP's masked rows and Llip's custom backward each broke the graph;
compiled, the padding is masked instead of cut, the CutMix box is always built, the GRU runs step by step and the
mixer's chunks are checkpointed (the same values; tests/test_models.py and tests/test_fidelity.py check the eager ones).
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.train_step import LABEL
from models.objective import build_objective
from models.tokenizer import tokenize
from pipelines.config import ModelConfig
from pipelines.pretrain.config import TrainDocument


@pytest.mark.parametrize("name", list(LABEL))
def test_training_forward_has_no_graph_break(name):
    torch.manual_seed(0)
    objective = build_objective(TrainDocument(model=ModelConfig(name=name, overrides={}))).train()
    images = torch.randn(8, 3, 32, 32)
    tokens = tokenize([f"a photo of the digit {i}" for i in range(8)], 16)
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(lambda i, t: objective(i, t)["loss"])(images, tokens)
    finally:
        torch._dynamo.reset()
    reasons = [f"{b.reason.splitlines()[0]} at {b.user_stack[-1].filename}:{b.user_stack[-1].lineno}"
               for b in explained.break_reasons if b.user_stack]
    assert explained.graph_break_count == 0, f"{LABEL[name]}: {explained.graph_break_count} graph breaks: {reasons}"
