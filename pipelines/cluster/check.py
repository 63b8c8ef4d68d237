"""Before Ray Train asks for its workers: can any node of this cluster, now or once the autoscaler adds it,
hold one worker? Without this check a job asking for GPUs on a CPU-only cluster waits with no word of why."""
from __future__ import annotations

import os

import fsspec
import ray

from pipelines.compat.ray_private import autoscaler_node_groups
from pipelines.config import ConfigError


def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(key, 0) >= amount for key, amount in need.items() if amount > 0)


def _shape(resources: dict[str, float]) -> str:
    """CPUs, GPUs and custom resources (not memory, nor Ray's per-node markers)."""
    shown = {k: v for k, v in resources.items() if k not in ("memory", "object_store_memory") and ":" not in k}
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items())) or "no CPU"


def autoscaler_node_types() -> dict[str, dict[str, float]] | None:
    """The node types the autoscaler may launch, as Ray's GCS knows them (autoscaler v2 reports them);
    None when no autoscaler reported any."""
    groups = autoscaler_node_groups()
    if not groups:
        return None
    return {group["name"]: group["resources"] for group in groups if group["max_count"] != 0}


def check_cluster_holds_a_worker(need: dict[str, float], joined: bool, log=print) -> None:
    """A ConfigError (one line) when no node can ever hold one worker needing `need`: on the local Ray this
    process started (`joined` False: nothing will be added), or on a cluster whose autoscaler reports node types
    of which none fits. A warning line when no node can now and a joined cluster's autoscaler, whose node types
    Ray does not expose (v1, Ray's default), may add one: then Ray's autoscaler reports an infeasible request
    in the job's log, and Ray Train's start times out every minute, retrying."""
    nodes = {f"node {n['NodeManagerAddress']} {n['NodeID'][:8]}": n["Resources"] for n in ray.nodes() if n["Alive"]}
    if any(_fits(need, have) for have in nodes.values()):
        return
    types = autoscaler_node_types()
    if types and any(_fits(need, have) for have in types.values()):
        return
    worker = f"one training worker needs {_shape(need)}"
    if types is None and joined:
        log(f"warning: {worker} and no node of this cluster has that yet "
            f"({'; '.join(f'{k}: {_shape(v)}' for k, v in nodes.items())}): waiting for the autoscaler to add one; "
            "if its node types cannot (e.g. GPUs asked on a CPU-only cluster) the job waits until stopped "
            "(`ray job stop`)")
        return
    offered = {**nodes, **(types or {})}
    raise ConfigError(f"train: {worker}, which no node{' type' if types else ''} of this cluster offers "
                      f"({'; '.join(f'{k}: {_shape(v)}' for k, v in offered.items())})")


def spans_nodes() -> bool:
    """Whether this job's tasks and workers may run on a node other than the driver's: other nodes are up, the
    driver's node offers no CPU (a head that schedules no work, as ray_cluster.yaml's), or an autoscaler reports
    node types it can add. On such a cluster a node's disk is its own (README, "Running on a cluster";
    docs/SCALING.md section 5: nothing but packages and caches is read from it)."""
    here = ray.get_runtime_context().get_node_id()
    alive = [n for n in ray.nodes() if n["Alive"]]
    if any(n["NodeID"] != here for n in alive):
        return True
    own = next((n["Resources"] for n in alive if n["NodeID"] == here), {})
    return own.get("CPU", 0) == 0 or bool(autoscaler_node_types())


def is_local_path(path: str) -> bool:
    """A path on a disk (no protocol, or file://), as `pipelines.storage.is_local` tells for a filesystem."""
    return fsspec.core.split_protocol(path)[0] in (None, "file", "local")


# Folders every node mounts (the job's ray.shared_paths, `share_paths`): local paths there are every node's.
_SHARED: list[str] = []


def share_paths(paths: list[str]) -> None:
    _SHARED[:] = [os.path.abspath(p) for p in paths]


def node_only(path: str) -> bool:
    """A path on this node's disk alone: local, and outside the folders every node mounts."""
    local = path.removeprefix("file://")
    return is_local_path(path) and not any(local == s or local.startswith(s.rstrip("/") + "/") for s in _SHARED)


def check_storage_reachable(what: str, path: str, fix: str, spans: bool | None = None) -> None:
    """A ConfigError (one line) when `path`, which every node must reach, is on this node's disk alone and the
    cluster spans nodes (`spans`; None: as `spans_nodes` finds the cluster this process joined)."""
    if not node_only(path) or not (spans_nodes() if spans is None else spans):
        return
    raise ConfigError(f"{what}: {path} is a folder on this node's disk, which the cluster's other nodes do not see; "
                      f"{fix} (or list a folder every node mounts in ray.shared_paths)")


# Local data a driver sends through Ray's object store (the bundled digits are ~1 MB); past it, object storage.
SHIP_MAX_MB = 512


def only_here(paths: list[str], size_limit: bool = True) -> bool:
    """Whether files (or folders) on this node's disk must travel through Ray: the cluster spans nodes (another
    node's task would not find them). A ConfigError (one line) when files to send are too many bytes for that."""
    local = [p for p in paths if node_only(p)]
    if not local or not spans_nodes():
        return False
    if not size_limit:
        return True
    size = sum(os.path.getsize(p.removeprefix("file://")) for p in local)
    if size > SHIP_MAX_MB * 2**20:
        raise ConfigError(f"data: {len(local)} files under {os.path.dirname(local[0])} ({size / 2**20:.0f} MB) are on "
                          f"this node's disk, which the cluster's other nodes do not see, and over the {SHIP_MAX_MB} MB "
                          "sent through Ray's object store: put them on object storage (s3://...) or a folder every "
                          "node mounts (ray.shared_paths)")
    return True
