"""Object storage without a server between: MLflow artifacts written by the client straight to S3 (moto's server,
tests/multinode.py's `s3`), and jobs.adapt's refusal of a local checkpoint folder on a cluster of several nodes.
jobs.embed and jobs.adapt on S3: tests/test_evaluation.py and tests/test_probvlm.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from models import create_model
from models.model_file import load_model, save_model
from models.preprocess import encode_png
from pipelines.tracking import resolve_model, save_mlflow_model, tracked_run
from tests.helpers import BUCKET

ROOT = Path(__file__).resolve().parent.parent


def test_mlflow_artifacts_go_straight_to_s3_and_load_back(s3, tmp_path):
    """An experiment created with its artifact_location on S3 (`mlflow experiments create --artifact-location
    s3://...`) and a sqlite store: the run's config and its MLflow model, logged by the project's own functions, are
    objects on S3 (MLflow's client writes them, reaching the store by MLFLOW_S3_ENDPOINT_URL), and the model comes back
    from runs:/<id>/model with the same weights."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    location = f"s3://{BUCKET}/direct-artifacts"
    experiment = MlflowClient(uri).create_experiment("direct-s3", artifact_location=location)
    torch.manual_seed(0)
    weights = tmp_path / "model.safetensors"  # the name rank 0 saves (pipelines.tracking.model_file)
    save_model(create_model("clip_tiny").state_dict(), weights, "clip_tiny", {})
    image = encode_png(np.zeros((3, 32, 32), np.float32))
    with tracked_run(uri, "direct-s3", "straight-to-s3", resumed=False, params={"train.steps": 1},
                     config_yaml="train:\n  steps: 1\n", tags={"probvlp.kind": "test"}) as run:
        folder = save_mlflow_model(weights, tmp_path / "mlflow_model", image, "a photo of a seven", False)
        run.logger().artifacts(folder, "model")

    info = MlflowClient(uri).get_run(run.run_id).info
    assert info.status == "FINISHED" and info.experiment_id == experiment
    assert info.artifact_uri == f"{location}/{run.run_id}/artifacts"
    s3.invalidate_cache()
    stored = {p.removeprefix(f"{BUCKET}/direct-artifacts/{run.run_id}/artifacts/") for p in s3.find(location)}
    assert {"config.yaml", "model/MLmodel", "model/data/model.safetensors"} <= stored, stored
    assert s3.cat(f"{location}/{run.run_id}/artifacts/model/data/model.safetensors") == weights.read_bytes()
    assert b"loader_module: models.serving" in s3.cat(f"{location}/{run.run_id}/artifacts/model/MLmodel")

    # read back through MLflow's runs:/ URI, from S3 (nothing was written beside the sqlite store)
    assert not (tmp_path / "mlartifacts").exists()
    got = resolve_model(f"runs:/{run.run_id}/model", uri, tmp_path / "back")
    assert got["run_id"] == run.run_id and got["config"] == "train:\n  steps: 1\n"
    original, loaded = load_model(weights).state_dict(), load_model(got["model"]).state_dict()
    assert loaded.keys() == original.keys() and all(torch.equal(loaded[k], original[k]) for k in original)


def test_adapter_checkpoints_on_this_nodes_disk_are_refused_on_a_cluster_of_several_nodes(tmp_path):
    """jobs.adapt, as jobs.pretrain, stops in one line before any worker starts when run.storage_path is a folder on
    the driver's disk and the cluster spans nodes (Ray Train would fail at the first checkpoint); object storage and a
    folder every node mounts (ray.shared_paths) pass, as does any folder on a single node. (Whether a cluster spans
    nodes is `spans_nodes`, run on real clusters by tests/test_autoscaling.py.)"""
    from pipelines.adapt.config import load_adapt_config
    from pipelines.fit import launch
    from pipelines.config import ConfigError

    def adapt_config(*sets: str):
        config = ROOT / "configs" / "probvlm_demo.yaml"
        return load_adapt_config(config, [f"run.storage_path={tmp_path / 'ray'}", *sets]).with_absolute_paths()

    def check_storage(cfg, spans):  # as jobs.adapt checks its storage (pipelines.fit.launch.Launch.start_ray)
        launch.check_storage(cfg, "the adapter's checkpoints", spans)

    with pytest.raises(ConfigError) as err:
        check_storage(adapt_config(), spans=True)
    message = str(err.value)
    assert message.startswith(f"run.storage_path: {tmp_path / 'ray'} is a folder on this node's disk, which the "
                              "cluster's other nodes do not see; Ray Train writes the adapter's checkpoints there")
    assert "--set run.storage_path=s3://" in message and "\n" not in message
    check_storage(adapt_config(f"run.storage_path=s3://{BUCKET}/adapt"), spans=True)
    check_storage(adapt_config(f"ray.shared_paths=[{tmp_path}]"), spans=True)
    check_storage(adapt_config(), spans=False)
