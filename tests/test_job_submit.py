"""`ray job submit` against a real local head with token auth, the job logging to a real `mlflow server`
(sqlite backend, proxied artifacts); everything on 127.0.0.1."""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts

from models.model_file import load_model
from pipelines.tracking import model_file
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError as err:
            if getattr(err, "code", None):  # an HTTP error status: the server answers
                return
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head (GCS, dashboard, jobs API) on loopback with token auth; torn down after the test."""
    # Every port explicit: other Ray instances on this machine hold the fixed defaults (e.g. the agent's 52365).
    gcs, dash, agent = free_port(), free_port(), free_port()
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    env.pop("RAY_ADDRESS", None)
    temp = Path("/tmp") / f"rayjob_{secrets.token_hex(3)}"  # short: Ray's socket paths must fit
    tmp_path = tmp_path_factory.mktemp("ray_head")
    log = (tmp_path / "head.log").open("w")
    # --block ties the cluster's life to this process, so stopping it cannot touch other Ray instances.
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}",
         "--num-cpus=4", f"--temp-dir={temp}",
         "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
        start_new_session=True,  # its own process group: the teardown reaches every process of this head
    )
    try:
        wait_http(f"http://127.0.0.1:{dash}/api/version", head)
        yield f"http://127.0.0.1:{dash}", env, temp
    finally:
        head.terminate()  # `ray start --block` stops its processes on SIGTERM...
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        # ...but after a job it waits ~30 s for the job's workers to exit: a test has no use for that.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    log = (tmp_path / "mlflow.log").open("w")
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server_artifacts")],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
        # MLflow's job runner (seven task-queue processes, for its GenAI jobs) has nothing to do here.
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=120)
        yield f"http://127.0.0.1:{port}", tmp_path
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_job_submit_runs_pretrain_and_logs_to_mlflow_server(ray_head, mlflow_server, tmp_path):
    """The demo's job as a user submits it: the console shows progress lines and the run summary, not Ray
    Data's per-epoch execution lines nor Ray Train's per-report lines; every result reaches the MLflow server."""
    address, env, ray_temp = ray_head
    uri, server_dir = mlflow_server
    # Without --no-wait the CLI streams the job's logs and exits 1 if the job fails: one process, no polling.
    args = [str(BIN / "ray"), "job", "submit", f"--address={address}", "--working-dir", ".", "--",
            "python", "-m", "jobs.pretrain", "--config", "configs/demo.yaml",
            "--set", "train.steps=20", "--set", "train.log_every=5", "--set", "run.name=submitted",
            "--set", "run.experiment=jobs",
            "--set", f"tracking.uri={uri}", "--set", f"run.storage_path={tmp_path / 'ray'}",
            # data.root stays the demo's relative default: written in the job's working directory, read by
            # Ray workers that run elsewhere (fit hands them absolute paths)
            "--set", "model.overrides.vision_depth=1"]
    deadline = time.monotonic() + 120
    while True:  # the head's job agent comes up a little after the dashboard answers
        out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if out.returncode == 0 or "No available agent" not in out.stderr or time.monotonic() > deadline:
            break
        time.sleep(3)
    logs = out.stdout
    assert out.returncode == 0, (logs + out.stderr)[-3000:]
    assert "succeeded" in logs.lower()
    progress = [line for line in logs.splitlines() if "[train] step " in line]
    assert [line.split("[train] step ")[1].split(" ")[0] for line in progress] == ["5/20", "10/20", "15/20", "20/20"]
    assert all(" | loss " in line and "samples/s" in line and " | ETA " in line for line in progress)
    assert "Starting execution of Dataset" not in logs
    ray_data_logs = "".join(p.read_text() for p in ray_temp.glob("session_*/logs/ray-data/*.log"))
    assert "Starting execution of Dataset" in ray_data_logs  # kept in Ray's log files
    assert "Reporting training result" not in logs
    assert "digits_zeroshot: top1" in logs  # the per-task headline jobs.pretrain prints
    assert "sample predictions: 4 held-out images of eval task 'digits_zeroshot'" in logs
    assert "model: runs:/" in logs

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("jobs").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "submitted" and runs[0].info.status == "FINISHED"
    run = runs[0]
    assert run.data.tags["probvlp.master_addr"] == "127.0.0.1"
    assert run.data.params["train.steps"] == "20" and run.data.params["tracking.uri"] == uri
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [5, 10, 15, 20]
    assert "digits_zeroshot/top1" in run.data.metrics
    # The artifacts went through the server (proxied artifact store), not a shared local path.
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    folder = Path(download_artifacts(run_id=run.info.run_id, artifact_path="model", dst_path=str(tmp_path / "dl"),
                                     tracking_uri=uri))
    assert load_model(model_file(folder)).context_length == 16
    assert (server_dir / "server_artifacts").exists()


def test_jobs_api_refuses_requests_without_the_token(ray_head):
    address, env, _ = ray_head
    env = {k: v for k, v in env.items() if k not in ("RAY_AUTH_TOKEN",)}
    env["HOME"] = "/nonexistent"  # no ~/.ray/auth_token either
    out = subprocess.run([str(BIN / "ray"), "job", "list", f"--address={address}"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "auth" in (out.stdout + out.stderr).lower()
