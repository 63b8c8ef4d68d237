"""`jobs.pretrain` on the driver: what is pretraining's own (inputs, datasets, the workers' loop
`pipelines.pretrain.worker`, the final report's errors) on the training stages' launcher (`pipelines.fit.launch`)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray.train
from ray.data import ExecutionOptions

from models.objective import loss_name
from models.registry import tower_config
from pipelines.cluster.check import spans_nodes
from pipelines.cluster.runtime import local_cpus
from pipelines.pretrain.config import TrainConfig, TrainDocument
from pipelines.data.captions import CaptionSampler
from pipelines.data.reader import read_shards, read_split, train_options
from pipelines.evaluate import EvaluationError
from pipelines.inputs import prepare_inputs
from pipelines.data.stats import BadDataError
from pipelines.data.eval_reader import REQUIRES, read_eval_shards
from pipelines.data.worker_reader import WorkerShards
from pipelines.data.eval_tasks import driver_texts, task_paths
from pipelines.storage import outbox_folder
from pipelines.pretrain.data_health import run_stats_name
from pipelines.zero.snapshot_sweep import SnapshotSweep
from pipelines.fit.launch import Launch
from pipelines.data.eval_tasks import eval_dataset_name
from pipelines.result import JobResult
from pipelines.tracking import git_commit


@dataclass(kw_only=True)
class PretrainResult(JobResult):
    experiment: str
    checkpoint_path: str | None  # the run's final DeepSpeed checkpoint (Ray Train's)
    registered_version: str | None = None  # tracking.register_as: the Model Registry version of this run


def build_datasets(cfg: TrainDocument, context_length: int, run_id: str = "") -> dict[str, Any]:
    """The run's datasets: Ray datasets, or (data.reader auto, sets small enough to keep) `WorkerShards` that the
    workers read themselves; their reader counts kept under `run_stats_name(run_id, name)`."""
    size, worker_read = cfg.data.image_size, cfg.data.reader == "auto"
    datasets = {
        "train": read_split(cfg.data.root, "train", size, context_length, stats_name=run_stats_name(run_id, "train"),
                            captions=CaptionSampler(mid=cfg.data.mid_caption_prob, general=cfg.data.general_caption_prob,
                                                    instance=cfg.data.instance_caption_prob),
                            seed=cfg.run.seed if cfg.data.deterministic else None, augment=cfg.data.augment,
                            worker_read=worker_read, **train_options(cfg)),
    }
    for task in cfg.resolved_tasks():
        name = eval_dataset_name(task)
        if task.kind == "loss":
            # the reader's training-style batches (tokens, a caption drawn per sample), seeded: the same every eval
            datasets[name] = read_shards(task_paths(task), size, context_length, seed=0,
                                         stats_name=run_stats_name(run_id, name), stats_sync=True,
                                         worker_read=worker_read, split=False)
        else:
            datasets[name] = read_eval_shards(task_paths(task), size, stats_name=run_stats_name(run_id, name),
                                              require=REQUIRES[task.kind], worker_read=worker_read)
    return datasets


def run_tags(cfg: TrainDocument, extra_tags: dict[str, str] | None) -> dict[str, str]:
    return {"probvlp.run_name": cfg.run.name, "probvlp.model": cfg.model.name, "probvlp.method": loss_name(cfg),
            "mlflow.source.git.commit": git_commit() or "", **(extra_tags or {})}


def without_checkpoints(t: TrainConfig, spans: bool) -> str | None:
    """The one line for a run on a cluster (`spans`: its workers may be on other nodes) that never checkpoints before
    its end: a lost node then loses the whole run. None otherwise."""
    if not spans or t.checkpoint_every or t.checkpoint_every_s or t.last_step <= 1:
        return None
    return ("[checkpoint] warning: this run saves no checkpoint before its end (train.checkpoint_every 0, "
            "train.checkpoint_every_s 0) on a cluster: one lost node loses every step; set train.checkpoint_every_s "
            "(e.g. 600) or train.checkpoint_every")


def run_pretrain(cfg: TrainDocument, callbacks: list | None = None, extra_tags: dict[str, str] | None = None,
                 joined: bool | None = None, started_at: float | None = None,
                 inputs_ready: bool = False) -> PretrainResult:
    """`jobs.pretrain`: train `cfg` on Ray Train. `callbacks` go to the Train run (e.g. Tune's report callback);
    `extra_tags` to a new MLflow run (e.g. mlflow.parentRunId for sweep trials); `joined`: whether the cluster was
    joined, not started here (default: from the config and RAY_ADDRESS); `started_at`: when the job started (time.time;
    default now), from which rank 0 times the start-up to its first step (MLflow `startup_s`); `inputs_ready`: the
    caller ran `prepare_inputs` on this config's inputs (a sweep's driver, once for all its trials)."""
    started_at = time.time() if started_at is None else started_at
    launch = Launch(cfg, cfg.run.experiment)
    cfg, t = launch.cfg, launch.cfg.train
    launch.start_ray(local_cpus(t.max_workers, t.cpus_per_worker), writes="every worker's checkpoints", joined=joined)
    warning = without_checkpoints(t, spans_nodes())
    if warning:
        print(warning, flush=True)
    # what killed uploads left on any node, removed while this driver prepares the job (awaited before the workers)
    sweep = SnapshotSweep(t.checkpoint_snapshot_dir)
    from pipelines.pretrain.worker import train_loop  # deferred until init_ray quietened the logs: it imports DeepSpeed

    if not inputs_ready:
        prepare_inputs(cfg)  # on the Ray just joined (the digits download runs as Ray tasks)
    context_length = tower_config(cfg.model.name, **cfg.model.overrides).context_length  # the workers build the model
    # what rank 0 leaves undelivered: delivered by the next attempt's rank 0, or by this driver at the end
    with launch.run(params=cfg.flat(), tags=run_tags(cfg, extra_tags), register_as=cfg.tracking.register_as,
                    pending_in=outbox_folder(cfg.run.storage_path, cfg.run.name)) as run:
        run.flush_timeout_s = cfg.tracking.flush_timeout_s
        datasets = build_datasets(cfg, context_length, run.run_id)
        worker_read = {k: v for k, v in datasets.items() if isinstance(v, WorkerShards)}
        sweep.wait()
        result = launch.train(
            train_loop,
            {"worker_datasets": worker_read,
             "texts": driver_texts(cfg.resolved_tasks()),  # what rank 0 reads of the eval tasks, from any node
             "job_started_at": started_at},
            {k: v for k, v in datasets.items() if k not in worker_read}, callbacks=callbacks,
            dataset_config=ray.train.DataConfig(datasets_to_split=[] if "train" in worker_read else ["train"],
                                                execution_options=ExecutionOptions(preserve_order=cfg.data.deterministic),
                                                enable_shard_locality=not cfg.data.deterministic))
        metrics = result.metrics
        if metrics.get("data_error"):
            raise BadDataError(f"{metrics['data_error']} (MLflow run {run.run_id} FAILED)")
        if metrics.get("eval_error"):
            raise EvaluationError(f"{metrics['eval_error']} (the trained model is saved: runs:/{run.run_id}/model, "
                                  f"MLflow run {run.run_id} FAILED)")
        launch.end(metrics.get("step", 0))
    return PretrainResult(metrics=metrics, mlflow_uri=launch.uri, mlflow_run_id=run.run_id, run_name=cfg.run.name,
                          experiment=cfg.run.experiment, checkpoint_path=result.checkpoint.path if result.checkpoint else None,
                          registered_version=run.registered_version)
