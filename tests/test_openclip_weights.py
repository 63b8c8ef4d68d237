"""open_clip CLIP weights load into our towers: same embeddings on identical inputs (no download)."""
from __future__ import annotations

import pytest
import torch

from models import create_model
from models.openclip_weights import load_openclip_weights, openclip_to_probvlp, read_openclip_state
from models.tokenizer import tokenize


def tiny_openclip(context_length: int = 16):
    """A randomly initialised open_clip CLIP with the shape of our *_tiny models."""
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(1)
    vision = CLIPVisionCfg(layers=2, width=64, head_width=32, patch_size=8, image_size=32)
    text = CLIPTextCfg(context_length=context_length, vocab_size=49408, width=64, heads=2, layers=2)
    return CLIP(embed_dim=64, vision_cfg=vision, text_cfg=text).eval()


def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 32, 32, generator=g), tokenize(["the digit seven", "a handwritten digit",
                                                           "an odd digit", "a photo of the number three"], 16)


@pytest.mark.parametrize("source_context", [16, 20])
def test_clip_embeddings_match_openclip(source_context):
    src = tiny_openclip(source_context)
    ours = create_model("clip_tiny", vision_pre_norm=True).eval()
    assert load_openclip_weights(ours, src) == []  # every parameter of our CLIP came from open_clip
    images, tokens = inputs()
    with torch.no_grad():
        ref_img = src.encode_image(images, normalize=True)
        padded = torch.zeros(len(tokens), source_context, dtype=tokens.dtype)
        padded[:, :16] = tokens
        ref_txt = src.encode_text(padded, normalize=True)
        assert torch.allclose(ours.encode_image(images)["mu"], ref_img, atol=1e-5)
        assert torch.allclose(ours.encode_text(tokens)["mu"], ref_txt, atol=1e-5)


@pytest.mark.parametrize("name,new_prefixes", [
    ("pcmepp_tiny", ("image_var", "text_var", "image_gpo", "text_gpo")),
    ("prolip_tiny", ("visual.vit.reg_token", "image_unc_proj", "text_unc_proj", "text.appended", "text.mask_embedding")),
    ("siglip_tiny", ()),
])
def test_towers_of_other_methods_load(name, new_prefixes):
    src = tiny_openclip()
    model = create_model(name, vision_pre_norm=True)
    fresh = load_openclip_weights(model, src)
    assert fresh and all(k.startswith(new_prefixes) for k in fresh) if new_prefixes else fresh == []
    state = model.state_dict()
    for key, value in openclip_to_probvlp(src.state_dict(), model).items():
        assert torch.equal(state[key], value), key
    if name == "pcmepp_tiny":
        # the mu head (last block) carries CLIP's weights; the log sigma^2 head stays freshly initialised
        assert torch.equal(state["visual.vit.blocks.1.attn.qkv.weight"],
                           src.state_dict()["visual.transformer.resblocks.1.attn.in_proj_weight"])
        assert not torch.equal(state["image_var_block.attn.qkv.weight"], state["visual.vit.blocks.1.attn.qkv.weight"])
    model.train()
    images, tokens = inputs()
    out = model(images, tokens)
    assert torch.isfinite(out["image_mu"]).all() and torch.isfinite(out["text_mu"]).all()


def test_shape_mismatch_names_the_key():
    src = tiny_openclip()
    model = create_model("clip_tiny", vision_pre_norm=True, vision_width=128, vision_heads=2)
    with pytest.raises(ValueError, match="visual.vit"):
        load_openclip_weights(model, src)


def test_tiny_without_ln_pre_says_how_to_load():
    with pytest.raises(ValueError, match="vision_pre_norm=True"):
        load_openclip_weights(create_model("clip_tiny"), tiny_openclip())


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_state_files_load_into_a_config_built_model(tmp_path, suffix):
    """model.init_from_openclip: a saved open_clip state dict passes config validation and loads exactly."""
    import yaml
    from safetensors.torch import save_file

    from pipelines.config import ConfigError
    from pipelines.pretrain.config import load_train_config

    src = tiny_openclip()
    path = tmp_path / f"clip{suffix}"
    state = {k: v.contiguous() for k, v in src.state_dict().items()}
    save_file(state, path) if suffix == ".safetensors" else torch.save({"state_dict": state}, path)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({"model": {"name": "pcmepp_tiny", "init_from_openclip": str(path)}}))
    with pytest.raises(ConfigError, match="vision_pre_norm: true"):
        load_train_config(cfg_path)
    cfg = load_train_config(cfg_path, ["model.overrides.vision_pre_norm=true"])
    model = create_model(cfg.model.name, **cfg.model.overrides)
    load_openclip_weights(model, read_openclip_state(cfg.model.init_from_openclip))
    assert torch.equal(model.state_dict()["visual.vit.norm_pre.weight"], state["visual.ln_pre.weight"])
    assert torch.equal(model.state_dict()["text_proj.weight"], state["text_projection"].T)


def test_openclip_factory_vit_b16_maps_onto_clip_vit_b16():
    """The real open_clip ViT-B-16 layout (random weights, pretrained=None) maps key by key and shape by shape."""
    import open_clip

    src = open_clip.create_model("ViT-B-16", pretrained=None)
    with torch.device("meta"):
        ours = create_model("clip_vit_b16", embed_dim=512)  # open_clip's ViT-B-16 projects to 512
    mapped = openclip_to_probvlp(src.state_dict(), ours)
    assert set(mapped) == set(ours.state_dict())
