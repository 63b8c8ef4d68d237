"""Uncertainty analyses of a probabilistic model on a retrieval task's data (ProLIP Sec. 4.3, Figs. 5-8).

sigma^2 below is the per-item mean over the embedding dimensions (tr(Sigma) / D).

- caption length: Spearman rho between a caption's word count and its sigma^2 over every distinct caption
  (the task's and the levels'; Fig. 6: shorter, more uncertain);
- images vs captions: mean sigma^2 of each, and over (image, caption) pairs how often the caption's sigma^2
  is the larger (Fig. 5) and how often "image in caption" holds, H(Z_v in Z_t) > 0 (Eq. 4, at eps = 0,
  summed over the dimensions);
- generality levels, when samples carry captions by level (json "captions": level -> captions, e.g. the
  bundled digits' instance / specific / mid / general): mean sigma^2 per level, Spearman rho between the
  level (0 = most specific) and sigma^2 (Fig. 7: more general, more uncertain), and "image in caption"
  per level (the inclusion test of Fig. 8, between an image and its captions).

An analysis the data cannot support is skipped with its reason (`Analyses.skipped`, written beside the
plot and printed), never reported as a number.
"""
from __future__ import annotations

import json
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from models.distributions import inclusion_test
from pipelines.evaluate.in_process import embed_texts
from pipelines.plotting import pyplot


@dataclass
class Analyses:
    metrics: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # analysis -> why it was not run
    series: dict[str, dict] = field(default_factory=dict)  # what the plot draws


def spearman(x, y) -> float:
    # deferred: scipy.stats takes 0.4 s to import, and most runs draw no analysis
    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(stats.spearmanr(x, y).statistic)


def _sigma2(out: dict[str, torch.Tensor]) -> np.ndarray:
    return out["logvar"].float().exp().mean(dim=-1).numpy()


@torch.no_grad()
def image_in_caption(image: dict[str, torch.Tensor], text: dict[str, torch.Tensor], pairs: np.ndarray) -> np.ndarray:
    """(P, 2) rows (image row, text row) -> (P,) booleans H(Z_image in Z_text) > 0."""
    i, t = torch.from_numpy(pairs[:, 0]), torch.from_numpy(pairs[:, 1])
    # ProLIP Eq. 4, the inclusion hypothesis, summed over dimensions (its sign: does the caption include the image)
    h = inclusion_test(image["mu"][i].float(), image["logvar"][i].float(), text["mu"][t].float(),
                       text["logvar"][t].float(), eps=0.0, form="paper").sum(-1)
    return (h > 0).numpy()


def analyse(model, task, emb, image_pos: list[list[int]]) -> Analyses:
    """The analyses of one retrieval task's embeddings (pipelines.evaluate.tasks.TaskEmbeddings)."""
    out = Analyses()
    image_s2, text_s2 = _sigma2(emb.image), _sigma2(emb.text)
    level_texts, level_s2 = _levels(model, task, emb, out)

    # every distinct caption the task has: its own and, when the data has them, those of the levels
    seen = set(emb.texts)
    extra = [j for j, t in enumerate(level_texts) if t not in seen]
    words = np.array([len(t.split()) for t in emb.texts] + [len(level_texts[j].split()) for j in extra])
    caption_s2 = np.concatenate([text_s2, level_s2[extra]])
    if len(np.unique(words)) < 2:
        out.skipped["caption_length"] = f"every caption has {words[0]} words: no length to compare"
    else:
        out.metrics["unc_length_rho"] = spearman(words, caption_s2)
        out.series["caption_length"] = {"words": words.tolist(), "sigma2": caption_s2.tolist()}

    pairs = np.array([(i, j) for i, p in enumerate(image_pos) for j in p], dtype=np.int64)
    included = image_in_caption(emb.image, emb.text, pairs)
    out.metrics.update(
        unc_caption_over_image_sigma2=float(text_s2.mean() / image_s2.mean()),
        unc_caption_wider_frac=float((text_s2[pairs[:, 1]] > image_s2[pairs[:, 0]]).mean()),
        unc_image_in_caption_frac=float(included.mean()),
    )
    out.series["images_vs_captions"] = {"images": image_s2.tolist(), "captions": text_s2.tolist()}
    return out


def _levels(model, task, emb, out: Analyses) -> tuple[list[str], np.ndarray]:
    """The per-level analyses; returns the level captions and their sigma^2 (empty when skipped)."""
    none = ([], np.zeros(0))
    if emb.levels is None:
        out.skipped["levels"] = ("the data has no caption levels (sample json \"captions\": level -> captions, "
                                 f"levels named by the task's caption_levels {task.caption_levels})")
        return none
    present = [lv for lv in task.caption_levels if any(lv in per_image for per_image in emb.levels)]
    if len(present) < 2:
        found = sorted({lv for per_image in emb.levels for lv in per_image})
        out.skipped["levels"] = (f"the samples' caption levels {found} hold fewer than two of the task's "
                                 f"caption_levels {task.caption_levels}")
        return none
    texts = list(dict.fromkeys(c for per_image in emb.levels for lv in present for c in per_image.get(lv, [])))
    index = {t: j for j, t in enumerate(texts)}
    text = embed_texts(model, texts)
    s2 = _sigma2(text)
    level_of = {}
    for rank, lv in enumerate(present):
        for per_image in emb.levels:
            for c in per_image.get(lv, []):
                level_of.setdefault(index[c], rank)  # a caption listed at two levels counts at the more specific
    rows = np.array(sorted(level_of))
    out.metrics["unc_level_rho"] = spearman([level_of[r] for r in rows], s2[rows])
    series = {"levels": present, "sigma2": [], "image_in_caption": []}
    for rank, lv in enumerate(present):
        members = np.array([r for r in rows if level_of[r] == rank])
        pairs = np.array([(i, index[c]) for i, per_image in enumerate(emb.levels) for c in per_image.get(lv, [])],
                         dtype=np.int64)
        frac = float(image_in_caption(emb.image, text, pairs).mean())
        out.metrics[f"unc_level_{lv}_sigma2"] = float(s2[members].mean())
        out.metrics[f"unc_level_{lv}_image_in_caption"] = frac
        series["sigma2"].append(s2[members].tolist())
        series["image_in_caption"].append(frac)
    out.series["levels"] = series
    return texts, s2


def write_analyses(name: str, analyses: Analyses, folder: Path) -> list[Path]:
    """`{name}_analyses.png` (four panels; a skipped one says why) and `{name}_analyses.json` (numbers, reasons)."""
    for what, reason in analyses.skipped.items():
        print(f"uncertainty analyses, task {name}: {what} skipped: {reason}")
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    (length_ax, level_ax), (hist_ax, inc_ax) = axes
    series, metrics = analyses.series, analyses.metrics

    if "caption_length" in series:
        words, s2 = np.array(series["caption_length"]["words"]), np.array(series["caption_length"]["sigma2"])
        length_ax.scatter(words, s2, s=6, alpha=0.3)
        lengths = np.unique(words)
        length_ax.plot(lengths, [s2[words == n].mean() for n in lengths], color="C3", marker="o", label="mean")
        length_ax.set_title(f"caption sigma^2 vs length (Spearman rho {metrics['unc_length_rho']:.2f})")
        length_ax.set_xlabel("words")
        length_ax.set_ylabel("sigma^2")
        length_ax.legend(fontsize=8)
    else:
        _skipped(length_ax, "caption sigma^2 vs length", analyses.skipped["caption_length"])

    images, captions = series["images_vs_captions"]["images"], series["images_vs_captions"]["captions"]
    hist_ax.hist(images, bins=40, alpha=0.6, label=f"images (mean {np.mean(images):.2e})")
    hist_ax.hist(captions, bins=40, alpha=0.6, label=f"captions (mean {np.mean(captions):.2e})")
    hist_ax.set_title(f"images vs captions: caption wider in {metrics['unc_caption_wider_frac']:.0%} of pairs")
    hist_ax.set_xlabel("sigma^2")
    hist_ax.legend(fontsize=8)

    if "levels" in series:
        lv = series["levels"]
        level_ax.boxplot(lv["sigma2"], showfliers=False)
        level_ax.set_xticks(range(1, len(lv["levels"]) + 1), lv["levels"])
        level_ax.set_title(f"caption sigma^2 by level, specific -> general (rho {metrics['unc_level_rho']:.2f})")
        level_ax.set_ylabel("sigma^2")
        labels = ["task captions"] + lv["levels"]
        values = [metrics["unc_image_in_caption_frac"]] + lv["image_in_caption"]
    else:
        _skipped(level_ax, "caption sigma^2 by level", analyses.skipped["levels"])
        labels, values = ["task captions"], [metrics["unc_image_in_caption_frac"]]
    inc_ax.bar(range(len(values)), values, color="C2")
    inc_ax.set_xticks(range(len(values)), labels)
    inc_ax.set_ylim(0, 1)
    inc_ax.set_title("image in caption: H(Z_v in Z_t) > 0 (ProLIP Eq. 4)")
    inc_ax.set_ylabel("fraction of (image, caption) pairs")
    fig.tight_layout()
    png = folder / f"{name}_analyses.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    js = folder / f"{name}_analyses.json"
    js.write_text(json.dumps({"metrics": metrics, "skipped": analyses.skipped}, indent=1))
    return [png, js]


def _skipped(ax, title: str, reason: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "skipped:\n" + textwrap.fill(reason, 50), ha="center", va="center", fontsize=9,
            transform=ax.transAxes)
    ax.set_axis_off()
