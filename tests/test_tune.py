"""Ray Tune sweeps: trials are TorchTrainer runs, ASHA stops bad ones, MLflow holds every trial, resume skips finished ones."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from functools import reduce
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from pipelines.config import STATE_DIR, ConfigError
from pipelines.pretrain.config import load_train_config
from pipelines.tune.config import load_tune_config

from tests.helpers import BUCKET
from tests.pace import scaled

ROOT = Path(__file__).resolve().parent.parent
# The six knobs of the probabilistic Llip, plus a learning rate with one hopeless value.
KNOBS = {
    "loss.params.eps": {"uniform": [-20.0, -5.0]},
    "loss.params.c": {"loguniform": [1.0, 1000.0]},
    "loss.params.alpha1": {"loguniform": [1.0e-8, 1.0e-5]},
    "loss.params.beta": {"loguniform": [1.0e-5, 1.0e-3]},
    "model.overrides.tau": {"uniform": [1.0, 10.0]},
    "model.overrides.mixture_tokens": {"choice": [2, 4]},
    "train.lr": {"choice": [5.0e-4, 1.0e-7]},  # 5e-4: prolip_llip_tiny.yaml's (2e-3 collapses it, docs/RESULTS.md)
}
PAPER = {"loss.params.eps": -10.0, "loss.params.c": 10.0, "loss.params.alpha1": 1.0e-7, "loss.params.beta": 1.0e-4,
         "model.overrides.tau": 5.0, "model.overrides.mixture_tokens": 4}
GOOD = {**PAPER, "train.lr": 5.0e-4}


def sweep_file(tmp: Path, data_root, name: str, num_samples: int, space=None, storage: str | None = None,
               **tune) -> Path:
    """The probabilistic Llip on user-style shards (no labels), 10-step trials, one at a time."""
    data = {
        "base": str(ROOT / "configs" / "user_data.yaml"),
        "overrides": [
            f"data.root={data_root}", f"tracking.uri=sqlite:///{tmp}/mlflow.db", "run.experiment=sweep-trials",
            "model.name=prolip_llip_tiny", "loss.name=prob_llip",
            # The first rung comes at step 5: ASHA's stop reaches a trial asynchronously (~1 s after its report
            # here), before the cut trial's last 5 steps and its final evaluation. The tiny model's held-out loss
            # at step 5 separates lr 5e-4 from the hopeless 1e-7 (7.0-7.8 in nine runs, against 8.97); later it
            # wanders as sigma^2 shrinks (7.1-8.7 at step 10, 2026-11-27), so which trial ends best is not asserted.
            "train.steps=10", "train.eval_every=5", "train.num_workers=1", "train.batch_size=64",
            "train.warmup_steps=2", "data.augment=false",
        ],
        "space": space or KNOBS,
        "tune": {"name": name, "num_samples": num_samples, "max_concurrent": 1, "storage_path": storage or str(tmp / "tune"),
                 "experiment": "sweeps", "points_to_evaluate": [GOOD], "grace_period": 1,
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
def test_sweep_on_user_shards_stops_bad_trials_survives_ctrl_c_and_resumes(user_shards, s3, one_sweep_at_a_time,
                                                                          tmp_path):
    """A 2-trial ASHA sweep over the six knobs on user-style shards, run as a user would, its storage (Tune's
    experiment and every trial's Ray Train run) on S3: the paper's point, then a sampled one (seeded: a hopeless
    learning rate). Interrupted with Ctrl-C once the first trial has ended, then the same command again: the ended
    trial is kept, not rerun, and the sampled one is cut at the first rung against the first trial's result from
    before the interruption (restored from S3); MLflow holds a parent run with every trial as a child."""
    root, _ = user_shards
    storage = f"{BUCKET}/tune-{tmp_path.name}"
    path = sweep_file(tmp_path, root, "two", num_samples=2, storage=f"s3://{storage}")
    best_out = tmp_path / "best.yaml"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [sys.executable, "-m", "jobs.tune", "--config", str(path), "--best-config-out", str(best_out)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = tmp_path / "first.log"
    with log.open("w") as out:
        first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + scaled(600)
    while time.monotonic() < deadline and first.poll() is None:
        if ended_trials(log):  # the progress lines
            break
        time.sleep(2)
    assert first.poll() is None, f"the sweep ended before it could be interrupted:\n{log.read_text()[-4000:]}"
    first.send_signal(signal.SIGINT)  # what Ctrl-C does
    assert first.wait(timeout=scaled(180)) == 130, log.read_text()[-3000:]
    done_before = ended_trials(log)
    assert len(done_before) == 1, log.read_text()[-3000:]
    assert "sweep 'two' interrupted, its state saved: run the same command again to resume it" in log.read_text()

    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(900))
    assert second.returncode == 0, second.stderr[-3000:]
    # progress lines, counting on from the trials that ended before the interruption
    assert "[sweep] trial 2/2 (100%)" in second.stdout and "heldout_loss/loss" in second.stdout

    s3.invalidate_cache()
    assert s3.ls(f"{storage}/two")  # Tune's experiment state, restored from there by the second command
    assert s3.glob(f"{storage}/two_train/*/checkpoint_*")  # the trials' Ray Train runs
    assert not (tmp_path / "tune").exists()
    client = MlflowClient(uri)
    parent = client.search_runs([client.get_experiment_by_name("sweeps").experiment_id])[0]
    runs = children(uri, "two")
    by_trial: dict[str, list] = {}
    for r in runs:
        by_trial.setdefault(r.data.tags["probvlp.trial_id"], []).append(r)
    assert len(by_trial) == 2
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
    # The sampled trial ran after the resume with the hopeless learning rate and was cut at the first rung against
    # the first trial's result: ASHA's rungs are restored with the sweep (Tune rebuilds its scheduler empty).
    after = [r for r in final if r.data.tags["probvlp.trial_id"] not in done_before]
    assert [float(r.data.params["train.lr"]) for r in after] == [1.0e-7], "the seeded sample changed"
    assert [r.data.tags["probvlp.trial_status"] for r in after] == ["stopped early"]
    # the scheduler's rungs stay with the driver (pipelines.tune.job), its storage being on S3: in the project's local
    # state folder ($PROBVLP_HOME, which tests/conftest.py sets and the job inherits)
    assert (STATE_DIR / "tune" / "two_asha_rungs.json").is_file()
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"results.csv", "results.md", "best_config.yaml", "metric_vs_knobs.png"} <= artifacts
    # The best trial is the one with the lowest final metric, and the best config carries its sampled knobs.
    parent = client.get_run(parent.info.run_id)
    best_run = min(final, key=lambda r: r.data.metrics["heldout_loss/loss"])
    assert parent.data.metrics["best_heldout_loss/loss"] == best_run.data.metrics["heldout_loss/loss"]
    best = yaml.safe_load(best_out.read_text())
    sampled = {knob: float(v) for knob, v in best_run.data.params.items() if knob in KNOBS}
    assert {knob: float(reduce(dict.__getitem__, knob.split("."), best)) for knob in KNOBS} == pytest.approx(sampled)
    assert best["model"]["name"] == "prolip_llip_tiny"
    # The best config is a complete pretraining config: it loads and validates as one.
    tokens = load_train_config(best_out).model.overrides["mixture_tokens"]
    assert type(tokens) is int and tokens == sampled["model.overrides.mixture_tokens"]


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
        load_tune_config(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_space_that_changes_the_data_the_trials_share_is_refused(tmp_path):
    """The driver prepares the digits and checks the eval tasks' data once, from the base config, and the trials skip
    it: a space value or point that would change either is refused before the preparation (values that leave them as
    they are pass)."""
    from pipelines.tune.job import check_trials_share_inputs

    def check(name, space, *overrides, points=()):
        path = sweep_file(tmp_path, tmp_path / "data", name, num_samples=2, space=space,
                          points_to_evaluate=list(points))
        doc = yaml.safe_load(path.read_text())
        doc["overrides"] += list(overrides)
        path.write_text(yaml.safe_dump(doc))
        check_trials_share_inputs(*load_tune_config(path))

    check("shards", {"data.image_size": {"choice": [32, 64]}, "train.lr": {"loguniform": [1e-4, 1e-3]}})
    check("same_digits", {"data.image_size": {"choice": [32]}}, "data.source=digits", "data.image_size=32")
    refused = [
        ("digits", {"data.image_size": {"choice": [32, 64]}}, ["data.source=digits"], [], "space.data.image_size: "),
        ("root", {"data.root": {"choice": [str(tmp_path / "a")]}}, [], [], "space.data.root: "),
        ("point", {"data.image_size": {"choice": [32]}}, ["data.source=digits", "data.image_size=32"],
         [{"data.image_size": 48}], "tune.points_to_evaluate[0]: "),
    ]
    for name, space, overrides, points, where in refused:
        with pytest.raises(ConfigError) as err:
            check(name, space, *overrides, points=points)
        assert str(err.value).startswith(where) and "prepared once" in str(err.value) and "\n" not in str(err.value)


def test_jobs_tune_says_a_bad_space_in_one_line_without_importing_ray(tmp_path, digits_root):
    space, message = BAD_SPACES[0]
    path = sweep_file(tmp_path, digits_root, "bad", num_samples=2, space=space, points_to_evaluate=[])
    proc = subprocess.run([sys.executable, "-c", "import sys, jobs.tune as t; rc = t.main(sys.argv[1:]); "
                           "print('ray imported' if 'ray' in sys.modules else 'no ray'); sys.exit(rc)",
                           "--config", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 2 and proc.stdout.strip() == "no ray"
    assert proc.stderr.strip().startswith("config error: ") and message in proc.stderr


def test_asha_rungs_outlive_the_scheduler(tmp_path):
    """Tune rebuilds its scheduler empty on resume; ResumableASHA reads its rungs back, so a trial after the resume
    is cut against the trials before it (an empty ASHA lets it through: the control)."""
    from types import SimpleNamespace

    from pipelines.tune.asha import ResumableASHA

    state = tmp_path / "rungs.json"

    def scheduler() -> ResumableASHA:
        asha = ResumableASHA(state_file=str(state), max_t=15, grace_period=5, reduction_factor=2)
        asha.set_search_properties("heldout_loss/loss", "min")
        return asha

    good, bad, late = (SimpleNamespace(trial_id=name) for name in ("good", "bad", "late"))
    first = scheduler()
    for trial in (good, bad):
        first.on_trial_add(None, trial)
    assert first.on_trial_result(None, good, {"step": 5, "heldout_loss/loss": 7.0}) == "CONTINUE"
    assert first.on_trial_result(None, bad, {"step": 5, "heldout_loss/loss": 9.0}) == "STOP"
    assert first.on_trial_result(None, good, {"step": 10, "heldout_loss/loss": 6.0}) == "CONTINUE"
    resumed = scheduler()
    resumed.on_trial_add(None, late)
    assert resumed.on_trial_result(None, late, {"step": 4, "heldout_loss/loss": 9.0}) == "CONTINUE"  # before the rung
    assert resumed.on_trial_result(None, late, {"step": 5, "heldout_loss/loss": 9.0}) == "STOP"
    state.unlink()
    empty = scheduler()
    empty.on_trial_add(None, late)
    assert empty.on_trial_result(None, late, {"step": 5, "heldout_loss/loss": 9.0}) == "CONTINUE"
