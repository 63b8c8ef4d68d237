"""What rank 0 has not delivered to MLflow travels with every periodic checkpoint: a node lost hard during a tracking
outage (SIGKILL: no failure path runs, nothing is handed over at the end) costs no metric."""
from __future__ import annotations

import os
import signal

import pytest
from mlflow import MlflowClient

from tests.helpers import Hold, pretrain_beside, registered, wait_for
from tests.small_runs import REFERENCE, config
from tests.test_preemption import audited, journal, train_workers

STEPS = 40  # REFERENCE: a checkpoint every 5 steps


def loss_steps(client: MlflowClient, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "loss"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_lost_hard_during_an_outage_loses_no_metric(ray_local, digits_root, restartable_mlflow, tmp_path):
    """The tracking server stops once the driver has made the run: rank 0 queues everything it logs. Once Ray Train
    has registered a periodic checkpoint past the step the run had reached then, both training workers are killed
    (SIGKILL), the server still away: only what that checkpoint carried of rank 0's queue survives. The restart
    resumes from it, trains with the server away, the server comes back, and MLflow holds every step's loss exactly
    once: the steps before the checkpoint from the queue it carried, the rest from the restart. Rank 0 is held in the
    final evaluation (a Hold) until the test has acted: the run cannot end first, however fast."""
    server, audit, name = restartable_mlflow, tmp_path / "steps.txt", "hardkill"
    cfg = config(tmp_path, digits_root, name, *REFERENCE, "train.log_every=1", f"tracking.uri={server.uri}",
                 "run.max_failures=1", f"run.audit_steps_to={audit}")
    client = MlflowClient(server.uri)
    end = Hold(tmp_path / "hold")
    seen: dict = {}

    def run_id() -> str | None:
        exp = client.get_experiment_by_name("test-scale")
        runs = client.search_runs([exp.experiment_id], f"tags.`probvlp.run_name` = '{name}'") if exp else []
        return runs[0].info.run_id if runs else None

    def kill_during_an_outage() -> None:
        seen["run_id"] = wait_for("the run in MLflow", run_id, 300, 0.1)
        server.stop()  # the driver made the run; the workers start (seconds) while the server is away
        reached = max(audited(audit).get(1, [0]))
        # a registered checkpoint of a step after the outage began: its save persisted the queue first
        past = wait_for("a checkpoint registered after the outage began",
                        lambda: [n for n in registered(tmp_path / "ray" / name)
                                 if int(n.split("_")[1]) > reached], 300, 0.1)
        seen["checkpoint"] = int(past[-1].split("_")[1])
        seen["reached_at_outage"] = reached
        for pid in train_workers():
            os.kill(pid, signal.SIGKILL)
        wait_for("the restart", lambda: len(journal(tmp_path / "ray", name)) >= 2, 300, 0.1)
        server.start()  # same port, same database

    result = pretrain_beside(cfg, kill_during_an_outage, holds=(end,))
    ran = audited(audit)
    assert sorted(ran) == [1, 2], ran
    resumed = ran[2][0] - 1  # from a checkpoint registered no earlier than the one the test saw
    assert resumed % 5 == 0 and resumed >= seen["checkpoint"], (ran[2][:3], seen)
    assert ran[1][-1] >= seen["checkpoint"] > seen["reached_at_outage"], (ran[1][-3:], seen)
    assert result.metrics["step"] == STEPS
    # every step once: attempt 1's queued steps up to the checkpoint came with it, the rest from attempt 2
    assert loss_steps(client, seen["run_id"]) == list(range(1, STEPS + 1))
    print(f"server stopped at step {seen['reached_at_outage']}; killed after the checkpoint of step "
          f"{seen['checkpoint']} (attempt 1 reached {ran[1][-1]}); attempt 2 from step {ran[2][0]}")
