"""Heads shared by the probabilistic models: ProLIP's [UNC] projection, PCME++'s GPO pooling.

Both compute in float32 whatever the input dtype and the autocast state: under bf16 training
(towers under bf16 autocast) a log sigma^2 near -10 held in bf16 moves in steps of 0.0625, i.e.
sigma^2 in 6.4% steps, and a bf16 pooling weight errs by ~0.4% of log sigma^2.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

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

    def position_weights(self, max_len: int, device=None) -> torch.Tensor:
        """(max_len, max_len): row n - 1 holds the pooling weights of a sequence of n tokens (zero past n).

        One packed GRU pass over the sequences of every length 1 .. max_len: their lengths are known on the
        host, so nothing waits for the device (``torch.unique`` of the batch's lengths and the packing's
        ``lengths.cpu()`` would each stop the host until the GPU has caught up). They are packed longest first
        and already sorted (no sorting permutation: ``pad_packed_sequence`` would copy its inverse to the host)."""
        return self._weights_of(torch.arange(max_len, 0, -1), max_len, device).flip(0)

    def _weights_of(self, lengths_cpu: torch.Tensor, max_len: int, device) -> torch.Tensor:
        """(len(lengths_cpu), max_len) weights for the given distinct lengths (a CPU tensor, non-increasing)."""
        n = len(lengths_cpu)
        dtype = self.score.weight.dtype
        pe = sinusoid(max_len, self.d_pe, device).to(dtype).unsqueeze(0).expand(n, -1, -1)
        if n == 1 and int(lengths_cpu[0]) == max_len:  # one full-length sequence (an image's tokens): no packing
            out, _ = self.gru(pe)
        else:
            packed = pack_padded_sequence(pe, lengths_cpu, batch_first=True, enforce_sorted=True)
            out, _ = self.gru(packed)
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=max_len)
        out = (out[..., : self.d_hidden] + out[..., self.d_hidden :]) / 2  # average of both directions
        scores = self.score(out).squeeze(-1)  # (n, max_len)
        valid = torch.arange(max_len, device=scores.device)[None, :] < lengths_cpu.to(scores.device, non_blocking=True)[:, None]
        # at least float32 (float64 stays: a float32 round trip would put float64 runs ~1e-7 off)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        scores = scores.masked_fill(~valid, float("-inf"))
        return torch.softmax(scores / self.temperature, dim=1)

    def weights(self, lengths: torch.Tensor | None, max_len: int, device=None) -> torch.Tensor:
        """Pooling weights for sequences of the given lengths, (B, max_len); ``lengths`` None: every sequence has
        max_len tokens, and the result is one (1, max_len) row for all."""
        if lengths is None:
            return self._weights_of(torch.tensor([max_len]), max_len, device)
        return self._weights_of(torch.arange(max_len, 0, -1), max_len, lengths.device)[max_len - lengths]

    def forward(self, features: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L, D) token features, `lengths` (B,) valid tokens per row (None: all L) -> (B, D) in float32."""
        with float32_region(features.device):
            return self._pool(features, lengths)

    def _pool(self, features: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
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
        w = self.weights(lengths, length, features.device).to(out_dtype)
        # VSE-infinity Eq. 2: f = sum_k theta_k * max_k(features), theta from the GRU position model
        return (ordered * w.unsqueeze(-1)).sum(dim=1)
