"""A tracking store that hangs (tests/multinode.py's `hanging_store`: it accepts the connection and never answers, as a
stuck proxy or a server whose workers are all busy) against two rules of docs/SCALING.md section 4: training never
waits for the store, and neither does a restart or a resume (nothing on the way to the first step reads it). A port
that refuses at once cannot show either: a caller that tries the store there and catches the error returns at once,
as if it had not tried. Against this store a call returns only after MLflow's request timeout, set to 10 minutes
here, so a caller that tried the store is still waiting when the test looks. What is shown is counted, not clocked:
the connections the store accepted and still holds when each log call returns, and the thread of every request made;
the one deadline (the logging thread's end, far below the request timeout) only bounds how long a failure takes to
show."""
from __future__ import annotations

import threading

from mlflow import MlflowClient
from mlflow.entities import Metric, RunTag

import pipelines.tracking as tracking
import pipelines.tracking.logger as tracking_logger
from pipelines.tracking import StepLogger
from pipelines.tracking.outbox import LOGGED_THROUGH_TAG, UNREACHABLE_METRIC, load, metrics_op, write_pending
from tests.pace import scaled

# MLflow's timeout for one request in this test: a call to the hanging store returns after it (never, for the test)
REQUEST_TIMEOUT_S = 600
# The logging thread's end, on the reference machine (x4 at most on a slow one: still far below REQUEST_TIMEOUT_S)
DEADLINE_S = 30
STEPS = 500  # logged by attempt 2 after its resume step (5)


def test_a_restart_logs_every_step_while_the_store_holds_its_one_request(hanging_store, http_calls, tmp_path,
                                                                        monkeypatch):
    """Attempt 2 of a run resumes from step 5 with the store hanging: its rank-0 logger (resumed_from=5, background,
    carrying what attempt 1's checkpoint held undelivered) is made and logs its resume step's metric, steps 6-505 and
    a tag, all while the store holds the one request it received, the outbox thread's read of the run: at every log
    call's return the store had accepted one connection and still held it; no request came from the logging thread;
    everything is queued (nothing dropped, nothing delivered). The logging thread ends within a deadline far below
    the request timeout. Then the store answers (it is back, at another address here): the carried calls and the new
    steps are delivered once, attempt 1's steps kept and their replays dropped."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", str(REQUEST_TIMEOUT_S))  # wins over the outbox's own 30 s
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setattr(tracking_logger, "OUTBOX_DIR", tmp_path / "outbox")
    store = tracking.tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("hangs", tracking.sqlite_artifact_root(store))).info.run_id
    # attempt 1 delivered steps 1-8 and its node went; its checkpoint of step 5 had carried steps 4-5 (and a tag),
    # not delivered at that moment
    client.log_batch(run_id, metrics=[Metric("loss", float(s), 1000 + s, s) for s in range(1, 9)],
                     tags=[RunTag(LOGGED_THROUGH_TAG, "8")])
    storage = str(tmp_path / "storage" / "tracking_outbox")
    write_pending(storage, run_id, hanging_store.uri,
                  [*(metrics_op([Metric("loss", float(s), 1000 + s, s)], 0) for s in (4, 5)),
                   {"tag": ["probvlp.carried", "from attempt 1"]}], tmp_path / "files", unreachable_s=1.5)
    carried = load(storage, tmp_path / "carried", 5)
    assert carried is not None and len(list(carried[1])) == 3

    returned: list[tuple[int, int]] = []  # (connections accepted, connections held) as each log call returned
    made: dict = {}

    def attempt_2() -> None:
        try:
            logger = made["logger"] = StepLogger(hanging_store.uri, run_id, None, resumed_from=5, background=True,
                                                 carried=carried)
            # the store holds a request from here on (the outbox thread's read of the run): every call below is
            # made while it does
            hanging_store.wait_requests(1, DEADLINE_S)
            logger.log({"preemption_steps_lost": 0.0}, 5)
            for step in range(6, 6 + STEPS):
                logger.log({"loss": 100.0 + step, "lr": 1.0 / step}, step)
                returned.append((hanging_store.accepted, hanging_store.held()))
            logger.tag("probvlp.attempt.2", "resumed from step 5")
        except BaseException as error:  # noqa: BLE001 - raised by the test below
            made["error"] = error

    logging = threading.Thread(target=attempt_2, name="attempt-2-loop", daemon=True)
    logging.start()
    logging.join(scaled(DEADLINE_S))
    assert not logging.is_alive(), (f"the logging thread is waiting (for the store?) after {len(returned)} of {STEPS} "
                                    f"steps; the store received {hanging_store.requests}")
    assert "error" not in made, made.get("error")
    assert len(returned) == STEPS
    assert set(returned) == {(1, 1)}, "a log call returned only once the store had more connections, or none held"
    [held] = hanging_store.requests  # the one request: the outbox thread's read of the run, still unanswered
    assert held.startswith("GET /api/2.0/mlflow/runs/get") and hanging_store.held() == 1, hanging_store.requests
    to_store = [(thread.name, url) for thread, _, url in http_calls if url.startswith(hanging_store.uri)]
    assert {name for name, _ in to_store} == {f"probvlp-tracking-{run_id[:8]}"}, to_store  # the outbox's thread alone
    logger = made["logger"]
    queued = logger.outbox.snapshot()
    assert len(queued) == 3 + 1 + STEPS + 1, len(queued)  # carried, the resume step, the steps, the tag

    # the store is back (at another address here): the held read fails, the thread reads the run and delivers
    logger.outbox.client = MlflowClient(store)
    hanging_store.release()
    assert logger.outbox.wait(scaled(60)), "the outbox did not deliver once the store answered"
    report = logger.close()
    assert report.kept_in is None and report.undelivered == {"metrics": 0, "tags": 0, "artifacts": 0, "other": 0}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == \
        [(s, float(s)) for s in range(1, 9)] + [(s, 100.0 + s) for s in range(9, 6 + STEPS)]
    assert [m.step for m in client.get_metric_history(run_id, "lr")] == list(range(6, 6 + STEPS))
    assert [m.step for m in client.get_metric_history(run_id, "preemption_steps_lost")] == [5]
    run = client.get_run(run_id)
    assert run.data.tags["probvlp.carried"] == "from attempt 1"
    assert run.data.tags["probvlp.attempt.2"] == "resumed from step 5"
    assert run.data.tags[LOGGED_THROUGH_TAG] == str(5 + STEPS)
    # attempt 1's share of the outage travelled with its queue (the hanging store's own is counted once a call fails)
    assert report.unreachable_s >= 1.5 and run.data.metrics[UNREACHABLE_METRIC] == round(report.unreachable_s, 1)
