"""train.grad_checkpointing and train.compile: the same loss and gradients as without, and the config keys reach
the model the trainer builds (pipelines.pretrain.objective.training_objective, which pipelines.pretrain.worker calls)."""
from __future__ import annotations

import pytest
import torch

from models.objective import build_objective
from models.registry import METHODS
from models.tokenizer import tokenize
from pipelines.config import ConfigError
from pipelines.pretrain.config import TrainDocument
from pipelines.pretrain.objective import training_objective

CAPTIONS = ["the digit seven", "a handwritten digit four", "an odd digit", "a photo of the number three",
            "two", "a drawing of the digit 9 written by hand"]


def config(name: str, **train) -> TrainDocument:
    return TrainDocument.from_dict({"model": {"name": name}, "train": train})


def inputs(n: int = 6):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64), tokenize(CAPTIONS[:n], 16)


def loss_and_grads(objective, images, tokens):
    torch.manual_seed(7)  # ProLIP's masked copies and PCME++'s MSDA draw the same rows and boxes on both sides
    loss = objective(images, tokens)["loss"]
    params = [p for p in objective.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss, {n: g for (n, _), g in zip(((n, p) for n, p in objective.named_parameters() if p.requires_grad), grads)}


def saved_bytes(objective, images, tokens) -> int:
    """Bytes autograd keeps for the backward outside checkpointed regions (checkpointing keeps block inputs only)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    torch.manual_seed(7)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        objective(images, tokens)["loss"]
    return total


@pytest.mark.parametrize("method", sorted(METHODS))
def test_grad_checkpointing_gives_the_same_loss_and_gradients(method):
    images, tokens = inputs()
    torch.manual_seed(0)
    plain = build_objective(config(f"{method}_tiny")).double().train()
    torch.manual_seed(0)
    ckpt = training_objective(config(f"{method}_tiny", grad_checkpointing=True)).double().train()
    assert ckpt.model.visual.grad_checkpointing and ckpt.model.text.grad_checkpointing
    assert not plain.model.visual.grad_checkpointing
    loss_a, grads_a = loss_and_grads(plain, images, tokens)
    loss_b, grads_b = loss_and_grads(ckpt, images, tokens)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-12, atol=1e-12)
    assert grads_a.keys() == grads_b.keys()
    for name, g in grads_a.items():
        if g is None:
            assert grads_b[name] is None, name
        else:
            torch.testing.assert_close(grads_b[name], g, rtol=1e-9, atol=1e-12, msg=name)
    # the point of it: the towers' block activations are no longer held for the backward
    assert saved_bytes(ckpt, images, tokens) < 0.5 * saved_bytes(plain, images, tokens)


def test_grad_checkpointing_off_in_evaluation_and_without_grad():
    images, tokens = inputs(2)
    objective = training_objective(config("prolip_tiny", grad_checkpointing=True)).double().eval()
    with torch.no_grad():
        out = objective.model(images, tokens)
    torch.manual_seed(0)
    plain = build_objective(config("prolip_tiny")).double().eval()
    plain.load_state_dict(objective.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(plain.model(images, tokens)["image_mu"], out["image_mu"])


def test_train_knobs_reject_wrong_types():
    with pytest.raises((ConfigError, ValueError), match="grad_checkpointing"):
        config("clip_tiny", grad_checkpointing="sometimes")
    with pytest.raises((ConfigError, ValueError), match="compile"):
        config("clip_tiny", compile=[1])


@pytest.mark.slow  # inductor compiles the tiny blocks: ~35 s of CPU time
def test_compile_knob_compiles_every_block_and_keeps_the_outputs():
    torch.manual_seed(0)
    objective = training_objective(config("clip_tiny", compile=True)).eval()
    blocks = [m for m in objective.model.modules() if type(m).__name__ == "Block"]
    assert len(blocks) == 4 and all(b._compiled_call_impl is not None for b in blocks)
    assert set(objective.state_dict()) == set(build_objective(config("clip_tiny")).state_dict())
    plain = build_objective(config("clip_tiny")).eval()
    plain.load_state_dict(objective.state_dict())
    images, tokens = inputs(2)
    with torch.no_grad():
        got, ref = objective.model(images.float(), tokens), plain.model(images.float(), tokens)
    torch.testing.assert_close(got["image_mu"], ref["image_mu"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got["text_mu"], ref["text_mu"], rtol=1e-4, atol=1e-5)
