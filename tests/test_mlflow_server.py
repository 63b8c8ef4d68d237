"""Pretraining logs to a real `mlflow server` (sqlite backend) on 127.0.0.1, and everything reads back."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts

from models.checkpoint import load_model
from pipelines.config import load_config
from pipelines.trainer import fit
from pipelines.tracking import model_file
from tests.test_job_submit import free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    log = (tmp_path / "mlflow.log").open("w")
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server_artifacts")],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_run_reaches_mlflow_server(ray_local, digits_root, mlflow_server, tmp_path):
    cfg = load_config(ROOT / "configs" / "demo.yaml", [
        f"data.root={digits_root}", f"tracking.uri={mlflow_server}", f"run.storage_path={tmp_path}/ray",
        "run.name=served", "run.experiment=server", "train.steps=20", "model.overrides.vision_depth=1",
    ])
    result = fit(cfg)
    client = MlflowClient(mlflow_server)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "20" and run.data.params["tracking.uri"] == mlflow_server
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [10, 20]
    assert "digits_zeroshot/top1" in run.data.metrics
    # The artifact went through the server (proxied artifact store), not a shared local path.
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    folder = Path(download_artifacts(run_id=run.info.run_id, artifact_path="model", dst_path=str(tmp_path / "dl"),
                                     tracking_uri=mlflow_server))
    assert load_model(model_file(Path(folder))).context_length == 16
    assert (tmp_path / "server_artifacts").exists()
