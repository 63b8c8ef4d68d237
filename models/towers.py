"""Image tower (timm VisionTransformer) and CLIP-style causal text transformer, returning all tokens."""
from __future__ import annotations

import torch
import torch.nn as nn
from timm.models.vision_transformer import Block, VisionTransformer

from models.tokenizer import VOCAB_SIZE


class ImageTower(nn.Module):
    """timm ViT without a head; `extra_tokens` learnable prefix tokens follow [CLS] (e.g. [UNC], mixture tokens)."""

    def __init__(self, img_size: int, patch_size: int, width: int, depth: int, heads: int, extra_tokens: int = 0):
        super().__init__()
        self.vit = VisionTransformer(
            img_size=img_size, patch_size=patch_size, embed_dim=width, depth=depth, num_heads=heads,
            num_classes=0, global_pool="", class_token=True, reg_tokens=extra_tokens,
        )
        self.width = width
        self.num_prefix = 1 + extra_tokens

    def forward(self, images: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """(B, num_prefix + patches, width). `keep` (B, n) selects patch tokens (masked copies); prefix tokens stay."""
        vit = self.vit
        x = vit._pos_embed(vit.patch_embed(images))
        if keep is not None:
            prefix, patches = x[:, : self.num_prefix], x[:, self.num_prefix :]
            patches = torch.gather(patches, 1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
            x = torch.cat([prefix, patches], dim=1)
        x = vit.blocks(vit.norm_pre(x))
        return vit.norm(x)


class TextTower(nn.Module):
    """CLIP text transformer: token + position embeddings, causal blocks, final LayerNorm."""

    def __init__(self, context_length: int, width: int, depth: int, heads: int, vocab_size: int = VOCAB_SIZE):
        super().__init__()
        self.context_length = context_length
        self.width = width
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.randn(context_length, width) * 0.01)
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio=4.0, qkv_bias=True) for _ in range(depth))
        self.ln_final = nn.LayerNorm(width)
        nn.init.normal_(self.token_embedding.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(tokens) + self.positional_embedding[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x, is_causal=True)
        return self.ln_final(x)

    @staticmethod
    def eot_index(tokens: torch.Tensor) -> torch.Tensor:
        # The EOT id is the largest in the vocabulary, so argmax finds it (as in CLIP).
        return tokens.argmax(dim=-1)
