"""Image tower (timm VisionTransformer) and CLIP-style causal text transformer, returning all tokens.

Both towers are laid out like OpenAI/open_clip CLIP (pre-norm ViT, LayerNorm eps 1e-5, GELU), so
``models.openclip_weights`` can load CLIP weights into them. Extra pieces for the methods:

- ImageTower: learnable prefix tokens ([CLS], then ``extra_tokens`` more: ProLIP's [UNC], Llip's
  mixture tokens) and token dropping (``keep``) that drops patch tokens only, never the prefix.
- TextTower: ``append_tokens`` learnable tokens appended after the context (ProLIP: [UNC], [CLS]);
  they attend to the real tokens (up to EOT) and each other, never to padding. Token masking
  replaces chosen token embeddings by a learned [MASK] embedding (``mask_token=True``). Padding
  after the batch's longest caption is cut before the blocks: no position up to a caption's EOT
  sees it (causal attention, or the key mask of ``causal=False``), so the result is the same and
  short captions cost less. ``text_pad_attention=True`` (official ProLIP) keeps the whole padded
  context and lets every token attend to it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from models._imports import without
from models.tokenizer import VOCAB_SIZE


def _timm():
    """timm's ViT and its Block, imported where a tower is built: timm pulls in torchvision and torch._dynamo (~2
    CPU-s), which a process that only reads the model table (a job's driver, for the text context) never needs.
    timm tries wandb (its training scripts' logger) as it loads, and img2dataset installs it: 0.2 CPU-s and a
    network-minded package in every process that builds a model, for nothing this library calls."""
    with without("wandb"):
        from timm.models.vision_transformer import Block, VisionTransformer
    return Block, VisionTransformer

LayerNorm = partial(nn.LayerNorm, eps=1e-5)  # CLIP's LayerNorm eps


def run_blocks(blocks, x: torch.Tensor, checkpointed: bool = False, **kwargs) -> torch.Tensor:
    """Apply transformer blocks in turn; ``checkpointed``: activation checkpointing per block (non-reentrant
    torch.utils.checkpoint), which stores each block's input only and recomputes the block in the backward."""
    checkpointed = checkpointed and torch.is_grad_enabled()
    for blk in blocks:
        x = checkpoint(blk, x, use_reentrant=False, **kwargs) if checkpointed else blk(x, **kwargs)
    return x


def set_grad_checkpointing(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Turn activation checkpointing of every tower's blocks in `model` on or off (``train.grad_checkpointing``):
    the image and text towers' block loops, and the blocks that models run on the towers' tokens themselves
    (PCME++'s last and variance blocks follow their tower's setting)."""
    for m in model.modules():
        if isinstance(m, (ImageTower, TextTower)):
            m.grad_checkpointing = enabled
    return model


def compile_blocks(model: nn.Module) -> nn.Module:
    """torch.compile every transformer block of `model`, in place (``train.compile``): parameter names and the
    state dict stay as they are, and every method's own block loops (PCME++'s, the masked copies) use them."""
    block = _timm()[0]
    for m in model.modules():
        if isinstance(m, block):
            m.compile()
    return model


@dataclass(frozen=True)
class TowerConfig:
    """Sizes of the two towers and the shared embedding, as open_clip's vision / text configs.

    The defaults are the papers' size: ViT-B/16 image tower, 12-layer 512-wide text transformer,
    64-token context, 768-d embeddings (ProLIP App. B.1). Every field is also a config override
    (``model.overrides.vision_depth`` ...). ``vision_pre_norm`` is CLIP's ``ln_pre`` (see ImageTower).
    """

    img_size: int = 224
    patch_size: int = 16
    vision_width: int = 768
    vision_depth: int = 12
    vision_heads: int = 12
    vision_pre_norm: bool = True
    context_length: int = 64
    text_width: int = 512
    text_depth: int = 12
    text_heads: int = 8
    embed_dim: int = 768
    # CLIP's causal text attention; False: every token sees the whole caption (official ProLIP's no_causal_mask)
    text_causal: bool = True
    # False: no token attends to the padding after EOT; True: every token sees the whole padded context
    # (official ProLIP's text tower runs its blocks with attn_mask=None on the padded context)
    text_pad_attention: bool = False

    def image_tower(self, extra_tokens: int = 0, class_token: bool = True) -> "ImageTower":
        return ImageTower(self.img_size, self.patch_size, self.vision_width, self.vision_depth, self.vision_heads,
                          extra_tokens=extra_tokens, class_token=class_token, pre_norm=self.vision_pre_norm)

    def text_tower(self, append_tokens: int = 0, mask_token: bool = False) -> "TextTower":
        return TextTower(self.context_length, self.text_width, self.text_depth, self.text_heads,
                         append_tokens=append_tokens, mask_token=mask_token, causal=self.text_causal,
                         pad_attention=self.text_pad_attention)

    def projections(self, bias: bool = False) -> tuple[nn.Linear, nn.Linear]:
        """Image and text linear maps from the towers' widths to the embedding."""
        return (nn.Linear(self.vision_width, self.embed_dim, bias=bias),
                nn.Linear(self.text_width, self.embed_dim, bias=bias))


class ImageTower(nn.Module):
    """timm ViT without a head. Prefix tokens: [CLS] (if ``class_token``) then ``extra_tokens`` learnable tokens.

    Position embeddings cover the patches only (timm ``no_embed_class``): prefix tokens are plain
    learnable vectors (for CLIP weights, [CLS] := class_embedding + its position embedding).
    ``pre_norm`` is CLIP's LayerNorm before the first block (``ln_pre``): needed to load CLIP weights,
    but from scratch it slows early training of small towers markedly (a 2-block ViT sits at
    loss = log(batch) for ~100 steps with it), so the tiny models leave it out.
    """

    def __init__(self, img_size: int, patch_size: int, width: int, depth: int, heads: int, extra_tokens: int = 0,
                 class_token: bool = True, pre_norm: bool = True):
        super().__init__()
        self.vit = _timm()[1](
            img_size=img_size, patch_size=patch_size, embed_dim=width, depth=depth, num_heads=heads,
            num_classes=0, global_pool="", class_token=class_token, reg_tokens=extra_tokens,
            no_embed_class=True, pre_norm=pre_norm, norm_layer=LayerNorm,
        )
        self.width = width
        self.num_prefix = int(class_token) + extra_tokens
        self.num_patches = self.vit.patch_embed.num_patches
        self.grad_checkpointing = False  # set_grad_checkpointing

    def embed(self, images: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Prefix + patch tokens after position embedding and the pre-norm; `keep` (B, n) selects patches."""
        vit = self.vit
        x = vit._pos_embed(vit.patch_embed(images))
        if keep is not None:
            prefix, patches = x[:, : self.num_prefix], x[:, self.num_prefix :]
            patches = torch.gather(patches, 1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
            x = torch.cat([prefix, patches], dim=1)
        return vit.norm_pre(x)

    def forward(self, images: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """(B, num_prefix + kept patches, width), final LayerNorm applied."""
        return self.vit.norm(self.run(self.embed(images, keep), self.vit.blocks))

    def run(self, x: torch.Tensor, blocks) -> torch.Tensor:
        return run_blocks(blocks, x, self.grad_checkpointing)


MASK_COUNTS = ("round", "floor")


def masked_count(n: int, share: float, counts: str = "round") -> int:
    """How many of n items a share selects: "round": round(share n), at least 1 when share > 0;
    "floor" (official ProLIP's int(n * share)): may be 0."""
    if counts not in MASK_COUNTS:
        raise ValueError(f"mask counts must be one of {MASK_COUNTS}, got {counts!r}")
    if share <= 0:
        return 0
    return int(n * share) if counts == "floor" else max(1, int(round(n * share)))


def random_keep(batch: int, n_patches: int, ratio: float, device=None, counts: str = "round",
                shared: bool = False) -> torch.Tensor:
    """(batch, n_keep) sorted random patch indices keeping a (1 - ratio) share of the patches
    (``masked_count``); ``shared``: one random subset for the whole batch (official ProLIP: one
    ``torch.randperm`` per masked batch), else one per row."""
    # ProLIP Sec. 4.1: masked copies drop 75% of the image tokens (token drop as in MAE, He et al. 2022)
    n_keep = masked_count(n_patches, 1.0 - ratio, counts)
    if shared:
        return torch.randperm(n_patches, device=device)[:n_keep].sort().values.expand(batch, -1)
    order = torch.rand(batch, n_patches, device=device).argsort(dim=1)
    return order[:, :n_keep].sort(dim=1).values


TEXT_MASK_MODES = ("exact", "bernoulli")


def random_text_mask(tokens: torch.Tensor, ratio: float, mode: str = "exact") -> torch.Tensor:
    """(B, L) bool: the caption tokens to replace by [MASK]; only words (between SOT and EOT) are masked.

    "exact": round(ratio * n) (at least 1) of each caption's n words;
    "bernoulli" (official ProLIP): each word with probability `ratio` (its tokenizer has no start token and
    its end token is its padding token, which it never masks).
    """
    if mode not in TEXT_MASK_MODES:
        raise ValueError(f"text mask mode must be one of {TEXT_MASK_MODES}, got {mode!r}")
    eot = TextTower.eot_index(tokens)
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    content = (pos[None, :] > 0) & (pos[None, :] < eot[:, None])
    if mode == "bernoulli":
        return (torch.rand(tokens.shape, device=tokens.device) < ratio) & content
    # ProLIP Sec. 4.1: masked copies replace 75% of the text tokens with [MASK] (as in BERT)
    n_content = content.sum(1)
    n_mask = torch.where(n_content > 0, (n_content.float() * ratio).round().clamp_min(1), 0).long()
    score = torch.rand(tokens.shape, device=tokens.device).masked_fill(~content, 2.0)
    rank = score.argsort(dim=1).argsort(dim=1)  # rank of each position among the content tokens
    return rank < n_mask[:, None]


class TextTower(nn.Module):
    """CLIP text transformer: token + position embeddings, causal blocks (``causal=False``: full attention
    over the caption), final LayerNorm.

    The context is cut to L' = the batch's longest caption (up to its EOT); ``append_tokens`` learnable
    tokens follow it (ProLIP puts [UNC] and [CLS] there): the output is (B, L' + append_tokens, width),
    the appended tokens last. ``pad_attention=True`` (official ProLIP): nothing is cut and no key is
    masked, every token attends to the whole padded context (L' = L).
    """

    def __init__(self, context_length: int, width: int, depth: int, heads: int, vocab_size: int = VOCAB_SIZE,
                 append_tokens: int = 0, mask_token: bool = False, causal: bool = True, pad_attention: bool = False):
        super().__init__()
        self.context_length = context_length
        self.causal, self.pad_attention = causal, pad_attention
        self.width = width
        self.grad_checkpointing = False  # set_grad_checkpointing
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.randn(context_length, width) * 0.01)
        block = _timm()[0]
        self.blocks = nn.ModuleList(block(width, heads, mlp_ratio=4.0, qkv_bias=True, norm_layer=LayerNorm)
                                    for _ in range(depth))
        self.ln_final = LayerNorm(width)
        self.num_appended = append_tokens
        self.appended = nn.Parameter(torch.randn(append_tokens, width) * 0.02) if append_tokens else None
        self.mask_embedding = nn.Parameter(torch.randn(width) * 0.02) if mask_token else None
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        proj_std, attn_std, fc_std = width**-0.5 * (2 * depth) ** -0.5, width**-0.5, (2 * width) ** -0.5
        for blk in self.blocks:  # CLIP's text initialisation
            nn.init.normal_(blk.attn.qkv.weight, std=attn_std)
            nn.init.normal_(blk.attn.proj.weight, std=proj_std)
            nn.init.normal_(blk.mlp.fc1.weight, std=fc_std)
            nn.init.normal_(blk.mlp.fc2.weight, std=proj_std)

    def embed(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Input embeddings (B, L' + appended, width) and the attention mask the blocks need (None: plain causal)."""
        # compiled: no trim (its length is a host read, a graph break and a recompile per length); the padding is
        # masked instead, the same result
        if not self.pad_attention and not torch.compiler.is_compiling():
            tokens, mask = self.trim(tokens, mask)
        x = self.token_embedding(tokens)
        if mask is not None:
            if self.mask_embedding is None:
                raise ValueError("this text tower has no [MASK] embedding (mask_token=False)")
            x = torch.where(mask.unsqueeze(-1), self.mask_embedding.to(x.dtype), x)
        x = x + self.positional_embedding[: tokens.shape[1]].to(x.dtype)
        if not self.num_appended and self.causal:
            return x, None
        b, length = tokens.shape
        if self.num_appended:
            x = torch.cat([x, self.appended.to(x.dtype).unsqueeze(0).expand(b, -1, -1)], dim=1)
        total = length + self.num_appended
        pos = torch.arange(total, device=tokens.device)
        eot = self.eot_index(tokens)
        # no token attends to padding after EOT (the appended tokens sit after the padding); causal unless not
        key_ok = (pos[None, :] <= eot[:, None]) | (pos[None, :] >= length) | self.pad_attention  # (B, total)
        allowed = key_ok[:, None, :].expand(b, total, total)  # (B, query, key)
        if self.causal:
            allowed = allowed & (pos[None, :, None] >= pos[None, None, :])
        return x, allowed.unsqueeze(1)

    def run(self, x: torch.Tensor, blocks, attn_mask: torch.Tensor | None) -> torch.Tensor:
        kwargs = {"is_causal": True} if attn_mask is None else {"attn_mask": attn_mask}
        return run_blocks(blocks, x, self.grad_checkpointing, **kwargs)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x, attn_mask = self.embed(tokens, mask)
        return self.ln_final(self.run(x, self.blocks, attn_mask))

    @classmethod
    def trim(cls, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drop the padding columns after the longest caption's EOT (exact: no position up to an EOT sees them)."""
        length = int(cls.eot_index(tokens).max()) + 1 if tokens.numel() else tokens.shape[1]
        return tokens[:, :length], None if mask is None else mask[:, :length]

    @staticmethod
    def eot_index(tokens: torch.Tensor) -> torch.Tensor:
        # The EOT id is the largest in the vocabulary, so argmax finds it (as in CLIP).
        return tokens.argmax(dim=-1)


def reset_linear_and_norm(module: nn.Module) -> None:
    """Fresh timm-ViT initialisation for a (copied) block: truncated normal (std 0.02) weights, zero biases."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            m.reset_parameters()


def sinusoid(positions: int, dim: int, device=None) -> torch.Tensor:
    """(positions, dim) sine/cosine position encodings of 1 .. positions."""
    pos = torch.arange(1, positions + 1, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    enc = torch.zeros(positions, dim, device=device)
    enc[:, 0::2] = torch.sin(pos * freq)
    enc[:, 1::2] = torch.cos(pos * freq)
    return enc
