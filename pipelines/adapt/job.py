"""Driver of `jobs.adapt`: source model -> embeddings (Ray Data) -> adapter (Ray Train) -> adapted model, scored.

Order: every check that needs no Ray first (config, source model, existing embeddings, eval data), then
Ray: batch inference of the training pairs when their embeddings are missing, the Ray Train fit on the
embeddings, the adapted model file(s), evaluation from the source's task embeddings, MLflow.
"""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray.data
import torch
from safetensors.torch import load_file

from models.model_file import save_model
from models.probvlm import adapter_kind, adapter_model_name, adapter_options, embedding_width
from models.registry import create_model
from pipelines.adapt.config import AdaptDocument
from pipelines.adapt.pairs import Pairs, compute_embeddings, has_embeddings, load_pairs
from pipelines.adapt.scoring import comparison_plot, score_adapted
from pipelines.adapt.source import AdaptError, Source, file_sha256, resolve_source
from pipelines.cluster.runtime import local_cpus
from pipelines.config import STATE_DIR, ConfigError
from pipelines.data.reader import shard_paths
from pipelines.data.tars import iter_tar_samples
from pipelines.digits.shards import prepare_digits, write_digit_pairs
from pipelines.evaluate import EvaluationError
from pipelines.evaluate.inference import InferenceOptions, embed_tasks
from pipelines.evaluate.tasks import prefixed, write_plots
from pipelines.inputs import check_eval_tasks
from pipelines.fit.launch import Launch
from pipelines.result import JobResult
from pipelines.storage import outbox_folder
from pipelines.tracking import TrackedRun, git_commit, save_mlflow_model

EXAMPLE_CAPTION = "a photo of a dog"


@dataclass(kw_only=True)
class AdaptResult(JobResult):
    """`metrics`: eval: {task}/{metric}, baseline/{task}/{metric}; `out`: the job's folder."""

    model_file: Path | None  # the adapted model (source + adapter); None when stopped at train.stop_at_step
    baseline_file: Path | None
    train: dict[str, Any]  # the workers' final report (steps, samples/s, ...)
    source: Source
    pairs: int
    plots: list[Path] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per stage


def pair_shards(cfg: AdaptDocument) -> list[str]:
    """The training pairs' shards (the digits' are written first when missing)."""
    if cfg.data.source == "digits":
        folder = write_digit_pairs(cfg.data.root, cfg.data.split)
        return shard_paths(str(folder), None)
    try:
        return shard_paths(cfg.data.root, cfg.data.split)
    except FileNotFoundError as err:
        raise AdaptError(f"data.root: {err}") from None


def adapter_overrides(cfg: AdaptDocument, source: Source, head: str) -> dict[str, Any]:
    return {"source": source.name, "source_overrides": source.overrides, **adapter_options(head, cfg.adapter)}


def build_adapted(cfg: AdaptDocument, source: Source, head: str, adapter_state: dict):
    """The adapted model: the source's exact weights + the trained adapter."""
    model = create_model(adapter_model_name(head), **adapter_overrides(cfg, source, head))
    model.source.load_state_dict(source.model.state_dict())
    model.adapter.load_state_dict(adapter_state)
    return model.eval()


def source_unchanged(source: Source, models: list) -> bool:
    """Every source tensor of every adapted model equals the source file's, and the file is unchanged."""
    original = load_file(str(source.path))
    for model in models:
        state = model.source.state_dict()
        if state.keys() != original.keys() or not all(torch.equal(state[k], original[k]) for k in original):
            return False
    return file_sha256(source.path) == source.sha256


def check_before_ray(cfg: AdaptDocument, out: Path, uri: str) -> tuple[Source, str | Path, Pairs | None]:
    """Source, embeddings folder (a local Path or a URI) and (if they exist) the checked pairs; AdaptError on bad
    input."""
    source = resolve_source(cfg.source, uri, out / "source")
    folder = cfg.data.embeddings or out / "embeddings"
    pairs = load_pairs(folder, embedding_width(source.model)) if has_embeddings(folder) else None
    return source, folder, pairs


def run_adapt(cfg: AdaptDocument, out: Path | None = None) -> AdaptResult:
    """`jobs.adapt`: the source's embeddings, the adapter fitted on them, the adapted model(s) saved, scored and logged,
    under `out` (default .probvlp/adapt/<run name>)."""
    launch = Launch(cfg, "adapt")
    cfg, t, uri = launch.cfg, launch.cfg.train, launch.uri
    out = Path(out or STATE_DIR / "adapt" / cfg.run.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    source, folder, pairs = check_before_ray(cfg, out, uri)
    width = embedding_width(source.model)

    launch.start_ray(local_cpus(max(t.num_workers, cfg.embed.actors), t.cpus_per_worker),
                     writes="the adapter's checkpoints")
    from pipelines.adapt.loop import ADAPTER_FILE, adapt_loop  # deferred until init_ray quietened the logs

    if cfg.data.source == "digits":
        # digits already written (by the source's pretraining) stay as they are: rewriting them with other parameters
        # could move the source's training images into the held-out split the adapter is scored on
        prepare_digits(cfg.data.root, keep_written=True)
    try:
        check_eval_tasks(cfg)
    except ConfigError as err:
        raise AdaptError(f"eval: {err}") from None
    tasks = cfg.resolved_tasks()
    opts = InferenceOptions(concurrency=cfg.embed.actors, batch_size=cfg.embed.batch_size,
                            num_gpus=cfg.embed.gpus_per_actor)
    paths = pair_shards(cfg)
    seconds, clock = {}, time.perf_counter()
    if pairs is None:
        compute_embeddings(source.path, paths, source.model.img_size, folder, opts)
        pairs = load_pairs(folder, width)
    seconds["embed_pairs"], clock = time.perf_counter() - clock, time.perf_counter()

    tags = {"probvlp.kind": "adapt", "probvlp.run_name": cfg.run.name, "probvlp.model": adapter_model_name(cfg.adapter.head),
            "probvlp.method": adapter_kind(cfg.adapter.head).method,
            "probvlp.source_model": source.name, "probvlp.source_run": source.run_id or "",
            "mlflow.source.git.commit": git_commit() or ""}
    params = {**cfg.flat(), "source.file": str(source.path), "source.sha256": source.sha256, "data.pairs": len(pairs.image),
              "data.images": pairs.n_images, "data.texts": pairs.n_texts, "embed_dim": width}
    common = dict(mlflow_uri=uri, run_name=cfg.run.name, out=out, source=source, pairs=len(pairs.image))
    # what rank 0 leaves undelivered (the store away): delivered by the next attempt's rank 0, or by this driver as the
    # run ends (for up to tracking.flush_timeout_s; past it, one line says how many calls are pending where)
    with launch.run(params=params, tags=tags, pending_in=outbox_folder(cfg.run.storage_path, cfg.run.name)) as run:
        run.flush_timeout_s = cfg.tracking.flush_timeout_s
        result = launch.train(adapt_loop, {"dim": width},
                            {"train": ray.data.from_numpy(np.stack([pairs.image, pairs.text], axis=1))})
        train = dict(result.metrics)
        seconds["train"], clock = time.perf_counter() - clock, time.perf_counter()
        if not launch.end(int(train.get("step", 0))):  # train.stop_at_step: resumable, not scored
            return AdaptResult(mlflow_run_id=run.run_id, model_file=None, baseline_file=None, train=train,
                               seconds=seconds, **common)
        with result.checkpoint.as_directory() as folder:  # on object storage: downloaded to a local folder
            state = load_file(str(Path(folder) / ADAPTER_FILE))
        heads = {"adapter": cfg.adapter.head, **({"baseline": cfg.adapter.baseline} if cfg.adapter.baseline != "none" else {})}
        models = {name: build_adapted(cfg, source, head, {k.removeprefix(f"{name}."): v for k, v in state.items()
                                                          if k.startswith(f"{name}.")})
                  for name, head in heads.items()}
        if not source_unchanged(source, list(models.values())):
            raise RuntimeError("the source model's weights changed during adaptation")
        files = save_models(cfg, source, heads, models, out)
        log_models(run, files, paths)  # save before judging: the adapter is in MLflow whatever evaluation does
        try:
            metrics, plots = evaluate_adapted(cfg, source, models, tasks, out, opts)
        except Exception as err:  # noqa: BLE001 - reported by task, the models stay
            failure = err if isinstance(err, EvaluationError) else EvaluationError.of("adapter evaluation", err)
            run.logger().tag("probvlp.failure", str(failure))
            raise EvaluationError(f"{failure} (the adapter is saved: runs:/{run.run_id}/model and {files['adapter']})") \
                from err
        seconds["evaluate"] = time.perf_counter() - clock
        log_adapter_results(run, metrics, plots, {**train, **{f"seconds_{k}": v for k, v in seconds.items()}}, out)
    return AdaptResult(metrics=metrics, mlflow_run_id=run.run_id, model_file=files["adapter"],
                       baseline_file=files.get("baseline"), train=train, plots=plots, seconds=seconds, **common)


def save_models(cfg: AdaptDocument, source: Source, heads: dict[str, str], models: dict, out: Path) -> dict[str, Path]:
    files = {}
    for name, model in models.items():
        files[name] = out / ("model.safetensors" if name == "adapter" else f"{name}.safetensors")
        save_model(model.state_dict(), files[name], adapter_model_name(heads[name]), adapter_overrides(cfg, source, heads[name]))
    return files


def evaluate_adapted(cfg: AdaptDocument, source: Source, models: dict, tasks, out: Path, opts):
    """Each task: the source's embeddings by batch inference, scored for every adapted model; plots."""
    metrics: dict[str, float] = {}
    plots: list[Path] = []
    adapter_results = {}
    try:
        embeddings = embed_tasks(str(source.path), source.model, list(tasks), out / "eval", opts)
    except Exception as err:  # noqa: BLE001 - one pass embeds every task: the error names them all
        raise EvaluationError.of(", ".join(t.name for t in tasks), err) from err
    for task in tasks:
        try:
            emb = embeddings[task.name]
            results = score_adapted(models, task, emb, cfg.eval.calibration_bins)
        except Exception as err:  # noqa: BLE001 - any failure of a task is reported by its name
            raise EvaluationError.of(task.name, err) from err
        for name, res in results.items():
            metrics.update({(k if name == "adapter" else f"{name}/{k}"): v for k, v in prefixed(task, res).items()})
        adapter_results[task.name] = results["adapter"]
        if len(results) > 1:
            plot = comparison_plot(task.name, results, out / "plots")
            plots += [plot] if plot else []
    plots += write_plots(adapter_results, _mkdir(out / "plots"))
    return metrics, plots


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_models(run: TrackedRun, files: dict[str, Path], paths: list[str]) -> None:
    """The MLflow model of the adapted model and the baseline's file."""
    logger = run.logger()
    example = next(iter_tar_samples(paths, limit=1))
    image = next(example[k] for k in ("jpg", "jpeg", "png", "webp") if k in example)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_mlflow_model(files["adapter"], Path(tmp) / "model", image, EXAMPLE_CAPTION, True)
        logger.artifacts(folder, "model")
    for name, path in files.items():
        if name != "adapter":
            logger.artifact(path, name)


def log_adapter_results(run: TrackedRun, metrics: dict[str, float], plots: list[Path], train: dict[str, Any],
                        out: Path) -> None:
    """Eval metrics, results and plots."""
    logger = run.logger()
    logger.log({**metrics, **{k: v for k, v in train.items() if k.startswith("seconds_")}}, int(train.get("step", 0)))
    logger.tag("probvlp.source_unchanged", "true")
    logger.flush()
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True))
    logger.artifact(out / "metrics.json", "eval")
    for png in plots:
        logger.artifact(png, "plots")
