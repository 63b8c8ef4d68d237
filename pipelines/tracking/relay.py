"""A local MLflow store written from any node: rank 0's MLflow calls go through a Ray actor on the driver's node.

The embedded default store (sqlite under the project folder) and its artifact folder live on the driver's disk. On
a cluster whose nodes share no disk, rank 0 runs on another node, where that path holds nothing (MLflow would open a
new, empty store there: "Run ... not found"). The relay is an actor pinned to the driver's node that owns the
store's client; rank 0 calls it with the same few calls it makes on `MlflowClient` (`RelayClient`), artifacts sent as
bytes. Used for a local store whenever the job may run on other nodes (`pipelines.cluster.check.spans_nodes`: other
nodes up, a head without CPUs, or an autoscaler that can add nodes); on one machine the workers open the store
themselves, and a tracking server (`MLFLOW_TRACKING_URI=http://...`) is called directly.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import ray
from mlflow import MlflowClient
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

NAMESPACE = "probvlp"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class TrackingRelay:
    """The driver node's MlflowClient, for workers on any node."""

    def __init__(self, uri: str):
        self.client = MlflowClient(uri)

    def call(self, method: str, *args, **kwargs):
        return getattr(self.client, method)(*args, **kwargs)

    def put_files(self, run_id: str, files: dict[str, bytes], artifact_path: str | None) -> None:
        """Write `files` (relative path -> bytes) under a temporary folder and log it as the run's artifacts."""
        with tempfile.TemporaryDirectory() as tmp:
            for name, data in files.items():
                target = Path(tmp) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            self.client.log_artifacts(run_id, tmp, artifact_path)


def start_relay(uri: str, run_id: str):
    """The relay of run `run_id`'s store, on this (the driver's) node; its name, for `RelayClient`, is the run id's."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = TrackingRelay.options(name=relay_name(run_id), namespace=NAMESPACE, get_if_exists=True,
                                  scheduling_strategy=here).remote(uri)
    ray.get(actor.call.remote("get_run", run_id))  # up, and the store opens: fail here, not in a worker
    return actor


def relay_name(run_id: str) -> str:
    return f"probvlp_tracking_{run_id}"


class RelayClient:
    """The `MlflowClient` calls `pipelines.tracking.StepLogger` makes, through the run's relay (waited for: the
    caller sees the store's errors, and calls keep their order)."""

    def __init__(self, run_id: str):
        self.actor = ray.get_actor(relay_name(run_id), namespace=NAMESPACE)

    def _call(self, method: str, *args, **kwargs):
        return ray.get(self.actor.call.remote(method, *args, **kwargs))

    def log_batch(self, run_id, metrics=(), params=(), tags=()) -> None:
        self._call("log_batch", run_id, metrics=list(metrics), params=list(params), tags=list(tags))

    def set_tag(self, run_id, key, value) -> None:
        self._call("set_tag", run_id, key, value)

    def get_run(self, run_id):
        return self._call("get_run", run_id)

    def log_artifact(self, run_id, local_path, artifact_path=None) -> None:
        path = Path(local_path)
        ray.get(self.actor.put_files.remote(run_id, {path.name: path.read_bytes()}, artifact_path))

    def log_artifacts(self, run_id, local_dir, artifact_path=None) -> None:
        root = Path(local_dir)
        files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        ray.get(self.actor.put_files.remote(run_id, files, artifact_path))
