"""Evaluation options: zero-shot prompt weighting (`prompts: mean | bprw | filter`) and scoring (`score: model |
mean`), approximate retrieval (`index: faiss`), and the uncertainty analyses. Each formula against an
independent float64 / scipy / quadrature reference written from the papers. No Ray."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from models import create_model
from models.scoring.ann import MeanIndex, pair_scores, rerank
from models.scoring.metrics import rank_candidates, rank_queries
from models.scoring.prompts import (bprw_em, bprw_observations, filter_weights, gaussian_log_density,
                                     weighted_ensemble)
from pipelines.config import ConfigError, EvalTask
from pipelines.pretrain.config import TrainDocument, load_train_config
from pipelines.evaluate.tasks import classes_from_prompts, score_task
from pipelines.evaluate.in_process import TaskEmbeddings

# ------------------------------------------------------------------------------------ BPRW (ProLIP A.5)


def naive_bprw(points, mu, var, alpha, eps, iters, tol):
    """Algorithm 1 of ProLIP A.5 for one class, loops and scipy densities in float64."""
    n_prompts = len(mu)
    inv_tr = [1.0 / sum(v) for v in var]
    pi = np.array([x / sum(inv_tr) for x in inv_tr])
    var = [np.asarray(v, np.float64) + eps for v in var]
    log_f = np.array([[stats.norm.logpdf(x, loc=mu[n], scale=np.sqrt(var[n])).sum() for n in range(n_prompts)]
                      for x in points])
    for _ in range(iters):
        gamma = np.zeros_like(log_f)
        for j in range(len(points)):
            logs = [math.log(pi[n]) + log_f[j, n] if pi[n] > 0 else -math.inf for n in range(n_prompts)]
            top = max(logs)
            norm = sum(math.exp(v - top) for v in logs)
            gamma[j] = [math.exp(v - top) / norm for v in logs]
        new = np.array([(gamma[:, n].sum() + alpha - 1) / (len(points) + n_prompts * (alpha - 1))
                        for n in range(n_prompts)])
        new = np.clip(new, 0, None)
        new = new / new.sum()
        done = np.abs(new - pi).max() < tol
        pi = new
        if done:
            break
    return pi


@pytest.mark.parametrize("alpha", [0.5, 2.0, 5.0])
def test_bprw_em_matches_algorithm_1(alpha):
    rng = np.random.default_rng(0)
    d, t, m = 6, 4, 30
    mu = rng.normal(size=(t, d))
    var = np.exp(rng.normal(size=(t, d)) - 1.5)
    points = mu[rng.integers(0, t, m)] + rng.normal(size=(m, d)) * 0.4
    got = bprw_em(torch.tensor(points[None]), torch.tensor(mu[None]), torch.tensor(np.log(var)[None]), alpha, 0.02,
                  iters=50, tol=1e-9)[0]
    want = naive_bprw(points, mu, var, alpha, 0.02, iters=50, tol=1e-9)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5)
    assert got.min() >= 0 and got.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_bprw_recovers_known_mixing_proportions():
    # with alpha = 1 the MAP estimate is the maximum-likelihood mixture weight of well-separated components
    rng = np.random.default_rng(1)
    d, true_pi = 8, np.array([0.6, 0.3, 0.1])
    mu = rng.normal(size=(3, d)) * 3
    which = rng.choice(3, size=4000, p=true_pi)
    points = mu[which] + rng.normal(size=(4000, d)) * 0.5
    logvar = torch.full((1, 3, d), math.log(0.25))
    pi = bprw_em(torch.tensor(points[None]), torch.tensor(mu[None]), logvar, alpha=1.0, eps=0.0, iters=200)[0]
    np.testing.assert_allclose(pi.numpy(), np.bincount(which, minlength=3) / 4000, atol=0.01)
    # a strong prior pulls towards uniform
    flat = bprw_em(torch.tensor(points[None]), torch.tensor(mu[None]), logvar, alpha=1e5, eps=0.0)[0]
    assert (flat - 1 / 3).abs().max() < 0.01


def test_gaussian_log_density_against_scipy():
    rng = np.random.default_rng(2)
    x, mu, var = rng.normal(size=(2, 5, 7)), rng.normal(size=(2, 3, 7)), np.exp(rng.normal(size=(2, 3, 7)))
    got = gaussian_log_density(torch.tensor(x), torch.tensor(mu), torch.tensor(var)).numpy()
    for c in range(2):
        for j in range(5):
            for n in range(3):
                want = stats.multivariate_normal.logpdf(x[c, j], mu[c, n], np.diag(var[c, n]))
                assert got[c, j, n] == pytest.approx(want, rel=1e-10)


def test_bprw_observations_are_the_nearest_images_samples():
    torch.manual_seed(0)
    image = {"mu": torch.randn(20, 4), "logvar": torch.full((20, 4), math.log(1e-6))}
    scores = torch.randn(20, 3)
    points = bprw_observations(image, scores, images=2, samples=5, generator=torch.Generator().manual_seed(0))
    assert points.shape == (3, 10, 4)
    for c in range(3):
        nearest = scores[:, c].topk(2).indices
        # sigma = 1e-3: each point lies next to one of the class's two best-scoring images
        dist = torch.cdist(points[c], image["mu"][nearest]).min(dim=1).values
        assert dist.max() < 0.02


# ------------------------------------------------------------------------------------ ensembles and filter


def test_weighted_ensemble_with_uniform_weights_is_each_models_prompt_ensemble():
    torch.manual_seed(0)
    out = {"mu": F.normalize(torch.randn(3, 4, 8), dim=-1), "logvar": torch.randn(3, 4, 8)}
    uniform = torch.full((3, 4), 0.25)
    for name in ("prolip_tiny", "pcmepp_tiny"):
        want = create_model(name).class_embeddings(out)
        got = weighted_ensemble(out, uniform)
        assert torch.allclose(got["mu"], want["mu"], atol=1e-6) and torch.allclose(got["logvar"], want["logvar"], atol=1e-6)
    want = create_model("clip_tiny").class_embeddings({"mu": out["mu"]})
    assert torch.allclose(weighted_ensemble({"mu": out["mu"]}, uniform)["mu"], want["mu"], atol=1e-6)


def test_weighted_ensemble_against_float64_sums():
    torch.manual_seed(1)
    out = {"mu": torch.randn(2, 5, 6), "logvar": torch.randn(2, 5, 6)}
    w = torch.softmax(torch.randn(2, 5), dim=1)
    got = weighted_ensemble(out, w)
    mu, var, w64 = out["mu"].double().numpy(), out["logvar"].double().exp().numpy(), w.double().numpy()
    for c in range(2):
        m = sum(w64[c, n] * mu[c, n] for n in range(5))
        np.testing.assert_allclose(got["mu"][c].numpy(), m / np.linalg.norm(m), atol=1e-6)
        np.testing.assert_allclose(got["logvar"][c].exp().numpy(), sum(w64[c, n] * var[c, n] for n in range(5)),
                                   rtol=1e-5)


def test_filter_keeps_the_k_most_certain_prompts():
    rng = np.random.default_rng(3)
    logvar = rng.normal(size=(4, 7, 5))
    w = filter_weights(torch.tensor(logvar), keep=3).numpy()
    for c in range(4):
        trace = [np.exp(logvar[c, n]).sum() for n in range(7)]
        kept = sorted(range(7), key=lambda n: trace[n])[:3]
        assert sorted(np.flatnonzero(w[c]).tolist()) == sorted(kept)
        np.testing.assert_allclose(w[c][kept], 1 / 3)
    assert (filter_weights(torch.tensor(logvar), keep=20) == 1 / 7).all()  # k past the prompt count keeps all


# ------------------------------------------------------------------------------------ zero-shot task


def toy_zeroshot(n_classes=4, per_class=30, dim=16, seed=0):
    """Images around one direction per class; 3 right prompts per class near it (small sigma^2) and 3 wrong
    prompts shared by every class (a fixed unrelated direction, large sigma^2)."""
    g = torch.Generator().manual_seed(seed)
    centers = F.normalize(torch.randn(n_classes, dim, generator=g), dim=-1)
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    mu = F.normalize(centers[labels] + 0.45 * torch.randn(len(labels), dim, generator=g), dim=-1)
    image = {"mu": mu, "logvar": torch.full_like(mu, math.log(1e-3))}
    wrong = F.normalize(torch.randn(3, dim, generator=g), dim=-1)
    t_mu, t_lv = [], []
    for c in range(n_classes):
        right = F.normalize(centers[c] + 0.2 * torch.randn(3, dim, generator=g), dim=-1)
        t_mu += [right, wrong]
        t_lv += [torch.full((3, dim), math.log(2e-3)), torch.full((3, dim), math.log(2e-2))]
    text = {"mu": torch.cat(t_mu), "logvar": torch.cat(t_lv)}
    prompts = [f"class {c} prompt {i}" for c in range(n_classes) for i in range(6)]
    return TaskEmbeddings([f"{i:04d}" for i in range(len(labels))], image, [[] for _ in labels], labels, prompts,
                          text, [6] * n_classes, [f"c{c}" for c in range(n_classes)])


def zs_task(**options) -> EvalTask:
    return EvalTask(name="zs", kind="zeroshot", data="/d", split="test", **options)


def test_filter_drops_the_uncertain_prompts():
    model, emb = create_model("prolip_tiny").eval(), toy_zeroshot()
    mean = score_task(model, zs_task(), emb, bins=4)
    filt = score_task(model, zs_task(prompts="filter", filter_keep=3), emb, bins=4)
    assert mean.prompt_weights is None
    w = np.array(list(filt.prompt_weights.values()))
    assert w.shape == (4, 6) and np.allclose(w[:, :3], 1 / 3) and (w[:, 3:] == 0).all()
    assert filt.metrics["top1"] > mean.metrics["top1"]


def test_bprw_moves_the_weight_to_the_prompts_that_fit_the_images():
    # every prompt equally uncertain: the prior starts uniform, only the images can tell the prompts apart
    model, emb = create_model("prolip_tiny").eval(), toy_zeroshot()
    emb.text["logvar"] = torch.full_like(emb.text["logvar"], math.log(5e-3))
    mean = score_task(model, zs_task(), emb, bins=4)
    bprw = score_task(model, zs_task(prompts="bprw"), emb, bins=4)
    w = np.array(list(bprw.prompt_weights.values()))
    assert w.shape == (4, 6) and np.allclose(w.sum(1), 1)
    assert (w[:, :3].sum(1) > 0.5).all() and w[:, :3].sum(1).mean() > 0.75
    # alpha = 5 keeps every weight at or above the prior's floor (alpha - 1) / (M' + N (alpha - 1))
    opts = zs_task().bprw
    floor = (opts.alpha - 1) / (opts.images * opts.samples + 6 * (opts.alpha - 1))
    assert w.min() >= floor - 1e-6
    assert bprw.metrics["top1"] > mean.metrics["top1"]


def test_score_mean_is_the_cosine_of_the_means():
    model, emb = create_model("prolip_tiny").eval(), toy_zeroshot(seed=1)
    # very different sigma^2 per class: CSD and the means' cosine then rank differently
    emb.text["logvar"] = emb.text["logvar"] + torch.arange(4).repeat_interleave(6)[:, None].float()
    classes = classes_from_prompts(model, emb.text, emb.prompt_counts)
    cos = F.normalize(emb.image["mu"], dim=-1) @ F.normalize(classes["mu"], dim=-1).T
    by_mean = score_task(model, zs_task(score="mean"), emb, bins=4)
    by_model = score_task(model, zs_task(), emb, bins=4)
    assert by_mean.metrics["top1"] == pytest.approx((cos.argmax(1) == emb.cls).double().mean().item())
    csd = model.class_scores(emb.image, classes)
    assert by_model.metrics["top1"] == pytest.approx((csd.argmax(1) == emb.cls).double().mean().item())
    assert by_model.metrics["top1"] != by_mean.metrics["top1"]


def test_weighting_prompts_needs_a_probabilistic_model():
    emb = toy_zeroshot()
    emb.text, emb.image = {"mu": emb.text["mu"]}, {"mu": emb.image["mu"]}
    with pytest.raises(ValueError, match=r"prompts: bprw weighs prompts by their sigma\^2 and needs a probabilistic"):
        score_task(create_model("clip_tiny").eval(), zs_task(prompts="bprw"), emb)


@pytest.mark.parametrize("task, message", [
    ({"name": "a", "kind": "retrieval", "prompts": "bprw"}, "prompts: only zeroshot tasks take prompts"),
    ({"name": "a", "kind": "retrieval", "score": "mean"}, "score: only zeroshot tasks take score"),
    ({"name": "a", "kind": "zeroshot", "index": "faiss"}, "index: only retrieval tasks take index"),
    ({"name": "a", "kind": "zeroshot", "prompts": "weighted"}, "eval.tasks.0.prompts:"),
    ({"name": "a", "kind": "retrieval", "index": "faiss", "faiss": {"kind": "lsh"}}, "eval.tasks.0.faiss.kind:"),
    ({"name": "a", "kind": "zeroshot", "bprw": {"alpha": 0}}, "eval.tasks.0.bprw.alpha:"),
    ({"name": "a", "kind": "zeroshot", "filter_keep": 0}, "eval.tasks.0.filter_keep:"),
])
def test_bad_options_are_one_line_errors(tmp_path, task, message):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"eval": {"tasks": [task]}}))
    with pytest.raises(ConfigError) as err:
        load_train_config(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_options_survive_the_config_round_trip():
    cfg = TrainDocument.model_validate({"eval": {"tasks": [
        {"name": "z", "kind": "zeroshot", "prompts": "bprw", "score": "mean", "bprw": {"alpha": 2.0}},
        {"name": "r", "kind": "retrieval", "index": "faiss", "faiss": {"kind": "ivf", "candidates": 50}}]}})
    back = TrainDocument.from_dict(cfg.to_dict())
    assert back.eval.tasks == cfg.eval.tasks


# ------------------------------------------------------------------------------------ approximate retrieval


def synthetic_gallery(n: int, dim: int = 32, seed: int = 0):
    """Clustered unit means with per-item sigma^2 spread over a decade (the CSD ranking then differs from
    the means' alone)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(max(1, n // 50), dim, generator=g)
    mu = F.normalize(centers[torch.randint(len(centers), (n,), generator=g)] + 0.6 * torch.randn(n, dim, generator=g),
                     dim=-1)
    logvar = math.log(2e-3) + 2.3 * torch.rand(n, dim, generator=g)
    return {"mu": mu, "logvar": logvar}


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_faiss_candidates_reranked_by_csd_recall_the_exact_top10(kind):
    gallery, queries = synthetic_gallery(5000), synthetic_gallery(200, seed=1)
    exact = -torch.cdist(queries["mu"], gallery["mu"]).pow(2) - gallery["logvar"].exp().sum(-1)  # -CSD + const
    want = exact.topk(10, dim=1).indices
    rows = MeanIndex(gallery["mu"], kind=kind).search(queries["mu"], 100)
    _, ranked = rerank(pair_scores(queries, gallery, rows), rows)
    recall = np.mean([len(set(ranked[q, :10].tolist()) & set(want[q].tolist())) / 10 for q in range(200)])
    assert recall >= 0.95


def test_pair_scores_are_the_models_scores():
    torch.manual_seed(0)
    q, g = synthetic_gallery(7, seed=2), synthetic_gallery(9, seed=3)
    rows = torch.tensor([[3, 0, 8, -1]] * 7)
    got = pair_scores(q, g, rows)
    full = create_model("prolip_tiny").class_scores(q, g)  # -CSD
    assert torch.allclose(got[:, :3], full[:, [3, 0, 8]], atol=1e-5) and torch.isinf(got[:, 3]).all()
    dot = create_model("clip_tiny").class_scores({"mu": q["mu"]}, {"mu": g["mu"]})
    assert torch.allclose(pair_scores({"mu": q["mu"]}, {"mu": g["mu"]}, rows)[:, :3], dot[:, [3, 0, 8]], atol=1e-6)


def test_rank_candidates_equals_full_ranking_and_truncates():
    rng = np.random.default_rng(4)
    scores = torch.from_numpy(rng.normal(size=(30, 40)))
    positives = torch.from_numpy(rng.random((30, 40)) < 0.1)
    positives[torch.arange(30), torch.from_numpy(rng.integers(0, 40, 30))] = True
    full = rank_queries(scores, positives)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    keys = torch.tensor(sorted(q * 40 + g for q, g in positives.nonzero().tolist()))
    got = rank_candidates(order, keys, positives.sum(1), 40)
    assert torch.equal(got.first_hit, full.first_hit)
    assert torch.allclose(got.map_at_r, full.map_at_r) and torch.allclose(got.r_precision, full.r_precision)
    short = rank_candidates(order[:, :5], keys, positives.sum(1), 40)
    assert torch.equal(short.first_hit, torch.where(full.first_hit < 5, full.first_hit, torch.tensor(5)))
    for k in (1, 5):
        assert short.recall_at(k) == full.recall_at(k)


def test_retrieval_task_with_faiss_equals_exact_when_candidates_cover_the_gallery():
    torch.manual_seed(0)
    model = create_model("prolip_tiny").eval()
    image = synthetic_gallery(60, dim=64, seed=5)
    captions = [[f"c{i // 3}", f"d{i}"] for i in range(60)]
    texts = list(dict.fromkeys(c for caps in captions for c in caps))
    text = synthetic_gallery(len(texts), dim=64, seed=6)
    emb = TaskEmbeddings([f"{i:03d}" for i in range(60)], image, captions, torch.full((60,), -1), texts, text)
    base = dict(name="r", kind="retrieval", data="/d", split="test", analyses=False)
    exact = score_task(model, EvalTask(**base), emb, bins=5).metrics
    ann = score_task(model, EvalTask(**base, index="faiss", faiss={"candidates": 100}), emb, bins=5).metrics
    assert set(ann) == set(exact)
    for k, v in exact.items():
        assert ann[k] == pytest.approx(v, abs=1e-9), k


# ------------------------------------------------------------------------------------ uncertainty analyses


def printed_inclusion(m1, v1, m2, v2) -> float:
    """ProLIP Eq. 3 as printed, one dimension, float64: -2 log v1 - log v2 - 1/2 log A + B^2 / 4A - C with
    A = 1/v1 + 1/(2 v2), B = 2 m1 / v1 + m2 / v2, C = m1^2 / v1 + m2^2 / (2 v2) (from int p1^2 p2)."""
    a = 1 / v1 + 1 / (2 * v2)
    b = 2 * m1 / v1 + m2 / v2
    c = m1**2 / v1 + m2**2 / (2 * v2)
    return -2 * math.log(v1) - math.log(v2) - 0.5 * math.log(a) + b * b / (4 * a) - c


def toy_retrieval(with_levels: bool):
    torch.manual_seed(0)
    n = 24
    image = {"mu": F.normalize(torch.randn(n, 64), dim=-1), "logvar": torch.randn(n, 64) * 0.3 - 4}
    captions = [[f"a digit {i % 4}", f"a very small bold digit {i} slanted left"] for i in range(n)]
    texts = list(dict.fromkeys(c for caps in captions for c in caps))
    text = {"mu": F.normalize(torch.randn(len(texts), 64), dim=-1), "logvar": torch.randn(len(texts), 64) * 0.3 - 3}
    levels = [{"instance": [f"digit {i} bold"], "specific": [f"the digit {i % 4}"], "general": ["a digit"]}
              for i in range(n)] if with_levels else None
    return TaskEmbeddings([f"{i:03d}" for i in range(n)], image, captions, torch.full((n,), -1), texts, text,
                          levels=levels)


def test_analyses_numbers_plots_and_named_skips(tmp_path):
    from pipelines.evaluate.tasks import prefixed, write_plots

    model = create_model("prolip_tiny").eval()
    task = EvalTask(name="r", kind="retrieval", data="/d", split="test")
    result = score_task(model, task, toy_retrieval(with_levels=True), bins=4)
    a = result.analyses
    assert not a.skipped
    # the levels present, in the task's order (no "mid" in this data)
    assert a.series["levels"]["levels"] == ["instance", "specific", "general"]
    for name in ("unc_length_rho", "unc_level_rho", "unc_image_in_caption_frac", "unc_caption_wider_frac",
                 "unc_level_instance_sigma2", "unc_level_general_image_in_caption"):
        assert math.isfinite(a.metrics[name]) and f"r/{name}" in prefixed(task, result)
    files = write_plots({"r": result}, tmp_path)
    assert {p.name for p in files} >= {"r_analyses.png", "r_analyses.json"}
    assert (tmp_path / "r_analyses.png").read_bytes()[:4] == b"\x89PNG"

    bare = score_task(model, task, toy_retrieval(with_levels=False), bins=4).analyses
    assert "no caption levels" in bare.skipped["levels"]
    assert not any(k.startswith("unc_level") for k in bare.metrics)  # skipped, not 0.0
    import json

    assert json.loads((tmp_path / "r_analyses.json").read_text())["metrics"] == pytest.approx(a.metrics)


def test_analyses_statistics_against_references():
    from pipelines.evaluate.uncertainty import analyse

    model = create_model("prolip_tiny").eval()
    emb = toy_retrieval(with_levels=False)
    index = {c: j for j, c in enumerate(emb.texts)}
    image_pos = [[index[c] for c in caps] for caps in emb.captions]
    a = analyse(model, EvalTask(name="r", kind="retrieval", data="/d", split="test"), emb, image_pos)
    s2_t = emb.text["logvar"].double().exp().mean(-1).numpy()
    s2_i = emb.image["logvar"].double().exp().mean(-1).numpy()
    words = [len(t.split()) for t in emb.texts]
    # Spearman: Pearson correlation of average ranks
    want_rho = np.corrcoef(stats.rankdata(words), stats.rankdata(s2_t))[0, 1]
    assert a.metrics["unc_length_rho"] == pytest.approx(want_rho, abs=1e-9)
    pairs = [(i, j) for i, p in enumerate(image_pos) for j in p]
    assert a.metrics["unc_caption_wider_frac"] == pytest.approx(np.mean([s2_t[j] > s2_i[i] for i, j in pairs]))
    # image in caption: H(v in t) = sum_d inc(v, t) - inc(t, v) (ProLIP Eq. 4 with the printed Eq. 3)
    inside = []
    for i, j in pairs[:12]:
        mv, vv = emb.image["mu"][i].double().numpy(), emb.image["logvar"][i].double().exp().numpy()
        mt, vt = emb.text["mu"][j].double().numpy(), emb.text["logvar"][j].double().exp().numpy()
        h = sum(printed_inclusion(mv[d], vv[d], mt[d], vt[d]) - printed_inclusion(mt[d], vt[d], mv[d], vv[d])
                for d in range(64))
        inside.append(h > 0)
    from pipelines.evaluate.uncertainty import image_in_caption

    got = image_in_caption(emb.image, emb.text, np.array(pairs[:12]))
    assert got.tolist() == inside
