"""The run outlives its tracking server, alone and together with a preemption: a real `mlflow server` on 127.0.0.1
stopped in the middle of a real training job (jobs.pretrain, 2 Ray Train workers under DeepSpeed) for longer than the
MLflow client's retry budget, then restarted on the same database and port. Rank 0's outbox
(pipelines.tracking.outbox.Outbox) keeps what the loop logs meanwhile, hands it to the next attempt through the run's
storage, and the driver delivers the end's backlog or keeps it for the command it names."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from mlflow import MlflowClient

import pipelines.tracking as tracking
import pipelines.tracking.logger as tracking_logger
import pipelines.tracking.outbox as tracking_outbox
from pipelines.tracking import StepLogger, deliver
from pipelines.tracking.outbox import UNREACHABLE_METRIC, UNREACHABLE_TAG
from tests.helpers import free_port, wait_for
from tests.pace import scaled
from tests.small_runs import SMALL

ROOT = Path(__file__).resolve().parent.parent
STEPS = 150
END_STEPS = 60
EXPERIMENT = "test-tracking-outage"
# The client's retry budget in the job's processes (every Ray process inherits the job's environment): one retry
# after ~1-2 s, so a call made while the server is down fails within seconds unless something else retries it.
CLIENT_BUDGET = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def loss_steps(client: MlflowClient, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "loss"))


def audited(path: Path) -> dict[int, list[tuple[int, float]]]:
    """The optimizer steps each attempt applied (run.audit_steps_to): attempt -> [(step, time)]."""
    steps: dict[int, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        attempt, step, at = line.split()
        steps.setdefault(int(attempt), []).append((int(step), float(at)))
    return steps


def train_workers() -> list[int]:
    """The training workers' pids (the cluster tier runs alone: the job's Ray is the only one)."""
    import psutil

    return sorted(p.pid for p in psutil.process_iter(["cmdline"])
                  if (p.info["cmdline"] or [""])[0].startswith("ray::RayTrainWorker"))


def start_job(tmp_path: Path, overrides: list[str], name: str) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(CLIENT_BUDGET)
    log = tmp_path / f"{name}.log"
    job = subprocess.Popen([sys.executable, "-m", "jobs.pretrain", "--config", str(ROOT / "configs" / "demo.yaml"),
                            *(a for kv in overrides for a in ("--set", kv))],
                           cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return job, log


@contextmanager
def ended(job: subprocess.Popen):
    """The job killed with its process group if it still runs when the block ends (a failed wait)."""
    try:
        yield job
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()


def run_of(client: MlflowClient, name: str) -> str | None:
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`probvlp.run_name` = '{name}'") if exp else []
    return runs[0].info.run_id if runs else None


# In the tier of the outage tests (`make test-cluster`, run alone): a tracking server stopped and restarted under a
# job, whose timing the other worker's Ray runs would stretch.
@pytest.mark.slow
@pytest.mark.cluster
def test_a_preemption_during_a_tracking_outage_loses_nothing(digits_root, tmp_path, monkeypatch, restartable_mlflow):
    """The server stops while the job trains; SIGTERM reaches a training worker during the outage (run.max_failures
    0: only a preemption may restart it); the restart trains on with the server still away (it never reads the
    store); the server comes back after the restart's first step. Then a second job of the same server: the server
    stops at ~90% of it and stays away past its end: the job ends rc 0 with one line, the workers released at once,
    and the one command it names delivers everything and ends the run FINISHED. Counted: the steps every attempt
    applied (run.audit_steps_to) and every step's metrics as lists (a step logged twice fails)."""
    for key, value in CLIENT_BUDGET.items():  # this process's client too: the test never waits minutes on it
        monkeypatch.setenv(key, value)
    server = restartable_mlflow  # stopped and started again under the jobs
    uri = server.uri
    client = MlflowClient(uri)
    audit = tmp_path / "steps.txt"
    common = [f"data.root={digits_root}", f"tracking.uri={uri}", f"run.storage_path={tmp_path / 'ray'}",
              f"run.experiment={EXPERIMENT}", *SMALL, "train.log_every=1", "train.num_workers=2",
              "run.max_failures=0"]
    job, log = start_job(tmp_path, [*common, "run.name=outage", f"train.steps={STEPS}",
                                    "train.checkpoint_every=50", "run.sigterm_grace_s=3",
                                    f"run.audit_steps_to={audit}"], "outage")
    with ended(job):
        rid = wait_for("the job's MLflow run", lambda: run_of(client, "outage"), timeout_s=300)
        wait_for("the first steps' metrics in MLflow",
                 lambda: job.poll() is not None or loss_steps(client, rid), timeout_s=300)
        assert job.poll() is None, log.read_text()[-3000:]
        down_at = time.time()
        server.stop()
        reached = max(s for s, _ in audited(audit)[1])
        wait_for("steps trained with the server away",
                 lambda: max(s for s, _ in audited(audit)[1]) >= reached + 5, 60, 0.1)
        sigterm_at = time.time()
        os.kill(train_workers()[-1], signal.SIGTERM)
        wait_for("the restart's first step", lambda: job.poll() is not None or 2 in audited(audit), 300, 0.2)
        assert job.poll() is None, f"the job ended while the server was down:\n{log.read_text()[-3000:]}"
        server.start()  # same database, same port
        up_at = time.time()
        rc = job.wait(timeout=scaled(600))
        output = log.read_text()
        assert rc == 0, output[-5000:]

    run = client.get_run(rid)
    assert run.info.status == "FINISHED"
    ran = audited(audit)
    applied = sorted(s for steps in ran.values() for s, _ in steps)
    twice = len(applied) - len(set(applied))
    assert set(applied) == set(range(1, STEPS + 1)) and twice <= 1, ran.keys()
    # every metric logged at each step exactly once, in order (not the one-offs)
    per_step = {key: [m.step for m in client.get_metric_history(rid, key)] for key in run.data.metrics}
    per_step = {key: steps for key, steps in per_step.items() if len(steps) > 1}
    for key in ("loss", "lr", "samples_per_s", "data_wait_frac"):
        assert sorted(per_step[key]) == list(range(1, STEPS + 1)), f"{key}: a step missing or logged twice"
    notices = [k for k in run.data.tags if k.startswith("probvlp.preemption.step_")]
    assert len(notices) == 1, notices
    restart = json.loads(run.data.tags["probvlp.attempt.2"])
    assert "notice of preemption (SIGTERM)" in restart["why"] and restart["steps_again"] == 0, restart
    assert "[restart] attempt 2 of run outage, after a notice of preemption (SIGTERM)" in output
    # the outage as both attempts saw it: attempt 1's share travelled with its queue
    [unreachable] = client.get_metric_history(rid, UNREACHABLE_METRIC)
    assert sigterm_at - down_at <= unreachable.value <= up_at - down_at + scaled(30)
    assert float(run.data.tags[UNREACHABLE_TAG]) == pytest.approx(unreachable.value, abs=0.1)
    assert {a.path for a in client.list_artifacts(rid, "model")} >= {"model/MLmodel", "model/loss.safetensors"}
    first_after = min(t for _, t in ran[2])
    print(f"SIGTERM {sigterm_at - down_at:.1f} s into the outage; steps applied twice: {twice}; the restart's "
          f"first step {first_after - sigterm_at:.1f} s after the SIGTERM; server back {up_at - down_at:.0f} s "
          f"after it went; tracking_unreachable_s {unreachable.value}")

    # the end of a run with the server away: released at once, one line, delivered later by the command it names
    job, log = start_job(tmp_path, [*common, "run.name=end", f"train.steps={END_STEPS}",
                                    "tracking.flush_timeout_s=3"], "end")
    with ended(job):
        rid = wait_for("the second job's MLflow run", lambda: run_of(client, "end"), timeout_s=300)
        wait_for("~90% of the second run in MLflow", lambda: job.poll() is not None or
                 max(loss_steps(client, rid) or [0]) >= END_STEPS * 9 // 10, 300, 0.1)
        server.stop()
        rc = job.wait(timeout=scaled(300))
        output = log.read_text()
        assert rc == 0, output[-5000:]
    [line] = [line for line in output.splitlines() if "did not answer within tracking.flush_timeout_s" in line]
    command = line.split("deliver them with: ")[1].strip()
    assert command.startswith("python -m pipelines.tracking.deliver ") and "pending" in line
    server.start()
    assert client.get_run(rid).info.status == "RUNNING"
    delivered = subprocess.run([sys.executable, *command.split()[1:]], cwd=ROOT, capture_output=True, text=True,
                               env={**os.environ, **CLIENT_BUDGET}, timeout=scaled(120))
    assert delivered.returncode == 0, delivered.stdout + delivered.stderr
    run = client.get_run(rid)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(rid, "loss")] == list(range(1, END_STEPS + 1))
    assert {a.path for a in client.list_artifacts(rid, "model")} >= {"model/MLmodel"}


def test_what_a_store_that_never_returns_missed_is_kept_in_order_and_delivered_later(tmp_path, monkeypatch, capsys):
    """A store that never answers (a port nothing listens on): the loop's calls return at once; at the end rank 0
    hands what it could not deliver to the run's storage and is released at once (not after flush_timeout_s); the
    driver's delivery there keeps it too; the later command delivers everything in the order it was logged, the
    queue that went on in a file (a small memory bound here) included, and ends the run FINISHED."""
    for key, value in CLIENT_BUDGET.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tracking_logger, "OUTBOX_DIR", tmp_path / "outbox")
    monkeypatch.setattr(tracking_outbox, "MEMORY_METRICS", 40)  # most of what follows goes on in the spill file
    store = tracking.tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")  # from a copy of an empty store
    # its artifacts beside the store, as pipelines.tracking makes a run's (MLflow's default: the checkout's ./mlruns)
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("outbox", tracking.sqlite_artifact_root(store))).info.run_id
    away = f"http://127.0.0.1:{free_port()}"
    logger = StepLogger(away, run_id, None, background=True, flush_timeout_s=600)
    for step in range(1, 101):
        logger.log({"loss": float(step), "lr": 1.0 / step}, step)
        if step % 25 == 0:
            logger.tag("probvlp.last_quarter", str(step))  # set four times: the last value must win
    (tmp_path / "card.md").write_text("a model card")
    logger.artifact(tmp_path / "card.md", "model")
    (tmp_path / "card.md").unlink()  # the caller's temporary file goes away: the outbox holds a copy
    storage = str(tmp_path / "storage" / "run" / "tracking_outbox")
    # released while the store is away (flush_timeout_s, 600 s, is the driver's wait): the close returns long before
    import threading

    closed: dict = {}
    closing = threading.Thread(target=lambda: closed.setdefault("report", logger.close(keep_to=storage)), daemon=True)
    closing.start()
    closing.join(scaled(60))
    assert "report" in closed, "rank 0's close waited for a store that is away instead of handing its queue over"
    report = closed["report"]
    assert report.kept_in == storage and report.unreachable_s > 0
    assert report.undelivered == {"metrics": 200, "tags": 4, "artifacts": 1, "other": 1}  # other: the summary
    assert "handed over" in capsys.readouterr().out

    run = tracking.TrackedRun(away, run_id, pending_in=storage, flush_timeout_s=2)
    run.end()
    out = capsys.readouterr().out
    assert run.kept is not None and run.kept.pending == 207  # and the run's status last
    assert f"{tracking_outbox.COMMAND} {storage}" in out and "pending" in out and "FINISHED" in out

    assert deliver.main([storage, store]) == 0
    losses = client.get_metric_history(run_id, "loss")
    assert [m.step for m in losses] == list(range(1, 101)) and [m.value for m in losses] == list(range(1, 101))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["probvlp.last_quarter"] == "100"
    assert run.data.tags[tracking_outbox.LOGGED_THROUGH_TAG] == "100"
    assert run.data.metrics[UNREACHABLE_METRIC] >= report.unreachable_s
    assert [a.path for a in client.list_artifacts(run_id, "model")] == ["model/card.md"]
    assert tracking_outbox.load(storage, tmp_path / "files") is None  # delivered: nothing left to deliver twice


def test_a_restart_neither_reads_the_store_nor_logs_a_step_twice(tmp_path, monkeypatch):
    """Attempt 1 delivers steps 1-10 as it logs them (not held for a checkpoint) and dies after step 10; its
    checkpoint of step 5 carried what it had not delivered then. Attempt 2 resumes from step 5 with the store away:
    its logger starts without the store (the thread reads what was delivered once the store is back), and MLflow
    ends with every step once: 1-10 from attempt 1 (its replays 6-10 dropped), 11-12 from attempt 2, the metric
    attempt 2 logs at its own resume step, and the one it logs at attempt 1's last step that attempt 1 never logged
    (the final evaluation of a run whose node went after its last step)."""
    for key, value in CLIENT_BUDGET.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tracking_logger, "OUTBOX_DIR", tmp_path / "outbox")
    uri = tracking.tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("attempts")).info.run_id
    storage = str(tmp_path / "storage")
    first = StepLogger(uri, run_id, None, background=True)
    for step in range(1, 11):
        first.log({"loss": float(step)}, step)
        if step == 5:
            first.persist(storage)  # the checkpoint's
    wait_for("attempt 1's steps in MLflow", lambda: len(client.get_metric_history(run_id, "loss")) == 10, 60, 0.1)
    first.outbox.stopped = True  # the node goes: nothing more from attempt 1

    port = free_port()
    second = StepLogger(f"http://127.0.0.1:{port}", run_id, None, resumed_from=5, background=True,
                        carried=tracking_outbox.load(storage, tmp_path / "f", 5))
    second.log({"preemption_steps_lost": 5.0}, 5)
    for step in range(6, 13):
        # step 10 was attempt 1's last: it delivered the loss there, not what came after it (an evaluation's metrics)
        second.log({"loss": 100.0 + step, **({"top1": 0.5} if step == 10 else {})}, step)
    assert not second.outbox.reachable()
    second.outbox.client = MlflowClient(uri)  # the store is back (at another address here)
    assert second.outbox.wait(scaled(30))
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == \
        [(s, float(s)) for s in range(1, 11)] + [(11, 111.0), (12, 112.0)]
    assert [m.step for m in client.get_metric_history(run_id, "preemption_steps_lost")] == [5]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "top1")] == [(10, 0.5)]
    assert client.get_run(run_id).data.tags[tracking_outbox.LOGGED_THROUGH_TAG] == "12"
