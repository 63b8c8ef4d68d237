"""Evaluation tasks on any data: embeddings in, `{task}/{metric}` numbers and plots out.

The same scoring serves the training run (rank 0 embeds in process at each eval point) and
`jobs.evaluate` (embeddings from Ray Data batch inference, read back from parquet), so both give the
same numbers for the same model and data.

- retrieval: images and their captions (several per image; a caption string shared by several
  images makes each of them a positive). i2t queries are the images that have a caption, t2i queries
  the distinct captions. R@1/5/10 (a hit when any positive is in the top K), rsum, mAP@R and
  R-Precision (PCME++ B.1), ranked by the model's own score (CSD for probabilistic models, the
  contextualised cosine for Llip) and, for probabilistic models, also by the means alone (``cos_``).
  `index: faiss` takes each query's candidates from an approximate index on the gallery's means and
  re-ranks them by the same score (models.scoring.ann).
- zeroshot: one embedding per class from its prompts (`prompts`: the model's ensemble, BPRW weights or
  the most certain prompts; models.scoring.prompts), scored by the model (`score: model`) or by the
  cosine of the means (`score: mean`); top-1, top-5, mean per-class recall.
- loss: the training objective over held-out batches (each batch its own negatives).
- probabilistic models, every embedding task: mean sigma^2 of images and captions, and calibration
  (queries in `eval.calibration_bins` equal-count bins by sigma^2; Spearman rho, R^2, -rho R^2); retrieval
  tasks add the uncertainty analyses (pipelines.evaluate.uncertainty, `unc_*` metrics and a plot).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from models.gather import World
from models.preprocess import to_device
from models.scoring.ann import MeanIndex, pair_scores, rerank
from models.scoring.metrics import (Calibration, Ranked, calibration, mean_per_class_recall, rank_candidates,
                                    rank_queries, retrieval_summary, topk_accuracy)
from models.scoring.prompts import bprw_em, bprw_observations, filter_weights, weighted_ensemble
from pipelines.config import EvalTask
from pipelines.evaluate.in_process import TaskEmbeddings, autocast, model_device, on_device
from pipelines.evaluate.names import DIRECTIONS
from pipelines.plotting import pyplot
from pipelines.evaluate.uncertainty import Analyses, analyse, write_analyses


SCORE_ELEMENTS = 2**24  # queries x gallery scores held at once


# ------------------------------------------------------------------------------------ scoring


@dataclass
class TaskResult:
    metrics: dict[str, float]
    calibrations: dict[str, Calibration] = field(default_factory=dict)
    sigma2: dict[str, np.ndarray] = field(default_factory=dict)
    analyses: "Analyses | None" = None  # retrieval, probabilistic models (pipelines.evaluate.uncertainty)
    prompt_weights: dict[str, list[float]] | None = None  # zeroshot, bprw / filter: class -> its prompts' weights


def _rows(out: dict[str, torch.Tensor], idx: slice | torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[idx] for k, v in out.items()}


def _mean_only(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same outputs with sigma^2 = 0: the model's score then depends on the means alone."""
    return {**out, "logvar": torch.full_like(out["logvar"], float("-inf"))} if "logvar" in out else out


def sigma2(out: dict[str, torch.Tensor]) -> np.ndarray:
    """Per item: sigma^2 averaged over the embedding dimensions."""
    return out["logvar"].float().exp().mean(dim=-1).numpy()


@torch.no_grad()
def rank_retrieval(model, image: dict, text: dict, image_pos: list[list[int]]) -> tuple[Ranked, Ranked, torch.Tensor]:
    """i2t over the images that have a caption and t2i over every text, chunked (no full score matrix)."""
    n_img, n_txt = next(iter(image.values())).shape[0], next(iter(text.values())).shape[0]
    queries = torch.tensor([i for i, p in enumerate(image_pos) if p], dtype=torch.long)
    pos = torch.zeros(n_img, n_txt, dtype=torch.bool)  # n_img x n_txt booleans: small next to the scores
    for i, p in enumerate(image_pos):
        pos[i, p] = True
    i2t, t2i = [], []
    device = model_device(model)  # scores on the model's device, ranks on the CPU
    image, text = on_device(image, device), on_device(text, device)
    step = max(1, SCORE_ELEMENTS // max(n_txt, 1))
    for a in range(0, len(queries), step):
        q = queries[a : a + step]
        i2t.append(rank_queries(model.class_scores(_rows(image, q.to(device)), text).float().cpu(), pos[q]))
    step = max(1, SCORE_ELEMENTS // max(n_img, 1))
    for a in range(0, n_txt, step):
        s = slice(a, a + step)
        t2i.append(rank_queries(model.class_scores(image, _rows(text, s)).float().cpu().T, pos[:, s].T))
    return Ranked.cat(i2t), Ranked.cat(t2i), queries


@torch.no_grad()
def rank_retrieval_ann(image: dict, text: dict, image_pos: list[list[int]], candidates: tuple, views: list):
    """Per view (e.g. the model's score, the means' score): i2t and t2i from the index's candidates re-ranked."""
    n_img, n_txt = next(iter(image.values())).shape[0], next(iter(text.values())).shape[0]
    queries = torch.tensor([i for i, p in enumerate(image_pos) if p], dtype=torch.long)
    # positive pairs as sorted keys query * gallery + item (i2t queries numbered by position among the queries)
    i2t_keys = torch.tensor(sorted(a * n_txt + j for a, i in enumerate(queries.tolist()) for j in set(image_pos[i])),
                            dtype=torch.long)
    t2i_keys = torch.tensor(sorted({j * n_img + i for i, p in enumerate(image_pos) for j in p}), dtype=torch.long)
    n_pos_i2t = torch.tensor([len(set(image_pos[i])) for i in queries.tolist()], dtype=torch.long)
    n_pos_t2i = torch.bincount(t2i_keys // n_img, minlength=n_txt)
    text_rows, image_rows = candidates
    out = []
    for view in views:
        img, txt = view(image), view(text)
        _, i2t = rerank(pair_scores(_rows(img, queries), txt, text_rows), text_rows)
        _, t2i = rerank(pair_scores(txt, img, image_rows), image_rows)
        out.append((rank_candidates(i2t, i2t_keys, n_pos_i2t, n_txt), rank_candidates(t2i, t2i_keys, n_pos_t2i, n_img),
                    queries))
    return out


def ann_candidates(task: EvalTask, image: dict, text: dict, image_pos: list[list[int]]) -> tuple:
    """(i2t candidate text rows, t2i candidate image rows) from faiss indexes on the means."""
    opts = task.faiss
    kwargs = dict(kind=opts.kind, hnsw_m=opts.hnsw_m, ef_construction=opts.ef_construction, ef_search=opts.ef_search,
                  nlist=opts.nlist, nprobe=opts.nprobe)
    queries = torch.tensor([i for i, p in enumerate(image_pos) if p], dtype=torch.long)
    text_rows = MeanIndex(text["mu"], **kwargs).search(image["mu"][queries], opts.candidates)
    image_rows = MeanIndex(image["mu"], **kwargs).search(text["mu"], opts.candidates)
    return text_rows, image_rows


def score_retrieval(model, task: EvalTask, emb: TaskEmbeddings, bins: int) -> TaskResult:
    index = {c: j for j, c in enumerate(emb.texts)}
    image_pos = [[index[c] for c in caps] for caps in emb.captions]
    variants = [("", lambda o: o)] + ([("cos_", _mean_only)] if model.probabilistic else [])
    result = TaskResult({})
    if task.index == "faiss":
        ranked = rank_retrieval_ann(emb.image, emb.text, image_pos, ann_candidates(task, emb.image, emb.text, image_pos),
                                    [view for _, view in variants])
    for v, (prefix, view) in enumerate(variants):
        if task.index == "faiss":
            i2t, t2i, queries = ranked[v]
        else:
            i2t, t2i, queries = rank_retrieval(model, view(emb.image), view(emb.text), image_pos)
        part = {**retrieval_summary("i2t", i2t), **retrieval_summary("t2i", t2i)}
        part["rsum"] = 100 * sum(part[f"{d}_R{k}"] for d in DIRECTIONS for k in (1, 5, 10))
        result.metrics.update({prefix + k: v for k, v in part.items()})
        if prefix == "" and model.probabilistic:
            image_var, text_var = sigma2(emb.image), sigma2(emb.text)
            result.sigma2 = {"images": image_var, "captions": text_var}
            for direction, var, ranking in (("i2t", image_var[queries.numpy()], i2t), ("t2i", text_var, t2i)):
                result.calibrations[direction] = _calibrate(task, direction, var, ranking.first_hit == 0, bins)
    if model.probabilistic and task.analyses:
        result.analyses = analyse(model, task, emb, image_pos)
    return _with_uncertainty(result, model)


def score_zeroshot(model, task: EvalTask, emb: TaskEmbeddings, bins: int) -> TaskResult:
    labels = emb.cls
    if bool((labels < 0).any()):
        raise ValueError(f"eval task {task.name!r} (zeroshot): {int((labels < 0).sum())} samples have no 'cls'")
    if int(labels.max()) >= len(emb.prompt_counts):
        raise ValueError(f"eval task {task.name!r} (zeroshot): cls {int(labels.max())} but only "
                         f"{len(emb.prompt_counts)} class names")
    classes, weights = zeroshot_classes(model, task, emb)
    scores = zeroshot_scores(model, emb.image, classes, task.score)
    predicted = scores.argmax(dim=1)
    result = TaskResult({"top1": topk_accuracy(scores, labels, 1), "top5": topk_accuracy(scores, labels, 5),
                         "mean_per_class_recall": mean_per_class_recall(predicted, labels)})
    if weights is not None:
        result.prompt_weights = dict(zip(emb.classnames or [str(c) for c in range(len(weights))], weights))
    if model.probabilistic:
        result.sigma2 = {"images": sigma2(emb.image), "prompts": sigma2(emb.text)}
        result.calibrations["top1"] = _calibrate(task, "top1", result.sigma2["images"], predicted == labels, bins)
    return _with_uncertainty(result, model)


@torch.no_grad()
def zeroshot_scores(model, image: dict[str, torch.Tensor], classes: dict[str, torch.Tensor], score: str) -> torch.Tensor:
    """(N, C) image-class scores: the model's own (`model`) or the cosine of the means (`mean`)."""
    if score == "mean":
        return F.normalize(image["mu"].float(), dim=-1) @ F.normalize(classes["mu"].float(), dim=-1).T
    n, device = next(iter(image.values())).shape[0], model_device(model)
    classes = on_device(classes, device)
    return torch.cat([model.class_scores(on_device(_rows(image, slice(a, a + 1024)), device), classes).float().cpu()
                      for a in range(0, n, 1024)])


def per_class_prompts(text: dict[str, torch.Tensor], counts: list[int]) -> list[dict[str, torch.Tensor]]:
    starts = np.cumsum([0] + counts[:-1]).tolist()
    return [{k: v[a : a + n] for k, v in text.items()} for a, n in zip(starts, counts)]


@torch.no_grad()
def zeroshot_classes(model, task: EvalTask, emb: TaskEmbeddings) -> tuple[dict[str, torch.Tensor], list | None]:
    """Class embeddings by `task.prompts`, and the prompt weights (None for the model's own ensemble)."""
    base = classes_from_prompts(model, emb.text, emb.prompt_counts)
    if task.prompts == "mean":
        return base, None
    if not model.probabilistic or "logvar" not in emb.text:
        raise ValueError(f"eval task {task.name!r} (zeroshot): prompts: {task.prompts} weighs prompts by their "
                         f"sigma^2 and needs a probabilistic model ({type(model).__name__} has none)")
    prompts = per_class_prompts(emb.text, emb.prompt_counts)
    if task.prompts == "filter":
        weights = [filter_weights(p["logvar"][None], task.filter_keep)[0] for p in prompts]
    else:
        opts = task.bprw
        generator = torch.Generator().manual_seed(opts.seed)
        # ProLIP C.5 without labels: the images nearest each class's prompt-ensemble embedding
        points = bprw_observations(emb.image, zeroshot_scores(model, emb.image, base, "model"), opts.images,
                                   opts.samples, generator)
        weights = [bprw_em(points[c : c + 1], p["mu"][None], p["logvar"][None], opts.alpha, opts.eps, opts.iters,
                           opts.tol)[0] for c, p in enumerate(prompts)]
    parts = [weighted_ensemble({k: v[None] for k, v in p.items()}, w[None]) for p, w in zip(prompts, weights)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}, [w.tolist() for w in weights]


def classes_from_prompts(model, text: dict[str, torch.Tensor], counts: list[int]) -> dict[str, torch.Tensor]:
    """Flat prompt outputs -> one embedding per class through the model's prompt ensemble (on the CPU)."""
    device = model_device(model)
    text = on_device(text, device)
    if len(set(counts)) == 1:  # one call on (C, T, D)
        out = model.class_embeddings({k: v.reshape(len(counts), counts[0], *v.shape[1:]) for k, v in text.items()})
        return on_device(out, torch.device("cpu"))
    parts, start = [], 0
    for n in counts:
        parts.append(model.class_embeddings({k: v[start : start + n][None] for k, v in text.items()}))
        start += n
    return {k: torch.cat([p[k] for p in parts]).cpu() for k in parts[0]}


def _calibrate(task: EvalTask, what: str, uncertainty: np.ndarray, correct: torch.Tensor, bins: int) -> Calibration:
    if len(uncertainty) < bins:
        raise ValueError(f"eval task {task.name!r}: {what} calibration needs at least {bins} queries "
                         f"(eval.calibration_bins), the data gives {len(uncertainty)}")
    return calibration(uncertainty, correct.numpy(), bins)


def _with_uncertainty(result: TaskResult, model) -> TaskResult:
    for name, cal in result.calibrations.items():
        result.metrics.update({f"{name}_calib_rho": cal.rho, f"{name}_calib_r2": cal.r2, f"{name}_calib_score": cal.score})
    if model.probabilistic:
        texts = result.sigma2.get("captions", result.sigma2.get("prompts"))
        result.metrics.update(image_sigma2_mean=float(result.sigma2["images"].mean()),
                              text_sigma2_mean=float(texts.mean()))
    return result


def score_task(model, task: EvalTask, emb: TaskEmbeddings, bins: int = 10) -> TaskResult:
    model.eval()
    if task.kind == "retrieval":
        return score_retrieval(model, task, emb, bins)
    if task.kind == "zeroshot":
        return score_zeroshot(model, task, emb, bins)
    raise ValueError(f"eval task {task.name!r}: {task.kind} tasks are not scored from embeddings")


@torch.no_grad()
def held_out_loss(objective: torch.nn.Module, batches: Iterable[dict], bf16: bool = False) -> float:
    """Mean training loss over held-out batches (single process: each batch is its own negatives), on the
    objective's device."""
    objective.eval()
    device = model_device(objective)
    total, count = 0.0, 0
    for batch in batches:
        n = batch["image"].shape[0]
        if n == 0:
            continue
        with autocast(device, bf16):
            loss = objective(to_device(batch["image"], device).float(), to_device(batch["text"], device), World())["loss"]
        total += loss.item() * n
        count += n
    if count == 0:
        raise ValueError("held-out loss: no batches")
    return total / count


def prefixed(task: EvalTask, result: TaskResult) -> dict[str, float]:
    extra = result.analyses.metrics if result.analyses is not None else {}
    return {f"{task.name}/{k}": float(v) for k, v in {**result.metrics, **extra}.items()}


# ------------------------------------------------------------------------------------ plots


def write_plots(results: dict[str, TaskResult], folder: Path) -> list[Path]:
    """Per task with uncertainty: calibration curve(s) and sigma^2 histograms, as PNGs."""
    paths = []
    for name, res in results.items():
        if not res.calibrations:
            continue
        plt = pyplot()
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for what, cal in res.calibrations.items():
            label = {"i2t": "image->text R@1", "t2i": "text->image R@1", "top1": "zero-shot top-1"}.get(what, what)
            left.plot(np.arange(1, len(cal.bin_metric) + 1), cal.bin_metric, marker="o",
                      label=f"{label} (rho {cal.rho:.2f}, R2 {cal.r2:.2f})")
        left.set_xlabel("uncertainty bin (1 = lowest sigma^2)")
        left.set_ylabel("metric in bin")
        left.set_title(f"{name}: calibration")
        left.legend(fontsize=8)
        for what, values in res.sigma2.items():
            right.hist(values, bins=40, alpha=0.6, label=f"{what} (mean {values.mean():.2e})")
        right.set_xlabel("sigma^2 (mean over dimensions)")
        right.set_ylabel("count")
        right.legend(fontsize=8)
        fig.tight_layout()
        path = folder / f"{name}_uncertainty.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    for name, res in results.items():
        if res.analyses is not None:
            paths += write_analyses(name, res.analyses, folder)
        if res.prompt_weights is not None:
            path = folder / f"{name}_prompt_weights.json"
            path.write_text(json.dumps(res.prompt_weights))
            paths.append(path)
    return paths
