"""ray_cluster.yaml passes Ray's own cluster-config validation; a typo does not."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pipelines.compat.ray_private import node_provider_class, validate_cluster_config
from tests.pace import scaled

ROOT = Path(__file__).resolve().parent.parent


def load() -> dict:
    return yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())


def test_cluster_yaml_validates():
    config = load()
    validate_cluster_config(copy.deepcopy(config))
    nodes = config["available_node_types"]
    assert nodes[config["head_node_type"]]["resources"] == {"CPU": 0}  # no work on the head
    assert nodes["gpu_worker"]["min_workers"] == 0 and nodes["gpu_worker"]["max_workers"] >= 1
    assert nodes["cpu_worker"]["min_workers"] == 0
    import ray

    assert config["docker"]["image"].startswith(f"rayproject/ray:{ray.__version__}-")


@pytest.mark.parametrize("where", ["top", "node"])
def test_unknown_key_is_rejected(where):
    config = load()
    if where == "top":
        config["max_wokers"] = 3
    else:
        config["available_node_types"]["gpu_worker"]["min_worker"] = 1
    with pytest.raises(Exception, match="Additional properties are not allowed"):
        validate_cluster_config(config)


def test_local_cluster_config_is_derived_from_the_cloud_one():
    """pipelines.cluster.local's config (Ray's autoscaler over the node provider that starts each node in its own
    mount namespace) passes Ray's schema, names a provider Ray can load, and keeps the cloud config's worker node
    types by name, min_workers and CPU-side resources, scaled to this machine."""
    from pipelines.cluster.isolated import IsolatedNodeProvider
    from pipelines.cluster.local import local_config

    cloud = load()
    local = local_config(gcs_port=6379, cpus_per_node=2, max_nodes_per_type=3, idle_timeout_minutes=0.2)
    # the schema (prepare_config needs the provider's example file, absent from the wheel)
    validate_cluster_config(local, prepare=False)
    assert local["provider"]["type"] == "external" and local["idle_timeout_minutes"] == 0.2
    assert node_provider_class(local["provider"]) is IsolatedNodeProvider
    for name, node in cloud["available_node_types"].items():
        if name == cloud["head_node_type"]:
            continue
        mine = local["available_node_types"][name]
        assert mine["resources"] == {"CPU": 2}  # the cloud's CPUs scaled down, its GPUs dropped (none here)
        assert mine["min_workers"] == node["min_workers"] and mine["max_workers"] == min(3, node["max_workers"])
    assert cloud["available_node_types"]["gpu_worker"]["resources"]["GPU"] == 8  # what p5.48xlarge has


def test_a_local_node_type_that_cannot_hold_a_worker_is_a_config_error():
    from pipelines.config import ConfigError
    from pipelines.cluster.local import local_config

    with pytest.raises(ConfigError, match=r"^local cluster: node type 'cpu_worker' with 0.5 CPU cannot hold one worker"):
        local_config(gcs_port=6379, cpus_per_node={"cpu_worker": 0.5})


def test_a_worker_node_whose_process_ended_is_no_longer_listed(monkeypatch, tmp_path):
    """A node whose raylet failed to start (its process ended) leaves the provider's list, so the autoscaler starts
    another for the demand, instead of waiting on it as a launch still pending; the live node and the head stay."""
    import subprocess

    from pipelines.cluster.isolated import IsolatedNodeProvider

    monkeypatch.setenv("RAY_FAKE_CLUSTER", "1")
    provider = IsolatedNodeProvider({"gcs_address": "127.0.0.1:1", "log_dir": str(tmp_path)}, "test")
    ended = subprocess.Popen(["true"], start_new_session=True)
    ended.wait()
    live = subprocess.Popen(["sleep", "60"], start_new_session=True)
    head = provider.non_terminated_nodes({})
    provider._nodes["dead"] = {"tags": {}, "process": ended}
    provider._nodes["live"] = {"tags": {}, "process": live}
    try:
        assert provider.non_terminated_nodes({}) == [*head, "live"]
        provider.terminate_node("dead")  # listed to the autoscaler before it ended: no error
        provider.terminate_node("live")
        assert live.wait(timeout=scaled(30)) is not None and provider.non_terminated_nodes({}) == head
    finally:
        live.kill()
