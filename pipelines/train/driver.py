"""Driver side of pretraining: data, MLflow run, Ray Train TorchTrainer (the workers run `pipelines.train.worker`)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from pipelines.config import Config, absolute_local
from pipelines.tracking import (LOCAL_DIR, find_run, finish_run, git_commit, register_model, reopen_run, start_run,
                                tracking_uri)


@dataclass
class FitResult:
    metrics: dict[str, Any]
    mlflow_uri: str
    mlflow_run_id: str
    experiment: str
    run_name: str
    checkpoint_path: str | None
    registered_version: str | None = None  # tracking.register_as: the Model Registry version of this run


def prepare_data(cfg: Config) -> None:
    if cfg.data.source == "digits":
        from pipelines.data.digits import write_digit_eval_sets, write_digit_shards

        write_digit_shards(cfg.data.root, image_size=cfg.data.image_size, shard_size=cfg.data.shard_size,
                           seed=cfg.data.split_seed)
        write_digit_eval_sets(cfg.data.root)


def check_eval_tasks(cfg: Config) -> None:
    """Every eval task's data has what its kind needs (one-line ConfigError otherwise), before training."""
    from pipelines.evaluate.data import check_task

    for task in cfg.eval.resolved_tasks(cfg.data.root):
        check_task(task)


def build_datasets(cfg: Config, context_length: int) -> dict[str, Any]:
    from pipelines.data.captions import CaptionSampler
    from pipelines.evaluate.data import read_eval_shards, task_paths
    from pipelines.data.reader import read_shards, read_split
    from pipelines.train.worker import eval_dataset_name

    size = cfg.data.image_size
    datasets = {
        "train": read_split(cfg.data.root, "train", size, context_length,
                            captions=CaptionSampler(mid=cfg.data.mid_caption_prob, general=cfg.data.general_caption_prob,
                                                    instance=cfg.data.instance_caption_prob),
                            seed=cfg.run.seed if cfg.data.deterministic else None, augment=cfg.data.augment,
                            ordered=cfg.data.deterministic),
    }
    for task in cfg.eval.resolved_tasks(cfg.data.root):
        name = eval_dataset_name(task)
        if task.kind == "loss":
            # the reader's training-style batches (tokens, a caption drawn per sample), seeded: the same every eval
            datasets[name] = read_shards(task_paths(task), size, context_length, seed=0, stats_name=name, ordered=True)
        else:
            datasets[name] = read_eval_shards(task_paths(task), size, stats_name=name)
    return datasets


def storage_path(cfg: Config) -> str:
    return absolute_local(cfg.run.storage_path)


def run_exists(cfg: Config) -> bool:
    """Whether Ray Train storage already holds this run name (then the trainer resumes it)."""
    import pyarrow.fs

    fs, base = pyarrow.fs.FileSystem.from_uri(storage_path(cfg))
    info = fs.get_file_info(f"{base.rstrip('/')}/{cfg.run.name}")
    return info.type != pyarrow.fs.FileType.NotFound


def mlflow_run(cfg: Config, uri: str, extra_tags: dict[str, str] | None = None) -> str:
    """A new MLflow run, or the one of the run being resumed."""
    from models.objective import loss_name

    existing = find_run(uri, cfg.run.experiment, cfg.run.name) if run_exists(cfg) else None
    if existing:
        reopen_run(uri, existing, cfg.to_yaml())
        return existing
    tags = {"probvlp.run_name": cfg.run.name, "probvlp.model": cfg.model.name,
            "probvlp.method": loss_name(cfg), "mlflow.source.git.commit": git_commit() or "",
            **(extra_tags or {})}
    return start_run(uri, cfg.run.experiment, cfg.run.name, cfg.flat(), cfg.to_yaml(), tags)


def fit(cfg: Config, callbacks: list | None = None, extra_tags: dict[str, str] | None = None) -> FitResult:
    """Train `cfg` on Ray Train. `callbacks` go to the Train run (e.g. Tune's report callback);
    `extra_tags` to a new MLflow run (e.g. mlflow.parentRunId for sweep trials)."""
    import ray.train
    from ray.data import ExecutionOptions
    from ray.train.torch import TorchTrainer

    import torch

    from models.objective import build_objective
    from pipelines.cluster.check import check_cluster_holds_a_worker
    from pipelines.cluster.runtime import init_ray, local_cpus

    if cfg.run.name is None:
        cfg.run.name = f"{cfg.run.experiment}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = cfg.with_absolute_paths()  # what the workers get: they run in other directories
    t = cfg.train
    init_ray(cfg.ray.address, cfg.ray.num_cpus or local_cpus(t.max_workers, t.cpus_per_worker))
    check_cluster_holds_a_worker(t.worker_resources, joined=bool(cfg.ray.address or os.environ.get("RAY_ADDRESS")))
    from pipelines.train.worker import train_loop  # after init_ray quietened the logs: it imports DeepSpeed
    prepare_data(cfg)  # on the Ray just joined (the digits download runs as Ray tasks)
    check_eval_tasks(cfg)
    with torch.device("meta"):  # the sizes only: the workers build the weights
        context_length = build_objective(cfg).model.context_length
    uri = tracking_uri(cfg.tracking.uri)
    run_id = mlflow_run(cfg, uri, extra_tags)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"config": cfg.to_dict(), "mlflow_run_id": run_id, "mlflow_uri": uri,
                           # train.fail_once_at_step fires once per MLflow run (a fresh store fires again)
                           "failure_marker": str(LOCAL_DIR / "injected_failures" / f"{run_id}.done")},
        # [min, max]: Ray Train's elastic scaling; it reconsiders the size every elastic_resize_interval_s.
        scaling_config=ray.train.ScalingConfig(num_workers=t.num_workers, use_gpu=t.use_gpu,
                                               resources_per_worker=t.worker_resources,
                                               elastic_resize_monitor_interval_s=t.elastic_resize_interval_s),
        run_config=ray.train.RunConfig(
            name=cfg.run.name, storage_path=storage_path(cfg),
            failure_config=ray.train.FailureConfig(max_failures=cfg.run.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
            callbacks=callbacks,
            # Ray Train's routine INFO lines (worker group started, checkpoint saved) stay in its log files.
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
        datasets=build_datasets(cfg, context_length),
        dataset_config=ray.train.DataConfig(
            datasets_to_split=["train"],
            execution_options=ExecutionOptions(preserve_order=cfg.data.deterministic),
            enable_shard_locality=not cfg.data.deterministic,
        ),
    )
    try:
        result = trainer.fit()
    except BaseException:
        finish_run(uri, run_id, "FAILED")
        raise
    metrics = dict(result.metrics or {})
    if metrics.get("eval_error"):
        finish_run(uri, run_id, "FAILED")
        from pipelines.evaluate.tasks import EvaluationError

        raise EvaluationError(f"{metrics['eval_error']} (the trained model is saved: runs:/{run_id}/model, "
                              f"MLflow run {run_id} FAILED)")
    finished = metrics.get("step", 0) >= t.steps
    finish_run(uri, run_id, "FINISHED" if finished else "KILLED")
    checkpoint = result.checkpoint.path if result.checkpoint else None
    version = register_model(uri, run_id, cfg.tracking.register_as) if finished and cfg.tracking.register_as else None
    return FitResult(metrics, uri, run_id, cfg.run.experiment, cfg.run.name, checkpoint, version)
