"""PCME++'s GPO weights from one GRU pass per tower (block-diagonal recurrent weights, off the CPU) and from the
step-by-step recurrence (under torch.compile) equal each GPO's own nn.GRU pass, values and gradients."""
from __future__ import annotations

from unittest import mock

import torch

from models.heads import GPO, gpo_tables


def tables_and_grads(gpos, specs, compiling: bool = False, alone: bool = False):
    for g in gpos:
        g.zero_grad()
    weights = torch.Generator().manual_seed(1)
    with mock.patch("torch.compiler.is_compiling", return_value=compiling):
        joint = [g.table(m, every) for g, m, every in specs] if alone else gpo_tables(specs)
    probes = [torch.randn(t.shape, generator=weights, dtype=t.dtype) for t in joint]
    sum((t * p).sum() for t, p in zip(joint, probes)).backward()
    return joint, [p.grad.clone() for g in gpos for p in g.parameters()]


def test_joint_and_stepwise_gpo_tables_equal_each_gpos_own_pass():
    torch.manual_seed(0)
    gpos = [GPO().double() for _ in range(4)]
    specs = [(gpos[0], 17, False), (gpos[1], 17, False), (gpos[2], 9, True), (gpos[3], 9, True)]
    alone, alone_grads = tables_and_grads(gpos, specs, alone=True)  # each GPO's own pass
    joint, joint_grads = tables_and_grads(gpos, specs)
    stepwise, step_grads = tables_and_grads(gpos, specs, compiling=True)
    for a, b, c in zip(alone, joint, stepwise):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(c, a, rtol=1e-12, atol=1e-14)
    for a, b, c in zip(alone_grads, joint_grads, step_grads):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-13)
    # the tables index by max_len - length, as GPO.weights reads them
    lengths = torch.tensor([9, 3, 1])
    torch.testing.assert_close(gpos[2].weights(lengths, 9), joint[2][9 - lengths], rtol=1e-12, atol=1e-14)
