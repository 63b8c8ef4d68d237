"""Heads shared by the probabilistic models: ProLIP's [UNC] projection, PCME++'s GPO pooling.

Both compute in float32 whatever the input dtype and the autocast state: under bf16 training
(towers under bf16 autocast) a log sigma^2 near -10 held in bf16 moves in steps of 0.0625, i.e.
sigma^2 in 6.4% steps, and a bf16 pooling weight errs by ~0.4% of log sigma^2.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from models.towers import sinusoid


def float32_region(device: torch.device):
    """Autocast off on `device` (inputs still need an explicit ``.float()``)."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


class Float32Linear(nn.Linear):
    """nn.Linear computed in float32 (weights, inputs and output) under any autocast or input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with float32_region(x.device):
            dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
            return F.linear(x.to(dtype), self.weight.to(dtype), None if self.bias is None else self.bias.to(dtype))


def unc_projection(width: int, embed_dim: int, bias_init: float = -10.0) -> nn.Linear:
    """Float32 linear map of the [UNC] output to log sigma^2; bias starts at `bias_init` (sigma^2 ~ e^-10 ~ 5e-5)."""
    # ProLIP Sec. 3.1 / 4.1: the [UNC] projection's bias is initialised to -10 for stable training
    proj = Float32Linear(width, embed_dim, bias=True)
    nn.init.constant_(proj.bias, bias_init)
    return proj


class GPO(nn.Module):
    """Generalized Pooling Operator (Chen et al. 2021, "VSE-infinity"), PCME++ Sec. 2.5.

    Each feature dimension is sorted over the (valid) tokens in descending order and pooled with
    weights that depend only on the number of tokens: a bidirectional GRU reads sine/cosine
    encodings of the positions 1..n, a linear layer scores each position, and a softmax (temperature
    0.1) over the n positions gives the weights. Padding (positions >= length) gets weight 0.
    """

    def __init__(self, d_pe: int = 32, d_hidden: int = 32, temperature: float = 0.1):
        super().__init__()
        self.d_pe, self.d_hidden, self.temperature = d_pe, d_hidden, temperature
        self.gru = nn.GRU(d_pe, d_hidden, batch_first=True, bidirectional=True)
        self.score = nn.Linear(d_hidden, 1, bias=False)
        # the GRU's parameters (the same objects) for compiled code: dynamo refuses to touch an nn.GRU at all
        self.gru_weights = list(self.gru._flat_weights)

    def gru_parameter(self, name: str) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.gru_weights[self.gru_weight_names.index(name)]
        return getattr(self.gru, name)

    gru_weight_names = ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0", "weight_ih_l0_reverse",
                        "weight_hh_l0_reverse", "bias_ih_l0_reverse", "bias_hh_l0_reverse")

    def position_weights(self, max_len: int, device=None) -> torch.Tensor:
        """(max_len, max_len): row n - 1 holds the pooling weights of a sequence of n tokens (zero past n)."""
        return self.table(max_len, True, device).flip(0)

    def table(self, max_len: int, every_length: bool, device=None) -> torch.Tensor:
        """Pooling weights by length, longest first: (max_len, max_len) with row i for a sequence of max_len - i
        tokens (``every_length``), or (1, max_len) for max_len tokens alone. Index it by ``max_len - lengths``."""
        return gpo_tables([(self, max_len, every_length)], device)[0]

    def weights_from(self, forward: torch.Tensor, backward: torch.Tensor, max_len: int) -> torch.Tensor:
        """The weights of rows of lengths max_len, max_len - 1, ... from their GRU outputs in each direction
        (rows, max_len, d_hidden)."""
        out = (forward + backward) / 2  # average of both directions
        scores = self.score(out).squeeze(-1)  # (rows, max_len)
        pos = torch.arange(max_len, device=scores.device)
        valid = pos[None, :] + torch.arange(scores.shape[0], device=scores.device)[:, None] < max_len  # t < length
        # at least float32 (float64 stays: a float32 round trip would put float64 runs ~1e-7 off)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        scores = scores.masked_fill(~valid, float("-inf"))
        return torch.softmax(scores / self.temperature, dim=1)

    def weights(self, lengths: torch.Tensor | None, max_len: int, device=None) -> torch.Tensor:
        """Pooling weights for sequences of the given lengths, (B, max_len); ``lengths`` None: every sequence has
        max_len tokens, and the result is one (1, max_len) row for all."""
        if lengths is None:
            return self.table(max_len, False, device)
        return self.table(max_len, True, lengths.device)[max_len - lengths]

    def forward(self, features: torch.Tensor, lengths: torch.Tensor | None = None,
                table: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L, D) token features, `lengths` (B,) valid tokens per row (None: all L) -> (B, D) in float32.
        ``table``: ``self.table(L, lengths is not None)`` where the caller has it (``gpo_tables``)."""
        with float32_region(features.device):
            return self._pool(features, lengths, table)

    def _pool(self, features: torch.Tensor, lengths: torch.Tensor | None, table: torch.Tensor | None) -> torch.Tensor:
        b, length, _ = features.shape
        # Sorted in the input's own precision, then upcast: a bf16 value converts to float32 exactly and in the
        # same order, so this equals sorting the float32 copy, with half the sort's memory traffic.
        out_dtype = torch.float64 if features.dtype == torch.float64 else torch.float32
        if lengths is None:
            ordered = features.sort(dim=1, descending=True).values.to(out_dtype)
        else:
            valid = (torch.arange(length, device=features.device)[None, :] < lengths[:, None])[..., None]
            low = torch.finfo(features.dtype).min
            ordered = features.masked_fill(~valid, low).sort(dim=1, descending=True).values.to(out_dtype)
            ordered = ordered.masked_fill(~valid, 0.0)  # padding sorts to the end
        if table is None:
            table = self.table(length, lengths is not None, features.device)
        w = (table if lengths is None else table[length - lengths]).to(out_dtype)
        # VSE-infinity Eq. 2: f = sum_k theta_k * max_k(features), theta from the GRU position model
        return (ordered * w.unsqueeze(-1)).sum(dim=1)


def gpo_tables(specs: list[tuple[GPO, int, bool]], device=None) -> list[torch.Tensor]:
    """``gpo.table(max_len, every_length)`` for each (gpo, max_len, every_length), from ONE bidirectional GRU pass.

    The GRU is sequential over time steps (a GPU launches kernels per step), so several GPOs (PCME++'s four) share
    one pass: their GRUs side by side as one GRU with block-diagonal
    recurrent weights (each unit's gates read its own GPO's hidden state only, so every block evolves exactly as its
    own GRU would), over the union of the sequence lengths they need, packed longest first (lengths known on the
    host: no sort, no copy between host and device)."""
    gpos = [g for g, _, _ in specs]
    first = gpos[0]
    if any((g.d_pe, g.d_hidden) != (first.d_pe, first.d_hidden) for g in gpos):
        raise ValueError("gpo_tables: the GPOs must share d_pe and d_hidden")
    h, k = first.d_hidden, len(gpos)
    lengths = sorted({n for _, m, every in specs for n in (range(1, m + 1) if every else (m,))}, reverse=True)
    slot = {n: i for i, n in enumerate(lengths)}
    pe = sinusoid(lengths[0], first.d_pe, device).to(first.score.weight.dtype).unsqueeze(0).expand(len(lengths), -1, -1)
    if k == 1:
        weights = [first.gru_parameter(n) for n in GPO.gru_weight_names]
    else:
        # Each joint weight from one stack of the GPOs' own, not from per-gate slices: a slice's backward is a zeroed
        # copy of the whole weight, ~190 small kernels at the end of a GPU step for the four GPOs' 96 slices.
        weights = []
        eye = torch.eye(k, dtype=first.score.weight.dtype, device=first.score.weight.device)
        for sfx in ("", "_reverse"):
            w_ih, w_hh, b_ih, b_hh = (torch.stack([g.gru_parameter(f"{p}_l0{sfx}") for g in gpos])
                                      for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))

            def gates(w: torch.Tensor) -> torch.Tensor:  # (k, 3h, ...) -> (3kh, ...): gate-major (r, z, n), GPO-minor
                return w.unflatten(1, (3, h)).transpose(0, 1).flatten(0, 2)

            # per gate the block-diagonal (kh, kh) of the GPOs' (h, h) recurrent weights
            w_hh = torch.einsum("ij,igab->giajb", eye, w_hh.unflatten(1, (3, h))).reshape(3 * k * h, k * h)
            weights += [gates(w_ih), w_hh, gates(b_ih), gates(b_hh)]
    if torch.compiler.is_compiling():  # dynamo traces no RNN module or op: the same recurrence step by step
        out = _gru_steps(pe[0], lengths, weights)
    else:
        packed = pack_padded_sequence(pe, torch.tensor(lengths), batch_first=True, enforce_sorted=True)
        hx = pe.new_zeros(2, len(lengths), k * h)
        with warnings.catch_warnings():  # cuDNN packs the joint weights into its buffer per call, as it must
            warnings.filterwarnings("ignore", message="RNN module weights are not part of single contiguous chunk")
            data, _ = torch._VF.gru(packed.data, packed.batch_sizes, hx, weights, True, 1, 0.0, first.training, True)
        out, _ = pad_packed_sequence(PackedSequence(data, packed.batch_sizes), batch_first=True, total_length=lengths[0])
    tables = []
    for i, (gpo, m, every) in enumerate(specs):
        rows = out[slot[m] : slot[m] + (m if every else 1), :m]
        tables.append(gpo.weights_from(rows[..., i * h : (i + 1) * h], rows[..., (k + i) * h : (k + i + 1) * h], m))
    return tables


def _gru_steps(x: torch.Tensor, lengths: list[int], weights: list[torch.Tensor]) -> torch.Tensor:
    """A one-layer bidirectional GRU (torch's gate equations) over sequences that all read x (T, d) from the
    start, of the given non-increasing lengths: (len(lengths), T, 2 H), positions past a length unspecified."""
    def run(w_ih, w_hh, b_ih, b_hh, steps, h, active=None):
        gi = torch.addmm(b_ih, x, w_ih.T)  # every step's input part at once
        outs = [None] * x.shape[0]
        for t in steps:
            gh = torch.addmm(b_hh, h, w_hh.T)
            i_r, i_z, i_n = gi[t].chunk(3)
            h_r, h_z, h_n = gh.chunk(3, dim=-1)
            r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
            # torch.nn.GRU: n = tanh(W_in x + b_in + r (W_hn h + b_hn)), h' = (1 - z) n + z h
            new = (1 - z) * torch.tanh(i_n + r * h_n) + z * h
            h = new if active is None else torch.where(active[:, t, None], new, h)  # a sequence starts at its end
            outs[t] = h
        return torch.stack(outs, dim=1)

    steps, hidden = x.shape[0], weights[1].shape[1]
    # forward: every sequence reads the same inputs from the same zero state, so one row serves them all
    fwd = run(*weights[:4], range(steps), x.new_zeros(1, hidden)).expand(len(lengths), -1, -1)
    active = torch.arange(steps, device=x.device)[None, :] < torch.tensor(lengths, device=x.device)[:, None]
    bwd = run(*weights[4:], range(steps - 1, -1, -1), x.new_zeros(len(lengths), hidden), active)
    return torch.cat([fwd, bwd], dim=-1)
