"""A local autoscaling cluster made from ray_cluster.yaml's node types (pipelines.cluster.local: Ray's fake
multi-node provider, every node a raylet on this machine), its head with 0 CPUs and token auth, all on 127.0.0.1:
a training job scales it up, survives the loss of a worker node's raylet bit-exactly, and the idle nodes go away;
a GPU job says why it waits; a download spreads its parts over the nodes."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from pipelines.cluster.file_server import LoopbackServer
from pipelines.cluster.local import LocalCluster, processes, start
from pipelines.download.plan import bucket_of
from tests.helpers import jpeg, registered, saved, wait_for
from tests.small_runs import REFERENCE, SMALL, assert_identical, load_state

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# The run that conftest's straight_small_run trains uninterrupted (test_scale's bit-exact resume compares with it too).
RUN = [*REFERENCE, "train.log_every=5", "run.max_failures=2"]


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    # 2 CPUs a node: the training's two workers and Ray Data's tasks on few nodes (each node is a raylet and its agents)
    cluster = start(tmp_path_factory.mktemp("local_cluster"), idle_timeout_minutes=0.1, cpus_per_node=2)
    try:
        yield cluster
    finally:
        cluster.stop()


def dashboard(cluster: LocalCluster, path: str) -> dict:
    """GET `path` of the dashboard's HTTP API, with the token (a request, where the `ray` CLI would start a Python)."""
    with urllib.request.urlopen(cluster.api_request(path), timeout=30) as response:
        return json.load(response)


def nodes(cluster: LocalCluster) -> list[dict]:
    """The cluster's nodes from the state API."""
    return dashboard(cluster, "/api/v0/nodes?limit=1000")["data"]["result"]["result"]


def alive_workers(cluster: LocalCluster) -> set[str]:
    return {n["node_id"] for n in nodes(cluster) if n["state"] == "ALIVE" and not n["is_head_node"]}


def train_worker_raylets(cluster: LocalCluster) -> dict[int, str]:
    """raylet pid -> node id, for the nodes whose raylet runs a Ray Train worker (its child process)."""
    ours = set(cluster.pids())
    table = {pid: (ppid, cmd) for pid, ppid, cmd in processes() if pid in ours}
    raylets = {}
    for pid, (ppid, cmd) in table.items():
        if cmd.startswith("ray::RayTrainWorker") and ppid in table and "--node_id=" in table[ppid][1]:
            raylets[ppid] = table[ppid][1].split("--node_id=")[1].split()[0]
    return raylets


def submit(cluster: LocalCluster, args: list[str], log: Path, *options: str) -> subprocess.Popen:
    """`ray job submit`, the CLI streaming the job's log. No --working-dir: the fake nodes share one runtime-env
    folder, and a lost node's cleanup deletes the unpacked working dir under the other nodes' workers; the
    project is installed in the venv every node runs, and every path is absolute."""
    return subprocess.Popen([str(BIN / "ray"), "job", "submit", *options, "--", "python", *args],
                            cwd=ROOT, env=cluster.client_env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def job_args(tmp: Path, digits_root: str, name: str, *extra: str) -> list[str]:
    cfg = [f"data.root={digits_root}", f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"run.storage_path={tmp}/ray",
           f"run.name={name}", "run.experiment=test-autoscaling", *SMALL, *extra]
    return ["-m", "jobs.pretrain", "--config", str(ROOT / "configs" / "demo.yaml"), *(a for kv in cfg for a in ("--set", kv))]


def test_training_scales_up_survives_a_lost_node_and_scales_down(local_cluster, ray_local, straight_small_run,
                                                                  tmp_path):
    """jobs.pretrain submitted to the 0-CPU head: the autoscaler starts worker nodes for Ray Train's workers and
    Ray Data; after the first checkpoint the raylet of a node running a train worker is killed (the node is lost
    with its processes); Ray Train restarts the workers from that checkpoint on a node the autoscaler starts in its
    place, the run finishes with the weights of an uninterrupted run, and the idle nodes go away."""
    cluster, log = local_cluster, tmp_path / "job.log"
    assert alive_workers(cluster) == set()  # the head only: nothing runs on it
    t0 = time.monotonic()
    # the reference run's samples, in its order (the run ends bit for bit on its weights)
    job = submit(cluster, job_args(tmp_path, straight_small_run["data_root"], "lost-node", *RUN), log)
    try:
        wait_for("a worker node", lambda: alive_workers(cluster), timeout_s=300)
        scale_up_s = time.monotonic() - t0
        checkpoints = tmp_path / "ray" / "lost-node"
        target = wait_for("a registered checkpoint, and a train worker's raylet",
                          lambda: registered(checkpoints) and train_worker_raylets(cluster), 300, 0.2)
        before = alive_workers(cluster)
        raylet, lost = next(iter(target.items()))
        os.kill(raylet, signal.SIGKILL)
        killed_at = time.monotonic()
        replacement = wait_for("a replacement node", lambda: alive_workers(cluster) - before, timeout_s=300)
        replaced_s = time.monotonic() - killed_at
        assert job.wait(timeout=600) == 0, log.read_text()[-4000:]
        finished_s = time.monotonic() - killed_at
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out = log.read_text()
    assert "succeeded" in out.lower() and "[train] step 40/40" in out
    assert {n["node_id"]: n["state"] for n in nodes(cluster)}[lost] == "DEAD"
    wait_for("the idle worker nodes to go away", lambda: not alive_workers(cluster), timeout_s=300, every_s=1)
    print(f"scale-up {scale_up_s:.0f}s; replacement node {sorted(replacement)[0][-5:]} {replaced_s:.0f}s after the "
          f"raylet kill, job done {finished_s:.0f}s after it; worker nodes gone {time.monotonic() - killed_at:.0f}s "
          f"after it; {len(nodes(cluster)) - 1} worker nodes started in all")

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("test-autoscaling").experiment_id])[0]
    assert run.info.status == "FINISHED"
    assert int(run.data.tags["probvlp.resumed_from_step"]) % 5 == 0  # the workers restarted from a checkpoint
    # The same run, uninterrupted, on the plain local Ray: the node loss changed nothing, bit for bit.
    final = saved(checkpoints)[-1]
    assert assert_identical(load_state(str(final)), load_state(straight_small_run["checkpoint"])) > 20


def test_a_gpu_job_on_the_cpu_cluster_says_why_it_waits(local_cluster, digits_root, tmp_path):
    """The local node types have no GPU (ray_cluster.yaml's GPUs are dropped here): the driver says at once that
    no node holds a worker, and Ray's autoscaler that no node type can; the job is stopped, not left hanging."""
    cluster, log = local_cluster, tmp_path / "submit.log"
    job_id = f"gpu-{os.getpid()}"
    submitted = submit(cluster, job_args(tmp_path, digits_root, "gpu", "train.use_gpu=true"), log, "--no-wait",
                       f"--submission-id={job_id}")
    assert submitted.wait(timeout=120) == 0, log.read_text()
    env = cluster.client_env()

    def job_log() -> str:  # what `ray job logs` prints, from the Jobs REST API
        return dashboard(cluster, f"/api/jobs/{job_id}/logs")["logs"]

    try:
        text = wait_for("both messages in the job's log", lambda: (lambda t: t if (
            re.search(r"No available node types can fulfill resource request \{[^}]*'GPU': 1\.0", t)
            and "one training worker needs CPU 1, GPU 1" in t) else None)(job_log()), timeout_s=300, every_s=2)
    finally:
        subprocess.run([str(BIN / "ray"), "job", "stop", job_id], env=env, capture_output=True, timeout=120)
    assert "waiting for the autoscaler to add one" in text


def test_download_spreads_its_parts_over_the_nodes(local_cluster, tmp_path):
    """jobs.download submitted to the cluster: its parts run as Ray tasks on the worker nodes the autoscaler starts
    (the URLs are on this machine's loopback, which every fake node shares), and the summary says which did which."""
    site = tmp_path / "site"
    site.mkdir()
    for i in range(16):
        (site / f"{i}.jpg").write_bytes(jpeg(i))
    with LoopbackServer(site, delay_s=2.5) as server:  # slow images: a part outlasts the nodes' start-up skew
        urls = [server.url(f"{i}.jpg") for i in range(16)]
        rows = "".join(f"{url},image {i}\n" for i, url in enumerate(urls))
        (tmp_path / "urls.csv").write_text("url,caption\n" + rows)
        (tmp_path / "download.yaml").write_text(yaml.safe_dump({"run": {"name": "spread"}, "download": {
            "input": str(tmp_path / "urls.csv"), "output": str(tmp_path / "out"), "image_size": 32,
            "rows_per_shard": 4, "threads_per_task": 1, "max_parts_in_flight": 4, "disallowed_header_directives": []}}))
        job = submit(local_cluster, ["-m", "jobs.download", "--config", str(tmp_path / "download.yaml")],
                     tmp_path / "job.log")
        assert job.wait(timeout=600) == 0, (tmp_path / "job.log").read_text()[-4000:]
    summary = json.loads((tmp_path / "out" / "_summary.json").read_text())
    # A part per non-empty hash bucket of the 4 (16 rows / rows_per_shard): the URLs carry the server's port, so
    # now and then a bucket gets none of them and the plan has 3 parts.
    parts = len({bucket_of(url, 4) for url in urls})
    assert summary["written"] == 16 and summary["shards"] == summary["shards_complete"] == parts >= 2
    by_node = summary["parts_by_node"]
    shards = [s for node_shards in by_node.values() for s in node_shards]
    assert len(shards) == len(set(shards)) == parts  # every part once
    head = {n["node_id"] for n in nodes(local_cluster) if n["is_head_node"]}
    assert len(by_node) >= 2 and not head & set(by_node), by_node
    assert "downloaded this run by" in (tmp_path / "job.log").read_text()

