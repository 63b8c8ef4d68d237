"""models.distributions against independent references (Monte Carlo, quadrature, scipy), float64."""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.integrate
import scipy.special
import scipy.stats
import torch

from models.distributions import (
    csd,
    ggd_nll,
    ggd_variance,
    inclusion_test,
    log_inclusion,
    pml_logits,
    ppcl_logits,
    vib_kl,
)

f64 = torch.float64


def _gen(seed: int = 0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# CSD
# ---------------------------------------------------------------------------------------------
def test_csd_matches_monte_carlo_for_non_unit_means():
    g = _gen(0)
    n1, n2, d, samples = 3, 4, 5, 40_000
    mu1, mu2 = 2 * torch.randn(n1, d, generator=g, dtype=f64), torch.randn(n2, d, generator=g, dtype=f64)
    lv1, lv2 = torch.randn(n1, d, generator=g, dtype=f64), torch.randn(n2, d, generator=g, dtype=f64) - 1
    z1 = mu1 + (0.5 * lv1).exp() * torch.randn(samples, n1, d, generator=g, dtype=f64)
    z2 = mu2 + (0.5 * lv2).exp() * torch.randn(samples, n2, d, generator=g, dtype=f64)
    sq = (z1[:, :, None, :] - z2[:, None, :, :]).pow(2).sum(-1)  # (S, N1, N2)
    mc, stderr = sq.mean(0), sq.std(0) / math.sqrt(samples)
    got = csd(mu1, lv1, mu2, lv2)
    assert got.shape == (n1, n2)
    assert ((got - mc).abs() < 5 * stderr).all(), (got - mc) / stderr


def test_csd_and_logits_match_broadcast_formula_with_gradients():
    g = _gen(1)
    mu1 = torch.randn(6, 7, generator=g, dtype=f64, requires_grad=True)
    mu2 = torch.randn(5, 7, generator=g, dtype=f64, requires_grad=True)
    lv1 = torch.randn(6, 7, generator=g, dtype=f64, requires_grad=True)
    lv2 = torch.randn(5, 7, generator=g, dtype=f64, requires_grad=True)
    a = torch.tensor(3.0, dtype=f64, requires_grad=True)
    b = torch.tensor(-2.0, dtype=f64, requires_grad=True)
    inputs = (mu1, mu2, lv1, lv2, a, b)

    def naive_d():
        return (mu1[:, None] - mu2[None]).pow(2).sum(-1) + (lv1.exp()[:, None] + lv2.exp()[None]).sum(-1)

    w = torch.randn(6, 5, generator=g, dtype=f64)
    for fast, slow in [
        (lambda: csd(mu1, lv1, mu2, lv2), naive_d),
        (lambda: pml_logits(mu1, lv1, mu2, lv2, a, b), lambda: -a * naive_d() + b),
        (
            lambda: ppcl_logits(mu1, lv1, mu2, lv2, a, b),
            lambda: a * ((mu1[:, None] * mu2[None]).sum(-1) - 0.5 * (lv1.exp()[:, None] + lv2.exp()[None]).sum(-1)) + b,
        ),
    ]:
        got, ref = fast(), slow()
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        g1 = torch.autograd.grad((got * w).sum(), inputs, allow_unused=True)
        g2 = torch.autograd.grad((ref * w).sum(), inputs, allow_unused=True)
        for x, y in zip(g1, g2):
            if y is None:
                assert x is None or x.abs().max() == 0
            else:
                torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def test_csd_identical_means_is_nonnegative_in_float32():
    mu = torch.nn.functional.normalize(torch.randn(64, 256), dim=-1)
    lv = torch.full_like(mu, -30.0)
    d = csd(mu, lv, mu, lv)
    assert (d >= 0).all() and d.diagonal().max() < 1e-4


# ---------------------------------------------------------------------------------------------
# inclusion
# ---------------------------------------------------------------------------------------------
CASES = [  # mu1, l1, mu2, l2 (1-D)
    (0.0, -1.0, 0.0, 1.0),
    (0.3, 0.5, -0.4, -0.5),
    (1.2, -2.0, -0.7, 0.8),
    (-0.5, 1.5, 0.9, 1.5),
    (0.0, 0.0, 0.0, 0.0),
    (2.0, -0.3, 0.0, 2.0),
]


def _log_int_p1sq_p2(mu1, l1, mu2, l2) -> float:
    s1, s2 = math.exp(0.5 * l1), math.exp(0.5 * l2)
    lo = min(mu1, mu2) - 15 * max(s1, s2)
    hi = max(mu1, mu2) + 15 * max(s1, s2)

    def f(x):
        return scipy.stats.norm.pdf(x, mu1, s1) ** 2 * scipy.stats.norm.pdf(x, mu2, s2)

    val, _ = scipy.integrate.quad(f, lo, hi, points=sorted({mu1, mu2}), epsabs=0, epsrel=1e-12, limit=200)
    return math.log(val)


def _t(*xs):
    return [torch.tensor([[x]], dtype=f64) for x in xs]


@pytest.mark.parametrize("case", CASES)
def test_inclusion_test_both_forms_vs_quadrature(case):
    mu1, l1, mu2, l2 = case
    h_exact_ref = _log_int_p1sq_p2(mu1, l1, mu2, l2) - _log_int_p1sq_p2(mu2, l2, mu1, l1)
    args = _t(mu1, l1, mu2, l2)
    h_exact = inclusion_test(*args, eps=0.0, form="exact").item()
    h_paper = inclusion_test(*args, eps=0.0, form="paper").item()
    assert h_exact == pytest.approx(h_exact_ref, rel=1e-8, abs=1e-9)
    # The printed Eq. 3 doubles the log-variance terms: -2 l1 - l2 instead of -l1 - l2/2.
    assert h_paper == pytest.approx(h_exact_ref + 0.5 * (l2 - l1), rel=1e-8, abs=1e-9)


@pytest.mark.parametrize("case", CASES)
def test_log_inclusion_vs_quadrature(case):
    mu1, l1, mu2, l2 = case
    ref = _log_int_p1sq_p2(mu1, l1, mu2, l2)
    args = _t(mu1, l1, mu2, l2)
    assert log_inclusion(*args, form="exact").item() == pytest.approx(ref, rel=1e-9, abs=1e-9)
    const = -1.5 * math.log(2 * math.pi) + 0.5 * math.log(math.pi)
    paper = log_inclusion(*args, form="paper").item()
    assert paper == pytest.approx(ref - const + (-l1 - 0.5 * l2), rel=1e-9, abs=1e-9)


def test_inclusion_eps_scales_inverse_variances():
    g = _gen(2)
    mu1, mu2, l1, l2 = (torch.randn(4, 6, generator=g, dtype=f64) for _ in range(4))
    for form in ("paper", "exact"):
        for eps in (-20.0, -5.0, 3.0):
            got = inclusion_test(mu1, l1, mu2, l2, eps=eps, form=form)
            # Scaling 1/sigma^2 by e^eps == shifting every log-variance by -eps (l2 - l1 unchanged).
            torch.testing.assert_close(got, inclusion_test(mu1, l1 - eps, mu2, l2 - eps, form=form))
            diff = log_inclusion(mu1, l1, mu2, l2, eps, form) - log_inclusion(mu2, l2, mu1, l1, eps, form)
            torch.testing.assert_close(got, diff)


def test_inclusion_signs():
    # Narrow Z1 inside wide Z2: positive; the reverse: negative; identical: zero.
    mu = torch.zeros(1, 3, dtype=f64)
    narrow, wide = torch.full((1, 3), -2.0, dtype=f64), torch.full((1, 3), 1.0, dtype=f64)
    for form in ("paper", "exact"):
        assert (inclusion_test(mu, narrow, mu, wide, form=form) > 0).all()
        assert (inclusion_test(mu, wide, mu, narrow, form=form) < 0).all()
        assert inclusion_test(mu, wide, mu, wide, form=form).abs().max() == 0


def test_inclusion_bad_form():
    with pytest.raises(ValueError, match="form"):
        inclusion_test(*_t(0.0, 0.0, 0.0, 0.0), form="nope")


# ---------------------------------------------------------------------------------------------
# VIB, GGD
# ---------------------------------------------------------------------------------------------
def test_vib_kl_vs_closed_form_kl():
    g = _gen(3)
    mu, lv = torch.randn(7, 5, generator=g, dtype=f64), 2 * torch.randn(7, 5, generator=g, dtype=f64)
    m, s2 = mu.numpy(), np.exp(lv.numpy())
    # KL(N(m, s2) || N(0, 1)) = 1/2 (s2 + m^2 - 1 - log s2), per dimension
    ref = np.mean(0.5 * (s2 + m**2 - 1.0 - np.log(s2)))
    assert vib_kl(mu, lv).item() == pytest.approx(ref, rel=1e-12)
    kl = torch.distributions.kl_divergence(torch.distributions.Normal(mu, (0.5 * lv).exp()), torch.distributions.Normal(0.0, 1.0))
    assert vib_kl(mu, lv).item() == pytest.approx(kl.mean().item(), rel=1e-12)


@pytest.mark.parametrize("beta", [0.4, 1.0, 2.0, 3.5])
def test_ggd_nll_vs_scipy_gennorm(beta):
    g = _gen(4)
    x = torch.randn(50, generator=g, dtype=f64)
    mu = torch.randn(50, generator=g, dtype=f64)
    alpha = torch.rand(50, generator=g, dtype=f64) + 0.2
    b = torch.full((50,), beta, dtype=f64)
    ref = -scipy.stats.gennorm.logpdf(x.numpy(), beta, loc=mu.numpy(), scale=alpha.numpy()) - math.log(2.0)
    np.testing.assert_allclose(ggd_nll(x, mu, alpha, b).numpy(), ref, rtol=1e-10, atol=1e-12)
    var_ref = scipy.stats.gennorm.var(beta, loc=0.0, scale=alpha.numpy())
    np.testing.assert_allclose(ggd_variance(alpha, b).numpy(), var_ref, rtol=1e-10)


def test_ggd_nll_taylor_form():
    g = _gen(5)
    x, mu = torch.randn(30, generator=g, dtype=f64), torch.randn(30, generator=g, dtype=f64)
    alpha, beta = torch.rand(30, generator=g, dtype=f64) + 0.1, torch.rand(30, generator=g, dtype=f64) * 3 + 0.2
    r = (x - mu).abs().numpy() / alpha.numpy()
    b = beta.numpy()
    ref = 1 - b + b * r - np.log(b / alpha.numpy()) + scipy.special.gammaln(1 / b)
    np.testing.assert_allclose(ggd_nll(x, mu, alpha, beta, approx=True).numpy(), ref, rtol=1e-12)
    one = torch.ones_like(beta)  # at beta = 1 the Taylor form is exact
    torch.testing.assert_close(ggd_nll(x, mu, alpha, one, approx=True), ggd_nll(x, mu, alpha, one))


def test_ggd_nll_zero_residual_has_finite_gradient():
    x = torch.zeros(4, dtype=f64)
    mu = torch.zeros(4, dtype=f64, requires_grad=True)
    alpha = torch.ones(4, dtype=f64, requires_grad=True)
    beta = torch.tensor([0.3, 0.9, 1.0, 2.0], dtype=f64, requires_grad=True)
    ggd_nll(x, mu, alpha, beta).sum().backward()
    for t in (mu, alpha, beta):
        assert torch.isfinite(t.grad).all()


# ---------------------------------------------------------------------------------------------
# numerical safety (float32)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lv_value", [-30.0, 30.0])
@pytest.mark.parametrize("eps", [0.0, -20.0])
def test_extreme_logvars_are_finite(lv_value, eps):
    g = _gen(6)
    mu = torch.nn.functional.normalize(torch.randn(8, 16, generator=g), dim=-1).requires_grad_()
    other = torch.nn.functional.normalize(torch.randn(8, 16, generator=g), dim=-1).requires_grad_()
    lv1 = torch.full((8, 16), lv_value, requires_grad=True)
    lv2 = torch.empty(8, 16).uniform_(-30, 30, generator=g).requires_grad_()
    outs = [
        csd(mu, lv1, other, lv2).sum(),
        pml_logits(mu, lv1, mu, lv1, 5.0, 5.0).sum(),
        ppcl_logits(mu, lv1, other, lv2, 10.0, -10.0).sum(),
        vib_kl(mu, lv1),
    ]
    for form in ("paper", "exact"):
        for a, b in [((mu, lv1), (mu, lv1)), ((mu, lv1), (other, lv2)), ((other, lv2), (mu, lv1))]:
            h = inclusion_test(*a, *b, eps=eps, form=form)
            outs.append(torch.nn.functional.softplus(-1000.0 * h).mean())
    for o in outs:
        assert torch.isfinite(o)
        grads = torch.autograd.grad(o, (mu, other, lv1, lv2), allow_unused=True)
        assert all(gr is None or torch.isfinite(gr).all() for gr in grads)


def test_inclusion_gradients_match_literal_formula_including_ties():
    """Gradients of the cancellation-free form equal those of inc(1,2) - inc(2,1) written literally."""
    g = _gen(7)
    mu1, mu2 = torch.randn(5, 4, generator=g, dtype=f64), torch.randn(5, 4, generator=g, dtype=f64)
    l1, l2 = torch.randn(5, 4, generator=g, dtype=f64), torch.randn(5, 4, generator=g, dtype=f64)
    l2[0] = l1[0]  # exact ties of the log-variances
    mu2[1] = mu1[1]
    leaves = [t.requires_grad_() for t in (mu1, l1, mu2, l2)]
    for form in ("paper", "exact"):
        for eps in (0.0, -2.0):
            got = inclusion_test(mu1, l1, mu2, l2, eps=eps, form=form)
            ref = log_inclusion(mu1, l1, mu2, l2, eps, form) - log_inclusion(mu2, l2, mu1, l1, eps, form)
            w = torch.randn(5, 4, generator=g, dtype=f64)
            for a, b in zip(torch.autograd.grad((got * w).sum(), leaves), torch.autograd.grad((ref * w).sum(), leaves)):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
