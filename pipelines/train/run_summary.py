"""What a finished run prints about its model: its eval tasks' numbers, for probabilistic models the uncertainty
the final evaluation measured (sigma^2 by caption level, where the plots are), and a few held-out images with what the
model predicts for them and their sigma^2. Everything but the sample predictions comes from the run's final metrics."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from models.model_file import load_model
from pipelines.config import EvalTask
from pipelines.data.eval_reader import REQUIRES, iter_local_batches
from pipelines.data.eval_tasks import task_paths
from pipelines.data.stats import reports_summary
from pipelines.evaluate.headline import headline
from pipelines.evaluate.in_process import embed_texts, split_captions, task_texts
from pipelines.evaluate.tasks import classes_from_prompts, sigma2
from pipelines.tracking import resolve_model, sqlite_artifact_root


def showcase_task(tasks: list[EvalTask]) -> EvalTask | None:
    """The first zero-shot task, else the first retrieval task (a loss task has nothing to show)."""
    return next((t for t in tasks if t.kind == "zeroshot"), next((t for t in tasks if t.kind == "retrieval"), None))


@torch.no_grad()
def sample_predictions(model: torch.nn.Module, task: EvalTask, n: int = 4) -> list[str]:
    batch = next(iter_local_batches(task_paths(task), model.img_size, batch_size=n, require=REQUIRES[task.kind]))
    image = {k: v.float() for k, v in model.encode_image(torch.as_tensor(batch["image"])).items()}
    captions = split_captions(batch["captions"])
    texts, counts, classnames = task_texts(task, captions)
    counts = counts or [1] * len(texts)
    labels = classnames or texts
    text = embed_texts(model, texts)
    scores = model.class_scores(image, classes_from_prompts(model, text, counts))
    best = scores.argmax(dim=1).tolist()
    starts = [sum(counts[:i]) for i in range(len(counts))]
    lines = [f"sample predictions: {len(best)} held-out images of eval task {task.name!r} ({task.kind})"]
    if model.probabilistic:
        lines.append("  sigma^2: mean per-dimension variance; larger = less certain")
    image_s2 = sigma2(image) if model.probabilistic else None
    text_s2 = sigma2(text) if model.probabilistic else None
    for i, j in enumerate(best):
        truth = (classnames[int(batch["cls"][i])] if classnames and 0 <= int(batch["cls"][i]) < len(classnames)
                 else (captions[i][0] if captions[i] else "?"))
        line = f"  image {batch['key'][i]} (true: {truth!r}) -> {labels[j]!r}"
        if image_s2 is not None:
            prompts_s2 = text_s2[starts[j] : starts[j] + counts[j]].mean()
            line += f" | sigma^2 image {image_s2[i]:.4g}, its class prompts {prompts_s2:.4g}"
        lines.append(line)
    if not model.probabilistic:
        lines.append(f"  (no sigma^2: {type(model).__name__} is a deterministic model)")
    return lines


def run_summary(cfg, result) -> list[str]:
    """The end of `jobs.pretrain`: metrics per eval task, where the model is, how to look, sample predictions."""
    lines = [f"MLflow run {result.mlflow_run_id} in experiment {result.experiment!r} at {result.mlflow_uri}",
             f"  see it with: mlflow ui --backend-store-uri {result.mlflow_uri} --host 127.0.0.1",
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
    task = showcase_task(cfg.resolved_tasks())
    if task is not None:
        try:  # the run is done and logged: a sample that cannot be shown must not turn it into a failure
            with tempfile.TemporaryDirectory() as tmp:
                model = load_model(resolve_model(model_uri, result.mlflow_uri, tmp)["model"])
            lines += sample_predictions(model, task)
        except Exception as err:  # noqa: BLE001
            lines.append(f"(no sample predictions: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
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
