"""The `{task}/{metric}` names a run reports, from its config alone (no data, no Ray): what sweeps check their
metric against before any trial, and what the evaluation fills in."""
from __future__ import annotations

from models.registry import model_arch
from pipelines.config import EvalTask, ExperimentDocument

DIRECTIONS = ("i2t", "t2i")
RETRIEVAL_METRICS = [f"{d}_{m}" for d in DIRECTIONS for m in ("R1", "R5", "R10", "mAP_R", "R_precision")] + ["rsum"]
CALIBRATION_METRICS = ("calib_rho", "calib_r2", "calib_score")

def task_metric_names(task: EvalTask, probabilistic: bool) -> list[str]:
    """The metrics a task logs (without the `{task}/` prefix)."""
    if task.kind == "loss":
        return ["loss"]
    if task.kind == "retrieval":
        names = list(RETRIEVAL_METRICS)
        if probabilistic:
            names += [f"cos_{m}" for m in RETRIEVAL_METRICS]
            names += [f"{d}_{c}" for d in DIRECTIONS for c in CALIBRATION_METRICS]
    else:
        names = ["top1", "top5", "mean_per_class_recall"]
        if probabilistic:
            names += [f"top1_{c}" for c in CALIBRATION_METRICS]
    if probabilistic:
        names += ["image_sigma2_mean", "text_sigma2_mean"]
    return names


def metric_names(cfg: ExperimentDocument) -> list[str]:
    """Every `{task}/{metric}` a run of `cfg` reports."""
    probabilistic = bool(getattr(model_arch(cfg.model.name), "probabilistic", False))
    return [f"{t.name}/{m}" for t in cfg.resolved_tasks() for m in task_metric_names(t, probabilistic)]
