"""Scoring adapted models from their frozen source's embeddings, and the adapter-vs-baseline calibration plot.

An adapted model's outputs are a function of the source model's (`AdaptedModel.adapt`), so one Ray Data
batch inference of the source per task serves the adapter and the baseline alike; the numbers equal
`jobs.evaluate` on the saved adapted model (tests/test_probvlm.py).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from pipelines.evaluate.in_process import TaskEmbeddings
from pipelines.plotting import pyplot
from pipelines.evaluate.tasks import TaskResult, score_task


@torch.no_grad()
def adapted_embeddings(model, emb: TaskEmbeddings) -> TaskEmbeddings:
    """The source's task embeddings -> the adapted model's (mu kept, logvar from the adapter)."""
    return replace(emb, image=model.adapt("image", emb.image), text=model.adapt("text", emb.text))


def score_adapted(models: dict, task, emb: TaskEmbeddings, bins: int) -> dict[str, TaskResult]:
    return {name: score_task(model.eval(), task, adapted_embeddings(model, emb), bins) for name, model in models.items()}


LABELS = {"i2t": "image->text R@1", "t2i": "text->image R@1", "top1": "zero-shot top-1"}


def comparison_plot(task: str, results: dict[str, TaskResult], folder: Path) -> Path | None:
    """Metric per uncertainty bin (ProbVLM Fig. 3 style), one panel per direction, one line per model."""
    directions = sorted({d for r in results.values() for d in r.calibrations})
    if not directions:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(directions), figsize=(5 * len(directions), 4), squeeze=False)
    for ax, direction in zip(axes[0], directions):
        for name, res in results.items():
            cal = res.calibrations.get(direction)
            if cal is None:
                continue
            ax.plot(np.arange(1, len(cal.bin_metric) + 1), cal.bin_metric, marker="o",
                    label=f"{name}: -S R^2 {cal.score:.2f} (S {cal.rho:.2f}, R^2 {cal.r2:.2f})")
        ax.set_xlabel("uncertainty bin (1 = least uncertain)")
        ax.set_ylabel(LABELS.get(direction, direction))
        ax.set_title(f"{task}: {direction}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{task}_calibration_vs_baseline.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary_lines(metrics: dict[str, float], tasks: list[str], models: list[str]) -> list[str]:
    """One line per task and model: the calibration scores (-S R^2) and mean sigma^2."""
    lines = []
    for task in tasks:
        for name in models:
            prefix = f"{task}/" if name == "adapter" else f"{name}/{task}/"
            parts = [f"{d} -S R^2 {metrics[prefix + f'{d}_calib_score']:.3f}" for d in ("i2t", "t2i", "top1")
                     if prefix + f"{d}_calib_score" in metrics]
            for key, label in (("i2t_R1", "i2t R@1"), ("top1", "top-1")):
                if prefix + key in metrics:
                    parts.append(f"{label} {metrics[prefix + key]:.3f}")
            parts.append(f"image sigma^2 {metrics[prefix + 'image_sigma2_mean']:.2e}")
            lines.append(f"{task} [{name}]: " + ", ".join(parts))
    return lines
