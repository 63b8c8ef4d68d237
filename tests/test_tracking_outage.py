"""The run outlives its tracking server (issue 52, item 5): a real `mlflow server` on 127.0.0.1 stopped in the middle
of a real training job (jobs.pretrain, 2 Ray Train workers under DeepSpeed) for longer than the MLflow client's retry
budget, then restarted on the same database and port. Rank 0's outbox (pipelines.tracking_outbox.Outbox) keeps what the
loop logs meanwhile and delivers it when the server is back."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

import pipelines.tracking as tracking
import pipelines.tracking_outbox as tracking_outbox
from pipelines.cluster import services
from pipelines.tracking import StepLogger
from pipelines.tracking_outbox import UNREACHABLE_METRIC, UNREACHABLE_TAG, replay_outbox
from tests.helpers import free_port, wait_for
from tests.pace import scaled
from tests.small_runs import SMALL

ROOT = Path(__file__).resolve().parent.parent
STEPS = 120
EXPERIMENT = "test-tracking-outage"
# The client's retry budget in the job's processes (every Ray process inherits the job's environment): one retry
# after ~1-2 s, so a call made while the server is down fails within seconds unless something else retries it.
CLIENT_BUDGET = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
OUTAGE_S = 8  # several times that budget (the restart of the server adds its start-up)


def loss_steps(client: MlflowClient, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "loss"))


# In the tier of issue 52's outage tests (`make test-cluster`, run alone): a tracking server stopped and restarted under
# a job for ~20 s, whose timing the other worker's Ray runs would stretch.
@pytest.mark.slow
@pytest.mark.cluster
def test_training_outlives_a_tracking_server_outage(digits_root, tmp_path, monkeypatch):
    for key, value in CLIENT_BUDGET.items():  # this process's client too: the test never waits minutes on it
        monkeypatch.setenv(key, value)
    server_dir = tmp_path / "server"
    port = free_port()
    artifacts = str(server_dir / "artifacts")
    server = services.start_mlflow(port, server_dir, artifacts, {})
    uri = f"http://127.0.0.1:{port}"
    client = MlflowClient(uri)
    overrides = [f"data.root={digits_root}", f"tracking.uri={uri}", f"run.storage_path={tmp_path / 'ray'}",
                 "run.name=outage", f"run.experiment={EXPERIMENT}", *SMALL, f"train.steps={STEPS}",
                 "train.log_every=1", "train.num_workers=2", "run.max_failures=0"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(CLIENT_BUDGET)
    log = tmp_path / "job.log"
    job = subprocess.Popen([sys.executable, "-m", "jobs.pretrain", "--config", str(ROOT / "configs" / "demo.yaml"),
                            *(a for kv in overrides for a in ("--set", kv))],
                           cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def run_id():
            exp = client.get_experiment_by_name(EXPERIMENT)
            runs = client.search_runs([exp.experiment_id]) if exp else []
            return runs[0].info.run_id if runs else None

        rid = wait_for("the job's MLflow run", run_id, timeout_s=300)
        # rank 0 has delivered a first flush: training runs, and is far from its last step
        wait_for("the first steps' metrics in MLflow", lambda: job.poll() is not None or loss_steps(client, rid),
                 timeout_s=300)
        assert job.poll() is None, log.read_text()[-3000:]
        delivered_before = loss_steps(client, rid)
        assert max(delivered_before) < STEPS // 2, "training went too fast to be interrupted"

        down_at = time.time()
        services.stop(server)
        time.sleep(OUTAGE_S)  # the outage itself, not a wait for something
        assert job.poll() is None, f"the job ended while the server was down:\n{log.read_text()[-3000:]}"
        server = services.start_mlflow(port, server_dir, artifacts, {})  # same database, same port
        up_at = time.time()

        rc = job.wait(timeout=scaled(600))
        output = log.read_text()
        assert rc == 0, output[-5000:]

        run = client.get_run(rid)
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(rid, "loss")
        # every metric logged at each step (loss, lr, samples/s, ...; not the one-offs): no step missing, and the
        # loop's own ones once per step (the data counts are logged again by the end's report)
        per_step = {key: sorted(m.step for m in client.get_metric_history(rid, key)) for key in run.data.metrics}
        per_step = {key: steps for key, steps in per_step.items() if len(steps) > 1}
        for key, steps in per_step.items():
            assert sorted(set(steps)) == list(range(1, STEPS + 1)), f"{key}: a step is missing"
        for key in ("loss", "lr", "samples_per_s", "data_wait_frac"):
            assert per_step[key] == list(range(1, STEPS + 1)), f"{key}: a step is logged twice"
        # the loop went on during the outage: steps logged while the server was down reached it afterwards (whether
        # training ended before the server was back, its last flush waiting for it, or went on after)
        during = [m.step for m in history if down_at * 1000 < m.timestamp < up_at * 1000]
        assert during, "no step was logged while the server was down"
        # the run says how long tracking was unreachable: MLflow (metric at the last step, tag) and the console
        [unreachable] = client.get_metric_history(rid, UNREACHABLE_METRIC)
        assert unreachable.step == STEPS
        assert 0 < unreachable.value <= time.time() - down_at
        assert float(run.data.tags[UNREACHABLE_TAG]) == pytest.approx(unreachable.value, abs=0.1)
        assert f"was unreachable for {unreachable.value:.1f} s" in output, output[-5000:]
        # the artifacts of the run's end (after the outage) arrived too
        assert {a.path for a in client.list_artifacts(rid, "model")} >= {"model/MLmodel", "model/loss.safetensors"}
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()
        services.stop(server)


def test_what_a_store_that_never_returns_missed_is_kept_in_order_and_replayed(tmp_path, monkeypatch, capsys):
    """A store that never answers (a port nothing listens on): the loop's calls return at once, the final flush waits
    its limit, then says what it could not deliver and where it is; replayed later into the run's store, everything
    arrives in the order it was logged, the queue that went on in a file (a small memory bound here) included."""
    for key, value in CLIENT_BUDGET.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tracking, "OUTBOX_DIR", tmp_path / "outbox")
    monkeypatch.setattr(tracking_outbox, "MEMORY_METRICS", 40)  # most of what follows goes on in the spill file
    store = tracking.tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")  # from a copy of an empty store
    # its artifacts beside the store, as pipelines.tracking makes a run's (MLflow's default: the checkout's ./mlruns)
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("outbox", tracking.sqlite_artifact_root(store))).info.run_id
    logger = StepLogger(f"http://127.0.0.1:{free_port()}", run_id, flush_every=20, background=True,
                        flush_timeout_s=2)
    started = time.monotonic()
    for step in range(1, 101):
        logger.log({"loss": float(step), "lr": 1.0 / step}, step)
        if step % 25 == 0:
            logger.tag("probvlp.last_quarter", str(step))  # set four times: the last value must win
    (tmp_path / "card.md").write_text("a model card")
    logger.artifact(tmp_path / "card.md", "model")
    (tmp_path / "card.md").unlink()  # the caller's temporary file goes away: the outbox holds a copy
    assert time.monotonic() - started < scaled(5), "logging waited for the store"
    report = logger.close()
    assert report.kept_in == tmp_path / "outbox" / run_id
    assert report.undelivered == {"metrics": 200, "tags": 4, "artifacts": 1} and report.unreachable_s > 0
    out = capsys.readouterr().out
    assert "NOT delivered" in out and str(report.kept_in) in out and "python -m pipelines.tracking_outbox" in out

    replay_outbox(report.kept_in, store)
    client = MlflowClient(store)
    losses = client.get_metric_history(run_id, "loss")
    assert [m.step for m in losses] == list(range(1, 101)) and [m.value for m in losses] == list(range(1, 101))
    run = client.get_run(run_id)
    assert run.data.tags["probvlp.last_quarter"] == "100"
    assert run.data.tags[tracking.LOGGED_THROUGH_TAG] == "100"
    assert run.data.metrics[UNREACHABLE_METRIC] == pytest.approx(report.unreachable_s, abs=0.1)
    assert [a.path for a in client.list_artifacts(run_id, "model")] == ["model/card.md"]


@pytest.mark.parametrize("failed", [False, True])
def test_a_failed_attempt_leaves_its_steps_after_the_last_checkpoint_to_the_restart(tmp_path, failed):
    """Steps not yet flushed (with checkpoints: not covered by one) are written when an attempt ends well and dropped
    when it fails: the restart runs them again, at another size after a lost node, and MLflow keeps its values."""
    uri = tracking.tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("attempts")).info.run_id
    logger = StepLogger(uri, run_id, flush_every=None, background=True)
    logger.log({"loss": 1.0}, 1)
    logger.flush()  # a checkpoint's
    logger.log({"loss": 2.0}, 2)
    logger.close(drop_unflushed=failed)
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == ([1] if failed else [1, 2])
