"""The model zoo: every registered model builds, trains one step at tiny size and builds at the papers' size."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models import create_model, default_loss, list_models
from models.heads import GPO
from models.losses import create_loss
from models.objective import Objective
from models.registry import check_overrides, tower_config
from models.pcmepp import mixed_sample
from models.prolip import masked_rows
from models.tokenizer import tokenize
from models.towers import ImageTower, TextTower, random_keep, random_text_mask
from tests.pace import scaled

ROOT = Path(__file__).resolve().parent.parent
PAPER = ["clip_vit_b16", "siglip_vit_b16", "pcmepp_vit_b16", "prolip_vit_b16", "llip64_vit_b16",
         "prolip_llip64_vit_b16"]
TINY = ["clip_tiny", "siglip_tiny", "pcmepp_tiny", "prolip_tiny", "llip_tiny", "prolip_llip_tiny"]
PROBABILISTIC = {"pcmepp", "prolip", "prolip_llip"}
CAPTIONS = ["the digit seven", "a handwritten digit", "a photo of the number three", "an odd digit",
            "the number one written by hand", "a drawing of the digit 4", "a number", "the digit zero"]


def method(name: str) -> str:
    return name.removesuffix("_tiny").removesuffix("_vit_b16").replace("llip64", "llip")


def batch(n: int = 8, size: int = 32, context: int = 16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, size, size, generator=g), tokenize((CAPTIONS * n)[:n], context)


def test_registry_has_every_method_at_both_sizes():
    assert set(PAPER + TINY) <= set(list_models())
    for tiny in TINY:  # every tiny model has a paper-size sibling with the same default loss
        paper = [p for p in PAPER if method(p) == method(tiny)]
        assert len(paper) == 1 and default_loss(paper[0]) == default_loss(tiny)


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward_and_zero_shot(name):
    torch.manual_seed(0)
    model = create_model(name)
    objective = Objective(model, create_loss(default_loss(name))).train()
    images, tokens = batch()
    out = objective(images, tokens)
    assert out["loss"].ndim == 0 and torch.isfinite(out["loss"])
    out["loss"].backward()
    params = dict(objective.named_parameters())
    assert [n for n, p in params.items() if p.ndim == 0] == []  # DeepSpeed cannot broadcast 0-dim params
    missing = [n for n, p in params.items() if p.requires_grad and (p.grad is None or not torch.isfinite(p.grad).all())]
    assert missing == []
    probabilistic = method(name) in PROBABILISTIC
    if probabilistic:
        assert {"image_sigma2_mean", "text_sigma2_mean"} <= set(out)

    model.eval()
    with torch.no_grad():
        img, txt = model.encode_image(images), model.encode_text(tokens)
        for side in (img, txt):
            assert torch.allclose(side["mu"].norm(dim=-1), torch.ones(len(images)), atol=1e-5)
            assert ("logvar" in side) == probabilistic
        per_template = {k: v.reshape(2, 4, *v.shape[1:]) for k, v in txt.items()}
        scores = model.class_scores(img, model.class_embeddings(per_template))
    assert scores.shape == (8, 2) and torch.isfinite(scores).all()
    assert model.context_length == 16 and model.img_size == 32


@pytest.mark.parametrize("name", PAPER)
def test_paper_size_builds_on_meta(name):
    with torch.device("meta"):
        model = create_model(name)
    assert model.context_length == 64 and model.img_size == 224
    assert [n for n, p in model.named_parameters() if p.ndim == 0] == []
    assert model.text.width == 512 and len(model.text.blocks) == 12
    assert model.visual.width == 768 and len(model.visual.vit.blocks) == 12
    assert model.image_proj.out_features == 768 and model.text_proj.out_features == 768
    if "llip" in name:
        assert model.mixture_tokens == 64 and model.mixer.heads == 8
    n_params = sum(p.numel() for p in model.parameters())
    assert 140e6 < n_params < 170e6  # ViT-B/16 (86M) + 12-layer 512-wide text transformer (~63M incl. embeddings)


# One option out of its range per model class, and the start of the class's message
BAD_OPTIONS = [("llip_tiny", {"mixture_tokens": 0}, "mixture_tokens must be >= 1"),
               ("llip_tiny", {"query_from": "hidden"}, "query_from 'hidden' needs zeroshot_query"),
               ("prolip_tiny", {"mask_ratio": 1.0}, "mask_fraction must be in [0, 1]"),
               ("prolip_llip_tiny", {"mixture_tokens": 0}, "mixture_tokens must be >= 1"),
               ("pcmepp_tiny", {"msda_beta": 0.0}, "msda_fraction must be in [0, 1] and msda_beta > 0")]


@pytest.mark.parametrize("name, options, message", BAD_OPTIONS, ids=[f"{n}-{next(iter(o))}" for n, o, _ in BAD_OPTIONS])
def test_options_are_checked_without_building_the_model(name, options, message):
    """registry.check_overrides runs a model class's own option checks (what a config load calls, before any
    process starts) and raises what building it raises; the tower sizes come from the table as built."""
    with pytest.raises(ValueError, match=re.escape(message)):
        create_model(name, **options)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_overrides(name, **options)
    with pytest.raises(TypeError, match="unknown overrides nonsense"):
        check_overrides(name, nonsense=1)
    for valid in list_models():  # every class checks its options before its first tower
        check_overrides(valid, **({"source": name} if valid.endswith("_adapter") else {}))
    sizes = {"context_length": 12, "embed_dim": 32}
    model = create_model(name, **sizes)
    towers = tower_config(name, **sizes)
    assert (model.context_length, model.img_size, towers.embed_dim) == (towers.context_length, towers.img_size, 32)
    assert tower_config("pfe_adapter", source=name, source_overrides=sizes) == towers


def test_the_model_table_is_read_without_timm():
    """A job's driver reads the model table (names, option checks, the text context) but never builds a model: timm,
    which brings torchvision and torch._dynamo (~2 CPU-s), stays out of it."""
    code = ("import sys; from models.registry import check_overrides, tower_config; "
            "check_overrides('llip_tiny', mixture_tokens=4); tower_config('prolip_vit_b16'); "
            "from pipelines.pretrain.config import load_train_config; load_train_config('configs/prolip_demo.yaml'); "
            "import pipelines.pretrain.job, pipelines.pretrain.run_summary; print('timm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*_tiny.yaml")) + sorted((ROOT / "configs").glob("*_vit_b16.yaml")),
                         ids=lambda p: p.name)
def test_method_configs_validate(path):
    from pipelines.pretrain.config import load_train_config

    cfg = load_train_config(path)
    assert cfg.model.name in list_models()


def test_token_dropping_keeps_prefix_tokens():
    tower = ImageTower(32, 8, 64, 2, 2, extra_tokens=3).eval()
    images = torch.randn(4, 3, 32, 32)
    keep = random_keep(4, tower.num_patches, 0.75)
    assert keep.shape == (4, 4) and (keep.diff(dim=1) > 0).all()
    full, dropped = tower.embed(images), tower.embed(images, keep)
    assert dropped.shape == (4, 4 + 4, 64)
    assert torch.equal(dropped[:, :4], full[:, :4])  # [CLS] + 3 extra tokens stay
    assert torch.equal(dropped[:, 4:], torch.gather(full[:, 4:], 1, keep[..., None].expand(-1, -1, 64)))
    assert tower(images, keep).shape == (4, 8, 64)


def test_appended_text_tokens_ignore_padding():
    torch.manual_seed(0)
    tower = TextTower(16, 64, 2, 2, append_tokens=2, mask_token=True).eval()
    tokens = tokenize(["the digit seven", "a number"], 16)
    noisy = tokens.clone()
    eot = TextTower.eot_index(tokens)
    for i, e in enumerate(eot):
        noisy[i, e + 1 :] = 1234  # garbage in the padding
    with torch.no_grad():
        a, b = tower(tokens), tower(noisy)
    # the context is cut after the longest caption's EOT; the shorter caption keeps (garbage) padding
    assert a.shape == b.shape == (2, int(eot.max()) + 1 + 2, 64) and eot[1] < eot[0]
    assert torch.allclose(a[:, -2:], b[:, -2:], atol=1e-5)  # [UNC], [CLS] never see padding
    for i, e in enumerate(eot):
        assert torch.allclose(a[i, : e + 1], b[i, : e + 1], atol=1e-5)


@pytest.mark.parametrize("name", TINY)
def test_text_encoding_does_not_depend_on_batch_padding(name):
    # the text tower cuts the padding after the batch's longest caption: a caption must encode the same
    # alone, next to a caption that fills the whole context, and with [MASK]ed words (ProLIP's masked copies)
    torch.manual_seed(0)
    model = create_model(name).eval()
    short = tokenize(["the digit seven", "a number"], model.context_length)
    long = tokenize([" ".join(["seven"] * 40)], model.context_length)
    assert int(TextTower.eot_index(long)[0]) == model.context_length - 1  # truncated: EOT in the last column
    with torch.no_grad():
        alone, mixed = model.encode_text(short), model.encode_text(torch.cat([short, long]))
        for key in alone:
            assert torch.allclose(alone[key], mixed[key][:2], atol=1e-5), key
        if model.text.mask_embedding is not None:
            mask = torch.zeros_like(short, dtype=torch.bool)
            mask[:, 1] = True
            pad_mask = torch.zeros_like(long, dtype=torch.bool)
            alone = model.encode_text(short, mask)
            mixed = model.encode_text(torch.cat([short, long]), torch.cat([mask, pad_mask]))
            for key in alone:
                assert torch.allclose(alone[key], mixed[key][:2], atol=1e-5), key


def test_text_masking_masks_words_only():
    tokens = tokenize(["the number one written by hand", "a", "a handwritten digit"], 16)
    mask = random_text_mask(tokens, 0.75)
    eot = TextTower.eot_index(tokens)
    for i in range(3):
        n_words = int(eot[i]) - 1
        assert int(mask[i].sum()) == max(1, round(0.75 * n_words))
        assert not mask[i, 0] and not mask[i, eot[i]:].any()


def test_prolip_masked_pass_and_unc_init():
    torch.manual_seed(0)
    model = create_model("prolip_tiny").train()
    images, tokens = batch(64)
    out = model(images, tokens)
    assert out["masked_rows"].numel() == 8  # 12.5% of 64
    assert out["image_masked_mu"].shape == (8, 64) and out["text_masked_logvar"].shape == (8, 64)
    # [UNC] projection bias -10: sigma^2 starts near e^-10
    for side in ("image", "text"):
        assert abs(out[f"{side}_logvar"].mean().item() + 10) < 1.0
    assert masked_rows(64, 0.125).unique().numel() == 8
    model.eval()
    assert "masked_rows" not in model(images, tokens)


def test_mixed_sample_augmentation_labels():
    images = torch.rand(16, 3, 8, 8)
    seen = set()
    for seed in range(12):
        torch.manual_seed(seed)
        mixed, lam, partner = mixed_sample(images, 0.25, 2.0)
        touched = (lam < 1) | (partner != torch.arange(16))
        assert int(touched.sum()) <= 4 and ((lam >= 0) & (lam <= 1)).all()
        assert torch.equal(mixed[~touched], images[~touched])
        for i in touched.nonzero().flatten().tolist():
            src, dst, l = images[i], images[partner[i]], lam[i].item()
            if torch.allclose(mixed[i], l * src + (1 - l) * dst, atol=1e-6):
                seen.add("mixup")
            else:
                own = (mixed[i] == src).all(0)
                assert ((mixed[i] == src) | (mixed[i] == dst)).all()
                assert own.float().mean().item() == pytest.approx(l, abs=1e-6)
                seen.add("cutmix")
    assert seen == {"mixup", "cutmix"}


def test_pcmepp_training_forward_has_soft_labels():
    torch.manual_seed(0)
    out = create_model("pcmepp_tiny").train()(*batch(16))
    assert out["mix_lambda"].shape == (16,) and out["mix_partner"].shape == (16,)
    assert int(((out["mix_lambda"] < 1) | (out["mix_partner"] != torch.arange(16))).sum()) <= 4


def test_gpo_ignores_padding_and_weights_sum_to_one():
    torch.manual_seed(0)
    gpo = GPO()
    feats = torch.randn(3, 10, 8)
    lengths = torch.tensor([10, 4, 7])
    w = gpo.weights(lengths, 10)
    assert torch.allclose(w.sum(1), torch.ones(3)) and (w[1, 4:] == 0).all()
    noisy = feats.clone()
    noisy[1, 4:] = 100.0
    assert torch.allclose(gpo(feats, lengths), gpo(noisy, lengths))
    # one row alone gives the same pooled feature as inside the batch
    assert torch.allclose(gpo(feats[1:2, :4], lengths[1:2]), gpo(feats, lengths)[1:2], atol=1e-6)


def test_gpo_weights_and_bf16_sort_equal_the_per_length_float32_reference():
    """The sync-free weights (every length's GRU pass at once) equal each length's own pass; pooling bf16 features
    (sorted in bf16, then upcast) equals pooling their exact float32 copy."""
    torch.manual_seed(1)
    gpo = GPO().double()
    lengths = torch.tensor([9, 3, 9, 1, 6])
    for row, n in zip(gpo.weights(lengths, 9), lengths.tolist()):
        alone = gpo.weights(None, n)[0]  # one unpacked pass of a length-n sequence
        torch.testing.assert_close(row[:n], alone, rtol=1e-12, atol=1e-12)
        assert (row[n:] == 0).all()
    gpo = GPO()
    feats = torch.randn(4, 7, 16).bfloat16()
    for lens in (None, torch.tensor([7, 2, 5, 7])):
        assert torch.equal(gpo(feats, lens), gpo(feats.float(), lens))


def test_probabilistic_zero_shot_is_negative_csd_of_prompt_ensemble():
    torch.manual_seed(0)
    model = create_model("prolip_tiny").eval()
    images, tokens = batch()
    with torch.no_grad():
        img, txt = model.encode_image(images), model.encode_text(tokens)
        per = {k: v.reshape(2, 4, -1) for k, v in txt.items()}
        cls = model.class_embeddings(per)
        scores = model.class_scores(img, cls)
    mu = F.normalize(per["mu"].mean(1), dim=-1)
    var = per["logvar"].exp().mean(1)
    assert torch.allclose(cls["mu"], mu, atol=1e-6) and torch.allclose(cls["logvar"].exp(), var, rtol=1e-5)
    naive = torch.stack([torch.stack([
        -((img["mu"][i] - mu[c]).pow(2).sum() + img["logvar"][i].exp().sum() + var[c].sum())
        for c in range(2)]) for i in range(8)])
    assert torch.allclose(scores, naive, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["llip_tiny", "prolip_llip_tiny"])
def test_llip_zero_shot_contextualises_per_class(name):
    torch.manual_seed(0)
    model = create_model(name).eval()
    images, tokens = batch()
    with torch.no_grad():
        img, txt = model.encode_image(images), model.encode_text(tokens)
        per = {k: v.reshape(2, 4, -1) for k, v in txt.items()}
        cls = model.class_embeddings(per)
        scores = model.class_scores(img, cls)
        query = F.normalize(per["mu"].mean(1), dim=-1)  # template-averaged query
        z = model.mixer.contextualise(img["mix"], query)  # (N, C, D)
        cos = (z * query[None]).sum(-1)
    if name == "llip_tiny":
        assert torch.allclose(scores, cos, atol=1e-5)
    else:
        tr_i, tr_c = img["logvar"].exp().sum(-1), cls["logvar"].exp().sum(-1)
        assert torch.allclose(scores, -(2 - 2 * cos + tr_i[:, None] + tr_c[None]), atol=1e-5)


def test_llip_training_cosines_match_naive_mixer():
    torch.manual_seed(0)
    model = create_model("llip_tiny").train()
    images, tokens = batch()
    out = model(images, tokens)
    img, txt = model.encode_image(images), model.encode_text(tokens)
    naive = model.mixer.naive_pair_cos(img["mix"], txt["mu"], txt["mu"])
    assert out["pair_cos"].shape == (8, 8) and torch.allclose(out["pair_cos"], naive, atol=1e-5)
    assert math.isfinite(out["pair_cos"].sum().item())


def fresh_python_lines(code: str) -> list[str]:
    """The first two lines `code` prints in a new Python (the project's root as its folder), which must succeed."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120),
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split("\n")[:2]


def open_clip_tokens() -> list[list[int]]:
    """open_clip's own tokens for the caption the tokenizer tests use: the reference."""
    import open_clip

    return open_clip.tokenize(["a photo of a dog"], 8).tolist()


def test_data_workers_tokenize_without_importing_model_code():
    """What a Ray Data worker imports to read shards: the reader and the tokenizer, not timm or open_clip's models."""
    # Torch comes with the first tokenization, not with the import: the Ray Train and Ray Data actors that only
    # unpickle the reading plan (dataset manager, split coordinator) skip its import.
    code = ("import sys, pipelines.data.reader; from models.tokenizer import tokenize; print('torch' in sys.modules); "
            "t = tokenize(['a photo of a dog'], 8); "
            "print(t.tolist(), 'timm' in sys.modules, 'open_clip' in sys.modules, 'models.registry' in sys.modules)")
    assert fresh_python_lines(code) == ["False", f"{open_clip_tokens()} False False False"]


def test_tokenizer_load_stopped_part_way_is_retried_not_left_half_made():
    """Ray Data cancels a running task with a KeyboardInterrupt (an epoch or a run ending). Landing while the
    tokenizer's module runs its imports, it must leave nothing behind: the worker process's next tokenization loads
    the module afresh (a half-made module left in sys.modules failed every later task of that process)."""
    code = """
import sys

class InterruptOnce:
    fired = False

    def find_spec(self, name, path=None, target=None):
        if name == "ftfy" and not InterruptOnce.fired:  # the tokenizer module's first import
            InterruptOnce.fired = True
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, InterruptOnce())
from models.tokenizer import tokenize
try:
    tokenize(["a photo of a dog"], 8)
except KeyboardInterrupt:
    print("interrupted")
print(tokenize(["a photo of a dog"], 8).tolist())
"""
    assert fresh_python_lines(code) == ["interrupted", str(open_clip_tokens())]


def test_task_cancelled_inside_torch_import_leaves_the_worker_able_to_tokenize():
    """Ray cancels a task by `_thread.interrupt_main()`. Landing inside the worker's first `import torch` (here: as
    torch imports torch._prims), it left torch's operator registry half filled and every later tokenization of that
    worker process failed ('Only a single TORCH_LIBRARY can be used to register the namespace prims') or crashed: an
    elastic run that grew back failed five times on the new node's data workers. The cancel still ends the task."""
    code = """
import _thread, sys

class CancelInsideTorch:
    fired = False

    def find_spec(self, name, path=None, target=None):
        if name == "torch._prims" and not CancelInsideTorch.fired:
            CancelInsideTorch.fired = True
            _thread.interrupt_main()  # what ray.cancel does to the task's thread
        return None

sys.meta_path.insert(0, CancelInsideTorch())
from models.tokenizer import tokenize
try:
    tokenize(["a photo of a dog"], 8)
except KeyboardInterrupt:
    print("cancelled", CancelInsideTorch.fired)
print(tokenize(["a photo of a dog"], 8).tolist())
"""
    assert fresh_python_lines(code) == ["cancelled True", str(open_clip_tokens())]
