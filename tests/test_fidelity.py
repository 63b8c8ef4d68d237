"""Every switch between a paper's formula and its official code's behaviour (docs/FIDELITY.md), each against a
transcription of the official code's steps (repository, commit and path named at each transcription; the
official repositories are not installed, their functions are rewritten here step by step with this project's
weights), in float64 on generic inputs (log-variances spread over several units), values and gradients to
1e-10; plus the bf16 guarantee: under bf16 autocast the sigma heads, the Llip mixer and the losses compute in
float32.

Random choices (which rows, patches, words, images) are compared on the same random draws: the transcription
consumes the uniforms (or the permutation) this project draws, where the official code draws them itself.

No Ray: formulas and single forward passes, and three steps of a bf16 DeepSpeed engine in a subprocess
(``make test-fast``).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models.distributions import ggd_nll, vib_kl
from models.heads import GPO, Float32Linear
from models.losses import create_loss
from models.pcmepp import mixed_sample
from models.prolip import masked_rows
from models.registry import create_model
from models.tokenizer import tokenize
from models.towers import random_keep, random_text_mask
from pipelines.adapt.config import load_adapt_config
from pipelines.adapt.loop import build_adapter_set
from pipelines.config import ConfigError
from pipelines.pretrain.config import load_train_config

f64 = torch.float64
ROOT = Path(__file__).resolve().parent.parent
TOL = dict(rtol=1e-10, atol=1e-10)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _assert_same(ours: torch.Tensor, ref: torch.Tensor, wrt: list[torch.Tensor]) -> None:
    """Values equal, and the gradients of a fixed random weighting of them w.r.t. every tensor in `wrt`
    (a tensor neither depends on counts as a zero gradient), to 1e-10."""
    ref = torch.as_tensor(ref, dtype=ours.dtype)
    torch.testing.assert_close(ours, ref, **TOL)
    w = torch.randn(ours.shape, generator=_gen(99), dtype=ours.dtype)
    for output in (ours, ref):
        assert output.requires_grad, "nothing to differentiate"
    g_ours = torch.autograd.grad((ours * w).sum(), wrt, retain_graph=True, allow_unused=True)
    g_ref = torch.autograd.grad((ref * w).sum(), wrt, retain_graph=True, allow_unused=True)
    for t, a, b in zip(wrt, g_ours, g_ref):
        a = torch.zeros_like(t) if a is None else a
        b = torch.zeros_like(t) if b is None else b
        torch.testing.assert_close(a, b, **TOL)
    assert any(g is not None and g.abs().max() > 0 for g in g_ours), "all gradients vanish"


def _logvar(shape, seed: int, spread: float = 3.0, shift: float = -2.0) -> torch.Tensor:
    """Generic log-variances: N(shift, spread^2), i.e. over several units around `shift`."""
    return shift + spread * torch.randn(*shape, generator=_gen(seed), dtype=f64)


def _unit(shape, seed: int) -> torch.Tensor:
    return F.normalize(torch.randn(*shape, generator=_gen(seed), dtype=f64), dim=-1)


# ---------------------------------------------------------------------------------------------------- recipes
_ABSENT = object()


def _recipes(method: str):
    """configs/<method>_tiny_official.yaml and the paper config it departs from."""
    return (load_train_config(ROOT / "configs" / f"{method}_tiny_official.yaml"),
            load_train_config(ROOT / "configs" / f"{method}_tiny.yaml"))


def _shared_only(official: dict, paper: dict, chosen: dict) -> None:
    """A test may choose sizes and weights, never a switch: each key it sets holds the same value (or none) in
    both recipes, so the official side of every comparison is what the official YAML file says."""
    switches = sorted(k for k in chosen if official.get(k, _ABSENT) != paper.get(k, _ABSENT))
    assert not switches, f"the test overrides the official recipe's own switches {switches}"


def official_model(method: str, **chosen):
    """The model of configs/<method>_tiny_official.yaml, with the test's sizes `chosen` on top."""
    cfg, paper = _recipes(method)
    _shared_only(cfg.model.overrides, paper.model.overrides, chosen)
    return create_model(cfg.model.name, **{**cfg.model.overrides, **chosen})


def official_loss(method: str, **chosen):
    """The loss of configs/<method>_tiny_official.yaml, with the test's weights `chosen` on top."""
    cfg, paper = _recipes(method)
    _shared_only(cfg.loss.params, paper.loss.params, chosen)
    return create_loss(cfg.loss.name, **{**cfg.loss.params, **chosen})


# ---------------------------------------------------------------------------------------------------- VIB
def _prolip_kl_divergence(mu, logsigma_sq):
    """naver-ai/prolip @ 59f6324, src/prolip/loss.py, ProLIPLoss.kl_divergence."""
    logsigma = logsigma_sq / 2
    kl_loss = -0.5 * (1 + logsigma - mu.pow(2) - logsigma.exp()).mean()
    if kl_loss > 10000:
        return 0
    return kl_loss


def _pcmepp_kl_divergence(mu, logsigma):
    """naver-ai/pcmepp @ 8829c0d, pcmepp/criterions/pcmepp.py, ClosedFormSampledDistanceLoss.kl_divergence
    (its ``logsigma`` is the encoders' 'std' output, log sigma^2: the CSD exponentiates it as the variance)."""
    kl_loss = -0.5 * (1 + logsigma - mu.pow(2) - logsigma.exp()).mean()
    if kl_loss > 10000:
        return 0
    return kl_loss


@pytest.mark.parametrize("guarded", [False, True])
def test_vib_forms_and_guard_against_official_kl_divergence(guarded):
    mu_i, mu_t = torch.randn(5, 7, generator=_gen(1), dtype=f64), torch.randn(5, 7, generator=_gen(2), dtype=f64)
    lv_i, lv_t = _logvar((5, 7), 3), _logvar((5, 7), 4)
    if guarded:  # the image KL past 1e4 in both forms (e^(l/2) / 2 ~ e^11): the guard drops it
        lv_i = lv_i.clamp(-1, 1) + 24.0
    leaves = [_leaf(t) for t in (mu_i, lv_i, mu_t, lv_t)]
    mi, li, mt, lt = leaves
    out = {"image_mu": mi, "image_logvar": li, "text_mu": mt, "text_logvar": lt}
    for form, official in (("half_logvar", _prolip_kl_divergence), ("standard", _pcmepp_kl_divergence)):
        ours = create_loss("vib", beta=1.0, form=form, guard=1e4)(out)["loss"]
        ref = official(mi, li) + official(mt, lt)
        _assert_same(ours, ref, leaves)
        if guarded:
            assert float(official(mi, li)) == 0.0 and float(_kl_of(form, mi, li)) > 1e4
    # the official form is the standard KL at l/2: smallest at sigma^2 = 1, like the standard one
    for form in ("half_logvar", "standard"):
        lv = torch.zeros(1, 3, dtype=f64, requires_grad=True)
        vib_kl(torch.zeros(1, 3, dtype=f64), lv, form).backward()
        assert lv.grad.abs().max().item() < 1e-15
    with pytest.raises(ValueError, match="vib form"):
        vib_kl(mu_i, lv_i, "half")


def _kl_of(form, mu, lv):
    return vib_kl(mu.detach(), lv.detach(), form)


def test_the_losses_pass_the_vib_and_guard_switches_on():
    pml = create_loss("pml", vib_form="half_logvar", vib_guard=5.0)
    prolip = create_loss("prolip", vib_form="half_logvar", vib_guard=5.0, inclusion_guard=7.0)
    assert (pml.vib.form, pml.vib.guard, prolip.vib.form, prolip.vib.guard, prolip.inclusion.guard) == (
        "half_logvar", 5.0, "half_logvar", 5.0, 7.0)


# ---------------------------------------------------------------------------------------------------- ProLIP loss
class _OfficialProLIPLoss:
    """naver-ai/prolip @ 59f6324, src/prolip/loss.py, ProLIPLoss with world_size = 1 (its ``_loss``):
    PPCL, inclusion of the masked copies (``inclusion_alpha_occ``), image-in-caption inclusion
    (``inclusion_alpha``) and the VIB, with its explosion guards (inclusion 1e5, VIB 1e4)."""

    def __init__(self, inclusion_alpha, inclusion_alpha_occ, inclusion_loss_eps, inclusion_loss_scale, vib_beta):
        self.inclusion_alpha, self.inclusion_alpha_occ = inclusion_alpha, inclusion_alpha_occ
        self.inclusion_loss_eps, self.inclusion_loss_scale, self.vib_beta = inclusion_loss_eps, inclusion_loss_scale, vib_beta

    kl_divergence = staticmethod(_prolip_kl_divergence)

    def inclusion_test(self, mu1, logsigma_sq1, mu2, logsigma_sq2):
        eps = self.inclusion_loss_eps
        inv_sigma_sq1 = torch.exp(-logsigma_sq1 + eps)
        inv_sigma_sq2 = torch.exp(-logsigma_sq2 + eps)
        a = inv_sigma_sq1 + 0.5 * inv_sigma_sq2
        b = 2 * mu1 * inv_sigma_sq1 + mu2 * inv_sigma_sq2
        c = mu1 ** 2 * inv_sigma_sq1 + 0.5 * mu2 ** 2 * inv_sigma_sq2
        return -2 * logsigma_sq1 - logsigma_sq2 - 0.5 * torch.log(a) + b ** 2 / 4 / a - c

    def inclusion_loss(self, mu1, logsigma_sq1, mu2, logsigma_sq2, is_one_included_in_two, loss_thres=100000):
        logit = self.inclusion_test(mu1, logsigma_sq1, mu2, logsigma_sq2) - self.inclusion_test(mu2, logsigma_sq2, mu1, logsigma_sq1)
        loss = -F.logsigmoid(self.inclusion_loss_scale * logit * is_one_included_in_two)
        inclusion_loss = loss.mean()
        if inclusion_loss.abs() > loss_thres:
            return 0
        return inclusion_loss

    def __call__(self, image_features, text_features, logit_scale, logit_bias, masked_image_features, masked_text_features):
        image_mu, image_sigma = image_features["mean"], image_features["std"]
        text_mu, text_sigma = text_features["mean"], text_features["std"]
        labels = 2 * torch.eye(len(image_mu), dtype=image_mu.dtype) - torch.ones(len(image_mu), len(image_mu), dtype=image_mu.dtype)
        mu_pdist = image_mu @ text_mu.T
        sigma_pdist = ((torch.exp(image_sigma).unsqueeze(1) + torch.exp(text_sigma).unsqueeze(0))).sum(-1)
        logits = logit_scale * (mu_pdist - sigma_pdist / 2) + logit_bias
        loss = -F.logsigmoid(labels * logits).sum() / image_mu.shape[0]
        n = masked_image_features["mean"].size()[0]
        loss = loss + self.inclusion_alpha_occ * self.inclusion_loss(
            image_mu[:n], image_sigma[:n], masked_image_features["mean"], masked_image_features["std"], 1)
        loss = loss + self.inclusion_alpha_occ * self.inclusion_loss(
            text_mu[:n], text_sigma[:n], masked_text_features["mean"], masked_text_features["std"], 1)
        loss = loss + self.inclusion_alpha * self.inclusion_loss(image_mu, image_sigma, text_mu, text_sigma, 1)
        return loss + self.vib_beta * (self.kl_divergence(image_mu, image_sigma) + self.kl_divergence(text_mu, text_sigma))


@pytest.mark.parametrize("case", ["generic", "vib_guard", "inclusion_guard"])
def test_prolip_official_objective_against_official_loss(case):
    b, m, d = 6, 2, 5
    t = {"image_mu": _unit((b, d), 10), "text_mu": _unit((b, d), 11), "image_logvar": _logvar((b, d), 12),
         "text_logvar": _logvar((b, d), 13), "image_masked_mu": _unit((m, d), 14), "text_masked_mu": _unit((m, d), 15),
         "image_masked_logvar": _logvar((m, d), 16, shift=0.0), "text_masked_logvar": _logvar((m, d), 17, shift=0.0)}
    eps, c = -2.0, 10.0
    if case == "vib_guard":
        t["text_logvar"] = t["text_logvar"].clamp(-1, 1) + 24.0  # the text KL past 1e4
    if case == "inclusion_guard":  # the image-in-caption inclusion past 1e5: c H ~ -1e5
        c, t["image_logvar"] = 3e4, t["image_logvar"] + 6.0
    leaves = {k: _leaf(v) for k, v in t.items()}
    out = {**leaves, "masked_rows": torch.arange(m)}  # the official code masks the first rows of the batch
    weights = dict(alpha1=0.3, alpha2=0.2, beta=0.1, eps=eps, c=c)
    loss = official_loss("prolip", **weights).double()  # scale, VIB form and guards from the official YAML
    ours = loss(out)
    official = _OfficialProLIPLoss(0.3, 0.2, eps, c, 0.1)
    # official ProLIP's model holds log(1/0.07) and -10 (model_configs/ViT-B-16-ProLIP.json: init_logit_bias)
    assert loss.logit_scale.item() == pytest.approx(math.log(1 / 0.07), rel=1e-7) and loss.logit_bias.item() == -10.0
    ref = official({"mean": leaves["image_mu"], "std": leaves["image_logvar"]},
                   {"mean": leaves["text_mu"], "std": leaves["text_logvar"]},
                   loss.logit_scale.exp().reshape(()), loss.logit_bias.reshape(()),
                   {"mean": leaves["image_masked_mu"], "std": leaves["image_masked_logvar"]},
                   {"mean": leaves["text_masked_mu"], "std": leaves["text_masked_logvar"]})
    _assert_same(ours["loss"], ref, [*leaves.values(), loss.logit_scale, loss.logit_bias])
    if case == "vib_guard":
        assert ours["vib"].item() < 1e4 < _kl_of("half_logvar", leaves["text_mu"], leaves["text_logvar"]).item()
    if case == "inclusion_guard":
        assert ours["inclusion_v_t"].item() == 0.0


# ---------------------------------------------------------------------------------------------------- PCME++
def _pcmepp_official(img, cap, matched, negative_scale, shift, vib_beta, smoothness_alpha):
    """naver-ai/pcmepp @ 8829c0d, pcmepp/criterions/pcmepp.py, ClosedFormSampledDistanceLoss.forward
    (prob_distance 'csd'), with _recompute_matched, _compute_prob_matching_loss, _compute_closed_form_loss."""
    def recompute_matched(matched, logits, smoothness=0):
        if not smoothness:
            return matched
        logits = logits.view(matched.size())
        gt_labels, gt_indices = torch.max(matched, dim=1)
        gt_vals = logits[:, gt_indices].diag()
        pseudo_gt_indices = (logits >= gt_vals.unsqueeze(1))
        new_matched = (gt_labels.unsqueeze(1) * (pseudo_gt_indices))
        _matched = matched.clone()
        _matched[pseudo_gt_indices] = new_matched[pseudo_gt_indices]
        return _matched

    def closed_form_loss(input1, input2, matched, smoothness=0):
        mu_pdist = ((input1["mean"].unsqueeze(1) - input2["mean"].unsqueeze(0)) ** 2).sum(-1)
        sigma_pdist = ((torch.exp(input1["std"]).unsqueeze(1) + torch.exp(input2["std"]).unsqueeze(0))).sum(-1)
        logits = -negative_scale * (mu_pdist + sigma_pdist) + shift
        matched = recompute_matched(matched, logits, smoothness)
        return F.binary_cross_entropy_with_logits(logits, matched)  # nn.BCEWithLogitsLoss(), mean

    vib_loss = _pcmepp_kl_divergence(img["mean"], img["std"]) + _pcmepp_kl_divergence(cap["mean"], cap["std"])
    loss = 2 * closed_form_loss(img, cap, matched) + vib_beta * vib_loss
    smooth_i2t_loss = closed_form_loss(img, cap, matched, smoothness=smoothness_alpha)
    smooth_t2i_loss = closed_form_loss(cap, img, matched.T, smoothness=smoothness_alpha)
    return loss + smoothness_alpha * (smooth_i2t_loss + smooth_t2i_loss)


def _pcmepp_mixup_target(lam: torch.Tensor, smoothing: float) -> torch.Tensor:
    """naver-ai/pcmepp @ 8829c0d, pcmepp/augmentation.py, mixup_target(arange(B), B, lam, smoothing): the
    image's own caption lambda, the reversed partner's (image B-1-i) 1 - lambda, labels smoothed."""
    b = len(lam)
    y1 = torch.full((b, b), smoothing, dtype=f64).fill_diagonal_(1 - smoothing)
    y2 = y1.flip(1)  # one_hot(target.flip(0))
    return y1 * lam[:, None] + y2 * (1 - lam[:, None])


@pytest.mark.parametrize("guarded", [False, True])
def test_pml_official_total_against_official_loss(guarded):
    b, d = 6, 5
    t = {"image_mu": _unit((b, d), 20), "text_mu": _unit((b, d), 21),
         "image_logvar": _logvar((b, d), 22), "text_logvar": _logvar((b, d), 23)}
    if guarded:  # the image KL past 1e4: the official code drops it
        t["image_logvar"] = t["image_logvar"].clamp(-1, 1) + 24.0
    leaves = {k: _leaf(v) for k, v in t.items()}
    lam = torch.tensor([1.0, 0.62, 1.0, 0.27, 1.0, 0.81], dtype=f64)
    out = {**leaves, "mix_lambda": lam, "mix_partner": b - 1 - torch.arange(b)}
    smoothing, alpha, beta = 1e-4, 0.3, 0.2  # official PCME++'s label smoothing; generic weights
    # matching weight, pseudo-positive rows, label smoothing and the VIB guard from the official YAML
    loss = official_loss("pcmepp", init_a=0.4, init_b=2.0, alpha=alpha, beta=beta).double()
    got = loss(out)
    ref = _pcmepp_official({"mean": leaves["image_mu"], "std": leaves["image_logvar"]},
                           {"mean": leaves["text_mu"], "std": leaves["text_logvar"]},
                           _pcmepp_mixup_target(lam, smoothing), loss.a.reshape(()), loss.b.reshape(()), beta, alpha)
    _assert_same(got["loss"], ref, [*leaves.values(), loss.a, loss.b])
    assert got["n_pseudo"].item() > 0  # the pseudo-positive rule is exercised
    if guarded:
        assert _kl_of("standard", leaves["image_mu"], leaves["image_logvar"]).item() > 1e4


def _pml_reference(img_mu, img_lv, txt_mu, txt_lv, lam, partner, a, b, alpha, beta):
    """The paper's PCME++ objective (Eq. 1-3, pseudo-positives of the image rows), with python loops."""
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

    def bce(lg, lab):
        return sum(-lab[i, j] * math.log(torch.sigmoid(lg[i, j]).item()) - (1 - lab[i, j]) * math.log(
            torch.sigmoid(-lg[i, j]).item()) for i in range(n) for j in range(n)) / (n * n)

    new = m.clone()
    for i in range(n):
        gt = int(torch.argmax(m[i]))
        for j in range(n):
            if logits[i, j] >= logits[i, gt]:
                new[i, j] = m[i, gt]
    kl = lambda mu, lv: (-0.5 * (1 + lv - mu ** 2 - lv.exp())).mean().item()  # noqa: E731
    return float(bce(logits, m) + alpha * bce(logits, new) + beta * (kl(img_mu, img_lv) + kl(txt_mu, txt_lv)))


def test_pml_paper_total_against_reference():
    n, d = 6, 5
    out = {"image_mu": _unit((n, d), 4), "text_mu": _unit((n, d), 5),
           "image_logvar": _logvar((n, d), 6, 1.0), "text_logvar": _logvar((n, d), 7, 1.0),
           "mix_lambda": torch.tensor([1.0, 0.6, 1.0, 0.3, 1.0, 1.0], dtype=f64),
           "mix_partner": torch.tensor([0, 4, 2, 2, 4, 5])}
    got = create_loss("pml", init_a=2.0, init_b=1.5, alpha=0.3, beta=0.2).double()(out)
    ref = _pml_reference(out["image_mu"], out["image_logvar"], out["text_mu"], out["text_logvar"],
                         out["mix_lambda"].tolist(), out["mix_partner"].tolist(), 2.0, 1.5, 0.3, 0.2)
    assert got["loss"].item() == pytest.approx(ref, rel=1e-10)
    assert got["n_pseudo"].item() > 0


# ---------------------------------------------------------------------------------------------------- MSDA
def _distinct_images(b: int) -> torch.Tensor:
    # one constant value per image: a mixed pixel is a blend, a CutMix pixel one of the two values
    return (torch.arange(b, dtype=torch.float32) + 1.0).view(b, 1, 1, 1).expand(b, 3, 8, 8).clone()


def _msda(**chosen) -> dict:
    """The official PCME++ model's MSDA arguments (configs/pcmepp_tiny_official.yaml), as its forward passes them."""
    model = official_model("pcmepp", **chosen)
    return {"fraction": model.msda_fraction, "beta": model.msda_beta, **model.msda}


def test_msda_bernoulli_selection_mixes_each_image_with_probability_fraction():
    torch.manual_seed(0)
    official = _msda()
    assert (official["fraction"], official["beta"]) == (0.25, 2.0)  # PCME++'s mixed share and Beta(2, 2)
    counts = []
    for _ in range(300):
        _, lam, partner = mixed_sample(_distinct_images(64), **{**official, "partner": "random"})
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
    mixed, lam, partner = mixed_sample(x, **_msda(msda_fraction=1.0))  # every image, to see both kinds
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
    model = official_model("pcmepp", msda_fraction=1.0).train()
    out = model(torch.randn(6, 3, 32, 32), tokenize(["a digit"] * 6, 16))
    assert torch.equal(out["mix_partner"], torch.tensor([5, 4, 3, 2, 1, 0]))
    with pytest.raises(ValueError):
        create_model("pcmepp_tiny", msda_partner="left")


# ---------------------------------------------------------------------------------------------------- ProLIP model
def test_prolip_official_masked_share_and_kept_patches_against_official_counts():
    model = official_model("prolip")
    # naver-ai/prolip @ 59f6324, src/prolip_train/train.py (train_one_epoch): n_masked_samples = int(B * drop_ratio)
    for b in range(0, 70):
        assert len(masked_rows(b, model.mask_fraction, counts=model.mask_counts)) == int(b * 0.125)
    assert {b: len(masked_rows(b, 0.125)) for b in (4, 6, 12)} == {4: 1, 6: 1, 12: 2}  # the paper's reading
    assert {b: len(masked_rows(b, 0.125, counts="floor")) for b in (4, 6, 12)} == {4: 0, 6: 0, 12: 1}
    # src/prolip/transformer.py, VisionTransformer.forward with image_mask_ratio = args.drop_prob (the KEPT share):
    # one torch.randperm for the whole masked batch, its first int(n * keep) indices, sorted
    for n, keep in ((49, 0.75), (196, 0.75), (16, 0.75), (50, 0.5), (7, 0.75)):
        torch.manual_seed(n)
        ours = random_keep(5, n, 1.0 - keep, counts=model.mask_counts, shared=model.image_mask == "batch")
        torch.manual_seed(n)
        remain_size = int(n * keep)
        indices_to_keep = torch.randperm(n)[:remain_size]
        indices_to_keep, _ = torch.sort(indices_to_keep)
        assert torch.equal(ours, indices_to_keep.expand(5, -1))
    assert model.image_mask_ratio == 0.25  # official ProLIP's --drop-prob 0.75 is the share KEPT
    # 49 * 0.75 = 36.75 kept: the paper's reading rounds, official ProLIP's int() floors
    assert random_keep(3, 49, 0.25).shape == (3, 37) and random_keep(3, 49, 0.25, counts="floor").shape == (3, 36)
    per_row = random_keep(64, 49, 0.25)
    assert len({tuple(r) for r in per_row.tolist()}) > 1  # the paper's reading: a subset per image


def test_prolip_model_passes_the_masking_switches():
    torch.manual_seed(0)
    official = official_model("prolip").train()
    images, tokens = torch.randn(24, 3, 32, 32), tokenize(["one two three"] * 24, 16)
    rows, keep, _ = official.masked_inputs(images, tokens)
    assert len(rows) == 3 and keep.shape == (3, 12) and (keep == keep[:1]).all()  # int(0.75 * 16) kept, one subset
    assert len(official.masked_inputs(images[:12], tokens[:12])[0]) == 1  # int(0.125 * 12); the paper's reading 2
    out = official(images[:6], tokens[:6])  # int(0.125 * 6) = 0: no masked copies, the masked terms count 0
    assert out["masked_rows"].numel() == 0
    loss = create_loss("prolip")(out)
    assert loss["inclusion_masked"].item() == 0.0 and math.isfinite(loss["loss"].item())
    _, keep, _ = create_model("prolip_tiny", mask_fraction=1.0).masked_inputs(images[:4], tokens[:4])
    assert keep.shape == (4, 4)  # the paper: 75% dropped, a subset per image
    with pytest.raises(ValueError, match="image_mask"):
        create_model("prolip_tiny", image_mask="rows")


def test_bernoulli_text_mask_against_official_word_masking():
    captions = ["a bold wide seven slanted right", "seven", "a thin one", "two",
                "the digit four written with a very thick pen and slanted far to the left"]  # the last one truncated
    tokens = tokenize(captions * 40, 16)
    model = official_model("prolip")
    torch.manual_seed(3)
    ours = random_text_mask(tokens, model.mask_ratio, model.text_mask)
    torch.manual_seed(3)
    u = torch.rand(tokens.shape)  # the uniforms ours drew; the official code draws its own, row by row
    # the official layout: SigLIP's tokenizer has no start token and pads with its end token (id 1)
    pos = torch.arange(tokens.shape[1])
    texts = torch.where(pos[None, :] < tokens.argmax(-1)[:, None], tokens, 1)[:, 1:]
    assert not (texts[:, : 14] == 1).all(dim=1).any()
    drop_prob, replace_token = 0.75, -1
    # naver-ai/prolip @ 59f6324, src/prolip_train/train.py (train_one_epoch), the masked copies' texts
    masked_texts = texts.clone()
    padding_mask = texts != 1
    for i in range(len(texts)):
        non_padding_indices = torch.where(padding_mask[i])[0]
        replace_mask = u[i, 1:][non_padding_indices] < drop_prob  # official: torch.rand(non_padding_indices.size())
        non_padding_tokens = masked_texts[i, non_padding_indices]
        non_padding_tokens[replace_mask] = replace_token
        masked_texts[i, non_padding_indices] = non_padding_tokens
    assert torch.equal(ours[:, 1:], masked_texts == replace_token)
    assert not ours[:, 0].any()  # the start token never
    words = padding_mask.sum().item()
    assert abs(ours.sum().item() / words - 0.75) < 0.05 and len(set(ours.sum(1).tolist())) > 3
    exact = random_text_mask(tokens, 0.75)  # the paper's reading: exactly round(0.75 n) of the n words
    assert torch.equal(exact.sum(1), (padding_mask.sum(1).float() * 0.75).round().clamp_min(1).long())


def _official_prolip_text(model, text):
    """naver-ai/prolip @ 59f6324, src/prolip/transformer.py, TextTransformer.forward (embed_cls, embed_unc,
    no_causal_mask: ``self.transformer(x, attn_mask=None)`` over the whole padded context), its blocks
    (ResidualAttentionBlock: x + attn(ln_1(x)), x + mlp(ln_2(x)), nn.MultiheadAttention, GELU) and
    ProLIP.encode_text(normalize=True), with this project's weights. The official [UNC] and [CLS]
    embeddings and their positional embeddings are one learnable vector each here (their positional rows
    are 0), and its text projection's bias (proj_bias) is 0: this project's text_proj has none."""
    t = model.text
    x = t.token_embedding(text)
    b, seq_len = x.shape[0], text.shape[1] + 2
    x = torch.cat([x, t.appended[0].expand(b, 1, -1), t.appended[1].expand(b, 1, -1)], dim=1)
    positional_embedding = torch.cat([t.positional_embedding, torch.zeros(2, t.width, dtype=x.dtype)])
    x = x + positional_embedding[:seq_len]
    for blk in t.blocks:
        heads = blk.attn.num_heads
        h = F.layer_norm(x, (t.width,), blk.norm1.weight, blk.norm1.bias, blk.norm1.eps)
        q, k, v = F.linear(h, blk.attn.qkv.weight, blk.attn.qkv.bias).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, seq_len, heads, -1).transpose(1, 2) for z in (q, k, v))
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)  # attn_mask=None
        x = x + F.linear((attn @ v).transpose(1, 2).reshape(b, seq_len, -1), blk.attn.proj.weight, blk.attn.proj.bias)
        h = F.layer_norm(x, (t.width,), blk.norm2.weight, blk.norm2.bias, blk.norm2.eps)
        x = x + F.linear(F.gelu(F.linear(h, blk.mlp.fc1.weight, blk.mlp.fc1.bias)), blk.mlp.fc2.weight, blk.mlp.fc2.bias)
    pooled = x[:, -1]
    pooled = F.layer_norm(pooled, (t.width,), t.ln_final.weight, t.ln_final.bias, t.ln_final.eps)
    pooled = F.linear(pooled, model.text_proj.weight)  # text_projection
    std_pooled = F.linear(pooled, model.text_unc_proj.weight, model.text_unc_proj.bias)  # text_uncertainty_projection(pooled)
    return F.normalize(pooled, dim=-1), std_pooled


def test_prolip_official_text_tower_against_official_forward():
    torch.manual_seed(7)
    model = official_model("prolip").double().eval()
    with torch.no_grad():  # log sigma^2 spread over several units, not only near the initial -10
        model.text_unc_proj.bias.copy_(_logvar((64,), 50))
        model.text_unc_proj.weight.mul_(20.0)
    tokens = tokenize(["one two three", "a bold wide seven", "four", "a thin five slanted left"], 16)
    ours = model.encode_text(tokens)
    mu, logvar = _official_prolip_text(model, tokens)
    params = [p for n, p in model.named_parameters() if n.startswith(("text.", "text_proj", "text_unc_proj"))]
    _assert_same(ours["mu"], mu, params)
    _assert_same(ours["logvar"], logvar, params)
    assert ours["logvar"].std().item() > 2.0
    assert model.text_unc_proj.weight.shape == (64, 64)
    assert create_model("prolip_tiny", text_unc_from="pooled").text_unc_proj.bias[0].item() == -10.0
    # attention to the padding: the outputs change with the context's length; the default cuts the padding
    longer = torch.cat([tokens, torch.zeros(4, 8, dtype=tokens.dtype)], dim=1)
    model.text.positional_embedding = torch.nn.Parameter(torch.cat([model.text.positional_embedding] * 2))
    with torch.no_grad():
        assert (model.encode_text(longer)["mu"] - ours["mu"]).abs().max() > 1e-4
        paper = create_model("prolip_tiny", text_causal=False).double().eval()
        paper.text.positional_embedding = torch.nn.Parameter(torch.cat([paper.text.positional_embedding] * 2))
        torch.testing.assert_close(paper.encode_text(longer)["mu"], paper.encode_text(tokens)["mu"], rtol=0, atol=1e-12)
    # the paper's reading: sigma^2 from the [UNC] output
    assert create_model("prolip_tiny", text_width=32).text_unc_proj.weight.shape == (64, 32)
    assert create_model("prolip_tiny", text_width=32, text_unc_from="pooled").text_unc_proj.weight.shape == (64, 64)


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


# ---------------------------------------------------------------------------------------------------- Llip
def _llip_official_features(model, images, tokens):
    """facebookresearch/Llip @ d5649c3, llip/open_clip/model.py, CMP.encode_image (K, V: the image tower's
    mixture-token outputs times a (width, D) projection per token) and CMP.encode_text (Q = h q_proj,
    zt = h text_projection, h the EOT output after ln_final), with this project's weights (the official
    (in, out) matrices are this project's (out, in) weights transposed)."""
    mixer, heads = model.mixer, model.mixer.heads
    h = model.visual(images)[:, : model.mixture_tokens]
    K = h.transpose(0, 1) @ mixer.k_proj.weight.transpose(1, 2)
    V = h.transpose(0, 1) @ mixer.v_proj.weight.transpose(1, 2)
    N, B, C = K.shape
    K = K.reshape(N, B, heads, C // heads).permute(1, 2, 0, 3)
    V = V.reshape(N, B, heads, C // heads).permute(1, 2, 0, 3)
    x = model.text(tokens)
    ht = x[torch.arange(x.shape[0]), tokens.argmax(dim=-1)]
    Q = ht @ mixer.q_proj.weight.T
    Q = Q.reshape(Q.shape[0], heads, Q.shape[1] // heads)
    zt = ht @ model.text_proj.weight.T
    return K, V, Q, zt


def _llip_cross_attention(K, Q, V, weight_scale, out_proj):
    """facebookresearch/Llip @ d5649c3, llip/open_clip/model.py, xAttnPred.cross_attention."""
    attn = (torch.einsum('vhnd,thd->vthn', K, Q) / weight_scale).softmax(-1)
    zv = torch.einsum('vthn,vhnd->vthd', attn, V).reshape(K.shape[0], Q.shape[0], -1)
    return zv @ out_proj


def _llip_official_loss(K, Q, V_visual, V_text, out_proj, weight_temp, logit_scale, logit_bias):
    """facebookresearch/Llip @ d5649c3, llip/open_clip/loss.py, CMPLoss._loss / get_logits (world_size 1);
    llip/training/train.py normalises zt first."""
    zv = F.normalize(_llip_cross_attention(K, Q, V_visual, weight_temp, out_proj), dim=-1)
    cos = (V_text[None] * zv).sum(-1)
    logits = logit_scale * cos + logit_bias
    labels = 2 * torch.eye(len(V_visual), dtype=cos.dtype) - torch.ones(len(V_visual), len(V_visual), dtype=cos.dtype)
    return cos, -F.logsigmoid(labels * logits).sum() / V_visual.shape[0]


def _llip_official():
    torch.manual_seed(5)
    return official_model("llip", mixer_heads=2, mixture_tokens=3).double().eval()


def test_llip_official_model_and_loss_against_official_code():
    model = _llip_official()
    images = torch.randn(4, 3, 32, 32, generator=_gen(30), dtype=f64)
    tokens = tokenize(["one", "two three", "four five six", "seven"], 16)
    # official model: init_logit_scale = np.log(1 / 0.07) (CLIP.__init__), init_logit_bias -10 (model_configs/
    # ViT-B-16-quickgelu-siglip-ncls:64.json); no SigLIP init
    loss = official_loss("llip").double()
    assert loss.logit_scale.item() == pytest.approx(math.log(1 / 0.07), rel=1e-7) and loss.logit_bias.item() == -10.0
    out = model(images, tokens)
    ours = loss(out)["loss"]
    K, V, Q, zt = _llip_official_features(model, images, tokens)
    cos, ref = _llip_official_loss(K, Q, V, F.normalize(zt, dim=-1), model.mixer.out_weight.T, model.mixer.tau,
                                   loss.logit_scale.exp().reshape(()), loss.logit_bias.reshape(()))
    params = [*model.parameters(), loss.logit_scale, loss.logit_bias]
    _assert_same(out["pair_cos"], cos, params)
    _assert_same(ours, ref, params)
    assert model.mixer.k_proj.weight.shape == (3, 64, 64)  # one K (and one V) projection per mixture token


def test_llip_mean_query_zero_shot_against_official_evaluation():
    model = _llip_official()
    prompts = [["a one", "the digit one"], ["a two", "the digit two"], ["a three", "the digit three"]]
    images = torch.randn(2, 3, 32, 32, generator=_gen(31), dtype=f64)
    flat = model.encode_text(tokenize([p for c in prompts for p in c], 16))
    per = {k: v.reshape(3, 2, -1) for k, v in flat.items()}
    scores = model.class_scores(model.encode_image(images), model.class_embeddings(per))
    # facebookresearch/Llip @ d5649c3, llip/clipeval/eval_zeroshot.py, build_text_features_cmp (classnorm off)
    # and validate_zeroshot_cmp: class feature = normalised mean of normalised zt, class query = mean of Q
    text_features, Qs = [], []
    for c in range(3):
        K, V, Q, class_embeddings = _llip_official_features(model, images, tokenize(prompts[c], 16))
        class_embeddings = class_embeddings / class_embeddings.norm(dim=-1, keepdim=True)
        text_features.append(class_embeddings.mean(dim=0))
        Qs.append(Q.mean(0))
    text_features = torch.stack(text_features, dim=0)
    text_features = text_features / text_features.norm(dim=-1, keepdim=True)
    image_features = _llip_cross_attention(K, torch.stack(Qs, dim=0), V, model.mixer.tau, model.mixer.out_weight.T)
    image_features = image_features / image_features.norm(dim=-1, keepdim=True)
    logits_per_image = (image_features * text_features[None]).sum(-1)
    _assert_same(scores, logits_per_image, list(model.parameters()))
    with pytest.raises(ValueError, match="mean_query"):
        create_model("llip_tiny", query_from="hidden")
    with pytest.raises(KeyError, match="query"):
        model.class_scores(model.encode_image(images), {"mu": text_features})


def test_llip_mean_query_with_embedding_queries_averages_unnormalised_templates():
    # the official recipe's zero-shot query alone on the paper's model: its other switches (a K and V per mixture
    # token, hidden-state queries) change the weights, so the two models could not share them
    cfg, paper_cfg = _recipes("llip")
    switch = {"zeroshot_query": cfg.model.overrides["zeroshot_query"]}
    torch.manual_seed(6)
    paper = create_model(paper_cfg.model.name, **paper_cfg.model.overrides, mixer_heads=2).double().eval()
    official = create_model(cfg.model.name, **paper_cfg.model.overrides, **switch, mixer_heads=2).double().eval()
    official.load_state_dict(paper.state_dict())
    per = {"mu": F.normalize(torch.randn(3, 4, 64, dtype=f64), dim=-1)}
    q_paper, q_official = paper.class_embeddings(per), official.class_embeddings(per)
    torch.testing.assert_close(q_official["query"], per["mu"].mean(1))  # no renormalisation
    torch.testing.assert_close(paper.query(q_paper), F.normalize(per["mu"].mean(1), dim=-1))


# ---------------------------------------------------------------------------------------------------- ProbVLM
def _adapt_recipes():
    """configs/probvlm_demo_official.yaml and the paper's adapter config it departs from."""
    return (load_adapt_config(ROOT / "configs" / "probvlm_demo_official.yaml"),
            load_adapt_config(ROOT / "configs" / "probvlm_demo.yaml"))


class _OfficialTempCombLoss:
    """ExplainableML/ProbVLM @ cb69f28, src/losses.py, TempCombLoss (reduction 'mean') and GenGaussLoss
    (alpha_eps = beta_eps = 1e-4, resi_min 1e-4, resi_max 1e3); its network outputs 1/alpha."""

    def gen_gauss(self, mean, one_over_alpha, beta, target):
        one_over_alpha1 = one_over_alpha + 1e-4
        beta1 = beta + 1e-4
        resi = torch.abs(mean - target)
        resi = (resi * one_over_alpha1 * beta1).clamp(min=1e-4, max=1e3)
        log_one_over_alpha = torch.log(one_over_alpha1)
        log_beta = torch.log(beta1)
        lgamma_beta = torch.lgamma(torch.pow(beta1, -1))
        return (resi - log_one_over_alpha + lgamma_beta - log_beta).mean()

    def __call__(self, mean, one_over_alpha, beta, target, T1, T2):
        l1 = (mean - target).abs().mean()  # nn.L1Loss(reduction='mean')
        return T1 * l1 + T2 * self.gen_gauss(mean, one_over_alpha, beta, target)


def _probvlm_batch(seed: int, clamped: bool = False) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    out = {}
    for m in ("image", "text"):
        out[f"{m}_hat"] = torch.randn(4, 5, generator=g, dtype=f64)
        out[f"{m}_target"] = torch.randn(4, 5, generator=g, dtype=f64)
        out[f"{m}_alpha"] = torch.exp(torch.randn(4, 5, generator=g, dtype=f64))  # alpha over e^-2 .. e^2
        out[f"{m}_beta"] = torch.rand(4, 5, generator=g, dtype=f64) * 2.5 + 0.3
    if clamped:  # residuals the official clamp cuts at both ends
        out["image_hat"][0, :2] = out["image_target"][0, :2]
        out["text_hat"][1, :2] = out["text_target"][1, :2] + 5e3
    return {k: _leaf(v) for k, v in out.items()}


@pytest.mark.parametrize("clamped", [False, True])
@pytest.mark.parametrize("lambda_cross", [1e-4, 0.3])
def test_probvlm_official_loss_against_official_training_step(lambda_cross, clamped):
    out = _probvlm_batch(40, clamped)
    T1, T2 = 1.0, 5e-2  # train_ProbVLM's defaults
    cfg, paper = _adapt_recipes()
    _shared_only(cfg.loss.params, paper.loss.params, {"lambda_cross": lambda_cross})
    assert cfg.loss.params["l1"] == T1 / T2  # the recipe's ggd weight is 1: the official loss divided by T2
    loss = create_loss(cfg.loss_name(), **{**cfg.loss.params, "lambda_cross": lambda_cross})
    ours = loss(out)["loss"] * T2
    # ExplainableML/ProbVLM @ cb69f28, src/train_probVLM.py, train_ProbVLM (one step)
    Cri = _OfficialTempCombLoss()
    img_mu, img_1alpha, img_beta, xfI = out["image_hat"], 1 / out["image_alpha"], out["image_beta"], out["image_target"]
    txt_mu, txt_1alpha, txt_beta, xfT = out["text_hat"], 1 / out["text_alpha"], out["text_beta"], out["text_target"]
    loss_i = Cri(img_mu, img_1alpha, img_beta, xfI, T1=T1, T2=T2)
    loss_t = Cri(txt_mu, txt_1alpha, txt_beta, xfT, T1=T1, T2=T2)
    loss_i4t = Cri(img_mu, img_1alpha, img_beta, xfT, T1=T1, T2=T2)
    loss_t4i = Cri(txt_mu, txt_1alpha, txt_beta, xfI, T1=T1, T2=T2)
    ref = loss_i + loss_t + lambda_cross * (loss_i4t + loss_t4i)
    _assert_same(ours, ref, list(out.values()))


def _ggd_reference(r_abs: float, alpha: float, beta: float, approx: str | None, stabilise: bool) -> float:
    """The GGD NLL forms outside the official code's combination (Eq. 3, Eq. 16, each with or without the guards)."""
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
def test_ggd_forms_against_reference(approx, stabilise):
    # residuals from 0 (clamped up to 1e-4 when stabilised) to huge (clamped down to 1e3)
    target = torch.zeros(6, dtype=f64)
    mu = torch.tensor([0.0, 1e-7, 0.3, 1.5, 40.0, 5e3], dtype=f64)
    alpha = torch.tensor([0.5, 0.2, 1.3, 0.7, 0.05, 0.01], dtype=f64)
    beta = torch.tensor([1.5, 0.8, 2.0, 1.0, 3.0, 2.5], dtype=f64)
    got = ggd_nll(target, mu, alpha, beta, approx=approx is not None, approx_form=approx or "eq16", stabilise=stabilise)
    ref = [_ggd_reference(abs(m), a, b, approx, stabilise) for m, a, b in zip(mu.tolist(), alpha.tolist(), beta.tolist())]
    torch.testing.assert_close(got, torch.tensor(ref, dtype=f64), rtol=1e-10, atol=1e-12)


def test_probvlm_loss_parts_and_adapter_config_keys():
    out = {k: v.detach() for k, v in _probvlm_batch(7).items()}
    l1 = lambda a, b: (out[a] - out[b]).abs().mean().item()  # noqa: E731
    own = l1("image_hat", "image_target") + l1("text_hat", "text_target")
    cross = l1("image_hat", "text_target") + l1("text_hat", "image_target")
    for switch in (False, True):
        parts = create_loss("probvlm", l1_cross=switch)(out)
        assert parts["l1"].item() == pytest.approx(own, rel=1e-12)
        assert parts["l1_cross"].item() == pytest.approx(cross, rel=1e-12)
    base = create_loss("probvlm", l1=2.0, lambda_cross=0.3)(out)["loss"].item()
    with_cross = create_loss("probvlm", l1=2.0, lambda_cross=0.3, l1_cross=True)(out)["loss"].item()
    assert with_cross - base == pytest.approx(2.0 * 0.3 * cross, rel=1e-10)  # the cross L1 weighted l1 * lambda
    # the adapter's loss section ({name, params}, checked against the loss like pretraining's) carries the switches
    # to the loss unchanged; the paper's form by default; a wrong value or key, or the flat keys, is one line
    official = _adapt_recipes()[0]
    loss = build_adapter_set(official, 8).losses["adapter"]
    assert (loss.approx_form, loss.stabilise, loss.l1_cross) == ("linear", True, True)
    assert build_adapter_set(_adapt_recipes()[1], 8).losses["adapter"].approx_form == "eq16"
    for wrong, said in ((["loss.params.approx_form=taylor"], "loss.params: loss 'probvlm': approx_form must be one of"),
                        (["loss.params.lambda=0.1"], "loss.params.lambda: unknown key for loss 'probvlm'"),
                        (["loss.lambda_cross=0.1"], "the loss's parameters go under loss.params")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            load_adapt_config(ROOT / "configs" / "probvlm_demo.yaml", wrong)


# ---------------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("name", ["prolip_tiny_official", "pcmepp_tiny_official", "llip_tiny_official"])
def test_official_configs_load_and_differ_from_the_paper_configs_only_in_switches(name):
    cfg = load_train_config(ROOT / "configs" / f"{name}.yaml")
    paper = load_train_config(ROOT / "configs" / f"{name.removesuffix('_official')}.yaml")
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
    from pipelines.pretrain.config import TrainDocument
    from pipelines.zero.engine import deepspeed_config

    cfg = TrainDocument.from_dict({"model": {"name": "prolip_tiny"}})
    on, off = deepspeed_config(cfg.train, True), deepspeed_config(cfg.train, False)
    assert on["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and not off["torch_autocast"]["enabled"]
    assert "bf16" not in on  # DeepSpeed's bf16 engine would cast the float32 heads' parameters to bf16


BF16_ENGINE_STEPS = """
import json, os, torch, deepspeed
from models.objective import build_objective
from models.tokenizer import tokenize
from pipelines.pretrain.config import load_train_config
from pipelines.zero.engine import deepspeed_config, skip_inference_comm_op
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
skip_inference_comm_op()
torch.manual_seed(0)
cfg = load_train_config("configs/prolip_tiny.yaml",
                        ["train.precision=bf16", "train.batch_size=8", "train.num_workers=1"])
objective = build_objective(cfg)
engine, *_ = deepspeed.initialize(model=objective, optimizer=torch.optim.AdamW(objective.parameters(), lr=1e-3),
                                  config=deepspeed_config(cfg.train, True))
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
