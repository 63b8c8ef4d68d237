"""ray_cluster.yaml passes Ray's own cluster-config validation; a typo does not."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parent.parent


def load() -> dict:
    return yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())


def test_cluster_yaml_validates():
    config = load()
    validate_config(prepare_config(copy.deepcopy(config)))
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
        validate_config(prepare_config(config))
