"""Llip's text-conditioned mixing of visual mixture tokens (Llip, arXiv:2405.00740, Eq. 1-2).

For every (image i, caption j) pair the image is re-expressed as
    z_ij = Concat_h( sum_k softmax_k(q_j^h . k_ik^h / tau) v_ik^h ) W_o =: c_ij W_o^T,
and the loss needs cos(z_ij, z'_j) for all B_local x N_global pairs. Materialising z for all pairs
is a (B, N, D) tensor (plus (heads, B, N, K) attention weights): 2 GB each at B = N = 1024,
D = 512. ``LlipMixer`` never holds more than one chunk of image rows of these:

- forward: z and the cosines are computed one chunk of image rows at a time (the naive formulas);
  only the (B, N) cosines and norms are kept;
- backward (custom autograd function): recomputes each chunk's c (the cheap attention part) and
  uses z . t_j = c . r_j with r = T W_o and ||z||^2 = c G c^T with G = W_o^T W_o, so it needs two
  (rows N, D) x (D, D) products per chunk and never z: forward + backward cost the same three such
  products as the naive form (plain checkpointing would cost four: it repeats the whole forward).

That "direct" form costs ~3 D^2 multiply-adds per pair. Where the mixer's H K (heads x mixture tokens) is
well below D, the "factored" form needs none: z_ij = sum_hk w_ij^hk u_ik^h with u_ik^h = W_o[:, h] v_ik^h, so
z . t_j = sum_hk w^hk (v_ik^h . r_j^h) and ||z_ij||^2 = w_ij M_i w_ij^T with M_i the (H K)^2 Gram matrix of
image i's u (built once per image); per pair K D + (H K)^2, each chunk checkpointed. At ViT-B/16 sizes
(D = 768, K = 16, 8 heads, N = 256) that is ~6x fewer multiply-adds; ``cheaper_pair_form`` picks per call.

``LlipMixer.naive_pair_cos`` materialises z (reference for tests and benchmarks).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models.heads import float32_region


def llip_attention(q: torch.Tensor, k: torch.Tensor, tau: float) -> torch.Tensor:
    """Mixing weights, (H, B, N, K), from queries (H, N, dh) and keys (H, B, K, dh).

    Computed as one (B K, dh) x (dh, N) product per head (no per-image copy of the queries),
    normalised over K; the result is a transposed view of a (H, B, K, N) tensor.
    """
    heads, b, kk, dh = k.shape
    logits = torch.matmul(k.reshape(heads, b * kk, dh), (q / tau).transpose(-1, -2))  # (H, B K, N)
    # Llip Eq. 1: Phi_ij^m = softmax_k(Q_j^m . K_i^mk / tau)
    return torch.softmax(logits.view(heads, b, kk, -1), dim=2).transpose(-1, -2)


def llip_heads(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Concatenated per-head mixtures c_ij, (B, N, heads * dh), from weights (H, B, N, K), values (H, B, K, dh)."""
    # Llip Eq. 2 (inner part): Concat_m(sum_k Phi_ij^mk V_i^mk)
    heads, b, n, _ = weights.shape
    return torch.matmul(weights, v).permute(1, 2, 0, 3).reshape(b, n, heads * v.shape[-1])


def llip_mix(weights: torch.Tensor, v: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """Contextualised visual features z_ij = c_ij W_o^T, (B, N, D)."""
    # Llip Eq. 2: z_ij = Concat_m(sum_k Phi_ij^mk V_i^mk) W_O
    return F.linear(llip_heads(weights, v), w_o)


def llip_cosine(z: torch.Tensor, text_hat: torch.Tensor) -> torch.Tensor:
    """cos(z_ij, z'_j) = z_ij . z'_j / max(||z_ij||, 1e-12) for unit text rows, (B, N)."""
    # Llip Sec. 3 (before Eq. 3): z_hat_ij = z_ij / ||z_ij||, similarity z_hat_ij . z_hat'_j
    return (z * text_hat.unsqueeze(0)).sum(-1) / torch.linalg.vector_norm(z, dim=-1).clamp_min(1e-12)


_NORM_EPS = 1e-12


class _ChunkedCosine(torch.autograd.Function):
    """cos(c_ij W_o^T, t_j) for all pairs, in chunks of image rows, without storing (B, N, D) tensors.

    forward: per chunk, z = c W_o^T and cos = z . t / ||z|| (exactly the naive formulas, one chunk
    at a time); the (B, N) cosines and norms are kept.
    backward, per chunk (c recomputed with autograd for the attention part), with G = W_o^T W_o,
    r = T W_o, y = c G (so that ||z||^2 = c . y and z . t = c . r):
        dcos/dc_ij = r_j / n_ij - cos_ij / n_ij^2 * y_ij
        dL/dr_j    = sum_i g_ij c_ij / n_ij
        dL/dG      = -1/2 sum_ij (g_ij cos_ij / n_ij^2) c_ij^T c_ij
    and finally G = W^T W, r = T W give dW = W (dG + dG^T) + T^T dr, dT = dr W^T.
    The norm is clamped at 1e-12 like F.normalize; the backward formula assumes it is not hit.
    """

    @staticmethod
    def forward(ctx, q, k, v, text_hat, w_o, tau: float, rows: int):
        b, n = k.shape[1], text_hat.shape[0]
        cos, norm = text_hat.new_empty(b, n), text_hat.new_empty(b, n)
        for start in range(0, b, rows):
            sl = slice(start, start + rows)
            z = llip_mix(llip_attention(q, k[:, sl], tau), v[:, sl], w_o)  # one chunk of z only
            cos[sl] = llip_cosine(z, text_hat)
            norm[sl] = torch.linalg.vector_norm(z, dim=-1).clamp_min(_NORM_EPS)
        ctx.save_for_backward(q, k, v, text_hat, w_o, cos, norm)
        ctx.tau, ctx.rows = tau, rows
        return cos

    @staticmethod
    def backward(ctx, grad):
        q, k, v, text_hat, w_o, cos, norm = ctx.saved_tensors
        gram, r = w_o.T @ w_o, text_hat @ w_o
        need_q, need_k, need_v, need_t, need_w = ctx.needs_input_grad[:5]
        d_r, d_gram = torch.zeros_like(r), torch.zeros_like(gram)
        d_q = torch.zeros_like(q) if need_q else None
        d_k = torch.zeros_like(k) if need_k else None
        d_v = torch.zeros_like(v) if need_v else None
        grad = grad.contiguous()
        for start in range(0, k.shape[1], ctx.rows):
            sl = slice(start, start + ctx.rows)
            with torch.enable_grad():
                qq = q.detach().requires_grad_(need_q)
                kc = k[:, sl].detach().requires_grad_(need_k)
                vc = v[:, sl].detach().requires_grad_(need_v)
                c = llip_heads(llip_attention(qq, kc, ctx.tau), vc)
            cd = c.detach()
            g_over_n = grad[sl] / norm[sl]
            w_y = g_over_n * cos[sl] / norm[sl]
            flat = cd.reshape(-1, cd.shape[-1])
            # (w_y c) feeds both D x D products; d_c = g/n r - (w_y c) G, built in place on that product
            weighted = (cd * w_y.unsqueeze(-1)).reshape(-1, cd.shape[-1])
            if need_t or need_w:
                d_gram.addmm_(weighted.T, flat, alpha=-0.5)
                d_r += torch.einsum("in,ind->nd", g_over_n, cd)
            d_c = torch.mm(weighted, gram).view_as(cd).neg_()
            d_c.addcmul_(g_over_n.unsqueeze(-1), r.unsqueeze(0))
            inputs = [t for t, need in ((qq, need_q), (kc, need_k), (vc, need_v)) if need]
            if inputs:
                grads = torch.autograd.grad(c, inputs, d_c)
                it = iter(grads)
                if need_q:
                    d_q += next(it)
                if need_k:
                    d_k[:, sl] = next(it)
                if need_v:
                    d_v[:, sl] = next(it)
        d_t = d_r @ w_o.T if need_t else None
        d_w = w_o @ (d_gram + d_gram.T) + text_hat.T @ d_r if need_w else None
        return d_q, d_k, d_v, d_t, d_w, None, None


def llip_value_gram(v: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """(B, H K, H K) Gram matrices M_i of the image's values through W_o: M_i[(h,k),(g,l)] = u_ik^h . u_il^g,
    u_ik^h = W_o[:, h] v_ik^h (head h's block of W_o), so that ||z_ij||^2 = w_ij M_i w_ij^T for the
    flattened mixing weights w_ij (H K). Computed with G = W_o^T W_o at B (H K)^2 dh + B K D^2 cost."""
    heads, b, kk, dh = v.shape
    gram = w_o.T @ w_o  # (D, D)
    # t_il^g = G[g-block rows] ^T v_il^g: head g's value carried through W_o^T W_o, (H, B, K, D)
    # (one (B K, dh) x (dh, D) product per head: a broadcast (H, 1, dh, D) operand would be copied B times)
    t = torch.bmm(v.reshape(heads, b * kk, dh), gram.view(heads, dh, heads * dh))
    # M[(h,k),(g,l)] = v_ik^h . t_il^g[h-block]
    m = torch.einsum("hbke,gblhe->bhkgl", v, t.view(heads, b, kk, heads, dh))
    return m.reshape(b, heads * kk, heads * kk)


def _chunk_cosine(q, k, v, r, gram, tau: float) -> torch.Tensor:
    """cos(z_ij, t_j) for one chunk of image rows without forming c_ij or z_ij = W_o c_ij.

    With w_ij^hk the mixing weights (Llip Eq. 1), r_j = W_o^T t_j split per head and M_i = llip_value_gram:
        z_ij . t_j = sum_{h,k} w_ij^hk (v_ik^h . r_j^h),    ||z_ij||^2 = w_ij M_i w_ij^T
    (w_ij flattened to H K): per pair K D + (H K)^2 multiply-adds instead of the D^2 of z_ij = W_o c_ij.
    """
    heads, b, kk, dh = k.shape
    n = q.shape[1]
    logits = torch.matmul(k.reshape(heads, b * kk, dh), (q / tau).transpose(-1, -2)).view(heads, b, kk, n)
    # Llip Eq. 1: Phi_ij^m = softmax_k(Q_j^m . K_i^mk / tau), kept as (H, b, K, N)
    w = torch.softmax(logits, dim=2)
    vr = torch.matmul(v.reshape(heads, b * kk, dh), r.transpose(-1, -2)).view(heads, b, kk, n)
    num = (w * vr).sum(dim=(0, 2))  # (b, N)
    flat = w.permute(1, 3, 0, 2).reshape(b, n, heads * kk)  # (b, N, H K), (h, k) order as the Gram matrices
    sq = (torch.bmm(flat, gram) * flat).sum(-1)
    # Llip Sec. 3 (before Eq. 3): cos = z_ij . z'_j / ||z_ij|| for unit text rows (norm clamped like F.normalize)
    return num / sq.clamp_min(_NORM_EPS**2).sqrt()


def factored_pair_cos(q, k, v, text_hat, w_o, tau: float, rows: int) -> torch.Tensor:
    """(B, N) cosines cos(W_o c_ij, t_j) by ``_chunk_cosine``, image rows in chunks of `rows`, each chunk
    recomputed in the backward (activation checkpointing): only its inputs are stored, never a (B, N, .) tensor."""
    heads, dh = k.shape[0], k.shape[-1]
    r = (text_hat @ w_o).view(-1, heads, dh).transpose(0, 1)  # r_j = W_o^T t_j, per head (H, N, dh)
    gram = llip_value_gram(v, w_o)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, r, gram))
    parts = []
    for start in range(0, k.shape[1], rows):
        sl = slice(start, start + rows)
        args = (q, k[:, sl], v[:, sl], r, gram[sl])
        parts.append(checkpoint(_chunk_cosine, *args, tau, use_reentrant=False) if grad else _chunk_cosine(*args, tau))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


PAIR_FORMS = ("auto", "direct", "factored")


def cheaper_pair_form(heads: int, tokens: int, dim: int, n_text: int) -> str:
    """"factored" where its multiply-add count per (image, caption) pair, forward + backward, is under half the
    direct form's (its permutes and recomputed forward cost more than the count: at D = 256, K = 16, N = 64 on a
    CPU equal counts ran 2x slower), else "direct". Direct: z = W_o c and the backward's c G and dG, 3 D^2 + 4 K D.
    Factored: (H K)^2 four times (forward, recomputation, two in the backward) + 8 K D, and the per-image Gram
    matrices (K D^2 + (H K)^2 D / H, three times) shared by the N captions."""
    hk = heads * tokens
    direct = 3 * dim**2 + 4 * tokens * dim
    factored = 4 * hk**2 + 8 * tokens * dim + 3 * (tokens * dim**2 + hk**2 * dim // heads) / max(n_text, 1)
    return "factored" if factored < 0.5 * direct else "direct"


class PerTokenLinear(nn.Module):
    """A separate bias-free linear map for each of K tokens: (B, K, in) -> (B, K, out) (official Llip's K/V)."""

    def __init__(self, tokens: int, in_dim: int, out_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(tokens, out_dim, in_dim))
        for w in self.weight:  # nn.Linear's default initialisation, token by token
            nn.init.kaiming_uniform_(w, a=5**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[1] != self.weight.shape[0]:
            raise ValueError(f"per-token projection expects (B, {self.weight.shape[0]}, in), got {tuple(x.shape)}")
        return torch.einsum("bki,koi->bko", x, self.weight.to(x.dtype))


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
        query_dim: width of ``text_query_all`` (default ``dim``; the text tower's width when the query
            is computed from its hidden state, as official Llip does).
        kv_tokens, kv_dim: 0 (default): one K and one V projection shared by the mixture tokens, which
            are ``dim`` wide; K > 0: a separate K and V projection per token (official Llip), from
            ``kv_dim``-wide tokens (the image tower's width).
        pair_form: how the training cosines are computed (same values): "direct" (z_ij = W_o c_ij per chunk,
            ``_ChunkedCosine``), "factored" (``factored_pair_cos``: no D x D product per pair), "auto" (the
            cheaper by ``cheaper_pair_form``; factored pays where H K is well below D and N is large).

    Under any autocast the mixer computes in float32 (bf16 cosines err by ~2e-3).
    """

    def __init__(
        self,
        dim: int,
        heads: int = 8,
        tau: float = 5.0,
        chunk_size: int = 0,
        chunk_mib: float = 64.0,
        query_proj: bool = True,
        query_dim: int | None = None,
        kv_tokens: int = 0,
        kv_dim: int | None = None,
        pair_form: str = "auto",
    ):
        super().__init__()
        if pair_form not in PAIR_FORMS:
            raise ValueError(f"pair_form must be one of {PAIR_FORMS}, got {pair_form!r}")
        self.pair_form = pair_form
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        if tau <= 0:
            raise ValueError(f"tau must be > 0, got {tau}")
        self.dim, self.heads, self.tau = dim, heads, float(tau)
        self.query_dim, self.kv_dim = query_dim or dim, (kv_dim or dim) if kv_tokens else dim
        if not query_proj and self.query_dim != dim:
            raise ValueError("query_dim != dim needs query_proj")
        self.chunk_size, self.chunk_mib = int(chunk_size), float(chunk_mib)
        self.q_proj = nn.Linear(self.query_dim, dim, bias=False) if query_proj else nn.Identity()
        if kv_tokens:
            self.k_proj, self.v_proj = PerTokenLinear(kv_tokens, self.kv_dim, dim), PerTokenLinear(kv_tokens, self.kv_dim, dim)
        else:
            self.k_proj = nn.Linear(dim, dim, bias=False)
            self.v_proj = nn.Linear(dim, dim, bias=False)
        # W_O is a direct parameter (not a child nn.Linear): it is used inside the chunked autograd function,
        # and DeepSpeed ZeRO-3 gathers a module's own parameters around its forward and backward.
        self.out_weight = nn.Parameter(torch.empty(dim, dim))
        nn.init.kaiming_uniform_(self.out_weight, a=5**0.5)  # nn.Linear's default initialisation

    # -- shared preparation -------------------------------------------------------------------
    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (H, ..., dh)."""
        x = x.reshape(*x.shape[:-1], self.heads, self.dim // self.heads)
        return x.movedim(-2, 0)

    def _prepare(self, image_mix_tokens, text_query_all, text_emb_all):
        if image_mix_tokens.dim() != 3 or image_mix_tokens.shape[-1] != self.kv_dim:
            raise ValueError(f"image_mix_tokens must be (B, K, {self.kv_dim}), got {tuple(image_mix_tokens.shape)}")
        if (text_query_all.shape[0] != text_emb_all.shape[0] or text_query_all.shape[-1] != self.query_dim
                or text_emb_all.shape[-1] != self.dim):
            raise ValueError(f"text_query_all must be (N, {self.query_dim}) and text_emb_all (N, {self.dim})")
        # float32 (no autocast): the cosines feed the loss, bf16 would put them ~2e-3 off
        inputs = (image_mix_tokens, text_query_all, text_emb_all)
        dtype = torch.float64 if torch.float64 in {t.dtype for t in (*inputs, self.out_weight)} else torch.float32
        image_mix_tokens, text_query_all, text_emb_all = (t.to(dtype) for t in inputs)
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
        with float32_region(image_mix_tokens.device):
            q, k, v, text_hat = self._prepare(image_mix_tokens, text_query_all, text_emb_all)
            rows = self.rows_per_chunk(text_hat.shape[0], k.shape[2], text_hat.element_size())
            form = self.pair_form
            if form == "auto":
                form = cheaper_pair_form(self.heads, k.shape[2], self.dim, text_hat.shape[0])
            if form == "factored":
                return factored_pair_cos(q, k, v, text_hat, self.out_weight.to(q.dtype), self.tau, rows)
            # The custom function runs outside autocast on one common dtype (its backward is not autocast).
            dtype = functools.reduce(torch.promote_types, [t.dtype for t in (q, k, v, text_hat, self.out_weight)])
            cast = [t.to(dtype) for t in (q, k, v, text_hat, self.out_weight)]
            if torch.compiler.is_compiling():
                # the same chunks' forward, checkpointed: the custom backward's autograd.grad would break the graph
                q, k, v, text_hat, w_o = cast
                return torch.cat([checkpoint(self._block, q, k[:, i : i + rows], v[:, i : i + rows], text_hat, w_o,
                                             use_reentrant=False) for i in range(0, k.shape[1], rows)])
            return _ChunkedCosine.apply(*cast, self.tau, rows)

    def naive_pair_cos(
        self, image_mix_tokens: torch.Tensor, text_query_all: torch.Tensor, text_emb_all: torch.Tensor
    ) -> torch.Tensor:
        """Reference: the same cosine matrix with the full (B, N, D) tensor materialised."""
        with float32_region(image_mix_tokens.device):
            q, k, v, text_hat = self._prepare(image_mix_tokens, text_query_all, text_emb_all)
            return self._block(q, k, v, text_hat, self.out_weight.to(q.dtype))

    def contextualise(self, image_mix_tokens: torch.Tensor, text_query: torch.Tensor,
                      text_emb: torch.Tensor | None = None) -> torch.Tensor:
        """Normalised z_hat_ij, (B, N, D), for small B x N (analysis / zero-shot on few classes)."""
        text_emb = text_query if text_emb is None else text_emb
        with float32_region(image_mix_tokens.device):
            q, k, v, _ = self._prepare(image_mix_tokens, text_query, text_emb)
            return F.normalize(llip_mix(llip_attention(q, k, self.tau), v, self.out_weight.to(q.dtype)), dim=-1)


__all__ = ["LlipMixer", "PerTokenLinear", "cheaper_pair_form", "factored_pair_cos", "llip_attention",
           "llip_cosine", "llip_mix", "llip_value_gram"]
