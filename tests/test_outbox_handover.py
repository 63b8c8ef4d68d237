"""What rank 0 has not delivered to MLflow travels with every checkpoint, whatever kind of save wrote it (the one
order: the outbox first, then the snapshot and its registration): a node lost hard during a tracking outage (SIGKILL:
no failure path runs, nothing is handed over at the end) costs no metric, after a periodic save or during a notice's."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipelines.storage import run_folder
from pipelines.tracking.runs import RUN_RECORD
from pipelines.fit.faults import ATTEMPT_START, NOTICE_SAVED, released_file
from tests.helpers import Hold, pretrain_beside, registered, wait_for
from tests.small_runs import REFERENCE, config
from tests.test_preemption import audited, journal, train_workers

STEPS = 40  # REFERENCE: a checkpoint every 5 steps


def loss_steps(client: MlflowClient, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "loss"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_lost_hard_during_an_outage_loses_no_metric(ray_local, digits_root, restartable_mlflow, tmp_path):
    """The tracking server stops once the driver has made the run: rank 0 queues everything it logs.
    - Attempt 1: once Ray Train has registered a periodic checkpoint past the step the run had reached then, the
      training worker is killed (SIGKILL), the server still away: only what that checkpoint carried of rank 0's
      queue survives.
    - Attempt 2 resumes from it (held as it begins while a notice file is written: it takes the notice at its first
      step) and saves the notice's checkpoint; rank 0 is held right after that save's registration (NOTICE_SAVED:
      where the evaluation, the file's hand-over and the wait for the deadline follow) and the worker is killed
      again: only what the notice's save carried survives.
    - Attempt 3 resumes from the notice's checkpoint, the server comes back, and MLflow holds every step's loss
      exactly once: the steps before each checkpoint from the queue it carried, the rest from the restarts.
    Rank 0 is held in the final evaluation (a Hold) until the test has acted: the run cannot end first, however fast.
    One worker: the queue is rank 0's alone (a second rank would add two process starts an attempt and nothing to
    what is handed over; two ranks' saves agreeing on a notice are tests/test_preemption.py's)."""
    server, audit, name, notice = restartable_mlflow, tmp_path / "steps.txt", "hardkill", tmp_path / "notice"
    cfg = config(tmp_path, digits_root, name, *REFERENCE, "train.num_workers=1", "train.log_every=1",
                 f"tracking.uri={server.uri}", "run.max_failures=2", f"run.audit_steps_to={audit}",
                 f"run.notice_file={notice}")
    client = MlflowClient(server.uri)
    made = Path(run_folder(str(tmp_path / "ray"), name))
    end, start = Hold(tmp_path / "hold"), Hold(tmp_path / "start", ATTEMPT_START)
    saved = Hold(tmp_path / "saved", NOTICE_SAVED)
    for stop in (1, 3):  # only attempt 2 is held as it begins
        released_file(start.folder, ATTEMPT_START, stop).touch()
    seen: dict = {}

    def run_id() -> str | None:
        exp = client.get_experiment_by_name("test-scale")
        runs = client.search_runs([exp.experiment_id], f"tags.`probvlp.run_name` = '{name}'") if exp else []
        return runs[0].info.run_id if runs else None

    def kill_workers(attempts: int) -> None:
        for pid in train_workers():
            os.kill(pid, signal.SIGKILL)
        wait_for(f"attempt {attempts + 1}", lambda: len(journal(tmp_path / "ray", name)) > attempts, 300, 0.1)

    def kill_during_an_outage() -> None:
        seen["run_id"] = wait_for("the run in MLflow", run_id, 300, 0.1)
        # the driver done making it (its params and config.yaml too): it records the run in the run's storage last
        wait_for("the run recorded in its storage", (made / RUN_RECORD).exists, 300, 0.1)
        server.stop()  # the workers start (seconds) while the server is away
        reached = max(audited(audit).get(1, [0]))
        # a registered checkpoint of a step after the outage began: its save persisted the queue first
        past = wait_for("a checkpoint registered after the outage began",
                        lambda: [n for n in registered(tmp_path / "ray" / name)
                                 if int(n.split("_")[1]) > reached], 300, 0.1)
        seen["checkpoint"] = int(past[-1].split("_")[1])
        seen["reached_at_outage"] = reached
        kill_workers(1)
        wait_for("attempt 2 held as it begins", lambda: start.held() >= 2, 300, 0.1)
        notice.write_text("600\n")  # seconds left: far more than the test needs
        released_file(start.folder, ATTEMPT_START, 2).touch()
        wait_for("rank 0 held after the notice's save", lambda: saved.held() >= 1, 300, 0.1)
        kill_workers(2)
        server.start()  # same port, same database

    result = pretrain_beside(cfg, kill_during_an_outage, holds=(end, start, saved))
    ran, attempts = audited(audit), journal(tmp_path / "ray", name)
    assert sorted(ran) == [1, 2, 3], ran
    resumed = ran[2][0] - 1  # from a checkpoint registered no earlier than the one the test saw
    assert resumed % 5 == 0 and resumed >= seen["checkpoint"], (ran[2][:3], seen)
    assert ran[1][-1] >= seen["checkpoint"] > seen["reached_at_outage"], (ran[1][-3:], seen)
    # attempt 2 trained one step, saved on the notice there, and attempt 3 resumed from that checkpoint
    assert ran[2] == [resumed + 1] and attempts[1]["notice"]["step"] == resumed + 1, (ran, attempts[1])
    assert ran[3][0] == resumed + 2 and attempts[2]["from_step"] == resumed + 1, (ran[3][:3], attempts[2])
    assert result.metrics["step"] == STEPS
    # every step once: each attempt's queued steps up to the checkpoint the next resumed from came with it
    assert loss_steps(client, seen["run_id"]) == list(range(1, STEPS + 1))
    print(f"server stopped at step {seen['reached_at_outage']}; killed after the checkpoint of step "
          f"{seen['checkpoint']} (attempt 1 reached {ran[1][-1]}), then after attempt 2's notice save at step "
          f"{resumed + 1}")
