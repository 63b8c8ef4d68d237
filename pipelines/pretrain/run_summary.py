"""What a finished run prints about its model: its eval tasks' numbers, for probabilistic models the uncertainty
the final evaluation measured (sigma^2 by caption level, where the plots are), and a few held-out images with what the
model predicts for them and their sigma^2 (worked out by rank 0 beside the final evaluation), all from the run's final
metrics: the driver neither loads the model nor imports its code."""
from __future__ import annotations

import json
from pathlib import Path

from pipelines.config import EvalTask
from pipelines.data.stats import reports_summary
from pipelines.evaluate.headline import headline
from pipelines.tracking import hide_credentials, sqlite_artifact_root


def run_summary(cfg, result) -> list[str]:
    """The end of `jobs.pretrain`: metrics per eval task, where the model is, how to look, sample predictions."""
    shown = hide_credentials(result.mlflow_uri)  # a store behind credentials: the user has them, the log must not
    lines = [f"MLflow run {result.mlflow_run_id} in experiment {result.experiment!r} at {shown}",
             f"  see it with: mlflow ui --backend-store-uri {shown} --host 127.0.0.1",
             "final metrics:", *headline(result.metrics)]
    if "data_wait_frac_mean" in result.metrics:
        lines.append(f"  the training loop waited for data {result.metrics['data_wait_frac_mean']:.0%} of its time "
                     "(data_wait_frac in MLflow; above ~10% the reader, not the model, sets the pace)")
    lines += uncertainty_lines(result.metrics, cfg.resolved_tasks())
    lines += data_lines(result.metrics)
    if result.metrics.get("step", 0) < cfg.train.steps:
        return lines + [f"stopped at step {result.metrics.get('step', 0)} of {cfg.train.steps}: no final model"]
    model_uri = f"runs:/{result.mlflow_run_id}/model"
    lines.append(f"model: {model_uri} (mlflow.pyfunc.load_model; weights in model/data/model.safetensors)")
    if result.registered_version:
        lines.append(f"  registered as models:/{cfg.tracking.register_as}/{result.registered_version}")
    lines += plot_lines(result)
    lines += json.loads(result.metrics.get("sample_predictions", "[]"))  # rank 0's, beside the final evaluation
    return lines


def data_lines(metrics: dict) -> list[str]:
    """What the readers skipped in each of the run's datasets (the final report's data_report: counts by reason,
    example samples and broken files; all of it in MLflow as data/* metrics and data/skipped.json)."""
    if not metrics.get("data_report"):
        return []
    return reports_summary(json.loads(metrics["data_report"]))


# What each caption level (pipelines.data.captions; the bundled digits carry all four) says about an image.
LEVEL_MEANING = {
    "instance": "this image's own look (digits: class + ink, width, slant)",
    "specific": "its class (digits: 'the digit seven')",
    "mid": "a group of classes (digits: 'an odd digit', 'a small digit')",
    "general": "any image of the set (digits: 'a handwritten digit')",
}


def uncertainty_lines(metrics: dict, tasks: list[EvalTask]) -> list[str]:
    """sigma^2 by caption level, as the final evaluation's uncertainty analyses measured it (retrieval tasks of a
    probabilistic model on data with caption levels: pipelines.evaluate.uncertainty); nothing for other runs."""
    lines = []
    for task in tasks:
        p = f"{task.name}/"
        levels = [lv for lv in task.caption_levels if f"{p}unc_level_{lv}_sigma2" in metrics]
        if not levels:
            continue
        lines.append(f"uncertainty (eval task {task.name!r}): mean sigma^2 of the held-out captions by level, "
                     "specific -> general, and of the images")
        for lv in levels:
            lines.append(f"  {lv:<9} {metrics[f'{p}unc_level_{lv}_sigma2']:.4g}  {LEVEL_MEANING.get(lv, '')}")
        if f"{p}image_sigma2_mean" in metrics:
            lines.append(f"  {'images':<9} {metrics[f'{p}image_sigma2_mean']:.4g}  the held-out images; a caption is "
                         f"wider than its image in {metrics.get(f'{p}unc_caption_wider_frac', float('nan')):.0%} "
                         "of the pairs")
        lines.append(level_rho_line(metrics.get(f"{p}unc_level_rho", float("nan")),
                                    [metrics[f"{p}unc_level_{lv}_sigma2"] for lv in levels]))
    return lines


def level_rho_line(rho: float, means: list[float]) -> str:
    """ProLIP Fig. 7's claim beside this run's rho and, where the levels' mean sigma^2 (specific -> general) do not
    rise level by level, why (docs/RESULTS.md, "sigma^2 by caption level": studies.caption_level_study)."""
    claim = f"sigma^2: how far an embedding spreads; ProLIP Fig. 7 (web captions): more general, wider. rho(level, sigma^2) {rho:+.2f} here"
    if all(a < b for a, b in zip(means, means[1:])):
        return f"  {claim}, the mean rising level by level"
    return (f"  {claim}, the means not rising level by level, as in every recipe tried on the digits: PPCL widens a "
            "caption whose mean nearly matches batch images labelled negative (a class caption's classmates); a trained "
            "caption that fits every image sits near none and narrows (docs/RESULTS.md)")


def plot_lines(result) -> list[str]:
    """Where the run's plots are: the local folder of a sqlite store's artifacts when it holds them, else the
    run's `plots/` in MLflow."""
    root = sqlite_artifact_root(result.mlflow_uri)
    folder = Path(root.removeprefix("file://")) / result.mlflow_run_id / "artifacts" / "plots" if root else None
    pngs = sorted(p.name for p in folder.glob("*.png")) if folder is not None and folder.is_dir() else []
    if not pngs:
        return [f"plots: plots/ in the run's artifacts ({result.mlflow_run_id}, mlflow ui)"]
    return [f"plots ({_plot_legend(pngs)}): {folder}/", *(f"  {name}" for name in pngs)]


def _plot_legend(pngs: list[str]) -> str:
    parts = []
    if any(n.endswith("_uncertainty.png") for n in pngs):
        parts.append("*_uncertainty: top-1 / R@1 per sigma^2 bin, sigma^2 histograms")
    if any(n.endswith("_analyses.png") for n in pngs):
        parts.append("*_analyses: sigma^2 by caption level and length, images vs captions")
    return "; ".join(parts) or "MLflow artifacts"
