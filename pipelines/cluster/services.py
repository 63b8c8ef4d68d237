"""The services a cluster's nodes share, on 127.0.0.1: an S3-protocol object store (moto's server) and an `mlflow
server` whose artifacts live on it. `make cluster-up` starts them beside the local cluster; the tests do too.

Clients find them through the standard environment (`s3_env`): `AWS_ENDPOINT_URL` and `AWS_*` credentials (pyarrow's
S3 filesystem behind Ray Train and Ray Data, s3fs, boto3), `MLFLOW_S3_ENDPOINT_URL` (MLflow's S3 artifact store),
`MLFLOW_TRACKING_URI`. Never in a config file, which is logged.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def s3_env(endpoint: str) -> dict[str, str]:
    """The environment that points every S3 client at `endpoint` (moto accepts any credentials)."""
    return {"AWS_ENDPOINT_URL": endpoint, "MLFLOW_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "probvlp-local",
            "AWS_SECRET_ACCESS_KEY": "probvlp-local", "AWS_DEFAULT_REGION": "us-east-1"}


def wait_http(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited ({process.returncode}) before {url} answered")
        try:
            urllib.request.urlopen(url, timeout=5)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer in {timeout_s:.0f} s") from None
            time.sleep(0.5)


def start_s3(port: int, log: Path, buckets: list[str]) -> subprocess.Popen:
    """moto's S3 server on 127.0.0.1:`port` (objects in its memory), with `buckets` created."""
    import boto3

    process = subprocess.Popen([str(BIN / "python"), "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    wait_http(f"{endpoint}/moto-api/", process)
    client = boto3.client("s3", **{"endpoint_url": endpoint, "region_name": "us-east-1",
                                   "aws_access_key_id": "probvlp-local", "aws_secret_access_key": "probvlp-local"})
    for bucket in buckets:
        client.create_bucket(Bucket=bucket)
    return process


def start_mlflow(port: int, folder: Path, artifacts: str, env: dict[str, str]) -> subprocess.Popen:
    """`mlflow server` on 127.0.0.1:`port`: a sqlite store in `folder`, artifacts proxied to `artifacts` (e.g.
    s3://bucket/mlflow, reached with `env`)."""
    folder.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination", artifacts],
        stdout=(folder / "mlflow.log").open("ab"), stderr=subprocess.STDOUT, cwd=folder, start_new_session=True,
        # MLflow's job runner (task-queue processes for its GenAI jobs) has nothing to do here
        env={**os.environ, **env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    wait_http(f"http://127.0.0.1:{port}/health", process)
    return process


def stop(process: subprocess.Popen | int) -> None:
    """End a service started here (or by pid, from a saved state) and its process group."""
    pid = process if isinstance(process, int) else process.pid
    try:
        os.killpg(pid, 15)
    except ProcessLookupError:
        return
    if not isinstance(process, int):
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(pid, 9)
