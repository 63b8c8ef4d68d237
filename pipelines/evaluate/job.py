"""The evaluation stage's jobs, embeddings by Ray Data batch inference.

`jobs.evaluate` (`run_evaluate`): a saved model on the eval tasks of a config. Writes
{out}/{task}/images|texts/*.parquet (the embeddings), {out}/results.json (one record per task and metric) and the
uncertainty plots, and logs them to a new MLflow run tagged with the source run.

`jobs.embed` (`run_embed`): a saved model's embeddings of a shard set, its skipped samples, an optional faiss
index (see the job's help).
"""
from __future__ import annotations

import json
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from models import default_loss
from models.losses import create_loss
from models.model_file import load_model
from models.objective import Objective
from models.scoring.ann import MeanIndex
from pipelines.cluster.check import is_local_path
from pipelines.cluster.runtime import init_ray, local_cpus
from pipelines.config import STATE_DIR, ConfigError, InputError
from pipelines.data.eval_tasks import read_caption_levels, task_paths
from pipelines.data.reader import read_shards, shard_paths
from pipelines.storage import fs_path
from pipelines.data.stats import (drop_stats, reader_stats, report_lines, report_metrics, reports_summary,
                                  skipped_keys)
from pipelines.evaluate.config import EvaluateDocument
from pipelines.evaluate.in_process import distinct_captions, split_captions
from pipelines.evaluate.inference import (InferenceOptions, embed_tasks, read_embeddings, write_image_embeddings,
                                          write_text_embeddings)
from pipelines.evaluate.tasks import held_out_loss, prefixed, score_task, write_plots
from pipelines.inputs import prepare_inputs
from pipelines.result import JobResult
from pipelines.tracking import finish_with_results, resolve_model, start_run, tracking_uri


def loss_section(cfg: EvaluateDocument, source_config: str | None) -> tuple[str | None, dict]:
    """The loss to rebuild for `loss` tasks: the source run's, unless the eval config names one."""
    if cfg.loss.name is None and source_config:
        loss = (yaml.safe_load(source_config) or {}).get("loss") or {}
        return loss.get("name"), loss.get("params") or {}
    return cfg.loss.name, cfg.loss.params


def check_loss_section(cfg: EvaluateDocument) -> None:
    """A loss the config names, against the losses and its constructor: a one-line ConfigError before any work (the
    `loss` tasks rebuild it)."""
    if cfg.loss.name is None:
        return
    try:
        create_loss(cfg.loss.name, **cfg.loss.params)
    except KeyError as err:
        raise ConfigError(f"loss.name: {err.args[0]}") from None
    except (TypeError, ValueError) as err:
        raise ConfigError(f"loss.params: loss {cfg.loss.name!r}: {err}") from None


def held_out_loss_of(cfg: EvaluateDocument, model, source: dict, task, stats_name: str | None = None) -> float:
    if source["loss"] is None:
        raise ConfigError(f"eval task {task.name!r} (loss): needs the loss weights; no loss.safetensors beside "
                          f"{source['model']}")
    name, params = loss_section(cfg, source["config"])
    loss = create_loss(name or default_loss(model_name(source["model"])), **params)
    loss.load_state_dict(load_file(str(source["loss"])))
    ds = read_shards(task_paths(task), model.img_size, model.context_length, seed=0, stats_name=stats_name,
                     stats_sync=True)
    return held_out_loss(Objective(model, loss), ds.iter_torch_batches(batch_size=cfg.eval.batch_size, drop_last=False))


def model_name(path: Path) -> str:
    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {})["model"]


@dataclass(kw_only=True)
class EvaluateResult(JobResult):
    """`metrics`: {task}/{metric} and the reader's counts; `out`: results.json, skipped.json, the plots."""

    records: list[dict[str, Any]]  # results.json's rows: task, metric, value
    results: dict[str, Any]  # each task's full result (pipelines.evaluate.tasks.score_task)
    skipped: dict[str, dict]  # what the reader skipped, per task


def run_evaluate(cfg: EvaluateDocument, model_ref: str, out: Path | None, opts: InferenceOptions) -> EvaluateResult:
    """`jobs.evaluate`: the model (a file, runs:/<run_id>/model or a run id; InputError when none is there) on
    every task of cfg.eval, under `out` (None: .probvlp/eval/<time>)."""
    check_loss_section(cfg)
    out = Path(out or STATE_DIR / "eval" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        source = resolve_model(model_ref, tracking_uri(cfg.tracking.uri), out / "source")
    except ValueError as err:
        raise InputError(str(err)) from None
    # a local Ray keeps CPUs beside the actors for reading and decoding (ignored when joining a cluster)
    init_ray(cfg.ray.address, cfg.ray.num_cpus or local_cpus(opts.concurrency, 1))
    prepare_inputs(cfg)
    return evaluate_tasks(cfg, source, out, opts)


def evaluate_tasks(cfg: EvaluateDocument, source: dict, out: Path, opts: InferenceOptions) -> EvaluateResult:
    """Every task of cfg.eval on the resolved model `source` (`pipelines.tracking.resolve_model`)."""
    model = load_model(source["model"])
    tasks = cfg.resolved_tasks()
    metrics: dict[str, float] = {}
    results = {}
    # each task's reader counts under a name of this evaluation's own (`pipelines.data.stats`)
    stats_names = {t.name: f"evaluate-{uuid.uuid4().hex[:12]}/{t.name}" for t in tasks}
    embedded = [t for t in tasks if t.kind != "loss"]
    embeddings = embed_tasks(str(source["model"]), model, embedded, out, opts, stats_names)
    for task in tasks:
        if task.kind == "loss":
            metrics[f"{task.name}/loss"] = held_out_loss_of(cfg, model, source, task, stats_names[task.name])
            continue
        emb = embeddings[task.name]
        if task.kind == "retrieval" and model.probabilistic and task.analyses:
            emb.levels = read_caption_levels(task, emb.keys)  # json only; the actors' parquet carries no levels
        results[task.name] = score_task(model, task, emb, cfg.eval.calibration_bins)
        metrics.update(prefixed(task, results[task.name]))
    skipped = data_report(stats_names, out)
    records = [{"task": k.split("/", 1)[0], "metric": k.split("/", 1)[1], "value": v} for k, v in metrics.items()]
    (out / "results.json").write_text(json.dumps(records, indent=1))
    metrics.update({k: v for label, st in skipped.items() for k, v in report_metrics(label, st).items()})
    plots = write_plots(results, out)

    uri = tracking_uri(cfg.tracking.uri)
    tags = {"probvlp.source_run": source["run_id"] or "", "probvlp.model": model_name(source["model"]),
            "probvlp.kind": "evaluation"}
    params = {"model": str(source["model"]), **{f"eval.tasks.{t.name}": f"{t.kind} {t.data}/{t.split}" for t in tasks}}
    run_id = start_run(uri, cfg.run.experiment, cfg.run.name or f"eval-{tags['probvlp.model']}", params, cfg.to_yaml(),
                       tags)
    finish_with_results(uri, run_id, metrics, [(out / "results.json", "eval"), (out / "skipped.json", "data"),
                                               *((png, "plots") for png in plots)])
    return EvaluateResult(metrics=metrics, mlflow_uri=uri, mlflow_run_id=run_id, run_name=cfg.run.name, out=out,
                          records=records, results=results, skipped=skipped)


def data_report(stats_names: dict[str, str], out: Path) -> dict[str, dict]:
    """What the reader skipped per task: printed, written to {out}/skipped.json (every skipped sample's file and key
    by reason, broken files) and returned (MLflow metrics data/{task}/...)."""
    reports = {task: reader_stats(name) for task, name in stats_names.items()}
    for line in reports_summary(reports):
        print(line)
    every = {task: {**st, "samples": skipped_keys(stats_names[task])} for task, st in reports.items()}
    (out / "skipped.json").write_text(json.dumps(every, indent=1, sort_keys=True))
    for name in stats_names.values():
        drop_stats(name)
    return reports


def run_embed(model_ref: str, data: str, split: str | None, out: str | Path, opts: InferenceOptions,
              tracking: str | None = None, texts: bool = True, index: str | None = None, log=print) -> JobResult:
    """`jobs.embed`: {out}/images (one row per readable sample), {out}/skipped.json, with `texts` the distinct
    captions' embeddings in {out}/texts, with `index` a faiss index in {out}/images.faiss. Returns `out` (no metrics,
    no MLflow run).
    `out`: a local folder, or a URI on object storage (the parquet written there by Ray Data, the other files here
    first, then copied)."""
    with tempfile.TemporaryDirectory(prefix="probvlp_embed_") as tmp:
        here = Path(out) if is_local_path(str(out)) else Path(tmp)
        _embed(model_ref, data, split, out, here, opts, tracking, texts, index, log)
        if here != Path(out):
            fs, path = fs_path(str(out))
            for name in ("skipped.json", "images.faiss"):
                if (here / name).is_file():
                    fs.put_file(str(here / name), f"{path}/{name}")
    return JobResult(out=out)


def _embed(model_ref: str, data: str, split: str | None, out: str | Path, here: Path, opts: InferenceOptions,
           tracking: str | None, texts: bool, index: str | None, log) -> None:
    """`run_embed` with the files other than the parquet (source model, skipped.json, index) written in `here`."""
    try:
        source = resolve_model(model_ref, tracking_uri(tracking), here / "source")
        paths = shard_paths(data, split)
    except (ValueError, FileNotFoundError) as err:
        raise InputError(str(err)) from None
    init_ray(num_cpus=local_cpus(opts.concurrency, 1))  # a local Ray keeps CPUs beside the actors for decoding
    model = load_model(source["model"])
    stats_name = f"embed-{uuid.uuid4().hex[:12]}"  # this run's own reader counts
    folder = write_image_embeddings(str(source["model"]), paths, model.img_size, out, opts, stats_name=stats_name)
    skipped = {**reader_stats(stats_name), "samples": skipped_keys(stats_name)}
    drop_stats(stats_name)
    here.mkdir(parents=True, exist_ok=True)
    (here / "skipped.json").write_text(json.dumps(skipped, indent=1, sort_keys=True))
    cols, outputs = read_embeddings(folder, "key", getattr(model, "mixture_tokens", None))
    log(f"{len(cols['key'])} image embeddings in {folder}")
    for line in report_lines("embed", skipped):
        log(line)
    if skipped["skipped_unique"] or skipped["files"]:
        log(f"skipped samples and files: {out}/skipped.json")
    if index:
        MeanIndex(outputs["mu"], kind=index).save(here / "images.faiss")
        log(f"faiss {index} index on the image means in {out}/images.faiss")
    if texts:
        captions = distinct_captions(split_captions(cols["captions"]))
        if captions:
            written = write_text_embeddings(str(source["model"]), captions, out, opts, model)
            log(f"{len(captions)} caption embeddings in {written}")
