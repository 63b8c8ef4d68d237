"""The Ray Train side every training job shares (pretraining, the adapter): its storage and its TorchTrainer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow.fs
import ray.train
from ray.train.torch import TorchTrainer

from pipelines.compat.ray_private import without_idle_dataset_manager
from pipelines.config import JobDocument


# The loop config's key of what its workers alone may see: the config and the store's URI, which may carry credentials,
# passed by reference (an object in Ray's store), since Ray Train keeps the loop config in its run state (the
# dashboard, the state API, export events).
PRIVATE = "private"


@dataclass(frozen=True)
class FromDriver:
    """What every stage's workers get from its driver (pipelines.fit.launch.Launch.train), in Ray Train's loop config
    (`loop_config`: a plain dict at the Ray boundary; `read` on the workers' side): the job's config and the store's
    URI (by reference, never in Ray Train's state), the MLflow run, the command's job id (the attempts' journal tells
    its restarts from a later command's), the marker of train.fail_once_at_step (once per MLflow run), and the
    stage's own inputs (`stage`)."""

    config: dict[str, Any] = field(repr=False)  # may hold credentials, as the URI may: never printed
    mlflow_uri: str = field(repr=False)
    mlflow_run_id: str = ""
    job: str = ""
    failure_marker: str = ""
    stage: dict[str, Any] = field(default_factory=dict)

    def loop_config(self) -> dict[str, Any]:
        import ray

        secret = ray.put({"config": self.config, "mlflow_uri": self.mlflow_uri})
        return {PRIVATE: secret, "mlflow_run_id": self.mlflow_run_id, "job": self.job,
                "failure_marker": self.failure_marker, "stage": self.stage}

    @classmethod
    def read(cls, loop_config: dict[str, Any]) -> "FromDriver":
        import ray

        secret = ray.get(loop_config[PRIVATE])
        return cls(secret["config"], secret["mlflow_uri"], loop_config["mlflow_run_id"], loop_config["job"],
                   loop_config["failure_marker"], loop_config["stage"])


def run_exists(cfg: JobDocument) -> bool:
    """Whether Ray Train storage already holds this run name (then the trainer resumes from its checkpoint)."""
    fs, base = pyarrow.fs.FileSystem.from_uri(cfg.run.storage_path)
    return fs.get_file_info(f"{base.rstrip('/')}/{cfg.run.name}").type != pyarrow.fs.FileType.NotFound


def torch_trainer(loop: Callable[[dict], None], loop_config: dict[str, Any], cfg: JobDocument,
                  datasets: dict[str, Any], callbacks: list | None = None,
                  dataset_config: ray.train.DataConfig | None = None) -> TorchTrainer:
    """A TorchTrainer for `cfg` (absolute paths): workers and resources from cfg.train, name, storage, failures
    and checkpoints from cfg.run."""
    t = cfg.train
    scaling = {"num_workers": t.num_workers, "use_gpu": t.use_gpu, "resources_per_worker": t.worker_resources}
    if getattr(t, "elastic_resize_interval_s", None) is not None:
        # [min, max] workers: Ray Train's elastic scaling reconsiders the size every this many seconds
        scaling["elastic_resize_monitor_interval_s"] = t.elastic_resize_interval_s
    return without_idle_dataset_manager(TorchTrainer)(
        loop,
        train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(**scaling),
        run_config=ray.train.RunConfig(
            name=cfg.run.name, storage_path=cfg.run.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=cfg.run.max_failures,
                                                   max_preemption_failures=cfg.run.max_preemptions),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
            callbacks=callbacks,
            # Ray Train's routine INFO lines (worker group started, checkpoint saved) stay in its log files.
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
        datasets=datasets,
        **({"dataset_config": dataset_config} if dataset_config is not None else {}),
    )
