"""Before Ray Train asks for its workers: can any node of this cluster, now or once the autoscaler adds it,
hold one worker? Without this check a job asking for GPUs on a CPU-only cluster waits with no word of why."""
from __future__ import annotations

import ray
import ray._private.state

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
    config = ray._private.state.state.get_cluster_config()
    if not config or not config.node_group_configs:
        return None
    return {group.name: dict(group.resources) for group in config.node_group_configs if group.max_count != 0}


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
