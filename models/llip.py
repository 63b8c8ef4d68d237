"""Llip's text-conditioned mixing of visual mixture tokens (Llip, papers/002, Eq. 1-2).

For every (image i, caption j) pair the image is re-expressed as
    z_ij = Concat_h( sum_k softmax_k(q_j^h . k_ik^h / tau) v_ik^h ) W_o,
and the loss needs cos(z_ij, z'_j) for all B_local x N_global pairs. Materialising z for all pairs
is a (B, N, D) tensor (plus (B, N, heads, K) attention weights): 2 GB each at B = N = 1024,
D = 512. ``LlipMixer`` computes the cosine matrix in chunks of image rows; with gradients
enabled each chunk runs under ``torch.utils.checkpoint`` so its intermediates are recomputed in
backward instead of stored. Only (B, N) cosines and the (B, K, D) keys/values stay resident.

``LlipMixer.naive_pair_cos`` is the same computation without chunks (reference for tests and
benchmarks); both paths call the same three formula functions below.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def llip_attention(q: torch.Tensor, k: torch.Tensor, tau: float) -> torch.Tensor:
    """Mixing weights, (H, B, N, K), from queries (H, N, dh) and keys (H, B, K, dh)."""
    # Llip Eq. 1: Phi_ij^m = softmax_k(Q_j^m . K_i^mk / tau)
    return torch.softmax(torch.matmul(q.unsqueeze(1), k.transpose(-1, -2)) / tau, dim=-1)


def llip_mix(weights: torch.Tensor, v: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """Contextualised visual features z_ij, (B, N, D), from weights (H, B, N, K), values (H, B, K, dh)."""
    # Llip Eq. 2: z_ij = Concat_m(sum_k Phi_ij^mk V_i^mk) W_O
    heads, b, n, _ = weights.shape
    mixed = torch.matmul(weights, v)  # (H, B, N, dh)
    concat = mixed.permute(1, 2, 0, 3).reshape(b, n, heads * v.shape[-1])
    return F.linear(concat, w_o)


def llip_cosine(z: torch.Tensor, text_hat: torch.Tensor) -> torch.Tensor:
    """cos(z_ij, z'_j) = z_ij . z'_j / max(||z_ij||, 1e-12) for unit text rows, (B, N)."""
    # Llip Sec. 3 (before Eq. 3): z_hat_ij = z_ij / ||z_ij||, similarity z_hat_ij . z_hat'_j
    return (z * text_hat.unsqueeze(0)).sum(-1) / torch.linalg.vector_norm(z, dim=-1).clamp_min(1e-12)


class LlipMixer(nn.Module):
    """Multi-head cross-attention from captions (queries) to an image's K mixture tokens.

    Args:
        dim: embedding width D (queries, mixture tokens and output share it).
        heads: number of attention heads M (Llip uses 8); ``dim`` must be divisible by it.
        tau: softmax temperature of Llip Eq. 1 (logits are divided by tau; Llip's default 5).
        chunk_size: image rows per chunk; 0 picks it from ``chunk_mib``.
        chunk_mib: target size in MiB of one (rows, N, max(D, heads*K)) intermediate per chunk.
        query_proj: apply a learned query projection W_Q to ``text_query_all`` (Llip's Q = g W_Q);
            set False if the caller already projected the queries.
    """

    def __init__(
        self,
        dim: int,
        heads: int = 8,
        tau: float = 5.0,
        chunk_size: int = 0,
        chunk_mib: float = 32.0,
        query_proj: bool = True,
    ):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        if tau <= 0:
            raise ValueError(f"tau must be > 0, got {tau}")
        self.dim, self.heads, self.tau = dim, heads, float(tau)
        self.chunk_size, self.chunk_mib = int(chunk_size), float(chunk_mib)
        self.q_proj = nn.Linear(dim, dim, bias=False) if query_proj else nn.Identity()
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        # W_O is a direct parameter (not a child nn.Linear): it is used inside checkpointed chunks,
        # and DeepSpeed ZeRO-3 gathers a module's own parameters around its forward and backward.
        self.out_weight = nn.Parameter(torch.empty(dim, dim))
        nn.init.kaiming_uniform_(self.out_weight, a=5**0.5)  # nn.Linear's default initialisation

    # -- shared preparation -------------------------------------------------------------------
    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (H, ..., dh)."""
        x = x.reshape(*x.shape[:-1], self.heads, self.dim // self.heads)
        return x.movedim(-2, 0)

    def _prepare(self, image_mix_tokens, text_query_all, text_emb_all):
        if image_mix_tokens.dim() != 3 or image_mix_tokens.shape[-1] != self.dim:
            raise ValueError(f"image_mix_tokens must be (B, K, {self.dim}), got {tuple(image_mix_tokens.shape)}")
        if text_query_all.shape != text_emb_all.shape or text_query_all.shape[-1] != self.dim:
            raise ValueError("text_query_all and text_emb_all must both be (N, D)")
        q = self._split(self.q_proj(text_query_all))  # (H, N, dh)
        k = self._split(self.k_proj(image_mix_tokens))  # (H, B, K, dh)
        v = self._split(self.v_proj(image_mix_tokens))  # (H, B, K, dh)
        return q, k, v, F.normalize(text_emb_all, dim=-1)

    def _block(self, q, k, v, text_hat, w_o):
        return llip_cosine(llip_mix(llip_attention(q, k, self.tau), v, w_o), text_hat)

    def rows_per_chunk(self, n_text: int, n_tokens: int, itemsize: int = 4) -> int:
        if self.chunk_size > 0:
            return self.chunk_size
        per_row = n_text * max(self.dim, self.heads * n_tokens) * itemsize
        return max(1, int(self.chunk_mib * 2**20 // per_row))

    # -- public paths ---------------------------------------------------------------------------
    def forward(
        self, image_mix_tokens: torch.Tensor, text_query_all: torch.Tensor, text_emb_all: torch.Tensor
    ) -> torch.Tensor:
        """(B_local, N) cosine matrix between contextualised images and captions, chunked.

        image_mix_tokens: (B, K, D) this worker's mixture tokens; text_query_all / text_emb_all:
        (N, D) caption features of all workers (gathered with gradient by the caller).
        """
        q, k, v, text_hat = self._prepare(image_mix_tokens, text_query_all, text_emb_all)
        rows = self.rows_per_chunk(text_hat.shape[0], k.shape[2], text_hat.element_size())
        w_o = self.out_weight
        need_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (q, k, v, text_hat, w_o)
        )
        parts = []
        for start in range(0, k.shape[1], rows):
            kc, vc = k[:, start : start + rows], v[:, start : start + rows]
            if need_grad:
                parts.append(checkpoint(self._block, q, kc, vc, text_hat, w_o, use_reentrant=False))
            else:
                parts.append(self._block(q, kc, vc, text_hat, w_o))
        return torch.cat(parts, dim=0)

    def naive_pair_cos(
        self, image_mix_tokens: torch.Tensor, text_query_all: torch.Tensor, text_emb_all: torch.Tensor
    ) -> torch.Tensor:
        """Reference: the same cosine matrix with the full (B, N, D) tensor materialised."""
        q, k, v, text_hat = self._prepare(image_mix_tokens, text_query_all, text_emb_all)
        return self._block(q, k, v, text_hat, self.out_weight)

    def contextualise(self, image_mix_tokens: torch.Tensor, text_query: torch.Tensor) -> torch.Tensor:
        """Normalised z_hat_ij, (B, N, D), for small B x N (analysis / zero-shot on few classes)."""
        q, k, v, _ = self._prepare(image_mix_tokens, text_query, text_query)
        return F.normalize(llip_mix(llip_attention(q, k, self.tau), v, self.out_weight), dim=-1)


__all__ = ["LlipMixer", "llip_attention", "llip_cosine", "llip_mix"]
