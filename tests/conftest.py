"""Shared fixtures: a local Ray on 127.0.0.1 and throwaway MLflow stores."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the session, on loopback (see pipelines.ray_env)."""
    import ray

    from pipelines.ray_env import init_ray

    os.environ.pop("RAY_ADDRESS", None)
    init_ray(num_cpus=4)
    yield ray
    ray.shutdown()


@pytest.fixture
def mlflow_uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory) -> str:
    from pipelines.digits import write_digit_shards

    root = tmp_path_factory.mktemp("digits")
    write_digit_shards(root, image_size=32, shard_size=500)
    return str(root)


DEMO_STEPS = 600


@pytest.fixture(scope="session")
def trained_clip(ray_local, digits_root, tmp_path_factory):
    """The demo's tiny CLIP trained once per pytest run (2 workers, ZeRO-2): (config, FitResult, folder).
    Several modules read the run (training, MLflow, evaluation) instead of training again."""
    from pipelines.config import load_config
    from pipelines.trainer import fit

    tmp = tmp_path_factory.mktemp("pretrain")
    cfg = load_config(ROOT / "configs" / "demo.yaml", [
        f"data.root={digits_root}", f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"run.storage_path={tmp}/ray",
        f"train.steps={DEMO_STEPS}", "run.name=test_clip", "run.experiment=test-pretrain",
        "tracking.register_as=probvlp-test-clip",
    ])
    return cfg, fit(cfg), tmp


# Capability tests that have not yet passed on an unshared machine: they
# are collected with the `pending` marker and deselected by default (pyproject addopts), so they
# are listed as deselected, not hidden; run them with `pytest -m pending`. A later session that
# sees them pass removes their entry here.
PENDING: tuple[str, ...] = ()  # node-id prefixes; none at the moment


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(PENDING):
            item.add_marker(pytest.mark.pending)
