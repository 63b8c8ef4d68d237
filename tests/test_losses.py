"""Losses against deliberately naive O(B^2 D) references (values and gradients), float64."""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import scipy.stats
import torch
import torch.nn.functional as F

from models.gather import World
from models.llip_mixer import LlipMixer
from models.losses import create_loss, list_losses, loss_class

f64 = torch.float64
ONE = World(0, 1)
B, D = 6, 5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _prob_batch(seed=0, b=B, d=D, masked=True, mix=False):
    g = _gen(seed)
    out = {
        "image_mu": F.normalize(torch.randn(b, d, generator=g, dtype=f64), dim=-1),
        "text_mu": F.normalize(torch.randn(b, d, generator=g, dtype=f64), dim=-1),
        "image_logvar": torch.randn(b, d, generator=g, dtype=f64) - 1.0,
        "text_logvar": torch.randn(b, d, generator=g, dtype=f64) - 0.5,
    }
    if masked:
        rows = torch.tensor([1, 4])
        out["masked_rows"] = rows
        for m in ("image", "text"):
            out[f"{m}_masked_mu"] = F.normalize(torch.randn(2, d, generator=g, dtype=f64), dim=-1)
            out[f"{m}_masked_logvar"] = torch.randn(2, d, generator=g, dtype=f64)
    if mix:
        out["mix_lambda"] = torch.tensor([1.0, 0.7, 1.0, 0.35, 1.0, 0.6], dtype=f64)[:b]
        out["mix_partner"] = torch.tensor([0, 3, 2, 5, 4, 0])[:b]
    for k, v in out.items():
        if v.is_floating_point() and k != "mix_lambda":
            v.requires_grad_(True)
    return out


def _check(loss_mod, naive, out, rtol=1e-9, atol=1e-11):
    """Loss value and gradients (inputs + loss parameters) equal the naive reference."""
    got = loss_mod(out, ONE)
    ref = naive(out, loss_mod)
    torch.testing.assert_close(got["loss"], ref, rtol=rtol, atol=atol)
    leaves = [v for v in out.values() if v.requires_grad] + list(loss_mod.parameters())
    g1 = torch.autograd.grad(got["loss"], leaves, allow_unused=True)
    g2 = torch.autograd.grad(ref, leaves, allow_unused=True)
    for a, b in zip(g1, g2):
        if a is None or b is None:
            assert (a is None or a.abs().max() == 0) and (b is None or b.abs().max() == 0)
        else:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    for k, v in got.items():
        assert k == "loss" or not v.requires_grad, k
    return got


# ---------------------------------------------------------------------------------------------
# naive references: explicit (B, B, D) broadcasts and Python loops
# ---------------------------------------------------------------------------------------------
def _y(b):
    return 2 * torch.eye(b, dtype=f64) - 1


def _sigmoid_loss(logits):
    return -F.logsigmoid(_y(logits.shape[0]) * logits).sum() / logits.shape[0]


def _scale(mod):
    return mod.logit_scale.exp().clamp(max=mod.max_scale).reshape(()), mod.logit_bias.reshape(())


def naive_siglip(out, mod):
    s, b = _scale(mod)
    dots = (out["image_mu"][:, None, :] * out["text_mu"][None, :, :]).sum(-1)
    return _sigmoid_loss(s * dots + b)


def naive_ppcl_logits(out, mod):
    s, b = _scale(mod)
    dots = (out["image_mu"][:, None, :] * out["text_mu"][None, :, :]).sum(-1)
    var = (out["image_logvar"].exp()[:, None, :] + out["text_logvar"].exp()[None, :, :]).sum(-1)
    return s * (dots - 0.5 * var) + b


def naive_ppcl(out, mod):
    return _sigmoid_loss(naive_ppcl_logits(out, mod))


def naive_inc(mu1, l1, mu2, l2, eps, form):
    """ProLIP Eq. 3 literally (A, B, C), per dimension, then Eq. 4."""

    def inc(m1, v1, m2, v2, lv1, lv2):
        p1, p2 = math.exp(eps) / v1, math.exp(eps) / v2
        A = p1 + p2 / 2
        Bq = 2 * m1 * p1 + m2 * p2
        C = m1**2 * p1 + m2**2 * p2 / 2
        w = 2.0 if form == "paper" else 1.0
        return -w * lv1 - w / 2 * lv2 - 0.5 * torch.log(A) + Bq**2 / (4 * A) - C

    v1, v2 = l1.exp(), l2.exp()
    return inc(mu1, v1, mu2, v2, l1, l2) - inc(mu2, v2, mu1, v1, l2, l1)


def naive_inclusion_loss(mu1, l1, mu2, l2, eps, c, form):
    h = naive_inc(mu1, l1, mu2, l2, eps, form)
    return -F.logsigmoid(c * h).mean()


def naive_vib(mu, lv):
    kl = torch.distributions.kl_divergence(torch.distributions.Normal(mu, (0.5 * lv).exp()), torch.distributions.Normal(0.0, 1.0))
    return kl.mean()


def naive_prolip(out, mod, pair=naive_ppcl):
    o = out
    loss = pair(o, mod)
    loss = loss + mod.alpha1 * naive_inclusion_loss(
        o["image_mu"], o["image_logvar"], o["text_mu"], o["text_logvar"], mod.eps, mod.c, mod.form
    )
    if "masked_rows" in o:
        r = o["masked_rows"]
        for m in ("image", "text"):
            loss = loss + mod.alpha2 * naive_inclusion_loss(
                o[f"{m}_mu"][r], o[f"{m}_logvar"][r], o[f"{m}_masked_mu"], o[f"{m}_masked_logvar"], mod.eps, mod.c, mod.form
            )
    vib = naive_vib(o["image_mu"], o["image_logvar"]) + naive_vib(o["text_mu"], o["text_logvar"])
    return loss + mod.beta * vib


def naive_pml(out, mod):
    o = out
    b = o["image_mu"].shape[0]
    mu_d = (o["image_mu"][:, None, :] - o["text_mu"][None, :, :]).pow(2).sum(-1)
    var_d = (o["image_logvar"].exp()[:, None, :] + o["text_logvar"].exp()[None, :, :]).sum(-1)
    logits = -mod.a.reshape(()) * (mu_d + var_d) + mod.b.reshape(())
    labels = torch.zeros(b, b, dtype=f64)
    for i in range(b):
        if "mix_lambda" in o:
            lam, p = o["mix_lambda"][i].item(), int(o["mix_partner"][i])
            labels[i, i] += lam
            labels[i, p] += 1 - lam
        else:
            labels[i, i] = 1.0
    match = F.binary_cross_entropy_with_logits(logits, labels)
    pp_labels = labels.clone()
    for i in range(b):
        j_gt = int(torch.argmax(labels[i]))
        for j in range(b):
            if logits[i, j].item() >= logits[i, j_gt].item():
                pp_labels[i, j] = labels[i, j_gt]
    pseudo = F.binary_cross_entropy_with_logits(logits, pp_labels)
    vib = naive_vib(o["image_mu"], o["image_logvar"]) + naive_vib(o["text_mu"], o["text_logvar"])
    return match + mod.alpha * pseudo + mod.beta * vib


# ---------------------------------------------------------------------------------------------
# deterministic baselines
# ---------------------------------------------------------------------------------------------
def test_siglip_vs_naive():
    mod = create_loss("siglip", init_scale=7.0, init_bias=-3.0).double()
    got = _check(mod, naive_siglip, _prob_batch(1, masked=False))
    assert got["scale"].item() == pytest.approx(7.0)


def test_infonce_vs_naive():
    mod = create_loss("infonce").double()
    out = _prob_batch(2, masked=False)

    def naive(o, m):
        s = m.logit_scale.exp().reshape(())
        total = 0.0
        for i in range(B):
            li = torch.stack([s * (o["image_mu"][i] * o["text_mu"][j]).sum() for j in range(B)])
            lt = torch.stack([s * (o["text_mu"][i] * o["image_mu"][j]).sum() for j in range(B)])
            total = total - torch.log_softmax(li, 0)[i] - torch.log_softmax(lt, 0)[i]
        return total / (2 * B)

    _check(mod, naive, out)


# ---------------------------------------------------------------------------------------------
# ProLIP
# ---------------------------------------------------------------------------------------------
def test_ppcl_vs_naive():
    mod = create_loss("ppcl", init_scale=4.0, init_bias=-1.0).double()
    got = _check(mod, naive_ppcl, _prob_batch(3, masked=False))
    assert set(got) >= {"loss", "ppcl", "scale", "bias"}


def test_ppcl_scale_is_clamped_in_forward_not_in_data():
    mod = create_loss("ppcl", init_scale=500.0, max_scale=100.0).double()
    got = mod(_prob_batch(3), ONE)
    assert got["scale"].item() == pytest.approx(100.0)
    assert mod.logit_scale.item() == pytest.approx(math.log(500.0))


@pytest.mark.parametrize("form", ["paper", "exact"])
def test_inclusion_loss_vs_literal_eq3(form):
    mod = create_loss("inclusion", eps=-1.5, c=3.0, form=form).double()

    def naive(o, m):
        return naive_inclusion_loss(o["image_mu"], o["image_logvar"], o["text_mu"], o["text_logvar"], m.eps, m.c, m.form)

    got = _check(mod, naive, _prob_batch(4, masked=False))
    assert "inclusion_v_t" in got


def test_vib_loss_vs_closed_form():
    mod = create_loss("vib", beta=0.3)

    def naive(o, m):
        return m.beta * (naive_vib(o["image_mu"], o["image_logvar"]) + naive_vib(o["text_mu"], o["text_logvar"]))

    _check(mod, naive, _prob_batch(5, masked=False))


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("form", ["paper", "exact"])
def test_prolip_objective_vs_naive(masked, form):
    mod = create_loss("prolip", init_scale=3.0, init_bias=-2.0, alpha1=0.3, alpha2=0.5, beta=0.7, eps=-1.0, c=2.0, form=form).double()
    got = _check(mod, naive_prolip, _prob_batch(6, masked=masked))
    for k in ("ppcl", "inclusion_v_t", "inclusion_masked", "inclusion_masked_image", "inclusion_masked_text", "vib"):
        assert k in got and got[k].dim() == 0
    if not masked:
        assert got["inclusion_masked"].item() == 0.0


# ---------------------------------------------------------------------------------------------
# PCME++
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mix", [False, True])
def test_pml_vs_naive(mix):
    mod = create_loss("pml", init_a=2.0, init_b=1.5, alpha=0.4, beta=0.2).double()
    out = _prob_batch(7, masked=False, mix=mix)
    # Make some pseudo-positives: caption 2 is close to image 0.
    with torch.no_grad():
        out["text_mu"][2] = F.normalize(out["image_mu"][0] + 0.05 * out["text_mu"][2], dim=0)
        out["text_logvar"][2] = out["text_logvar"][0] - 0.5
    got = _check(mod, naive_pml, out)
    assert got["n_pseudo"].item() > 0
    assert set(got) >= {"pml", "pseudo_match", "vib", "a", "b"}


def test_pml_labels_with_msda():
    from models.losses import match_labels

    out = {"mix_lambda": torch.tensor([1.0, 0.7, 0.4]), "mix_partner": torch.tensor([0, 2, 0])}
    m = match_labels(3, 6, 3, out, torch.zeros(1))
    ref = torch.zeros(3, 6)
    ref[0, 3] = 1.0
    ref[1, 4], ref[1, 5] = 0.7, 0.3
    ref[2, 5], ref[2, 3] = 0.4, 0.6
    torch.testing.assert_close(m, ref)


# ---------------------------------------------------------------------------------------------
# Llip
# ---------------------------------------------------------------------------------------------
def naive_llip_cos(mixer: LlipMixer, tokens, query, text):
    """Loops over every (image, caption, head): Llip Eq. 1-2, then the cosine."""
    h, dh = mixer.heads, mixer.dim // mixer.heads
    wq = mixer.q_proj.weight if isinstance(mixer.q_proj, torch.nn.Linear) else torch.eye(mixer.dim, dtype=query.dtype)
    wk, wv, wo = mixer.k_proj.weight, mixer.v_proj.weight, mixer.out_weight
    rows = []
    for i in range(tokens.shape[0]):
        keys, vals = tokens[i] @ wk.T, tokens[i] @ wv.T  # (K, D)
        row = []
        for j in range(query.shape[0]):
            q = wq @ query[j]
            heads = []
            for m in range(h):
                sl = slice(m * dh, (m + 1) * dh)
                w = torch.softmax(keys[:, sl] @ q[sl] / mixer.tau, dim=0)  # (K,)
                heads.append((w[:, None] * vals[:, sl]).sum(0))
            z = wo @ torch.cat(heads)
            t = text[j] / text[j].norm()
            row.append((z / z.norm() * t).sum())
        rows.append(torch.stack(row))
    return torch.stack(rows)


def _llip_inputs(seed, b=5, n=5, k=3, d=8):
    g = _gen(seed)
    tokens = torch.randn(b, k, d, generator=g, dtype=f64, requires_grad=True)
    query = torch.randn(n, d, generator=g, dtype=f64, requires_grad=True)
    text = torch.randn(n, d, generator=g, dtype=f64, requires_grad=True)
    return tokens, query, text


@pytest.mark.parametrize("chunk", [1, 2, 0])
def test_llip_mixer_chunked_equals_naive_values_and_gradients(chunk):
    torch.manual_seed(0)
    mixer = LlipMixer(8, heads=2, tau=0.7, chunk_size=chunk).double()
    tokens, query, text = _llip_inputs(8)
    w = torch.randn(5, 5, dtype=f64)
    leaves = [tokens, query, text, *mixer.parameters()]
    results = []
    for fn in (mixer, mixer.naive_pair_cos, lambda *a: naive_llip_cos(mixer, *a)):
        cos = fn(tokens, query, text)
        results.append((cos, torch.autograd.grad((cos * w).sum(), leaves)))
    for cos, grads in results[:2]:
        torch.testing.assert_close(cos, results[2][0], rtol=1e-10, atol=1e-12)
        for a, b in zip(grads, results[2][1]):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert results[0][0].abs().max() <= 1 + 1e-12


@pytest.mark.parametrize("heads,k,chunk", [(2, 3, 2), (4, 3, 0), (2, 5, 1)])
def test_llip_mixer_factored_form_equals_naive_values_and_gradients(heads, k, chunk):
    """The factored cosines (values' Gram matrices, checkpointed chunks) equal the naive loops, with H K below
    and above D."""
    torch.manual_seed(heads + k)
    mixer = LlipMixer(8, heads=heads, tau=0.9, chunk_size=chunk, pair_form="factored").double()
    tokens, query, text = _llip_inputs(20 + heads + k, k=k)
    leaves = [tokens, query, text, *mixer.parameters()]
    cos, ref = mixer(tokens, query, text), naive_llip_cos(mixer, tokens, query, text)
    torch.testing.assert_close(cos, ref, rtol=1e-10, atol=1e-12)
    w = torch.randn(cos.shape, dtype=f64)
    for a, b in zip(torch.autograd.grad((cos * w).sum(), leaves), torch.autograd.grad((ref * w).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    with torch.no_grad():
        torch.testing.assert_close(mixer(tokens, query, text), ref.detach(), rtol=1e-10, atol=1e-12)


def test_llip_mixer_picks_the_factored_form_where_it_is_cheaper():
    from models.llip_mixer import cheaper_pair_form

    assert cheaper_pair_form(8, 16, 768, 256) == "factored"  # ViT-B/16, K = 16: H K = 128 << D
    assert cheaper_pair_form(8, 64, 768, 256) == "direct"  # K = 64: (H K)^2 = 262k vs D^2 = 590k per pair
    assert cheaper_pair_form(8, 16, 256, 64) == "direct"  # the CPU "small" size: counts too close to pay
    with pytest.raises(ValueError):
        LlipMixer(8, heads=2, pair_form="gram")


def test_llip_mixer_without_grad_and_validation():
    mixer = LlipMixer(8, heads=4, tau=5.0, chunk_size=2).double()
    tokens, query, text = _llip_inputs(9)
    with torch.no_grad():
        torch.testing.assert_close(mixer(tokens, query, text), mixer.naive_pair_cos(tokens, query, text))
    z = mixer.contextualise(tokens, query)
    assert z.shape == (5, 5, 8)
    torch.testing.assert_close(z.norm(dim=-1), torch.ones(5, 5, dtype=f64))
    with pytest.raises(ValueError):
        LlipMixer(10, heads=4)
    with pytest.raises(ValueError):
        mixer(tokens[0], query, text)


def test_llip_loss_vs_naive():
    torch.manual_seed(1)
    mixer = LlipMixer(8, heads=2, tau=1.0, chunk_size=2).double()
    tokens, query, text = _llip_inputs(10, b=6, n=6)
    mod = create_loss("llip", init_scale=6.0, init_bias=-2.0).double()
    out = {"pair_cos": mixer(tokens, query, text)}

    def naive(o, m):
        s, b = _scale(m)
        return _sigmoid_loss(s * naive_llip_cos(mixer, tokens, query, text) + b)

    got = mod(out, ONE)
    ref = naive(out, mod)
    torch.testing.assert_close(got["loss"], ref)
    leaves = [tokens, query, text, *mixer.parameters(), *mod.parameters()]
    for a, b in zip(torch.autograd.grad(got["loss"], leaves), torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(a, b)
    assert "llip" in got


def test_prob_llip_vs_naive():
    mod = create_loss("prob_llip", init_scale=3.0, init_bias=-1.0, alpha1=0.2, alpha2=0.3, beta=0.1, eps=-2.0, c=5.0).double()
    out = _prob_batch(11)
    g = _gen(11)
    out["pair_cos"] = (torch.rand(B, B, generator=g, dtype=f64) * 2 - 1).requires_grad_()

    def pair(o, m):
        s, b = _scale(m)
        var = (o["image_logvar"].exp()[:, None, :] + o["text_logvar"].exp()[None, :, :]).sum(-1)
        return _sigmoid_loss(s * (o["pair_cos"] - 0.5 * var) + b)

    got = _check(mod, lambda o, m: naive_prolip(o, m, pair=pair), out, rtol=1e-7, atol=1e-9)
    assert "prob_llip" in got and "ppcl" not in got


# ---------------------------------------------------------------------------------------------
# ProbVLM
# ---------------------------------------------------------------------------------------------
def _probvlm_batch(seed):
    g = _gen(seed)
    out = {}
    for m in ("image", "text"):
        out[f"{m}_hat"] = torch.randn(B, D, generator=g, dtype=f64)
        out[f"{m}_alpha"] = torch.rand(B, D, generator=g, dtype=f64) + 0.1
        out[f"{m}_beta"] = torch.rand(B, D, generator=g, dtype=f64) * 2 + 0.3
        out[f"{m}_target"] = torch.randn(B, D, generator=g, dtype=f64)
    return out


def test_probvlm_vs_scipy_gennorm():
    mod = create_loss("probvlm", lambda_cross=0.3, l1=0.2)
    out = _probvlm_batch(12)
    n = {k: v.numpy() for k, v in out.items()}

    def nll(x, m):
        return np.mean(-scipy.stats.gennorm.logpdf(x, n[f"{m}_beta"], loc=n[f"{m}_hat"], scale=n[f"{m}_alpha"]) - math.log(2))

    rec = nll(n["image_target"], "image") + nll(n["text_target"], "text")
    cross = nll(n["text_target"], "image") + nll(n["image_target"], "text")
    l1 = np.abs(n["image_hat"] - n["image_target"]).mean() + np.abs(n["text_hat"] - n["text_target"]).mean()
    got = mod(out, ONE)
    assert got["loss"].item() == pytest.approx(rec + 0.3 * cross + 0.2 * l1, rel=1e-10)
    assert got["cross"].item() == pytest.approx(cross, rel=1e-10)
    approx = create_loss("probvlm", approx=True)(out, ONE)
    assert torch.isfinite(approx["loss"])


# ---------------------------------------------------------------------------------------------
# registry, interface, numerical safety
# ---------------------------------------------------------------------------------------------
EXPECTED = {"infonce", "siglip", "ppcl", "pml", "inclusion", "vib", "prolip", "llip", "prob_llip", "probvlm"}


def test_registry_and_typed_constructor_params():
    assert EXPECTED <= set(list_losses())
    for name in EXPECTED:
        cls = loss_class(name)
        sig = inspect.signature(cls.__init__)
        for p in list(sig.parameters.values())[1:]:
            assert p.annotation in (float, int, bool, str, "float", "int", "bool", "str"), (name, p)
            assert p.default is not inspect.Parameter.empty, (name, p.name)
        assert isinstance(create_loss(name), torch.nn.Module)
    with pytest.raises(KeyError, match="unknown loss"):
        create_loss("nope")
    with pytest.raises(ValueError):
        create_loss("inclusion", form="bad")


def _extreme_out(kind: str, b=8, d=16):
    g = _gen(13)
    mu = F.normalize(torch.randn(b, d, generator=g), dim=-1)
    if kind == "tiny":
        lv_i, lv_t = torch.full((b, d), -30.0), torch.full((b, d), -30.0)
    elif kind == "huge":
        lv_i, lv_t = torch.full((b, d), 30.0), torch.full((b, d), 30.0)
    else:  # mixed extremes
        lv_i, lv_t = torch.full((b, d), -30.0), torch.full((b, d), 30.0)
    out = {
        "image_mu": mu.clone(),
        "text_mu": mu.clone(),  # identical means
        "image_logvar": lv_i,
        "text_logvar": lv_t,
        "masked_rows": torch.tensor([0, 3]),
        "image_masked_mu": mu[[0, 3]].clone(),
        "image_masked_logvar": lv_t[[0, 3]].clone(),
        "text_masked_mu": mu[[0, 3]].clone(),
        "text_masked_logvar": -lv_t[[0, 3]].clone(),
        "mix_lambda": torch.tensor([1.0, 0.5, 1, 1, 1, 1, 1, 0.2]),
        "mix_partner": torch.tensor([0, 2, 2, 3, 4, 5, 6, 1]),
        "pair_cos": torch.ones(b, b),
    }
    for m in ("image", "text"):
        out[f"{m}_hat"] = mu.clone()
        out[f"{m}_target"] = mu.clone()
        out[f"{m}_alpha"] = torch.full((b, d), 1e-6)
        out[f"{m}_beta"] = torch.full((b, d), 0.2)
    for v in out.values():
        if v.is_floating_point():
            v.requires_grad_(True)
    return out


@pytest.mark.parametrize("kind", ["tiny", "huge", "mixed"])
@pytest.mark.parametrize(
    "name,params",
    [
        ("infonce", {}),
        ("siglip", {}),
        ("ppcl", {}),
        ("pml", {}),
        ("inclusion", {"c": 1000.0, "eps": 0.0}),
        ("inclusion", {"c": 1000.0, "eps": -20.0, "form": "exact"}),
        ("vib", {}),
        ("prolip", {"c": 1000.0, "eps": -20.0, "alpha1": 1.0, "alpha2": 1.0}),
        ("prolip", {"c": 1000.0, "eps": 0.0, "alpha1": 1.0, "alpha2": 1.0}),
        ("llip", {}),
        ("prob_llip", {"c": 1000.0}),
        ("probvlm", {}),
        ("probvlm", {"approx": True, "l1": 1.0}),
    ],
)
def test_numerical_safety_float32(kind, name, params):
    mod = create_loss(name, **params)
    out = _extreme_out(kind)
    got = mod(out, ONE)
    assert got["loss"].dtype == torch.float32 and torch.isfinite(got["loss"]), got
    leaves = [v for v in out.values() if v.requires_grad] + list(mod.parameters())
    grads = torch.autograd.grad(got["loss"], leaves, allow_unused=True)
    assert all(g is None or torch.isfinite(g).all() for g in grads)


def test_bfloat16_inputs_are_computed_in_float32():
    out = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v) for k, v in _prob_batch(14).items()}
    for name in ("ppcl", "prolip", "siglip", "pml"):
        got = create_loss(name)(out, ONE)
        assert got["loss"].dtype == torch.float32 and torch.isfinite(got["loss"])


def test_llip_mixer_partial_gradients_and_bfloat16_autocast():
    torch.manual_seed(2)
    mixer = LlipMixer(8, heads=2, tau=2.0, chunk_size=2, query_proj=False).double()
    mixer.out_weight.requires_grad_(False)
    tokens, query, text = _llip_inputs(12)
    text = text.detach()
    w = torch.randn(5, 5, dtype=f64)
    got = torch.autograd.grad((mixer(tokens, query, text) * w).sum(), [tokens, query, mixer.k_proj.weight])
    ref = torch.autograd.grad((naive_llip_cos(mixer, tokens, query, text) * w).sum(), [tokens, query, mixer.k_proj.weight])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    mixer32 = LlipMixer(8, heads=2, chunk_size=2)
    t32 = [x.detach().float().requires_grad_() for x in _llip_inputs(13)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos = mixer32(*t32)
    cos.float().sum().backward()
    assert torch.isfinite(cos.float()).all() and all(torch.isfinite(x.grad).all() for x in t32)
