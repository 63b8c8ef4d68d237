"""Load open_clip CLIP weights into our towers (e.g. PCME++-style fine-tuning from CLIP, PCME++, arXiv:2305.18171, Sec. 2.5).

Mapping (open_clip ``CLIP`` state dict -> ours):

    visual.conv1.weight                         -> visual.vit.patch_embed.proj.weight (no bias: pre-norm ViT)
    visual.class_embedding + positional_embedding[0] -> visual.vit.cls_token   (our position embeddings
    visual.positional_embedding[1:]             -> visual.vit.pos_embed        cover the patches only)
    visual.ln_pre / ln_post                     -> visual.vit.norm_pre / norm
    visual.proj (width, D)                      -> image_proj.weight (D, width) (transposed)
    *.transformer.resblocks.i.ln_1 / ln_2       -> blocks.i.norm1 / norm2
    *.attn.in_proj_weight / in_proj_bias        -> blocks.i.attn.qkv.weight / bias  (same [q; k; v] layout)
    *.attn.out_proj                             -> blocks.i.attn.proj
    *.mlp.c_fc / c_proj                         -> blocks.i.mlp.fc1 / fc2
    token_embedding, ln_final                   -> text.token_embedding, text.ln_final
    positional_embedding[:context_length]       -> text.positional_embedding (a shorter context keeps the first rows)
    text_projection (width, D)                  -> text_proj.weight (transposed)

Everything else in our model (ProLIP's [UNC] tokens and projections, PCME++'s log sigma^2 heads and
GPOs, Llip's mixture tokens and mixer, the [MASK] embedding) keeps its own initialisation;
``load_openclip_weights`` returns those names. open_clip's ``logit_scale`` / ``logit_bias`` belong
to the loss, not the model, and are ignored. Shapes must match (same width, depth, patch size,
image size); a mismatch raises ValueError naming the key.
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn

_BLOCK = {
    "ln_1.weight": "norm1.weight", "ln_1.bias": "norm1.bias",
    "attn.in_proj_weight": "attn.qkv.weight", "attn.in_proj_bias": "attn.qkv.bias",
    "attn.out_proj.weight": "attn.proj.weight", "attn.out_proj.bias": "attn.proj.bias",
    "ln_2.weight": "norm2.weight", "ln_2.bias": "norm2.bias",
    "mlp.c_fc.weight": "mlp.fc1.weight", "mlp.c_fc.bias": "mlp.fc1.bias",
    "mlp.c_proj.weight": "mlp.fc2.weight", "mlp.c_proj.bias": "mlp.fc2.bias",
}
_IGNORED = {"logit_scale", "logit_bias", "attn_mask"}
_RESBLOCK = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.(.+)$")


def openclip_to_probvlp(source: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """open_clip CLIP state dict -> a (partial) state dict for `model` (see the module docstring)."""
    target = model.state_dict()
    text_ctx = model.text.positional_embedding.shape[0]
    has_cls = getattr(model.visual.vit, "cls_token", None) is not None
    out: dict[str, torch.Tensor] = {}
    unused = []
    for key, value in source.items():
        if key in _IGNORED or key.endswith(".attn_mask"):
            continue
        m = _RESBLOCK.match(key)
        if m:
            tower = "visual.vit.blocks" if m.group(1) else "text.blocks"
            if m.group(3) not in _BLOCK:
                raise ValueError(f"{key}: unknown open_clip block parameter (unsupported variant?)")
            out[f"{tower}.{m.group(2)}.{_BLOCK[m.group(3)]}"] = value
        elif key == "visual.conv1.weight":
            out["visual.vit.patch_embed.proj.weight"] = value
        elif key == "visual.class_embedding":
            if has_cls:
                out["visual.vit.cls_token"] = (value + source["visual.positional_embedding"][0]).reshape(1, 1, -1)
            else:
                unused.append(key)
        elif key == "visual.positional_embedding":
            out["visual.vit.pos_embed"] = value[1:].unsqueeze(0)
        elif key.startswith("visual.ln_pre."):
            out["visual.vit.norm_pre." + key.rsplit(".", 1)[1]] = value
        elif key.startswith("visual.ln_post."):
            out["visual.vit.norm." + key.rsplit(".", 1)[1]] = value
        elif key == "visual.proj":
            out["image_proj.weight"] = value.T
        elif key == "token_embedding.weight":
            out["text.token_embedding.weight"] = value
        elif key == "positional_embedding":
            if value.shape[0] < text_ctx:
                raise ValueError(f"positional_embedding: open_clip context {value.shape[0]} < ours {text_ctx}")
            out["text.positional_embedding"] = value[:text_ctx]
        elif key.startswith("ln_final."):
            out["text.ln_final." + key.rsplit(".", 1)[1]] = value
        elif key == "text_projection":
            out["text_proj.weight"] = value.T
        else:
            unused.append(key)
    if unused:
        raise ValueError(f"open_clip keys with no place in {type(model).__name__}: {', '.join(unused)}")
    if "visual.vit.norm_pre.weight" in out and "visual.vit.norm_pre.weight" not in target:
        raise ValueError(f"{type(model).__name__} was built without CLIP's ln_pre: create it with vision_pre_norm=True "
                         "to load open_clip weights")
    for key, value in out.items():
        if key not in target:
            raise ValueError(f"{key}: not in {type(model).__name__} (mapped from open_clip)")
        if tuple(target[key].shape) != tuple(value.shape):
            raise ValueError(f"{key}: open_clip shape {tuple(value.shape)} != ours {tuple(target[key].shape)}")
    return out


def load_openclip_weights(model: nn.Module, source: nn.Module | dict[str, torch.Tensor]) -> list[str]:
    """Copy an open_clip CLIP model's (or state dict's) weights into `model`'s towers and projections.

    Returns the names of `model`'s parameters and buffers that were NOT loaded (they keep their
    initialisation: [UNC] tokens, variance heads, GPO, mixture tokens, mixer, ...).
    """
    state = source.state_dict() if isinstance(source, nn.Module) else source
    mapped = openclip_to_probvlp(state, model)
    with torch.no_grad():
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        for key, value in mapped.items():
            (params.get(key) if key in params else buffers[key]).copy_(value)
    return sorted(k for k in model.state_dict() if k not in mapped)


def read_openclip_state(source: str) -> dict[str, torch.Tensor]:
    """An open_clip CLIP state dict from ``open_clip:<arch>/<pretrained tag>`` (open_clip's own download
    and cache, e.g. ``open_clip:ViT-B-16/laion2b_s34b_b88k``), a ``.safetensors`` file, or a torch file
    read with ``weights_only=True`` (a bare state dict or one under ``"state_dict"``)."""
    if source.startswith("open_clip:"):
        import open_clip  # deferred: its model zoo loads only for an open_clip: source

        arch, _, tag = source.removeprefix("open_clip:").partition("/")
        return open_clip.create_model(arch, pretrained=tag or None).state_dict()
    if source.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(source)
    state = torch.load(source, map_location="cpu", weights_only=True)
    return state.get("state_dict", state) if isinstance(state, dict) else state

