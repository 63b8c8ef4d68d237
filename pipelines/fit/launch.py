"""The driver's side of every stage that trains (pretraining, the adapter), written once: the run's name and absolute
paths, Ray started or joined and checked (a worker fits, the storage every worker reaches), the MLflow run (a new
one, or the earlier one of the same run.name reopened), the TorchTrainer's fit with the workers' stop reason as one
line, and the run's end status (KILLED: stopped before its last step, resumable). A stage's `run_*` says only what is
its own: its inputs, its datasets, its workers' loop, what it does with the fit's result."""
from __future__ import annotations

import os
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

import ray.train

from pipelines.cluster.check import check_cluster_holds_a_worker, check_storage_reachable, share_paths
from pipelines.cluster.runtime import init_ray
from pipelines.compat import say_problems
from pipelines.config import STATE_DIR, JobDocument, RunStopped
from pipelines.storage import run_folder
from pipelines.fit.attempts import final_report, stop_reason
from pipelines.fit.trainer import FromDriver, run_exists, torch_trainer
from pipelines.tracking import TrackedRun, tracked_run, tracking_uri

D = TypeVar("D", bound=JobDocument)


def joined_cluster(cfg: JobDocument) -> bool:
    """Whether this driver joins a running cluster (whose autoscaler may add nodes) rather than starting a local Ray."""
    return bool(cfg.ray.address or os.environ.get("RAY_ADDRESS"))


def start_ray(cfg: JobDocument, cpus: int, joined: bool | None = None) -> bool:
    """Ray started here with `cpus` (ray.num_cpus wins) or the cluster of ray.address joined (`joined`: its
    autoscaler may add the nodes a worker needs; None: `joined_cluster`), what an untested Ray's private names break
    said, and a one-line error where no node holds a worker (cfg.train.worker_resources). Returns `joined`."""
    init_ray(cfg.ray.address, cfg.ray.num_cpus or cpus)
    say_problems("ray_private", "ray")  # a Ray the project was not tested with: which notices go unseen
    joined = joined_cluster(cfg) if joined is None else joined
    check_cluster_holds_a_worker(cfg.train.worker_resources, joined=joined)
    return joined


def check_reachable(cfg: JobDocument, what: str, path: str, fix: str, spans: bool | None = None) -> None:
    """A ConfigError (one line, ending in `fix`) when `path` (config key `what`), which every node must reach, is a
    folder on this node's disk (not in ray.shared_paths) and the cluster spans nodes (`spans`, None: this
    cluster's)."""
    share_paths(cfg.ray.shared_paths)
    check_storage_reachable(what, path, fix, spans)


def check_storage(cfg: JobDocument, writes: str, spans: bool | None = None) -> None:
    """Before any worker starts: `check_reachable` of run.storage_path, where Ray Train writes `writes` from every
    node."""
    check_reachable(cfg, "run.storage_path", cfg.run.storage_path,
                    f"Ray Train writes {writes} there: set it to object storage, e.g. --set "
                    "run.storage_path=s3://BUCKET/runs (credentials from AWS_* in every node's environment)", spans)


@dataclass
class Fitted:
    """What a stage's workers returned to its driver: the metrics of their last report (Ray Train's result), joined
    by the final report rank 0 wrote for this command after its final checkpoint (pipelines.fit.attempts), and the
    last checkpoint Ray Train registered."""

    metrics: dict[str, Any]
    checkpoint: ray.train.Checkpoint | None


class Launch(Generic[D]):
    """One training job's driver, step by step: `Launch(cfg, "name-prefix")`, `start_ray(...)`, `with
    launch.run(...) as run:`, `launch.train(...)`, `launch.end(step)`."""

    def __init__(self, cfg: D, name_prefix: str):
        if cfg.run.name is None:
            cfg.run.name = f"{name_prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.cfg: D = cfg.with_absolute_paths()  # what the workers get: they run in other directories
        self.uri = tracking_uri(self.cfg.tracking.uri)
        self.tracked: TrackedRun | None = None
        self.job = uuid.uuid4().hex  # tells a restart within this command from a later command on the same run

    def start_ray(self, cpus: int, *, writes: str, joined: bool | None = None) -> None:
        """Ray started here with `cpus` (ray.num_cpus wins) or the cluster of ray.address joined (`joined`: its
        autoscaler may add the nodes a worker needs; None: `joined_cluster`), then one-line errors before any worker
        starts: no node holds a worker; run.storage_path a folder the workers on other nodes cannot reach (Ray Train
        writes `writes` there)."""
        start_ray(self.cfg, cpus, joined)
        check_storage(self.cfg, writes)

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

    def train(self, loop: Callable[[dict], None], stage: dict[str, Any], datasets: dict[str, Any], *,
            callbacks: list | None = None, dataset_config: ray.train.DataConfig | None = None) -> Fitted:
        """The workers' `loop` on Ray Train, inside `run`: they get what every stage's workers get
        (pipelines.fit.trainer.FromDriver: the config and the store's URI by reference, the MLflow run, this command's
        job, the marker of train.fail_once_at_step) and the stage's own inputs (`stage`). A failed fit the workers
        stopped on purpose (NoticeLoop: pipelines.fit.notices) is their one line (RunStopped), not Ray's
        traceback."""
        run, cfg = self.tracked, self.cfg
        sent = FromDriver(cfg.to_dict(), self.uri, run.run_id, self.job,
                          # train.fail_once_at_step fires once per MLflow run (a fresh store fires again)
                          str(STATE_DIR / "injected_failures" / f"{run.run_id}.done"), stage)
        trainer = torch_trainer(loop, sent.loop_config(), cfg, datasets, callbacks, dataset_config)
        folder = run_folder(cfg.run.storage_path, cfg.run.name)
        try:
            result = trainer.fit()
        except Exception:
            reason = stop_reason(folder, self.job, "NoticeLoop")
            if reason:
                raise RunStopped(f"{reason} (MLflow run {run.run_id} FAILED)") from None
            raise
        return Fitted({**(result.metrics or {}), **final_report(folder, self.job)}, result.checkpoint)

    def end(self, step: int) -> bool:
        """Whether the fit reached train.steps; otherwise (train.stop_at_step, a stop) the run ends KILLED: the same
        command continues it."""
        if step < self.cfg.train.steps:
            self.tracked.end_status = "KILLED"
            return False
        return True
