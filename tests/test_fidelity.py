"""Every switch between a paper's formula and its official code's behaviour (docs/FIDELITY.md), each against
an independent reference written from the description in that table (float64, small sizes), plus the
bf16 guarantee: under bf16 autocast the sigma heads, the Llip mixer and the losses compute in float32.

No Ray: formulas and single forward passes, and three steps of a bf16 DeepSpeed engine in a subprocess
(``make test-fast``).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models.distributions import ggd_nll, vib_kl
from models.heads import GPO, Float32Linear
from models.losses import create_loss
from models.pcmepp import mixed_sample
from models.registry import create_model
from models.tokenizer import tokenize
from models.towers import random_text_mask
from pipelines.adapt_config import AdaptLossConfig
from pipelines.config import load_config

f64 = torch.float64
ROOT = Path(__file__).resolve().parent.parent


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------- VIB
def _kl_reference(mu: torch.Tensor, lv: torch.Tensor, log_weight: float) -> float:
    """Elementwise python-float KL of N(mu, e^l) to N(0, 1), the log sigma^2 term weighted, mean over all."""
    terms = [-0.5 * (1.0 + log_weight * l - m * m - math.exp(l)) for m, l in zip(mu.flatten().tolist(), lv.flatten().tolist())]
    return sum(terms) / len(terms)


def test_vib_half_logvar_form_against_elementwise_reference():
    g = _gen(1)
    mu, lv = torch.randn(5, 7, generator=g, dtype=f64), 2 * torch.randn(5, 7, generator=g, dtype=f64)
    assert vib_kl(mu, lv, "half_logvar").item() == pytest.approx(_kl_reference(mu, lv, 0.5), rel=1e-12)
    assert vib_kl(mu, lv).item() == pytest.approx(_kl_reference(mu, lv, 1.0), rel=1e-12)
    # with l/2 the KL is smallest at sigma^2 = 1/2 (d/dl: -1/2 (1/2 - e^l) = 0), the standard one at sigma^2 = 1
    for form, best in (("half_logvar", 0.5), ("standard", 1.0)):
        lv = torch.full((1, 3), math.log(best), dtype=f64, requires_grad=True)
        vib_kl(torch.zeros(1, 3, dtype=f64), lv, form).backward()
        assert lv.grad.abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="vib form"):
        vib_kl(mu, lv, "half")


def test_vib_guard_zeroes_each_modality_past_the_threshold():
    g = _gen(2)
    out = {k: torch.randn(4, 6, generator=g, dtype=f64) for k in ("image_mu", "text_mu", "text_logvar")}
    out["image_logvar"] = torch.full((4, 6), 12.0, dtype=f64, requires_grad=True)  # KL ~ e^12 / 2 > 1e4
    kl_img = _kl_reference(out["image_mu"], out["image_logvar"].detach(), 1.0)
    kl_txt = _kl_reference(out["text_mu"], out["text_logvar"], 1.0)
    assert kl_img > 1e4 > kl_txt
    guarded = create_loss("vib", beta=1.0, guard=1e4)(out)
    assert guarded["vib"].item() == pytest.approx(kl_txt, rel=1e-12)
    guarded["loss"].backward()
    assert out["image_logvar"].grad.abs().max().item() == 0.0
    assert create_loss("vib", beta=1.0)(out)["vib"].item() == pytest.approx(kl_img + kl_txt, rel=1e-12)
    # the losses that carry a VIB term pass the switches on
    pml = create_loss("pml", vib_form="half_logvar", vib_guard=5.0)
    prolip = create_loss("prolip", vib_form="half_logvar", vib_guard=5.0, inclusion_guard=7.0)
    assert (pml.vib.form, pml.vib.guard, prolip.vib.form, prolip.vib.guard, prolip.inclusion.guard) == (
        "half_logvar", 5.0, "half_logvar", 5.0, 7.0)


def test_inclusion_guard_zeroes_the_loss_past_the_threshold():
    g = _gen(3)
    mu1, mu2 = torch.randn(3, 4, generator=g, dtype=f64), torch.randn(3, 4, generator=g, dtype=f64)
    lv1 = torch.randn(3, 4, generator=g, dtype=f64).requires_grad_()
    lv2 = torch.randn(3, 4, generator=g, dtype=f64) - 3.0
    plain = create_loss("inclusion", eps=2.0, c=50.0).pair(mu1, lv1, mu2, lv2)
    value = plain.item()
    assert value > 1.0
    below = create_loss("inclusion", eps=2.0, c=50.0, guard=1.01 * value).pair(mu1, lv1, mu2, lv2)
    assert below.item() == value
    above = create_loss("inclusion", eps=2.0, c=50.0, guard=0.99 * value).pair(mu1, lv1, mu2, lv2)
    assert above.item() == 0.0
    above.backward()
    assert lv1.grad.abs().max().item() == 0.0


# ---------------------------------------------------------------------------------------------------- PCME++
def _pml_reference(img_mu, img_lv, txt_mu, txt_lv, lam, partner, a, b, alpha, beta, smoothing, official):
    """Single-process PCME++ objective written from the FIDELITY table, with python loops."""
    n = img_mu.shape[0]
    csd = torch.zeros(n, n, dtype=f64)
    for i in range(n):
        for j in range(n):
            csd[i, j] = ((img_mu[i] - txt_mu[j]) ** 2).sum() + (img_lv[i].exp() + txt_lv[j].exp()).sum()
    logits = -a * csd + b
    m = torch.zeros(n, n, dtype=f64)
    for i in range(n):
        m[i, i] += lam[i]
        m[i, partner[i]] += 1 - lam[i]
    m = smoothing + (1 - 2 * smoothing) * m

    def bce(lg, lab):
        return sum(-lab[i, j] * math.log(torch.sigmoid(lg[i, j]).item()) - (1 - lab[i, j]) * math.log(
            torch.sigmoid(-lg[i, j]).item()) for i in range(n) for j in range(n)) / (n * n)

    def pseudo(lg, lab):  # rows: each row's columns scoring >= its ground truth take the ground truth's label
        new = lab.clone()
        for i in range(n):
            gt = int(torch.argmax(lab[i]))
            for j in range(n):
                if lg[i, j] >= lg[i, gt]:
                    new[i, j] = lab[i, gt]
        return bce(lg, new)

    match = bce(logits, m)
    p = pseudo(logits, m) + (pseudo(logits.T, m.T) if official else 0.0)
    vib = _kl_reference(img_mu, img_lv, 1.0) + _kl_reference(txt_mu, txt_lv, 1.0)
    return float((2.0 if official else 1.0) * match + alpha * p + beta * vib)


@pytest.mark.parametrize("official", [False, True])
def test_pml_official_total_against_reference(official):
    g = _gen(4)
    n, d = 6, 5
    out = {"image_mu": F.normalize(torch.randn(n, d, generator=g, dtype=f64), dim=-1),
           "text_mu": F.normalize(torch.randn(n, d, generator=g, dtype=f64), dim=-1),
           "image_logvar": torch.randn(n, d, generator=g, dtype=f64) - 2,
           "text_logvar": torch.randn(n, d, generator=g, dtype=f64) - 2,
           "mix_lambda": torch.tensor([1.0, 0.6, 1.0, 0.3, 1.0, 1.0], dtype=f64),
           "mix_partner": torch.tensor([0, 4, 2, 2, 4, 5])}
    smoothing = 0.01 if official else 0.0
    params = dict(init_a=2.0, init_b=1.5, alpha=0.3, beta=0.2)
    if official:
        params.update(match_weight=2.0, pseudo_rows="both", label_smoothing=smoothing)
    got = create_loss("pml", **params).double()(out)
    ref = _pml_reference(out["image_mu"], out["image_logvar"], out["text_mu"], out["text_logvar"],
                         out["mix_lambda"].tolist(), out["mix_partner"].tolist(), 2.0, 1.5, 0.3, 0.2, smoothing, official)
    assert got["loss"].item() == pytest.approx(ref, rel=1e-10)
    assert got["n_pseudo"].item() > 0  # the pseudo-positive rule is exercised


# ---------------------------------------------------------------------------------------------------- MSDA
def _distinct_images(b: int) -> torch.Tensor:
    # one constant value per image: a mixed pixel is a blend, a CutMix pixel one of the two values
    return (torch.arange(b, dtype=torch.float32) + 1.0).view(b, 1, 1, 1).expand(b, 3, 8, 8).clone()


def test_msda_bernoulli_selection_mixes_each_image_with_probability_fraction():
    torch.manual_seed(0)
    counts = []
    for _ in range(300):
        _, lam, partner = mixed_sample(_distinct_images(64), 0.25, 2.0, selection="bernoulli")
        counts.append(int((partner != torch.arange(64)).sum()))
    mean = sum(counts) / len(counts)
    var = sum((c - mean) ** 2 for c in counts) / (len(counts) - 1)
    # Binomial(64, 0.25): mean 16, variance 12 (a random partner equal to the row itself is rare: 1/64)
    assert abs(mean - 16 * 63 / 64) < 0.7 and 7 < var < 18
    assert len(set(counts)) > 5
    # the paper's reading: exactly 16 rows get a partner (a random partner may be the row itself)
    exact = {int((mixed_sample(_distinct_images(64), 0.25, 2.0)[2] != torch.arange(64)).sum()) for _ in range(20)}
    assert max(exact) == 16 and min(exact) >= 13


def test_msda_reversed_partner_and_per_image_switch():
    torch.manual_seed(1)
    b = 64
    x = _distinct_images(b)
    mixed, lam, partner = mixed_sample(x, 1.0, 2.0, selection="bernoulli", partner="reversed", switch="image")
    assert torch.equal(partner, b - 1 - torch.arange(b))
    kinds = set()
    for i in range(b):
        own, other = float(i + 1), float(b - i)
        pix = mixed[i]
        if own == other:
            continue
        is_cut = bool(((pix == own) | (pix == other)).all())
        if is_cut:  # CutMix: lambda is the share of the image's own pixels
            assert lam[i].item() == pytest.approx((pix == own).float().mean().item(), abs=1e-6)
        else:  # Mixup: every pixel lambda * own + (1 - lambda) * partner
            assert torch.allclose(pix, lam[i] * own + (1 - lam[i]) * other, atol=1e-4)
        kinds.add(is_cut)
    assert kinds == {True, False}  # both kinds inside one batch
    # per batch (the paper's reading): one kind for the whole batch
    per_batch = mixed_sample(x, 1.0, 2.0, partner="reversed", switch="batch")[0]
    cut_rows = {bool(((per_batch[i] == i + 1) | (per_batch[i] == b - i)).all()) for i in range(b) if i + 1 != b - i}
    assert len(cut_rows) == 1


def test_pcmepp_model_passes_the_msda_switches():
    torch.manual_seed(2)
    model = create_model("pcmepp_tiny", msda_fraction=1.0, msda_selection="bernoulli", msda_partner="reversed",
                         msda_switch="image").train()
    out = model(torch.randn(6, 3, 32, 32), tokenize(["a digit"] * 6, 16))
    assert torch.equal(out["mix_partner"], torch.tensor([5, 4, 3, 2, 1, 0]))
    with pytest.raises(ValueError):
        create_model("pcmepp_tiny", msda_partner="left")


# ---------------------------------------------------------------------------------------------------- ProLIP
def test_prolip_official_image_masking_keeps_three_quarters():
    model = create_model("prolip_tiny", image_mask_ratio=0.25, mask_fraction=1.0)
    images, tokens = torch.randn(4, 3, 32, 32), tokenize(["one two three"] * 4, 16)
    _, keep, _ = model.masked_inputs(images, tokens)
    assert keep.shape == (4, 12)  # 16 patches (32 / 8)^2, 25% dropped
    _, keep, _ = create_model("prolip_tiny", mask_fraction=1.0).masked_inputs(images, tokens)
    assert keep.shape == (4, 4)  # the paper: 75% dropped


def test_bernoulli_text_mask_covers_sot_to_eot_with_probability_ratio():
    torch.manual_seed(3)
    tokens = tokenize(["a bold wide seven slanted right"] * 400 + ["seven"] * 400, 16)
    eot = tokens.argmax(-1)
    mask = random_text_mask(tokens, 0.75, "bernoulli")
    pos = torch.arange(16)
    inside = pos[None, :] <= eot[:, None]
    assert not mask[~inside].any()  # padding never
    rate = mask[inside].float().mean().item()
    assert abs(rate - 0.75) < 0.02
    assert abs(mask[torch.arange(800), eot].float().mean().item() - 0.75) < 0.04  # EOT too
    assert abs(mask[:, 0].float().mean().item() - 0.75) < 0.04  # and the start token
    assert len(set(mask.sum(1).tolist())) > 3  # counts vary, unlike the paper's exact round(0.75 n)
    exact = random_text_mask(tokens, 0.75)
    n_words = eot - 1
    assert torch.equal(exact.sum(1), (n_words.float() * 0.75).round().clamp_min(1).long())


def test_non_causal_text_tower_sees_later_tokens_but_never_padding():
    torch.manual_seed(4)
    for causal in (True, False):
        model = create_model("prolip_tiny", text_causal=causal).eval()
        a, b = tokenize(["one two three", "one two four"], 16)
        with torch.no_grad():
            xa, xb = model.text(a[None]), model.text(b[None])
            early_same = torch.allclose(xa[0, 1], xb[0, 1], atol=1e-6)  # position of "one"
            assert early_same == causal
            # padding after EOT and a longer neighbour in the batch leave a caption's outputs unchanged
            alone = model.encode_text(a[None])["mu"]
            batched = model.encode_text(tokenize(["one two three", "one two three four five six seven"], 16))["mu"][:1]
        torch.testing.assert_close(alone, batched, atol=1e-5, rtol=1e-5)


def test_official_prolip_logit_scale_starts_at_one_over_007():
    s, b = create_loss("prolip", init_scale=1 / 0.07).scale_bias(torch.zeros(1))
    assert s.item() == pytest.approx(1 / 0.07, rel=1e-6) and b.item() == -10.0


# ---------------------------------------------------------------------------------------------------- Llip
def _llip_reference(kv_tokens, wk, wv, queries, wq, targets, wo, heads, tau):
    """Naive contextualised cosines: K/V per token (wk[k], wv[k]: (D, Din)), q_j = W_Q g_j, heads split,
    softmax over the K tokens of q.k / tau, z_ij = W_O concat(sum_k a v), cos(z_ij, t_j)."""
    b, k_tokens, _ = kv_tokens.shape
    n, d = queries.shape[0], wo.shape[0]
    dh = d // heads
    out = torch.zeros(b, n, dtype=f64)
    for i in range(b):
        keys = torch.stack([wk[k] @ kv_tokens[i, k] for k in range(k_tokens)])  # (K, D)
        values = torch.stack([wv[k] @ kv_tokens[i, k] for k in range(k_tokens)])
        for j in range(n):
            q = wq @ queries[j]
            parts = []
            for h in range(heads):
                sl = slice(h * dh, (h + 1) * dh)
                w = torch.softmax(torch.stack([q[sl] @ keys[k, sl] for k in range(k_tokens)]) / tau, dim=0)
                parts.append(sum(w[k] * values[k, sl] for k in range(k_tokens)))
            z = wo @ torch.cat(parts)
            t = targets[j] / targets[j].norm()
            out[i, j] = z @ t / z.norm()
    return out


def _llip_official():
    torch.manual_seed(5)
    return create_model("llip_tiny", kv_proj="per_token", query_from="hidden", zeroshot_query="mean_query",
                        mixer_heads=2, mixture_tokens=3).double().eval()


def test_llip_per_token_kv_and_hidden_query_against_reference():
    model = _llip_official()
    images, tokens = torch.randn(3, 3, 32, 32, dtype=f64), tokenize(["one", "two three", "four five six", "seven"], 16)
    with torch.no_grad():
        img, txt = model.encode_image(images), model.encode_text(tokens)
        out = model(images, tokens)
        tower = model.visual(images)[:, :3]
        x = model.text(tokens)
        hidden = x[torch.arange(4), tokens.argmax(-1)]
    # the mixer reads the image tower's mixture tokens (before image_proj) and the text's hidden state
    torch.testing.assert_close(img["mix"], tower)
    torch.testing.assert_close(txt["query"], hidden)
    torch.testing.assert_close(txt["mu"], F.normalize(model.text_proj(hidden), dim=-1))
    mixer = model.mixer
    ref = _llip_reference(tower, mixer.k_proj.weight, mixer.v_proj.weight, hidden, mixer.q_proj.weight,
                          txt["mu"], mixer.out_weight, heads=2, tau=mixer.tau)
    torch.testing.assert_close(out["pair_cos"], ref, rtol=1e-10, atol=1e-12)
    assert mixer.k_proj.weight.shape == (3, 64, 64)  # one K (and one V) projection per mixture token


def test_llip_mean_query_zero_shot_against_reference():
    model = _llip_official()
    prompts = [["a one", "the digit one"], ["a two", "the digit two"], ["a three", "the digit three"]]
    images = torch.randn(2, 3, 32, 32, dtype=f64)
    with torch.no_grad():
        flat = model.encode_text(tokenize([p for c in prompts for p in c], 16))
        per = {k: v.reshape(3, 2, -1) for k, v in flat.items()}
        scores = model.class_scores(model.encode_image(images), model.class_embeddings(per))
        mixer = model.mixer
        # the class query is the mean of the templates' queries, each W_Q h_t computed on its own
        queries = torch.stack([torch.stack([mixer.q_proj.weight @ h for h in per["query"][c]]).mean(0) for c in range(3)])
        target = F.normalize(per["mu"].mean(1), dim=-1)
        ref = _llip_reference(model.encode_image(images)["mix"], mixer.k_proj.weight, mixer.v_proj.weight, queries,
                              torch.eye(64, dtype=f64), target, mixer.out_weight, heads=2, tau=mixer.tau)
    torch.testing.assert_close(scores, ref, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="mean_query"):
        create_model("llip_tiny", query_from="hidden")
    with pytest.raises(KeyError, match="query"):
        model.class_scores(model.encode_image(images), {"mu": target})


def test_llip_mean_query_with_embedding_queries_averages_unnormalised_templates():
    torch.manual_seed(6)
    paper = create_model("llip_tiny", mixer_heads=2).double().eval()
    official = create_model("llip_tiny", mixer_heads=2, zeroshot_query="mean_query").double().eval()
    official.load_state_dict(paper.state_dict())
    per = {"mu": F.normalize(torch.randn(3, 4, 64, dtype=f64), dim=-1)}
    q_paper, q_official = paper.class_embeddings(per), official.class_embeddings(per)
    torch.testing.assert_close(q_official["query"], per["mu"].mean(1))  # no renormalisation
    torch.testing.assert_close(paper.query(q_paper), F.normalize(per["mu"].mean(1), dim=-1))


# ---------------------------------------------------------------------------------------------------- ProbVLM
def _ggd_reference(r_abs: float, alpha: float, beta: float, approx: str | None, stabilise: bool) -> float:
    inv_a = 1 / alpha + (1e-4 if stabilise else 0.0)
    bb = beta + (1e-4 if stabilise else 0.0)
    ratio = r_abs * inv_a
    if approx is None:
        power = ratio ** bb
    elif approx == "eq16":
        power = 1 - bb + bb * ratio
    else:
        power = bb * ratio
    if stabilise:
        power = min(max(power, 1e-4), 1e3)
    return power - math.log(bb) - math.log(inv_a) + math.lgamma(1 / bb)


@pytest.mark.parametrize("approx", [None, "eq16", "linear"])
@pytest.mark.parametrize("stabilise", [False, True])
def test_ggd_official_forms_against_reference(approx, stabilise):
    # residuals from 0 (clamped up to 1e-4 when stabilised) to huge (clamped down to 1e3)
    target = torch.zeros(6, dtype=f64)
    mu = torch.tensor([0.0, 1e-7, 0.3, 1.5, 40.0, 5e3], dtype=f64)
    alpha = torch.tensor([0.5, 0.2, 1.3, 0.7, 0.05, 0.01], dtype=f64)
    beta = torch.tensor([1.5, 0.8, 2.0, 1.0, 3.0, 2.5], dtype=f64)
    got = ggd_nll(target, mu, alpha, beta, approx=approx is not None, approx_form=approx or "eq16", stabilise=stabilise)
    ref = [_ggd_reference(abs(m), a, b, approx, stabilise) for m, a, b in zip(mu.tolist(), alpha.tolist(), beta.tolist())]
    torch.testing.assert_close(got, torch.tensor(ref, dtype=f64), rtol=1e-10, atol=1e-12)


def test_probvlm_loss_cross_l1_and_adapter_config_keys():
    g = _gen(7)
    out = {}
    for m in ("image", "text"):
        out[f"{m}_hat"] = torch.randn(4, 5, generator=g, dtype=f64)
        out[f"{m}_target"] = torch.randn(4, 5, generator=g, dtype=f64)
        out[f"{m}_alpha"] = torch.rand(4, 5, generator=g, dtype=f64) + 0.2
        out[f"{m}_beta"] = torch.rand(4, 5, generator=g, dtype=f64) + 0.5
    l1 = lambda a, b: (out[a] - out[b]).abs().mean().item()  # noqa: E731
    own = l1("image_hat", "image_target") + l1("text_hat", "text_target")
    cross = l1("image_hat", "text_target") + l1("text_hat", "image_target")
    assert create_loss("probvlm")(out)["l1"].item() == pytest.approx(own, rel=1e-12)
    assert create_loss("probvlm", l1_cross=True)(out)["l1"].item() == pytest.approx(own + cross, rel=1e-12)
    # the adapter's loss section carries the switches to the loss unchanged
    section = AdaptLossConfig(approx=True, approx_form="linear", stabilise=True, l1_cross=True)
    loss = create_loss("probvlm", **section.model_dump())
    assert (loss.approx_form, loss.stabilise, loss.l1_cross) == ("linear", True, True)
    assert AdaptLossConfig().model_dump()["approx_form"] == "eq16"
    with pytest.raises(ValueError):
        AdaptLossConfig(approx_form="taylor")


# ---------------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("name", ["prolip_tiny_official", "pcmepp_tiny_official", "llip_tiny_official"])
def test_official_configs_load_and_differ_from_the_paper_configs_only_in_switches(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    paper = load_config(ROOT / "configs" / f"{name.removesuffix('_official')}.yaml")
    assert cfg.train == paper.train and cfg.data == paper.data and cfg.model.name == paper.model.name
    assert cfg.model.overrides != paper.model.overrides or cfg.loss.params != paper.loss.params
    from models.objective import build_objective

    build_objective(cfg)  # every switch is accepted by the constructors


# ---------------------------------------------------------------------------------------------------- bf16
BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def _sigma2_after_step(model, images: torch.Tensor, lr: float) -> tuple[float, float]:
    """Mean image sigma^2 before and after one SGD step on the [UNC] head's bias, forward under bf16 autocast."""
    with torch.autocast(**BF16):
        before = model.encode_image(images)["logvar"]
    before.float().mean().backward()
    with torch.no_grad():
        bias = model.image_unc_proj.bias
        bias -= lr * bias.grad.to(bias.dtype)
        with torch.autocast(**BF16):
            after = model.encode_image(images)["logvar"]
    return before.detach().float().exp().mean().item(), after.float().exp().mean().item()


def test_bf16_sigma_head_moves_sigma2_by_less_than_one_percent():
    torch.manual_seed(8)
    images = torch.randn(4, 3, 32, 32)
    model = create_model("prolip_tiny")  # [UNC] bias at -10: bf16 spacing 2^-4 there
    lr = 0.005 * model.image_unc_proj.bias.numel()  # the mean's gradient is 1/D per bias entry: a 0.005 step
    s0, s1 = _sigma2_after_step(model, images, lr)
    assert 0.001 < 1 - s1 / s0 < 0.01
    with torch.autocast(**BF16):
        out = model(images, tokenize(["one"] * 4, 16))
    assert out["image_logvar"].dtype == out["text_logvar"].dtype == torch.float32
    # the same step on a model held in bf16 cannot move: the nearest bf16 neighbours of -10 are 0.0625 away,
    # a 6.4% step of sigma^2 (e^0.0625 - 1)
    torch.manual_seed(8)
    pure = create_model("prolip_tiny").bfloat16()
    spacing = (torch.tensor(-10.0, dtype=torch.bfloat16).float() - torch.nextafter(
        torch.tensor(-10.0, dtype=torch.bfloat16), torch.tensor(0.0, dtype=torch.bfloat16)).float()).abs().item()
    assert spacing == 0.0625 and math.expm1(spacing) > 0.064
    s0, s1 = _sigma2_after_step(pure, images.bfloat16(), lr)
    assert s1 == s0


def test_bf16_autocast_leaves_heads_mixer_and_pooling_in_float32():
    torch.manual_seed(9)
    x = torch.randn(5, 7, 64)
    head = Float32Linear(64, 64)
    with torch.autocast(**BF16):
        y = head(x)
        pooled = GPO()(x)
    assert y.dtype == pooled.dtype == torch.float32
    torch.testing.assert_close(y, head(x), rtol=0, atol=0)
    # Llip's cosines: identical with and without autocast (a bf16 mixer errs by ~1e-3)
    llip = create_model("llip_tiny")
    mix, text = torch.randn(3, 8, 64), F.normalize(torch.randn(4, 64), dim=-1)
    with torch.autocast(**BF16):
        under = llip.mixer(mix, text, text)
    plain = llip.mixer(mix, text, text)
    assert under.dtype == torch.float32
    torch.testing.assert_close(under, plain, rtol=0, atol=1e-6)
    bf16 = llip.mixer.naive_pair_cos(mix.bfloat16().float(), text, text)
    assert (bf16 - plain).abs().max() > 1e-4  # what the bf16 inputs alone would cost
    pcmepp = create_model("pcmepp_tiny").eval()
    with torch.autocast(**BF16):
        out = pcmepp(torch.randn(2, 3, 32, 32), tokenize(["one", "two"], 16))
    assert out["image_logvar"].dtype == out["text_logvar"].dtype == torch.float32


def test_bf16_training_is_deepspeed_torch_autocast():
    from pipelines.config import Config
    from pipelines.train_worker import deepspeed_config

    cfg = Config.from_dict({"model": {"name": "prolip_tiny"}})
    on, off = deepspeed_config(cfg, True), deepspeed_config(cfg, False)
    assert on["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and not off["torch_autocast"]["enabled"]
    assert "bf16" not in on  # DeepSpeed's bf16 engine would cast the float32 heads' parameters to bf16


BF16_ENGINE_STEPS = """
import json, os, torch, deepspeed
from models.objective import build_objective
from models.tokenizer import tokenize
from pipelines.config import load_config
from pipelines.train_worker import deepspeed_config, skip_inference_comm_op
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
skip_inference_comm_op()
torch.manual_seed(0)
cfg = load_config("configs/prolip_tiny.yaml", ["train.precision=bf16", "train.batch_size=8", "train.num_workers=1"])
objective = build_objective(cfg)
engine, *_ = deepspeed.initialize(model=objective, optimizer=torch.optim.AdamW(objective.parameters(), lr=1e-3),
                                  config=deepspeed_config(cfg, True))
dtypes = {{}}
for name, module in objective.named_modules():
    if isinstance(module, torch.nn.Linear):
        module.register_forward_hook(lambda m, i, o, n=name: dtypes.setdefault(n, str(o.dtype)) and None)
images, tokens = torch.randn(8, 3, 32, 32), tokenize(["one digit"] * 8, 16)
losses = []
for _ in range(3):
    out = engine(images, tokens)
    engine.backward(out["loss"])
    engine.step()
    losses.append(out["loss"].item())
print(json.dumps({{"losses": losses, "loss_dtype": str(out["loss"].dtype), "dtypes": dtypes,
                  "params": sorted({{str(p.dtype) for p in objective.parameters()}})}}))
"""


def test_bf16_deepspeed_engine_runs_towers_in_bf16_and_heads_in_float32():
    """The DeepSpeed engine of a bf16 run (CPU, one process): tower matmuls bf16, [UNC] heads, loss and
    parameters float32, and it trains."""
    import json
    import subprocess
    import sys

    from tests.helpers import free_port

    done = subprocess.run([sys.executable, "-c", BF16_ENGINE_STEPS.format(port=free_port())], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["dtypes"]["model.visual.vit.blocks.0.attn.qkv"] == "torch.bfloat16"
    assert got["dtypes"]["model.image_unc_proj"] == got["dtypes"]["model.text_unc_proj"] == "torch.float32"
    assert got["params"] == ["torch.float32"] and got["loss_dtype"] == "torch.float32"
    assert all(math.isfinite(v) for v in got["losses"]) and got["losses"][-1] < got["losses"][0]
