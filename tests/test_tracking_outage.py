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
import threading
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
from tests.helpers import Hold, free_port, wait_for
from tests.pace import scaled
from tests.small_runs import SMALL, audited, every_step_once

ROOT = Path(__file__).resolve().parent.parent
STEPS = 150
EXPERIMENT = "test-tracking-outage"
# The client's retry budget in the job's processes (every Ray process inherits the job's environment): one retry
# after ~1-2 s, so a call made while the server is down fails within seconds unless something else retries it.
CLIENT_BUDGET = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def loss_steps(client: MlflowClient, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "loss"))


def train_workers(job: subprocess.Popen) -> list[int]:
    """The pids of the job's training workers: processes under the job's own Ray (started by its driver; the other
    pytest worker's tests run Ray Train workers of their own)."""
    import psutil

    pids = []
    for process in psutil.Process(job.pid).children(recursive=True):
        try:
            if (process.cmdline() or [""])[0].startswith("ray::RayTrainWorker"):
                pids.append(process.pid)
        except psutil.Error:  # ended since the listing
            pass
    return sorted(pids)


def start_job(tmp_path: Path, overrides: list[str], name: str, hold: Hold | None = None
              ) -> tuple[subprocess.Popen, Path]:
    """jobs.pretrain as a process of its own; with `hold`, rank 0 stops at its point until the test releases it."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(CLIENT_BUDGET)
    log = tmp_path / f"{name}.log"
    job_module = ["tests.held_pretrain", str(hold.folder), hold.point, "--", "--config"] if hold else \
        ["jobs.pretrain", "--config"]
    job = subprocess.Popen([sys.executable, "-m", *job_module, str(ROOT / "configs" / "demo.yaml"),
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


# In the tier of the outage tests (`make test-cluster`): a tracking server stopped and restarted under a job.
@pytest.mark.slow
@pytest.mark.cluster
def test_a_preemption_during_a_tracking_outage_loses_nothing(digits_root, tmp_path, monkeypatch, restartable_mlflow):
    """The server stops while the job trains; SIGTERM reaches a training worker during the outage (run.max_failures
    0: only a preemption may restart it); the restart trains on with the server still away (it never reads the
    store); the server comes back after the restart's first step. It stops again once the restart has trained its
    last step (rank 0 held before its final evaluation, after ~90% of the steps reached MLflow: however fast the
    restart trains and however slowly its backlog drains, the run cannot end first) and stays away past its end: the
    job ends rc 0 with one line, the workers released at once, and the one command it names delivers everything and
    ends the run FINISHED. Counted: the steps every attempt applied (run.audit_steps_to) and every step's metrics as
    lists (a step logged twice fails)."""
    for key, value in CLIENT_BUDGET.items():  # this process's client too: the test never waits minutes on it
        monkeypatch.setenv(key, value)
    server = restartable_mlflow  # stopped and started again under the job
    uri = server.uri
    client = MlflowClient(uri)
    audit = tmp_path / "steps.txt"
    final = Hold(tmp_path / "holds")  # the final evaluation: the end of the run waits for the second outage
    job, log = start_job(tmp_path, [f"data.root={digits_root}", f"tracking.uri={uri}",
                                    f"run.storage_path={tmp_path / 'ray'}", f"run.experiment={EXPERIMENT}", *SMALL,
                                    "train.log_every=1", "train.num_workers=2", "run.max_failures=0",
                                    "run.name=outage", f"train.steps={STEPS}", "train.checkpoint_every=50",
                                    "run.sigterm_grace_s=3", "tracking.flush_timeout_s=3",
                                    f"run.audit_steps_to={audit}"], "outage", final)
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
        os.kill(train_workers(job)[-1], signal.SIGTERM)
        wait_for("the restart's first step", lambda: job.poll() is not None or 2 in audited(audit), 300, 0.2)
        assert job.poll() is None, f"the job ended while the server was down:\n{log.read_text()[-3000:]}"
        server.start()  # same database, same port
        up_at = time.time()
        # the end of the run with the server away: released at once, one line, delivered later by the command it names
        wait_for("the restart's last step, held before the final evaluation",
                 lambda: job.poll() is not None or final.held(), 300, 0.2)
        assert job.poll() is None and final.held() == 1, \
            f"the job ended before its final evaluation:\n{log.read_text()[-3000:]}"
        wait_for("~90% of the run in MLflow", lambda: max(loss_steps(client, rid) or [0]) >= STEPS * 9 // 10, 300, 0.2)
        server.stop()
        final.release()
        rc = job.wait(timeout=scaled(600))
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
    ran = audited(audit)
    notices = [k for k in run.data.tags if k.startswith("probvlp.preemption.step_")]
    assert len(notices) == 1, notices
    noticed = int(notices[0].rsplit("_", 1)[1])
    # no step trained twice, nor missed, counted by what each attempt applied (run.audit_steps_to), not by MLflow
    # (which drops replays before they reach it): attempt 1 up to the notice's step, attempt 2 from the next one
    steps = {attempt: [s for s, _ in applied] for attempt, applied in ran.items()}
    assert steps == {1: list(range(1, noticed + 1)), 2: list(range(noticed + 1, STEPS + 1))}, \
        {a: (s[0], s[-1], len(s)) for a, s in steps.items()}
    # the loop never waited for the store: both attempts applied steps while it was away, the restart's too
    assert len([s for s, at in ran[1] if at > down_at]) >= 5 and min(at for _, at in ran[2]) < up_at
    # every key a step logs is in MLflow at every step, once: through both outages and the later delivery
    every_step_once(client, rid, STEPS)
    restart = json.loads(run.data.tags["probvlp.attempt.2"])
    assert "notice of preemption (SIGTERM)" in restart["why"] and restart["steps_again"] == 0, restart
    assert "[restart] attempt 2 of run outage, after a notice of preemption (SIGTERM)" in output
    # the outage as both attempts saw it (attempt 1's share travelled with its queue), in the one summary rank 0
    # queues as the fit ends (the end's outage had lasted a few steps then)
    [unreachable] = client.get_metric_history(rid, UNREACHABLE_METRIC)
    assert sigterm_at - down_at <= unreachable.value <= up_at - down_at + scaled(30)
    assert float(run.data.tags[UNREACHABLE_TAG]) == pytest.approx(unreachable.value, abs=0.1)
    assert {a.path for a in client.list_artifacts(rid, "model")} >= {"model/MLmodel", "model/loss.safetensors"}
    first_after = min(t for _, t in ran[2])
    print(f"SIGTERM {sigterm_at - down_at:.1f} s into the outage; saved at step {noticed}, none applied twice; the "
          f"restart's first step {first_after - sigterm_at:.1f} s after the SIGTERM; server back "
          f"{up_at - down_at:.0f} s after it went; tracking_unreachable_s {unreachable.value}")


def test_what_a_store_that_never_returns_missed_is_kept_in_order_and_delivered_later(tmp_path, monkeypatch, capsys,
                                                                                    http_calls):
    """A store that never answers (a port nothing listens on): the loop's calls return at once, without waiting for
    the store (none of them sends a request, counted per thread: only the outbox's thread tries the store, fewer
    times than the loop calls); at the end rank 0 hands what it could not deliver to the run's storage and is
    released at once (not after flush_timeout_s); the driver's delivery there keeps it too; the later command
    delivers everything in the order it was logged, the queue that went on in a file (a small memory bound here)
    included, and ends the run FINISHED. The seconds unreachable it reports are those rank 0's outbox and the
    driver's saw, within the windows the test kept the store away from each."""
    for key, value in CLIENT_BUDGET.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tracking_logger, "OUTBOX_DIR", tmp_path / "outbox")
    monkeypatch.setattr(tracking_outbox, "MEMORY_METRICS", 40)  # most of what follows goes on in the spill file
    store = tracking.tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")  # from a copy of an empty store
    # its artifacts beside the store, as pipelines.tracking makes a run's (MLflow's default: the checkout's ./mlruns)
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("outbox", tracking.sqlite_artifact_root(store))).info.run_id
    away = f"http://127.0.0.1:{free_port()}"
    loop = threading.current_thread()
    rank0_from = time.monotonic()
    logger = StepLogger(away, run_id, None, background=True, flush_timeout_s=600)
    for step in range(1, 101):
        logger.log({"loss": float(step), "lr": 1.0 / step}, step)
        if step % 25 == 0:
            logger.tag("probvlp.last_quarter", str(step))  # set four times: the last value must win
    (tmp_path / "card.md").write_text("a model card")
    logger.artifact(tmp_path / "card.md", "model")
    (tmp_path / "card.md").unlink()  # the caller's temporary file goes away: the outbox holds a copy
    # logging never waited for the store: none of its 105 calls sent a request (a call that tried the store and
    # caught the error would show here); the outbox's thread tried it, fewer times than the loop called (a loop
    # waiting for a try per call would have made it try at least once a call); everything is queued
    tries = [url for thread, _, url in http_calls if url.startswith(away)]
    assert not [url for thread, _, url in http_calls if thread is loop and url.startswith(away)], tries
    assert len(tries) < 105 and len(logger.outbox.snapshot()) == 105, tries
    storage = str(tmp_path / "storage" / "run" / "tracking_outbox")
    # released while the store is away (flush_timeout_s, 600 s, is the driver's wait): the close returns long before
    closed: dict = {}
    closing = threading.Thread(target=lambda: closed.setdefault("report", logger.close(keep_to=storage)), daemon=True)
    close_from = time.monotonic()
    closing.start()
    closing.join(scaled(60))
    rank0_to = time.monotonic()
    assert "report" in closed, "rank 0's close waited for a store that is away instead of handing its queue over"
    report = closed["report"]
    assert report.kept_in == storage and report.unreachable_s > 0
    # rank 0's outage as its outbox saw it: from its first failed try (in the test's window; maybe only during the
    # close, which waits for it) to the report, made at the end of the close
    rank0_down = logger.outbox.down_since
    assert rank0_down is not None and rank0_from <= rank0_down <= rank0_to
    least = max(0.0, close_from - rank0_down)
    assert least <= report.unreachable_s <= rank0_to - rank0_down
    assert report.undelivered == {"metrics": 200, "tags": 4, "artifacts": 1, "other": 1}  # other: the summary
    assert "handed over" in capsys.readouterr().out

    handed_over = tracking_outbox.load(storage, tmp_path / "peek")[0]["unreachable_s"]  # what travels with the queue
    assert round(least, 1) <= handed_over <= round(report.unreachable_s, 1)
    driver_outboxes = []

    class Recorded(tracking_outbox.Outbox):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            driver_outboxes.append(self)

    monkeypatch.setattr(tracking_outbox, "Outbox", Recorded)
    run = tracking.TrackedRun(away, run_id, pending_in=storage, flush_timeout_s=2)
    driver_from = time.monotonic()
    run.end()
    driver_to = time.monotonic()
    out = capsys.readouterr().out
    kept = run.kept
    assert kept is not None and kept.pending == 207  # and the run's status last
    # the driver's share: from its outbox's first failed try to the end of its wait of flush_timeout_s
    [driver] = driver_outboxes
    assert driver.down_since is not None and driver_from <= driver.down_since
    share = kept.unreachable_s - handed_over
    assert driver_from + 2 - driver.down_since <= share <= driver_to - driver.down_since
    assert kept.unreachable_s <= (rank0_to - rank0_from) + (driver_to - driver_from)  # never more than made
    assert f"{tracking_outbox.COMMAND} {storage}" in out and "pending" in out and "FINISHED" in out

    assert deliver.main([storage, store]) == 0
    losses = client.get_metric_history(run_id, "loss")
    assert [m.step for m in losses] == list(range(1, 101)) and [m.value for m in losses] == list(range(1, 101))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["probvlp.last_quarter"] == "100"
    assert run.data.tags[tracking_outbox.LOGGED_THROUGH_TAG] == "100"
    # both shares, as the driver's outbox reported them, travelled to the metric and the tag (each rounded to 0.1 s)
    assert run.data.metrics[UNREACHABLE_METRIC] == pytest.approx(kept.unreachable_s, abs=0.05)
    assert float(run.data.tags[UNREACHABLE_TAG]) == run.data.metrics[UNREACHABLE_METRIC]
    assert [a.path for a in client.list_artifacts(run_id, "model")] == ["model/card.md"]
    assert tracking_outbox.load(storage, tmp_path / "files") is None  # delivered: nothing left to deliver twice


def test_a_restart_neither_reads_the_store_nor_logs_a_step_twice(tmp_path, monkeypatch, http_calls):
    """Attempt 1 delivers steps 1-10 as it logs them (not held for a checkpoint) and dies after step 10; its
    checkpoint of step 5 carried what it had not delivered then. Attempt 2 resumes from step 5 with the store away:
    its logger starts without the store (no request from the restarting thread, not even one that fails: only the
    outbox's thread reads what was delivered, once the store is back; a store that hangs instead of refusing is
    tests/test_store_hangs.py's), and MLflow
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
    asked = [(thread.name, url) for thread, _, url in http_calls if url.startswith(f"http://127.0.0.1:{port}")]
    assert all(name.startswith("probvlp-tracking-") for name, _ in asked), asked
    second.outbox.client = MlflowClient(uri)  # the store is back (at another address here)
    assert second.outbox.wait(scaled(30))
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == \
        [(s, float(s)) for s in range(1, 11)] + [(11, 111.0), (12, 112.0)]
    assert [m.step for m in client.get_metric_history(run_id, "preemption_steps_lost")] == [5]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "top1")] == [(10, 0.5)]
    assert client.get_run(run_id).data.tags[tracking_outbox.LOGGED_THROUGH_TAG] == "12"


def test_a_record_made_again_by_a_restart_lands_once_and_its_own_events_all_land(tmp_path, monkeypatch):
    """Two records a restart repeats, and the events it adds. (a) A notice at an evaluation step during an outage:
    attempt 1 saves at step 10, logs its notice and evaluates, and hands everything over (the store away throughout);
    attempt 2 resumes from that checkpoint, which says the evaluation may not have ended, and evaluates again: MLflow
    gets step 10's evaluation once (attempt 1's, delivered first). (b) Events inside the replay window: attempt 1
    delivered steps 1-12 and a save's seconds at steps 5 and 10, and died before step 10's checkpoint was registered;
    attempt 2 resumes from step 5 and saves at step 10 again: that second save's seconds are the attempt's own, not a
    replay, and land beside the first."""
    for key, value in CLIENT_BUDGET.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tracking_logger, "OUTBOX_DIR", tmp_path / "outbox")
    uri = tracking.tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = MlflowClient(uri)
    experiment = client.create_experiment("again")

    # (a) the store away for all of attempt 1
    run_id, storage = client.create_run(experiment).info.run_id, str(tmp_path / "notice")
    first = StepLogger(f"http://127.0.0.1:{free_port()}", run_id, None, background=True)
    for step in range(1, 11):
        first.log({"loss": float(step)}, step)
    first.persist(storage)  # the notice's save
    first.log({"preemptions": 1.0}, 10, event=True)
    first.log({"top1": 0.5}, 10)  # its evaluation, after the save
    first.persist(storage)  # the attempt ends: what it has not delivered, handed over
    first.outbox.stopped = True
    second = StepLogger(uri, run_id, None, resumed_from=10, background=True,
                        carried=tracking_outbox.load(storage, tmp_path / "fa", 10))
    second.log({"top1": 0.6}, 10)  # the evaluation again
    for step in (11, 12):
        second.log({"loss": float(step)}, step)
    assert second.outbox.wait(scaled(30))
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "top1")] == [(10, 0.5)]
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(1, 13))
    assert [m.step for m in client.get_metric_history(run_id, "preemptions")] == [10]

    # (b) the store up: attempt 1 delivered as it went
    run_id = client.create_run(experiment).info.run_id
    first = StepLogger(uri, run_id, None, background=True)
    for step in range(1, 13):
        first.log({"loss": float(step)}, step)
        if step in (5, 10):
            first.log({"checkpoint_blocked_s": 0.1 * step}, step, event=True)
    assert first.outbox.wait(scaled(30))
    first.outbox.stopped = True
    second = StepLogger(uri, run_id, None, resumed_from=5, background=True)
    second.log({"preemption_steps_lost": 7.0}, 5, event=True)
    for step in range(6, 14):
        second.log({"loss": 100.0 + step}, step)
        if step == 10:
            second.log({"checkpoint_blocked_s": 2.0}, step, event=True)
    assert second.outbox.wait(scaled(30))
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "checkpoint_blocked_s")) == \
        [(5, 0.5), (10, 1.0), (10, 2.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == \
        [(s, float(s)) for s in range(1, 13)] + [(13, 113.0)]
    assert [m.step for m in client.get_metric_history(run_id, "preemption_steps_lost")] == [5]


# In the tier of the outage tests (`make test-cluster`): two jobs of their own Ray and a server stopped.
@pytest.mark.slow
@pytest.mark.cluster
def test_a_resume_with_the_store_away_trains_without_it_and_reopens_the_run_later(digits_root, tmp_path, monkeypatch,
                                                                                 restartable_mlflow):
    """A job stops at step 20 of 40 (train.stop_at_step: KILLED, resumable); the server goes; the same command again
    (all 40 steps) resumes without it: the run's storage names its MLflow run (no search of the store), its reopening
    is handed to rank 0 with one line, and training goes on while the server is away. The server comes back once the
    resume has trained its steps (rank 0 held before its final evaluation: the run cannot end first): the run is
    FINISHED, counted one resume (config_resume_1.yaml beside config.yaml), every step's loss in MLflow once, and each
    step applied once (run.audit_steps_to)."""
    for key, value in CLIENT_BUDGET.items():
        monkeypatch.setenv(key, value)
    server = restartable_mlflow
    client = MlflowClient(server.uri)
    audit = tmp_path / "steps.txt"
    common = [f"data.root={digits_root}", f"tracking.uri={server.uri}", f"run.storage_path={tmp_path / 'ray'}",
              f"run.experiment={EXPERIMENT}", "run.name=away", *SMALL, "train.log_every=1", "train.num_workers=1",
              "train.steps=40", "train.checkpoint_every=10", f"run.audit_steps_to={audit}"]
    job, log = start_job(tmp_path, [*common, "train.stop_at_step=20"], "first")
    with ended(job):
        assert job.wait(timeout=scaled(600)) == 0, log.read_text()[-3000:]
    rid = run_of(client, "away")
    assert client.get_run(rid).info.status == "KILLED"
    server.stop()
    final = Hold(tmp_path / "holds")
    job, log = start_job(tmp_path, common, "second", final)
    with ended(job):
        wait_for("the resume's steps with the server away, held before the final evaluation",
                 lambda: job.poll() is not None or final.held(), 300, 0.2)
        assert job.poll() is None, log.read_text()[-3000:]
        server.start()
        final.release()
        rc = job.wait(timeout=scaled(600))
        output = log.read_text()
        assert rc == 0, output[-5000:]
    assert f"[tracking] {server.uri} is away as the run resumes" in output and f"run {rid} goes on without it" in output
    ran = audited(audit)
    assert {a: [s for s, _ in steps] for a, steps in ran.items()} == {1: list(range(1, 21)), 2: list(range(21, 41))}
    run = client.get_run(rid)
    assert run.info.status == "FINISHED" and run.data.tags["probvlp.resumes"] == "1"
    assert {a.path for a in client.list_artifacts(rid)} >= {"config.yaml", "config_resume_1.yaml"}
    assert sorted(m.step for m in client.get_metric_history(rid, "loss")) == list(range(1, 41))
    assert [r.info.run_id for r in client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id],
                                                      filter_string="tags.`probvlp.run_name` = 'away'")] == [rid]


def test_registering_a_runs_model_again_makes_no_second_version(tmp_path):
    """`register_model_version` delivered twice (the outbox retries a call whose answer timed out after the store made
    the version): one version of the run's model, the same number both times; another run's model is a new one."""
    from pipelines.tracking.outbox import register_model_version

    uri = tracking.tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = MlflowClient(uri, registry_uri=uri)
    experiment = client.create_experiment("registry")
    first, second = (client.create_run(experiment).info.run_id for _ in range(2))
    assert register_model_version(uri, first, "probvlp-m") == register_model_version(uri, first, "probvlp-m") == "1"
    assert register_model_version(uri, second, "probvlp-m") == "2"
    assert sorted(int(v.version) for v in client.search_model_versions("name='probvlp-m'")) == [1, 2]


def test_a_resume_reopened_twice_by_its_try_and_its_queued_copy_counts_once(tmp_path):
    """A resume's reopening tried by the driver and cut short by an outage after some of its calls reached the store,
    then delivered from the queue: the same resume (its key), counted once; another resume is the next number."""
    from pipelines.tracking.outbox import reopen

    uri = tracking.tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = MlflowClient(uri)
    rid = client.create_run(client.create_experiment("reopen", tracking.sqlite_artifact_root(uri))).info.run_id
    client.set_terminated(rid, "KILLED")
    assert reopen(client, rid, "a: 1", "key-one") == 1
    client.set_terminated(rid, "KILLED")  # as if the rest of the try never happened: its queued copy comes
    assert reopen(client, rid, "a: 1", "key-one") == 1
    run = client.get_run(rid)
    assert run.info.status == "RUNNING" and run.data.tags["probvlp.resumes"] == "1"
    assert reopen(client, rid, "a: 2", "key-two") == 2
    assert client.get_run(rid).data.tags["probvlp.resumes"] == "2"
    assert {a.path for a in client.list_artifacts(rid)} == {"config_resume_1.yaml", "config_resume_2.yaml"}
