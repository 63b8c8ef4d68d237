"""A local autoscaling cluster made from ray_cluster.yaml's node types (pipelines.cluster.local: Ray's autoscaler, every
worker node a raylet on this machine in a mount namespace of its own, so the nodes share no disk), its head with 0
CPUs and token auth, all on 127.0.0.1, with what its nodes share: an S3-protocol store (moto) and an `mlflow server`
with its artifacts there (pipelines.cluster.services; the fixtures and helpers in tests/multinode.py). Used through
`ray job submit`: a node sees no file of the head or of another node; the demo travels with `--working-dir` (its
bundled digits sent through Ray, its sqlite store reached through the driver); a download writes its shards to S3 from
the nodes; a training job from S3 with its checkpoints on S3 and its results on the server scales the cluster up,
survives the loss of a worker node bit-exactly, its model is evaluated on the cluster and loaded from the server, and
the idle nodes go away; a two-trial sweep keeps its state on S3; a GPU job says why it waits; the jobs API refuses a
client without the token."""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts

from models.model_file import load_model
from pipelines.cluster.file_server import LoopbackServer
from pipelines.config import STATE_DIR
from pipelines.download.plan import bucket_of
from pipelines.tracking import model_file
from tests.helpers import BUCKET, jpeg, registered, tracebacks, wait_for
from tests.multinode import BIN, alive_workers, dashboard, nodes, submit, train_worker_raylets
from tests.small_runs import REFERENCE, SMALL, assert_identical, load_state
from tests.pace import scaled

# `make test-cluster`: nodes that share no disk, beside the tier's other modules only (never `make test`'s Ray work)
pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parent.parent
# The run that conftest's straight_small_run trains uninterrupted (test_scale's bit-exact resume compares with it too).
RUN = [*REFERENCE, "train.log_every=5", "run.max_failures=2"]


def job_args(tmp: Path, digits_root: str, name: str, *extra: str, tracking: str | None = None) -> list[str]:
    tracking = tracking or f"sqlite:///{tmp}/mlflow.db"
    cfg = [f"data.root={digits_root}", f"tracking.uri={tracking}", f"run.storage_path=s3://{BUCKET}/ray",
           f"run.name={name}", "run.experiment=test-autoscaling", *SMALL, *extra]
    return ["-m", "jobs.pretrain", "--config", str(ROOT / "configs" / "demo.yaml"),
            *(a for kv in cfg for a in ("--set", kv))]


def ray_data_logs(cluster) -> str:
    return "".join(p.read_text() for p in Path(cluster.temp_dir).glob("session_*/logs/ray-data/*.log"))


def test_training_scales_up_survives_a_lost_node_and_scales_down(local_cluster, mlflow_server, s3, digits_on_s3,
                                                                  digits_root, straight_small_run, tmp_path):
    """jobs.pretrain submitted to the 0-CPU head, logging to an `mlflow server`: the autoscaler starts worker nodes
    for Ray Train's workers; after the first checkpoint the raylet of a node running a train worker is
    killed (the node is lost with its processes); Ray Train restarts the workers from that checkpoint on a node the
    autoscaler starts in its place, the run finishes with the weights of an uninterrupted run, and the idle nodes
    go away. The console shows progress lines and the run summary, not Ray Train's per-report lines nor (the evaluation
    after it, whose batch inference is Ray Data's) Ray Data's execution lines; every result, the model too, reaches the
    MLflow server."""
    cluster, log = local_cluster, tmp_path / "job.log"
    uri, server_dir = mlflow_server
    # the files on S3 are the reference's, so that the run can end on its weights (one pytest process: `make test-cluster`)
    assert straight_small_run["data_root"] == digits_root
    assert alive_workers(cluster) == set()  # the head only: nothing runs on it
    t0 = time.monotonic()
    job = submit(cluster, job_args(tmp_path, digits_on_s3, "lost-node", *RUN, "data.source=shards", tracking=uri), log)
    try:
        wait_for("a worker node", lambda: job.poll() is None and alive_workers(cluster), timeout_s=300)
        scale_up_s = time.monotonic() - t0
        checkpoints = f"{BUCKET}/ray/lost-node"  # on S3: no node could reach a folder on another's disk
        target = wait_for("a registered checkpoint, and a train worker's raylet",
                          lambda: registered(checkpoints, s3) and train_worker_raylets(cluster), 300, 0.2)
        before = alive_workers(cluster)
        raylet, lost = next(iter(target.items()))
        os.kill(raylet, signal.SIGKILL)
        killed_at = time.monotonic()
        replacement = wait_for("a replacement node", lambda: alive_workers(cluster) - before, timeout_s=300)
        replaced_s = time.monotonic() - killed_at
        assert job.wait(timeout=scaled(600)) == 0, log.read_text()[-4000:]
        finished_s = time.monotonic() - killed_at
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out = log.read_text()
    assert "succeeded" in out.lower() and "[train] step 40/40" in out
    progress = [line for line in out.splitlines() if "[train] step " in line]
    assert all(" | loss " in line and "samples/s" in line and " | ETA " in line for line in progress)
    assert "Starting execution of Dataset" not in out and "Reporting training result" not in out
    # the training workers read the small set themselves (pipelines.data.worker_reader): from S3 too, no Ray Data execution
    assert "Starting execution of Dataset" not in ray_data_logs(cluster)
    assert "digits_zeroshot: top1" in out  # the per-task headline jobs.pretrain prints
    assert "sample predictions: 4 held-out images of eval task 'digits_zeroshot'" in out
    assert "model: runs:/" in out
    assert {n["node_id"]: n["state"] for n in nodes(cluster)}[lost] == "DEAD"
    print(f"scale-up {scale_up_s:.0f}s; replacement node {sorted(replacement)[0][-5:]} {replaced_s:.0f}s after the "
          f"raylet kill, job done {finished_s:.0f}s after it")

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("test-autoscaling").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "lost-node" and runs[0].info.status == "FINISHED"
    run = runs[0]
    # The recipe's next step at once, on the nodes still up: jobs.evaluate of the run's model on the eval sets on S3,
    # its embedding actors on the worker nodes.
    model = f"runs:/{run.info.run_id}/model"
    evaluated = submit(cluster, ["-m", "jobs.evaluate", "--config", str(ROOT / "configs" / "demo.yaml"), "--model",
                                 model, "--set", "data.source=shards", "--set", f"data.root={digits_on_s3}",
                                 "--set", f"tracking.uri={uri}",
                                 "--set", "run.experiment=test-autoscaling-eval"], tmp_path / "evaluate.log")
    assert int(run.data.tags["probvlp.resumed_from_step"]) % 5 == 0  # the workers restarted from a checkpoint
    assert run.data.tags["probvlp.master_addr"] == "127.0.0.1"
    assert run.data.params["train.steps"] == "40" and run.data.params["tracking.uri"] == uri
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(5, 41, 5))
    assert "digits_zeroshot/top1" in run.data.metrics
    # The artifacts went through the server (proxied artifact store), not a shared local path.
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    folder = Path(download_artifacts(run_id=run.info.run_id, artifact_path="model", dst_path=str(tmp_path / "dl"),
                                     tracking_uri=uri))
    assert load_model(model_file(folder)).context_length == 16
    assert s3.ls(f"{BUCKET}/mlflow")  # the server stored them on S3
    assert not (server_dir / "mlartifacts").exists() and not (server_dir / "mlruns").exists()
    # The same run, uninterrupted, on the plain local Ray: the node loss changed nothing, bit for bit.
    s3.invalidate_cache()
    final = sorted(e["name"] for e in s3.ls(checkpoints, detail=True)
                   if e["type"] == "directory" and e["name"].rsplit("/", 1)[-1].startswith("checkpoint_"))[-1]
    s3.get(final, str(tmp_path / "final"), recursive=True)
    assert assert_identical(load_state(str(tmp_path / "final")), load_state(straight_small_run["checkpoint"])) > 20

    # The recipe's last steps: the evaluation's results, and the model loaded from MLflow in a fresh Python.
    assert evaluated.wait(timeout=scaled(600)) == 0, (tmp_path / "evaluate.log").read_text()[-4000:]
    # its batch inference is Ray Data's: the execution lines stay out of the console, kept in Ray's log files
    assert "Starting execution of Dataset" not in (tmp_path / "evaluate.log").read_text()
    assert "Starting execution of Dataset" in ray_data_logs(cluster)
    evals = client.search_runs([client.get_experiment_by_name("test-autoscaling-eval").experiment_id])
    assert evals[0].data.tags["probvlp.source_run"] == run.info.run_id
    assert evals[0].data.metrics["digits_zeroshot/top1"] == pytest.approx(run.data.metrics["digits_zeroshot/top1"], abs=0.02)
    fresh = subprocess.run([sys.executable, "-c", "import mlflow, pandas as pd, sys; "
                            "m = mlflow.pyfunc.load_model(sys.argv[1]); "
                            "print('MU', len(m.predict(pd.DataFrame({'caption': ['the digit seven']}))['text_mu'][0]))",
                            model], env={**os.environ, "MLFLOW_TRACKING_URI": uri}, capture_output=True, text=True,
                           timeout=scaled(300), cwd=tmp_path)
    assert fresh.returncode == 0 and "MU " in fresh.stdout, fresh.stderr[-3000:]
    wait_for("the idle worker nodes to go away", lambda: not alive_workers(cluster), timeout_s=300, every_s=1)
    print(f"worker nodes gone {time.monotonic() - killed_at:.0f}s after the kill; {len(nodes(cluster)) - 1} worker "
          f"nodes started in all")


def test_a_two_trial_sweep_keeps_its_storage_on_s3(local_cluster, mlflow_server, s3, digits_on_s3,
                                                  one_sweep_at_a_time, tmp_path):
    """jobs.tune submitted to the cluster: two trials at once, each a Ray Train run on a worker node, reading the
    digit shards from S3; Tune's experiment state and every trial's checkpoints on S3, every trial a child run of
    the sweep's parent run on the MLflow server."""
    uri, _ = mlflow_server
    storage = f"{BUCKET}/tune"
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "base": str(ROOT / "configs" / "demo.yaml"),
        "overrides": ["data.source=shards", f"data.root={digits_on_s3}", f"tracking.uri={uri}",
                      "run.experiment=test-autoscaling-trials", *SMALL, "train.steps=10", "train.eval_every=5",
                      "train.checkpoint_every=5", "train.num_workers=1"],
        "space": {"train.lr": {"choice": [1.0e-3, 3.0e-3]}},
        "tune": {"name": "on-s3", "num_samples": 2, "max_concurrent": 2, "search_alg": "random", "scheduler": "fifo",
                 "storage_path": f"s3://{storage}", "experiment": "test-autoscaling-sweeps",
                 "metric": "digits_zeroshot/top1", "mode": "max"}}))
    job = submit(local_cluster, ["-m", "jobs.tune", "--config", str(sweep)], tmp_path / "tune.log")
    assert job.wait(timeout=scaled(900)) == 0, (tmp_path / "tune.log").read_text()[-4000:]
    out = (tmp_path / "tune.log").read_text()
    assert "[sweep] trial 2/2 (100%)" in out and not tracebacks(out), out[-3000:]
    s3.invalidate_cache()
    assert s3.ls(f"{storage}/on-s3")  # Tune's experiment state
    assert len({p.split("/")[-2] for p in s3.glob(f"{storage}/on-s3_train/*/checkpoint_*/")}) == 2  # each trial's run
    client = MlflowClient(uri)
    parent = client.search_runs([client.get_experiment_by_name("test-autoscaling-sweeps").experiment_id])[0]
    trials = client.search_runs([client.get_experiment_by_name("test-autoscaling-trials").experiment_id])
    assert len(trials) == 2 and {r.data.tags["mlflow.parentRunId"] for r in trials} == {parent.info.run_id}
    assert all(r.info.status == "FINISHED" and "digits_zeroshot/top1" in r.data.metrics for r in trials)


@pytest.fixture(scope="module")
def gpu_job(local_cluster, digits_root, tmp_path_factory):
    """A training job that asks for a GPU, submitted with --no-wait (the local node types have none): it waits
    beside the other jobs of the module until the test reading its log stops it. (job id, its log's reader)."""
    tmp = tmp_path_factory.mktemp("gpu_job")
    job_id = f"gpu-{os.getpid()}"
    log = tmp / "submit.log"
    submitted = submit(local_cluster, job_args(tmp, digits_root, "gpu", "train.use_gpu=true"), log, "--no-wait",
                       f"--submission-id={job_id}")
    assert submitted.wait(timeout=scaled(120)) == 0, log.read_text()
    try:
        yield job_id, lambda: dashboard(local_cluster, f"/api/jobs/{job_id}/logs")["logs"]  # what `ray job logs` prints
    finally:
        subprocess.run([str(BIN / "ray"), "job", "stop", job_id], env=local_cluster.client_env(), capture_output=True,
                       timeout=scaled(120))


def test_download_to_s3_spreads_its_parts_over_the_nodes(local_cluster, s3, gpu_job, tmp_path):
    """jobs.download submitted to the cluster, from a URL table on S3 to shards on S3: its parts run as Ray tasks on
    the worker nodes the autoscaler starts (the URLs are on this machine's loopback, which every node shares), every
    shard is complete with no temporary object left, the summary agrees with the per-part lines and says which node
    did which part; a second run finds every shard finished."""
    site = tmp_path / "site"
    site.mkdir()
    for i in range(16):
        (site / f"{i}.jpg").write_bytes(jpeg(i))
    with LoopbackServer(site, delay_s=2.5) as server:  # slow images: a part outlasts the nodes' start-up skew
        urls = [server.url(f"{i}.jpg") for i in range(16)]
        rows = "".join(f"{url},image {i}\n" for i, url in enumerate(urls))
        s3.pipe(f"{BUCKET}/spread/urls.csv", ("url,caption\n" + rows).encode())
        out = f"{BUCKET}/spread/out"
        (tmp_path / "download.yaml").write_text(yaml.safe_dump({"run": {"name": "spread"}, "download": {
            "input": f"s3://{BUCKET}/spread/urls.csv", "output": f"s3://{out}", "image_size": 32,
            "rows_per_shard": 4, "threads_per_task": 1, "max_parts_in_flight": 4, "disallowed_header_directives": []}}))
        job = submit(local_cluster, ["-m", "jobs.download", "--config", str(tmp_path / "download.yaml")],
                     tmp_path / "job.log")
        assert job.wait(timeout=scaled(600)) == 0, (tmp_path / "job.log").read_text()[-4000:]
        s3.invalidate_cache()
        summary = json.loads(s3.cat(f"{out}/_summary.json"))
        again = submit(local_cluster, ["-m", "jobs.download", "--config", str(tmp_path / "download.yaml")],
                       tmp_path / "again.log")
        assert again.wait(timeout=scaled(600)) == 0, (tmp_path / "again.log").read_text()[-4000:]
    s3.invalidate_cache()
    log = (tmp_path / "job.log").read_text()
    assert "FAILED" not in log, log[-3000:]
    left = [p for p in s3.find(out) if "/_tmp/" in p]
    assert not [p for p in left if p.endswith((".tar", "_stats.json"))], left  # every shard moved into place
    assert summary["shards_downloaded"] == summary["shards"] and summary["shards_failed"] == 0
    assert s3.glob(f"{out}/*.tar") and len(s3.glob(f"{out}/*_stats.json")) == summary["shards"]
    assert f"this run: 0 downloaded, {summary['shards']} already finished, 0 failed" in (tmp_path / "again.log").read_text()
    # A part per non-empty hash bucket of the 4 (16 rows / rows_per_shard): the URLs carry the server's port, so
    # now and then a bucket gets none of them and the plan has 3 parts.
    parts = len({bucket_of(url, 4) for url in urls})
    assert summary["written"] == 16 and summary["shards"] == summary["shards_complete"] == parts >= 2
    by_node = summary["parts_by_node"]
    shards = [s for node_shards in by_node.values() for s in node_shards]
    assert len(shards) == len(set(shards)) == parts  # every part once
    head = {n["node_id"] for n in nodes(local_cluster) if n["is_head_node"]}
    assert len(by_node) >= 2 and not head & set(by_node), by_node
    assert "downloaded this run by" in log



def test_a_gpu_job_on_the_cpu_cluster_says_why_it_waits(local_cluster, gpu_job):
    """The local node types have no GPU (ray_cluster.yaml's GPUs are dropped here): the driver says at once that
    no node holds a worker, and Ray's autoscaler that no node type can, while the cluster runs other jobs (the
    download's, which started its worker nodes); the job is stopped, not left hanging."""
    job_id, job_log = gpu_job
    text = wait_for("both messages in the job's log", lambda: (lambda t: t if (
        re.search(r"No available node types can fulfill resource request \{[^}]*'GPU': 1\.0", t)
        and "one training worker needs CPU 1, GPU 1" in t) else None)(job_log()), timeout_s=300, every_s=2)
    assert "waiting for the autoscaler to add one" in text
    stop = subprocess.run([str(BIN / "ray"), "job", "stop", job_id], env=local_cluster.client_env(),
                          capture_output=True, text=True, timeout=scaled(120))
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert wait_for("the job stopped", lambda: dashboard(local_cluster, f"/api/jobs/{job_id}")["status"] == "STOPPED",
                    timeout_s=120, every_s=1)


def test_jobs_api_refuses_requests_without_the_token(local_cluster):
    """Token auth: the head's HTTP API answers 401 to a request without the token, and `ray job list` without one
    (none in the environment nor under ~/.ray) fails saying so."""
    request = urllib.request.Request(f"{local_cluster.address}/api/jobs/")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=scaled(30))
    assert refused.value.code in (401, 403)
    wrong = urllib.request.Request(f"{local_cluster.address}/api/jobs/",
                                   headers={"Authorization": f"Bearer {secrets.token_hex(16)}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(wrong, timeout=scaled(30))
    assert refused.value.code in (401, 403)
    env = {k: v for k, v in local_cluster.client_env().items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env["HOME"] = "/nonexistent"
    out = subprocess.run([str(BIN / "ray"), "job", "list", f"--address={local_cluster.address}"], env=env,
                         capture_output=True, text=True, timeout=scaled(60))
    assert out.returncode != 0 and "auth" in (out.stdout + out.stderr).lower()


PROBE = '''
import os, sys
from pathlib import Path
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

ray.init()
nodes = placement_group([{"CPU": 2}, {"CPU": 2}], strategy="STRICT_SPREAD")  # two whole nodes, held throughout
ray.get(nodes.ready())
on = [PlacementGroupSchedulingStrategy(nodes, placement_group_bundle_index=i) for i in range(2)]


@ray.remote(num_cpus=2)
def write(i):
    Path(f"/tmp/probvlp_node_probe_{i}").write_text("written on this node")
    return ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=2)
def look(i, head_file, data_file):
    return (ray.get_runtime_context().get_node_id(), os.path.exists(head_file), os.path.exists(data_file),
            os.path.exists(f"/tmp/probvlp_node_probe_{1 - i}"), os.path.exists(f"/tmp/probvlp_node_probe_{i}"))


written = ray.get([write.options(scheduling_strategy=on[i]).remote(i) for i in range(2)])
seen = ray.get([look.options(scheduling_strategy=on[i]).remote(i, sys.argv[1], sys.argv[2]) for i in range(2)])
print("WRITTEN", written)
print("SEEN", seen)
'''


def test_nodes_see_no_file_of_the_head_or_of_each_other(local_cluster, tmp_path):
    """The check the other tests stand on: a file the driver's node (the head) wrote is absent on the worker nodes,
    and a file one worker node wrote is absent on the head; the project's data folder is each node's own."""
    (tmp_path / "probe.py").write_text(PROBE)
    head_file = tmp_path / "written_on_the_head.txt"
    head_file.write_text("head")
    data = STATE_DIR / "written_on_the_head.txt"  # the project's local state folder ($PROBVLP_HOME: the tests')
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("head")
    out = subprocess.run([str(BIN / "ray"), "job", "submit", "--", sys.executable, str(tmp_path / "probe.py"),
                          str(head_file), str(data)],
                         env=local_cluster.client_env(), capture_output=True, text=True, timeout=scaled(300))
    logs = out.stdout + out.stderr
    assert out.returncode == 0, logs[-3000:]
    seen = eval(logs.split("SEEN ", 1)[1].splitlines()[0])  # noqa: S307 - the probe's own printed list
    head = {n["node_id"] for n in nodes(local_cluster) if n["is_head_node"]}
    written = eval(logs.split("WRITTEN ", 1)[1].splitlines()[0])  # noqa: S307 - the probe's own printed list
    assert len({s[0] for s in seen}) == 2 and not head & {s[0] for s in seen} and [s[0] for s in seen] == written
    # the head's files and the other node's are absent; the node's own file, written by the task before, is there
    assert [s[1:] for s in seen] == [(False, False, False, True)] * 2
    assert not list(Path("/tmp").glob("probvlp_node_probe_*"))  # and the nodes' files are not on the head


def test_the_demo_submitted_with_its_working_directory(local_cluster, s3, tmp_path):
    """`ray job submit --working-dir . -- python -m jobs.pretrain --config configs/prolip_demo.yaml`, as the README
    submits it. With its defaults it stops before any worker starts, in one line naming run.storage_path (a folder on
    the head, where the workers could not write checkpoints); with that one setting on S3 it trains on the bundled
    digits (written on the head, sent to the workers through Ray's object store) and logs to its default sqlite store
    (in the head's local state folder; the workers, on other nodes, log through the driver's node). With no
    checkpoint before its end (the clock's set to 0: the demo sets no step interval) it says so in one line."""
    def submit_demo(*overrides: str) -> subprocess.CompletedProcess:
        sets = [a for kv in ("train.steps=10", "train.log_every=5", *overrides) for a in ("--set", kv)]
        return subprocess.run([str(BIN / "ray"), "job", "submit", "--working-dir", ".", "--", "python", "-m",
                               "jobs.pretrain", "--config", "configs/prolip_demo.yaml", *sets],
                              cwd=ROOT, env=local_cluster.client_env(), capture_output=True, text=True, timeout=scaled(900))

    refused = submit_demo()
    logs = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "[train] step" not in logs and not tracebacks(logs), logs[-3000:]
    line = next(x for x in logs.splitlines() if x.startswith("config error: run.storage_path: "))
    assert "is a folder on this node's disk, which the cluster's other nodes do not see" in line
    assert "--set run.storage_path=s3://" in line

    done = submit_demo(f"run.storage_path=s3://{BUCKET}/demo", "run.name=demo-on-the-cluster",
                       "train.checkpoint_every_s=0")
    logs = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in logs.lower(), logs[-4000:]
    warned = [x for x in logs.splitlines() if x.startswith("[checkpoint] warning: this run saves no checkpoint")]
    assert len(warned) == 1 and "one lost node loses every step" in warned[0], logs[-4000:]
    assert "[train] step 10/10" in logs and "digits_zeroshot: top1" in logs and "model: runs:/" in logs
    assert "not found" not in logs.lower()
    # on the head, in the project's local state folder: $PROBVLP_HOME, which the tests set and the job inherits (the
    # job's copy of the project where it is not set)
    copies = list(Path(local_cluster.temp_dir).glob("session_2*/runtime_resources/working_dir_files/*/.probvlp/mlflow.db"))
    assert (STATE_DIR / "mlflow.db").is_file() and not copies, copies
    client = MlflowClient(f"sqlite:///{STATE_DIR / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("probvlp-demo").experiment_id])[0]
    assert run.info.status == "FINISHED" and run.data.params["train.steps"] == "10"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [5, 10]  # rank 0's, relayed
    assert {f.path for f in client.list_artifacts(run.info.run_id, "model")} >= {"model/MLmodel", "model/data"}
    assert registered(f"{BUCKET}/demo/demo-on-the-cluster", s3)
