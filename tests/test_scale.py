"""Training at scale on a local Ray: exact resume and worker-failure recovery (ZeRO-1), failures that end a run (a
loss that stays NaN, a final evaluation that cannot be computed), a worker no node can hold. The bit-exact runs
accumulate features over two micro-batches a step (train.grad_accum). Elastic runs:
tests/test_elastic.py. ZeRO-2, the default, trains the demo model in tests/test_pretrain.py; ZeRO-3 trains on user
shards in tests/test_user_data.py."""
from __future__ import annotations

import json

import pytest
import torch
from mlflow import MlflowClient

from pipelines.config import STATE_DIR, ConfigError
from pipelines.train.config import load_train_config
from pipelines.train.job import run_pretrain
from tests.helpers import failed_evaluation_keeps_the_model
from tests.small_runs import (
    REFERENCE,
    ROOT,
    SMALL,
    assert_identical,
    config,
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
