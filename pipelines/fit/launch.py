"""The driver's side of every stage that trains (pretraining, the adapter), written once: the run's name and absolute
paths, Ray started or joined and checked (a worker fits, the storage every worker reaches), the MLflow run (a new
one, or the earlier one of the same run.name reopened), the TorchTrainer's fit with the workers' stop reason as one
line, and the run's end status (KILLED: stopped before its last step, resumable). A stage's `run_*` says only what is
its own: its inputs, its datasets, its workers' loop, what it does with the fit's result."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Generic, Iterator, TypeVar

import ray.train

from pipelines.cluster.check import check_cluster_holds_a_worker, check_storage_reachable, share_paths
from pipelines.cluster.runtime import init_ray
from pipelines.compat import say_problems
from pipelines.config import JobDocument, RunStopped
from pipelines.storage import run_folder
from pipelines.fit.trainer import PRIVATE, run_exists, torch_trainer
from pipelines.tracking import TrackedRun, tracked_run, tracking_uri

D = TypeVar("D", bound=JobDocument)


def joined_cluster(cfg: JobDocument) -> bool:
    """Whether this driver joins a running cluster (whose autoscaler may add nodes) rather than starting a local Ray."""
    return bool(cfg.ray.address or os.environ.get("RAY_ADDRESS"))


def check_storage(cfg: JobDocument, writes: str, spans: bool | None = None) -> None:
    """Before any worker starts: a ConfigError (one line) when run.storage_path is a folder on this node's disk
    (not in ray.shared_paths) and the cluster spans nodes (`spans`, None: this cluster's): Ray Train writes `writes`
    there from every node."""
    share_paths(cfg.ray.shared_paths)
    check_storage_reachable("run.storage_path", cfg.run.storage_path,
                            f"Ray Train writes {writes} there: set it to object storage, e.g. --set "
                            "run.storage_path=s3://BUCKET/runs (credentials from AWS_* in every node's environment)",
                            spans)


class Launch(Generic[D]):
    """One training job's driver, step by step: `Launch(cfg, "name-prefix")`, `start_ray(...)`, `with
    launch.run(...) as run:`, `launch.fit(...)`, `launch.end(step)`."""

    def __init__(self, cfg: D, name_prefix: str):
        if cfg.run.name is None:
            cfg.run.name = f"{name_prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.cfg: D = cfg.with_absolute_paths()  # what the workers get: they run in other directories
        self.uri = tracking_uri(self.cfg.tracking.uri)
        self.tracked: TrackedRun | None = None

    def start_ray(self, cpus: int, *, writes: str, joined: bool | None = None) -> None:
        """Ray started here with `cpus` (ray.num_cpus wins) or the cluster of ray.address joined (`joined`: its
        autoscaler may add the nodes a worker needs; None: `joined_cluster`), then one-line errors before any worker
        starts: no node holds a worker; run.storage_path a folder the workers on other nodes cannot reach (Ray Train
        writes `writes` there)."""
        cfg = self.cfg
        init_ray(cfg.ray.address, cfg.ray.num_cpus or cpus)
        say_problems("ray_private", "ray")  # a Ray the project was not tested with: which notices go unseen
        joined = joined_cluster(cfg) if joined is None else joined
        check_cluster_holds_a_worker(cfg.train.worker_resources, joined=joined)
        check_storage(cfg, writes)

    @contextmanager
    def run(self, *, params: dict[str, Any], tags: dict[str, str], register_as: str | None = None,
            pending_in: str | None = None) -> Iterator[TrackedRun]:
        """The job's MLflow run (pipelines.tracking.tracked_run): reopened where Ray Train's storage holds this
        run.name already (the fit resumes from its checkpoint; the run's storage says which MLflow run, so a resume
        needs no store), else new. `pending_in`: where rank 0 leaves what it did not deliver (pretraining's outbox)."""
        cfg = self.cfg
        with tracked_run(self.uri, cfg.run.experiment, cfg.run.name, resumed=run_exists(cfg), params=params,
                         config_yaml=cfg.to_yaml(), tags=tags, register_as=register_as,
                         record_in=run_folder(cfg.run.storage_path, cfg.run.name), pending_in=pending_in) as run:
            self.tracked = run
            yield run

    def fit(self, loop: Callable[[dict], None], loop_config: dict[str, Any], datasets: dict[str, Any], *,
            callbacks: list | None = None, dataset_config: ray.train.DataConfig | None = None,
            stopped: Callable[[], str | None] | None = None) -> ray.train.Result:
        """The workers' `loop` on Ray Train, inside `run`: they get `loop_config` with the MLflow run, and the config
        and the store's URI by reference (`pipelines.fit.trainer.private`: Ray Train's run state holds no secret).
        A failed fit the workers stopped on purpose (`stopped()` says why) is that one line (RunStopped), not Ray's
        traceback."""
        run = self.tracked
        config = {PRIVATE: ray.put({"config": self.cfg.to_dict(), "mlflow_uri": self.uri}),
                  "mlflow_run_id": run.run_id, **loop_config}
        trainer = torch_trainer(loop, config, self.cfg, datasets, callbacks, dataset_config)
        try:
            return trainer.fit()
        except Exception:
            reason = stopped() if stopped else None
            if reason:
                raise RunStopped(f"{reason} (MLflow run {run.run_id} FAILED)") from None
            raise

    def end(self, step: int) -> bool:
        """Whether the fit reached train.steps; otherwise (train.stop_at_step, a stop) the run ends KILLED: the same
        command continues it."""
        if step < self.cfg.train.steps:
            self.tracked.end_status = "KILLED"
            return False
        return True
