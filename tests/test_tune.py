"""Ray Tune sweeps: trials are TorchTrainer runs, ASHA stops bad ones, MLflow holds every trial, resume skips finished ones."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from pipelines.config import ConfigError, load_config
from pipelines.train.sweep import load_sweep

ROOT = Path(__file__).resolve().parent.parent
# The six knobs of the probabilistic Llip, plus a learning rate with one hopeless value.
KNOBS = {
    "loss.params.eps": {"uniform": [-20.0, -5.0]},
    "loss.params.c": {"loguniform": [1.0, 1000.0]},
    "loss.params.alpha1": {"loguniform": [1.0e-8, 1.0e-5]},
    "loss.params.beta": {"loguniform": [1.0e-5, 1.0e-3]},
    "model.overrides.tau": {"uniform": [1.0, 10.0]},
    "model.overrides.mixture_tokens": {"choice": [2, 4]},
    "train.lr": {"choice": [2.0e-3, 1.0e-7]},
}
PAPER = {"loss.params.eps": -10.0, "loss.params.c": 10.0, "loss.params.alpha1": 1.0e-7, "loss.params.beta": 1.0e-4,
         "model.overrides.tau": 5.0, "model.overrides.mixture_tokens": 4}
GOOD, BAD = {**PAPER, "train.lr": 2.0e-3}, {**PAPER, "train.lr": 1.0e-7}


def sweep_file(tmp: Path, data_root, name: str, num_samples: int, space=None, **tune) -> Path:
    """The probabilistic Llip on user-style shards (no labels), 20-step trials, one at a time."""
    data = {
        "base": str(ROOT / "configs" / "user_data.yaml"),
        "overrides": [
            f"data.root={data_root}", f"tracking.uri=sqlite:///{tmp}/mlflow.db", "run.experiment=sweep-trials",
            "model.name=prolip_llip_tiny", "loss.name=prob_llip",
            # The first rung comes at step 5: ASHA's stop reaches a trial asynchronously, and on a loaded machine
            # the 10 steps left after a rung at step 10 could finish before it (the cut trial then completes).
            "train.steps=20", "train.eval_every=5", "train.num_workers=1", "train.batch_size=64",
            "train.warmup_steps=2", "data.augment=false",
        ],
        "space": space or KNOBS,
        "tune": {"name": name, "num_samples": num_samples, "max_concurrent": 1, "storage_path": str(tmp / "tune"),
                 "experiment": "sweeps", "points_to_evaluate": [GOOD, BAD], "grace_period": 1,
                 # Held-out loss separates a learning trial from a frozen one from the first report on,
                 # while retrieval of the tiny model is still near chance then.
                 "metric": "heldout_loss/loss", "mode": "min", **tune},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def children(uri: str, sweep: str) -> list:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("sweep-trials")
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], filter_string=f"tags.`probvlp.sweep` = '{sweep}'")


def ended_trials(log: Path) -> set[str]:
    """Trial ids that the sweep's progress lines report as ended."""
    return set(re.findall(r"\| trial (\S+) ended", log.read_text()))


@pytest.mark.timeout(2400)
def test_sweep_on_user_shards_stops_bad_trials_survives_ctrl_c_and_resumes(user_shards, tmp_path):
    """A 3-trial ASHA sweep over the six knobs on user-style shards, run as a user would: interrupted with
    Ctrl-C once two trials have ended (the hopeless learning rate cut at the first rung), then the same
    command again: ended trials are kept, not rerun; MLflow holds a parent run with every trial as a child."""
    root, _ = user_shards
    path = sweep_file(tmp_path, root, "three", num_samples=3)
    best_out = tmp_path / "best.yaml"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [sys.executable, "-m", "jobs.tune", "--config", str(path), "--best-config-out", str(best_out)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = tmp_path / "first.log"
    with log.open("w") as out:
        first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and first.poll() is None:
        if len(ended_trials(log)) >= 2:  # the progress lines: a trial cut by ASHA ends without finishing its run
            break
        time.sleep(2)
    assert first.poll() is None, "the sweep ended before it could be interrupted"
    first.send_signal(signal.SIGINT)  # what Ctrl-C does
    first.wait(timeout=180)
    done_before = ended_trials(log)
    assert 2 <= len(done_before) < 3, log.read_text()[-3000:]

    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    # progress lines, counting on from the trials that ended before the interruption
    assert "[sweep] trial 3/3 (100%)" in second.stdout and "heldout_loss/loss" in second.stdout

    client = MlflowClient(uri)
    parent = client.search_runs([client.get_experiment_by_name("sweeps").experiment_id])[0]
    runs = children(uri, "three")
    by_trial: dict[str, list] = {}
    for r in runs:
        by_trial.setdefault(r.data.tags["probvlp.trial_id"], []).append(r)
    assert len(by_trial) == 3
    for trial_id in done_before:
        assert len(by_trial[trial_id]) == 1  # not rerun
        assert "probvlp.resumes" not in by_trial[trial_id][0].data.tags
    # a trial interrupted mid-run may have an earlier, unfinished run beside the one that completed it
    final = []
    for rs in by_trial.values():
        rs = sorted((client.get_run(r.info.run_id) for r in rs), key=lambda r: r.info.start_time)
        final.append(rs[-1])
        for left in rs[:-1]:
            assert left.info.status == "KILLED" and left.data.tags["probvlp.trial_status"] == "interrupted"
    assert {r.data.tags["mlflow.parentRunId"] for r in final} == {parent.info.run_id}
    for r in final:
        assert set(KNOBS) <= set(r.data.params)  # eps, c, alpha, beta, tau, K (and lr) as sampled
        assert {"heldout/rsum", "heldout_loss/loss"} <= set(r.data.metrics)
        assert not any("top1" in k for k in r.data.metrics)  # no labels, no zero-shot
        steps = [m.step for m in client.get_metric_history(r.info.run_id, "loss")]
        assert steps == sorted(set(steps))
    assert len({r.data.metrics["heldout/rsum"] for r in final}) > 1  # the trials' retrieval differs
    statuses = [r.data.tags["probvlp.trial_status"] for r in final]
    assert "stopped early" in statuses and "completed" in statuses
    lrs = {float(r.data.params["train.lr"]) for r in final if r.data.tags["probvlp.trial_status"] == "stopped early"}
    assert 1.0e-7 in lrs  # the hopeless learning rate was cut at the first rung
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"results.csv", "results.md", "best_config.yaml", "metric_vs_knobs.png"} <= artifacts
    parent = client.get_run(parent.info.run_id)
    assert parent.data.metrics["best_heldout_loss/loss"] < min(r.data.metrics["heldout_loss/loss"] for r in final
                                                              if float(r.data.params["train.lr"]) < 1e-6)

    best = yaml.safe_load(best_out.read_text())
    assert best["train"]["lr"] == pytest.approx(2.0e-3) and best["model"]["name"] == "prolip_llip_tiny"
    # The best config is a complete pretraining config: it loads and validates as one.
    assert load_config(best_out).model.overrides["mixture_tokens"] == GOOD["model.overrides.mixture_tokens"]


BAD_SPACES = [
    ({"train.nope": {"uniform": [0, 1]}}, "space.train.nope: not a config key"),
    ({"train.lr": {"uniform": [0.1, 0.01]}}, "low must be < high"),
    ({"model.name": {"uniform": [0, 1]}}, "space.model.name: 0.0 is not valid here (uniform needs a numeric field)"),
    ({"loss.params.bogus": {"choice": [1, 2]}}, "space.loss.params.bogus: not a config key"),
    ({"train.lr": {"loguniform": [0, 1]}}, "loguniform: low must be > 0"),
]


@pytest.mark.parametrize("space, message", BAD_SPACES)
def test_invalid_search_space_fails_before_any_trial(tmp_path, digits_root, space, message):
    path = sweep_file(tmp_path, digits_root, "bad", num_samples=2, space=space, points_to_evaluate=[])
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_jobs_tune_says_a_bad_space_in_one_line_without_importing_ray(tmp_path, digits_root):
    space, message = BAD_SPACES[0]
    path = sweep_file(tmp_path, digits_root, "bad", num_samples=2, space=space, points_to_evaluate=[])
    proc = subprocess.run([sys.executable, "-c", "import sys, jobs.tune as t; rc = t.main(sys.argv[1:]); "
                           "print('ray imported' if 'ray' in sys.modules else 'no ray'); sys.exit(rc)",
                           "--config", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout.strip() == "no ray"
    assert proc.stderr.strip().startswith("config error: ") and message in proc.stderr
