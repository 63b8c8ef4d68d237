"""Training at scale on a local Ray: exact resume and worker-failure recovery (ZeRO-1), a SIGTERM to a training worker
in the middle of a run (a notice of preemption) that ends bit for bit as an uninterrupted run, failures that end a run
(a loss that stays NaN, a final evaluation that cannot be computed), a worker no node can hold. The bit-exact runs
accumulate features over two micro-batches a step (train.grad_accum). Elastic runs:
tests/test_elastic.py. ZeRO-2, the default, trains the demo model in tests/test_pretrain.py; ZeRO-3 trains on user
shards in tests/test_user_data.py."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from mlflow import MlflowClient

from pipelines.config import STATE_DIR, ConfigError
from pipelines.train.config import load_train_config
from pipelines.train.job import run_pretrain
from tests.helpers import Hold, failed_evaluation_keeps_the_model, pretrain_beside, wait_for
from tests.test_preemption import no_notice, train_workers  # noqa: F401 - no_notice: a fixture
from tests.small_runs import (
    REFERENCE,
    ROOT,
    SMALL,
    assert_identical,
    audited,
    config,
    every_step_once,
    load_state,
)


def steps_logged(result, key="loss") -> list[int]:
    return [m.step for m in MlflowClient(result.mlflow_uri).get_metric_history(result.mlflow_run_id, key)]


def test_resume_and_worker_failure_recovery_are_bit_exact(ray_local, straight_small_run, tmp_path):
    """Stopped at step 10, resumed by running the same run name again; the resumed run then loses a worker at
    step 17 and Ray Train restarts it from the step-15 checkpoint. The final state equals an uninterrupted run's.
    Every step accumulates two micro-batches (small_runs.REFERENCE: train.grad_accum=2), so both restarts continue
    an epoch part way, at a step's first micro-batch."""
    common = [*REFERENCE, "train.log_every=1"]
    data = straight_small_run["data_root"]  # the reference run's samples, in its order
    first = run_pretrain(config(tmp_path, data, "resumed", *common, "train.stop_at_step=10"))
    assert first.metrics["step"] == 10
    resumed = run_pretrain(config(tmp_path, data, "resumed", *common, "train.fail_once_at_step=17",
                                  "run.max_failures=1"))
    assert resumed.metrics["step"] == 40
    assert resumed.mlflow_run_id == first.mlflow_run_id  # same MLflow run, continued

    a, b = load_state(resumed.checkpoint_path), load_state(straight_small_run["checkpoint"])
    assert any("optim_states" in name for name in a)
    assert assert_identical(a, b) > 20  # parameters, Adam moments and fp32 partitions, bit for bit
    run = MlflowClient(resumed.mlflow_uri).get_run(resumed.mlflow_run_id)
    assert run.data.params["train.contrastive_batch"] == "128"  # 32 x 2 micro-batches x 2 workers
    assert run.data.tags["probvlp.resumes"] == "1"
    assert run.data.tags["probvlp.resumed_from_step"] == "15"  # the failure restarted from the last checkpoint
    assert (STATE_DIR / "injected_failures" / f"{resumed.mlflow_run_id}.done").read_text() == "17"
    assert steps_logged(resumed) == list(range(1, 41))  # every step exactly once, across stop, resume and failure
    # each attempt said why it resumed: the new command on the run's storage, then the restart after the failure
    said = {k: json.loads(v) for k, v in run.data.tags.items() if k.startswith("probvlp.attempt.")}
    assert said["probvlp.attempt.2"]["why"] == "a new command on the run's storage"
    assert said["probvlp.attempt.2"]["steps_left"] == 30
    restart = said["probvlp.attempt.3"]
    assert restart["why"].startswith("rank 1 failed (RuntimeError: injected failure at step 17")
    assert (restart["resumed_from_step"], restart["reached"], restart["steps_again"]) == (15, 17, 2)
    assert run.info.status == "FINISHED"
    losses = [m.value for m in MlflowClient(resumed.mlflow_uri).get_metric_history(resumed.mlflow_run_id, "loss")]
    assert all(map(torch.isfinite, torch.tensor(losses))) and len(set(losses)) > 1  # stage 1 steps


def test_a_sigterm_mid_run_saves_at_the_next_step_resumes_there_and_ends_bit_for_bit(ray_local, straight_small_run,
                                                                                    no_notice, tmp_path):
    """SIGTERM to one of the two training workers in the middle of the run (once rank 0 has applied step 3 of 40):
    both ranks save at the next step boundary, wait, and Ray Train restarts them at the end of the grace period
    (run.sigterm_grace_s) as a preemption: with run.max_failures=0 the run still ends well. Rank 0 is held in the
    final evaluation (a Hold) until the restart has trained a step, so the SIGTERM cannot land after the last step
    however fast the run. Counted by the steps each attempt applied (run.audit_steps_to, not MLflow, which drops
    replays before they reach it): attempt 1 up to the notice's step, attempt 2 from the next one, no step trained
    twice; every key a step logs is in MLflow at every step once; the run resumed from the notice's own checkpoint;
    and its end state (parameters, Adam moments, fp32 partitions) equals the uninterrupted REFERENCE run's bit for
    bit."""
    audit, steps = tmp_path / "steps.txt", 40
    cfg = config(tmp_path, straight_small_run["data_root"], "sigterm", *REFERENCE, "train.log_every=1",
                 "run.max_failures=0", "run.sigterm_grace_s=3", f"run.audit_steps_to={audit}")
    final_evaluation = Hold(tmp_path / "hold")
    sent: dict = {}

    def terminate_a_worker() -> None:
        pids = wait_for("two training workers", lambda: len(pids := train_workers()) == 2 and pids, 300, 0.2)
        sent["after"] = wait_for("step 3 applied", lambda: (reached := max(
            (s for s, _ in audited(audit).get(1, [])), default=0)) >= 3 and reached, 300, 0.01)
        os.kill(pids[-1], signal.SIGTERM)
        # the final evaluation waits for this: the restart has come and trained
        wait_for("a step trained by the restart", lambda: 2 in audited(audit), 300, 0.2)

    result = pretrain_beside(cfg, terminate_a_worker, holds=(final_evaluation,))
    assert result.metrics["step"] == steps
    client = MlflowClient(result.mlflow_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    notices = {int(k.rsplit("_", 1)[1]): json.loads(v) for k, v in run.data.tags.items()
               if k.startswith("probvlp.preemption.step_")}
    assert len(notices) == 1, notices
    (noticed, notice), = notices.items()
    assert sent["after"] <= noticed < steps, (sent, noticed)  # at a step after the SIGTERM, before the last
    assert run.data.tags["probvlp.resumed_from_step"] == str(noticed)  # the notice's own checkpoint
    ran = {attempt: [s for s, _ in applied] for attempt, applied in audited(audit).items()}
    assert ran == {1: list(range(1, noticed + 1)), 2: list(range(noticed + 1, steps + 1))}, \
        {a: (s[0], s[-1], len(s)) for a, s in ran.items()}  # no step trained twice, none missed
    restart = json.loads(run.data.tags["probvlp.attempt.2"])
    assert "notice of preemption (SIGTERM)" in restart["why"] and restart["steps_again"] == 0, restart
    every_step_once(client, run.info.run_id, steps)
    history = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
               for key in ("preemptions", "preemption_save_s", "preemption_steps_lost")}
    assert history["preemptions"] == {noticed: 1} and history["preemption_steps_lost"] == {noticed: 0}
    assert 0 < history["preemption_save_s"][noticed] == pytest.approx(notice["save_s"], abs=1e-3)
    assert final_evaluation.held() == 1  # attempt 2 alone reached it
    assert assert_identical(load_state(result.checkpoint_path), load_state(straight_small_run["checkpoint"])) > 20
    print(f"SIGTERM once step {sent['after']} was applied: checkpoint of step {noticed} saved in {notice['save_s']:.2f} "
          f"s, steps {noticed + 1}-{steps} by the restart")


def test_non_finite_losses_are_skipped_then_fail_the_run_clearly(ray_local, digits_root, tmp_path):
    # An absurd learning rate overflows the weights within a few steps; every later loss is NaN. With no
    # retries (run.max_failures=0) the worker's error ends the run, and MLflow records it as failed.
    cfg = config(tmp_path, digits_root, "diverging", "train.steps=40", "train.lr=1e12", "train.warmup_steps=0",
                 "train.max_bad_batches=3", "train.log_every=1", "run.max_failures=0", "train.num_workers=1")
    with pytest.raises(Exception, match=r"loss was not finite for 3 batches in a row"):
        run_pretrain(cfg)
    client = MlflowClient(cfg.tracking.uri)
    run = client.search_runs([client.get_experiment_by_name("test-scale").experiment_id])[0]
    assert run.info.status == "FAILED"


def test_failed_final_evaluation_keeps_the_model(ray_local, digits_root, tmp_path):
    """Save before judging: a final evaluation that cannot be computed (ProLIP with more calibration bins than the
    eval sets have queries) fails the run with a one-line reason naming the task; the model is in MLflow. The run
    trains with the reader's augmentation (crop, jitter, flip in Ray Data's tasks)."""
    cfg = load_train_config(ROOT / "configs" / "prolip_tiny.yaml", [
        f"data.root={digits_root}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"run.storage_path={tmp_path}/ray",
        "run.name=eval_fails", "run.experiment=test-eval-failure", *SMALL, "train.num_workers=1", "train.steps=8",
        "eval.calibration_bins=100000", "data.augment=true", "data.augment_on=reader"])
    failed_evaluation_keeps_the_model(cfg, tmp_path)


def test_a_worker_that_no_node_can_hold_is_a_one_line_error(ray_local, digits_root, tmp_path):
    """GPUs asked on a Ray without any and without an autoscaler: said before training, not waited on forever."""
    with pytest.raises(ConfigError, match=r"^train: one training worker needs CPU 1, GPU 1, which no node of this "
                                          r"cluster offers \(node 127\.0\.0\.1 \w+: CPU \d+\)$"):
        run_pretrain(config(tmp_path, digits_root, "gpu", "train.use_gpu=true"))
