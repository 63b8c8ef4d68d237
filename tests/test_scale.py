"""Training at scale on a local Ray: one run through a resume, a worker failure and a SIGTERM to a training worker in
the middle of it (a notice of preemption) that ends bit for bit as an uninterrupted run (ZeRO-1), failures that end a run
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
from pipelines.pretrain.config import load_train_config
from pipelines.pretrain.job import run_pretrain
from tests.helpers import Hold, failed_evaluation_keeps_the_model, pretrain_beside, wait_for
from tests.test_preemption import train_workers
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


def test_a_resume_a_worker_failure_and_a_sigterm_mid_run_end_bit_for_bit(ray_local, straight_small_run, no_notice,
                                                                          tmp_path):
    """One run through every way a run restarts, ending as the uninterrupted REFERENCE run, bit for bit (parameters,
    Adam moments and fp32 partitions). Every step accumulates two micro-batches (train.grad_accum=2), so each restart
    continues an epoch part way, at a step's first micro-batch.
    - Stopped at step 10 (train.stop_at_step), then resumed by running the same run name again.
    - The resumed run loses a worker at step 17 (train.fail_once_at_step) and Ray Train restarts it from the step-15
      checkpoint (run.max_failures=1).
    - Once the restart has applied step 20, SIGTERM to one of the two training workers: both ranks save at the next
      step boundary and Ray Train restarts them at the end of the grace period (run.sigterm_grace_s) as a
      preemption, which max_failures does not count. Rank 0 is held in the final evaluation (a Hold) until that
      restart has trained a step, so the SIGTERM cannot land after the last step however fast the run.
    Counted by the steps each attempt applied (run.audit_steps_to, not MLflow, which drops replays before they reach
    it): no step missed, none trained twice but the failure's two; every key a step logs is in MLflow at every step
    once; each attempt said why it resumed."""
    common = [*REFERENCE, "train.log_every=1"]
    audit, steps = tmp_path / "steps.txt", 40
    data = straight_small_run["data_root"]  # the reference run's samples, in its order
    first = run_pretrain(config(tmp_path, data, "resumed", *common, "train.stop_at_step=10"))
    assert first.metrics["step"] == 10
    cfg = config(tmp_path, data, "resumed", *common, "train.fail_once_at_step=17", "run.max_failures=1",
                 "run.sigterm_grace_s=3", f"run.audit_steps_to={audit}")
    final_evaluation = Hold(tmp_path / "hold")
    sent: dict = {}

    def terminate_a_worker() -> None:
        sent["after"] = wait_for("step 20 applied after the failure's restart", lambda: (reached := max(
            (s for s, _ in audited(audit).get(3, [])), default=0)) >= 20 and reached, 300, 0.01)
        pids = wait_for("two training workers", lambda: len(pids := train_workers()) == 2 and pids, 60, 0.2)
        os.kill(pids[-1], signal.SIGTERM)
        # the final evaluation waits for this: the restart has come and trained
        wait_for("a step trained by the notice's restart", lambda: 4 in audited(audit), 300, 0.2)

    resumed = pretrain_beside(cfg, terminate_a_worker, holds=(final_evaluation,))
    assert resumed.metrics["step"] == steps
    assert resumed.mlflow_run_id == first.mlflow_run_id  # same MLflow run, continued
    a, b = load_state(resumed.checkpoint_path), load_state(straight_small_run["checkpoint"])
    assert any("optim_states" in name for name in a)
    assert assert_identical(a, b) > 20  # parameters, Adam moments and fp32 partitions, bit for bit

    client = MlflowClient(resumed.mlflow_uri)
    run = client.get_run(resumed.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.contrastive_batch"] == "128"  # 32 x 2 micro-batches x 2 workers
    assert run.data.tags["probvlp.resumes"] == "1"  # one new command; the restarts are within it
    assert (STATE_DIR / "injected_failures" / f"{resumed.mlflow_run_id}.done").read_text() == "17"
    notices = {int(k.rsplit("_", 1)[1]): json.loads(v) for k, v in run.data.tags.items()
               if k.startswith("probvlp.preemption.step_")}
    assert len(notices) == 1, notices
    (noticed, notice), = notices.items()
    assert sent["after"] <= noticed < steps, (sent, noticed)  # at a step after the SIGTERM, before the last
    assert run.data.tags["probvlp.resumed_from_step"] == str(noticed)  # the notice's own checkpoint
    ran = {attempt: [s for s, _ in applied] for attempt, applied in audited(audit).items()}
    assert ran == {2: list(range(11, 18)), 3: list(range(16, noticed + 1)), 4: list(range(noticed + 1, steps + 1))}, \
        {a: (s[0], s[-1], len(s)) for a, s in ran.items()}  # the failure's 16-17 twice; none else, none missed
    # each attempt said why it resumed: the new command on the run's storage, the failure, the notice
    said = {k: json.loads(v) for k, v in run.data.tags.items() if k.startswith("probvlp.attempt.")}
    assert said["probvlp.attempt.2"]["why"] == "a new command on the run's storage"
    assert said["probvlp.attempt.2"]["steps_left"] == 30
    restart = said["probvlp.attempt.3"]
    assert restart["why"].startswith("rank 1 failed (RuntimeError: injected failure at step 17")
    assert (restart["resumed_from_step"], restart["reached"], restart["steps_again"]) == (15, 17, 2)
    notice_restart = said["probvlp.attempt.4"]
    assert "notice of preemption (SIGTERM)" in notice_restart["why"] and notice_restart["steps_again"] == 0
    every_step_once(client, run.info.run_id, steps, stopped_at=(10,))  # across stop, resume, failure, notice
    history = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
               for key in ("preemptions", "preemption_save_s", "preemption_steps_lost")}
    assert history["preemptions"] == {noticed: 1} and history["preemption_steps_lost"] == {noticed: 0}
    assert 0 < history["preemption_save_s"][noticed] == pytest.approx(notice["save_s"], abs=1e-3)
    assert final_evaluation.held() == 1  # attempt 4 alone reached it
    losses = [m.value for m in client.get_metric_history(resumed.mlflow_run_id, "loss")]
    assert all(map(torch.isfinite, torch.tensor(losses))) and len(set(losses)) > 1  # stage 1 steps
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
