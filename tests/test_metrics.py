"""Evaluation formulas against independent references (naive loops, scipy, scikit-learn), and the
eval-task configuration's errors. No Ray."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from sklearn.metrics import balanced_accuracy_score

from models import create_model
from models.scoring.metrics import calibration, mean_per_class_recall, rank_queries, retrieval_summary, topk_accuracy
from pipelines.config import ConfigError
from pipelines.pretrain.config import TrainDocument, load_train_config
from pipelines.evaluate.names import metric_names, task_metric_names
from pipelines.evaluate.tasks import classes_from_prompts, score_task
from pipelines.evaluate.in_process import TaskEmbeddings


def naive_ranking(scores: np.ndarray, positives: np.ndarray):
    """Per query, by the definitions: sort the gallery, walk it."""
    first, ap, rp = [], [], []
    for s, pos in zip(scores, positives):
        order = sorted(range(len(s)), key=lambda j: -s[j])
        rel = [bool(pos[j]) for j in order]
        r = int(pos.sum())
        first.append(rel.index(True))
        hits, total = 0, 0.0
        for i in range(r):
            if rel[i]:
                hits += 1
                total += hits / (i + 1)
        ap.append(total / r)
        rp.append(sum(rel[:r]) / r)
    return np.array(first), np.array(ap), np.array(rp)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rank_queries_matches_naive_definitions(seed):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(40, 57))
    positives = rng.random((40, 57)) < 0.08
    positives[np.arange(40), rng.integers(0, 57, 40)] = True  # every query has a positive
    ranked = rank_queries(torch.from_numpy(scores), torch.from_numpy(positives))
    first, ap, rp = naive_ranking(scores, positives)
    assert ranked.first_hit.numpy().tolist() == first.tolist()
    np.testing.assert_allclose(ranked.map_at_r.numpy(), ap, atol=1e-12)
    np.testing.assert_allclose(ranked.r_precision.numpy(), rp, atol=1e-12)
    summary = retrieval_summary("i2t", ranked)
    for k in (1, 5, 10):
        assert summary[f"i2t_R{k}"] == pytest.approx(np.mean(first < k))


def test_rank_queries_refuses_a_query_without_positive():
    with pytest.raises(ValueError, match="at least one positive"):
        rank_queries(torch.zeros(2, 3), torch.tensor([[True, False, False], [False, False, False]]))


def test_zero_shot_accuracy_against_sklearn():
    rng = np.random.default_rng(0)
    scores = torch.from_numpy(rng.normal(size=(200, 7)))
    labels = torch.from_numpy(rng.integers(0, 7, 200))
    pred = scores.argmax(1)
    assert topk_accuracy(scores, labels, 1) == pytest.approx((pred == labels).double().mean().item())
    top3 = np.argsort(-scores.numpy(), axis=1)[:, :3]
    assert topk_accuracy(scores, labels, 3) == pytest.approx(np.mean([l in t for l, t in zip(labels.numpy(), top3)]))
    assert mean_per_class_recall(pred, labels) == pytest.approx(balanced_accuracy_score(labels.numpy(), pred.numpy()))


def test_calibration_bins_spearman_and_r2():
    rng = np.random.default_rng(0)
    u = rng.random(1000)
    correct = rng.random(1000) > u  # more uncertain -> more often wrong
    cal = calibration(u, correct, bins=10)
    order = np.argsort(u, kind="stable")
    by_hand = np.array([correct[g].mean() for g in np.array_split(order, 10)])
    np.testing.assert_allclose(cal.bin_metric, by_hand)
    assert cal.rho == pytest.approx(stats.spearmanr(np.arange(10), by_hand).statistic)
    assert cal.r2 == pytest.approx(stats.pearsonr(np.arange(10), by_hand).statistic ** 2)
    assert cal.rho < -0.9 and cal.score > 0.8
    with pytest.raises(ValueError, match="at least 10 queries"):
        calibration(u[:5], correct[:5], bins=10)
    flat = calibration(u, np.ones(1000), bins=10)
    assert np.isnan(flat.rho) and np.isnan(flat.score)


def test_class_embeddings_with_unequal_prompt_counts_match_per_class_ensembles():
    torch.manual_seed(0)
    model = create_model("prolip_tiny").eval()
    text = {"mu": torch.nn.functional.normalize(torch.randn(7, 64), dim=-1), "logvar": torch.randn(7, 64)}
    got = classes_from_prompts(model, text, [3, 4])
    first = model.class_embeddings({k: v[:3][None] for k, v in text.items()})
    assert torch.allclose(got["mu"][0], first["mu"][0]) and torch.allclose(got["logvar"][0], first["logvar"][0])
    equal = classes_from_prompts(model, {k: v[:6] for k, v in text.items()}, [3, 3])
    assert torch.allclose(equal["mu"][1], model.class_embeddings({k: v[3:6][None] for k, v in text.items()})["mu"][0])


def test_retrieval_scores_csd_and_means_and_shared_captions():
    """Two images share a caption: both are its positives; CSD and cosine rankings both reported."""
    torch.manual_seed(0)
    model = create_model("prolip_tiny").eval()
    task = load_config_task("retrieval")
    mu = torch.nn.functional.normalize(torch.randn(12, 64), dim=-1)
    image = {"mu": mu, "logvar": torch.randn(12, 64) - 3}
    captions = [[f"c{i // 2}"] for i in range(12)]  # images 2k, 2k+1 share caption k
    texts = [f"c{k}" for k in range(6)]
    text = {"mu": torch.nn.functional.normalize(mu[0::2] + mu[1::2], dim=-1), "logvar": torch.full((6, 64), -3.0)}
    emb = TaskEmbeddings([str(i) for i in range(12)], image, captions, torch.full((12,), -1), texts, text)
    result = score_task(model, task, emb, bins=3)
    assert set(result.metrics) == set(task_metric_names(task, probabilistic=True))
    assert result.metrics["cos_t2i_R1"] == 1.0  # each caption's mean is closest to one of its two images
    assert result.metrics["cos_t2i_R_precision"] > 0.8
    assert result.metrics["i2t_R10"] == 1.0  # 6 captions: every positive is in the top 10
    assert result.metrics["rsum"] == pytest.approx(100 * sum(result.metrics[f"{d}_R{k}"] for d in ("i2t", "t2i")
                                                             for k in (1, 5, 10)))


def load_config_task(kind: str):
    cfg = TrainDocument.model_validate({"data": {"root": "/data"}, "eval": {"tasks": [{"name": "t", "kind": kind}]}})
    return cfg.resolved_tasks()[0]


def test_default_tasks_are_heldout_retrieval_and_loss():
    cfg = TrainDocument.model_validate({"data": {"root": "/data/root/"}})
    tasks = cfg.resolved_tasks()
    assert [(t.name, t.kind, t.data, t.split) for t in tasks] == [
        ("heldout", "retrieval", "/data/root", "test"), ("heldout_loss", "loss", "/data/root", "test")]
    names = metric_names(cfg)
    assert "heldout/i2t_R1" in names and "heldout_loss/loss" in names
    assert not any("top1" in n or "calib" in n for n in names)  # no labels, deterministic model
    prob = metric_names(TrainDocument.model_validate({"model": {"name": "pcmepp_tiny"}}))
    assert {"heldout/cos_t2i_R5", "heldout/i2t_calib_score", "heldout/image_sigma2_mean"} <= set(prob)


@pytest.mark.parametrize(
    "tasks, message",
    [
        ([{"name": "a", "kind": "ranking"}], "eval.tasks.0.kind:"),
        ([{"name": "a", "kind": "loss"}, {"name": "a", "kind": "retrieval"}], "repeated: a"),
        ([{"name": "a b", "kind": "loss"}], "eval.tasks.0.name:"),
        ([{"name": "a", "kind": "retrieval", "templates": "t.json"}], "only zeroshot tasks take templates"),
        ([{"name": "a", "kind": "loss", "bins": 3}], "eval.tasks.0.bins: unknown key"),
        ([], "give at least one task"),
    ],
)
def test_bad_eval_tasks_are_one_line_errors(tmp_path, tasks, message):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"eval": {"tasks": tasks}}))
    with pytest.raises(ConfigError) as err:
        load_train_config(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_uncertainty_plot_per_probabilistic_task(tmp_path):
    from pipelines.evaluate.tasks import write_plots

    torch.manual_seed(0)
    model = create_model("pcmepp_tiny").eval()
    mu = torch.nn.functional.normalize(torch.randn(30, 64), dim=-1)
    emb = TaskEmbeddings([f"{i:03d}" for i in range(30)], {"mu": mu, "logvar": torch.randn(30, 64)},
                         [[f"c{i}"] for i in range(30)], torch.full((30,), -1), [f"c{i}" for i in range(30)],
                         {"mu": mu, "logvar": torch.randn(30, 64)})
    result = score_task(model, load_config_task("retrieval"), emb, bins=10)
    assert result.metrics["cos_i2t_R1"] == 1.0  # captions share their image's mean
    assert set(result.calibrations) == {"i2t", "t2i"}
    png, *analyses = write_plots({"toy": result}, tmp_path)
    assert png.name == "toy_uncertainty.png" and png.read_bytes()[:4] == b"\x89PNG"
    assert [p.name for p in analyses] == ["toy_analyses.png", "toy_analyses.json"]  # tests/test_evaluation_options.py
    assert write_plots({"det": type(result)({"i2t_R1": 1.0})}, tmp_path) == []  # nothing for deterministic models
