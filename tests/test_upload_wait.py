"""Every wait for a checkpoint's registration is bounded (train.upload_timeout_s, pipelines.zero.checkpoint_files
.wait_for_uploads): an upload stuck on one rank fails the attempt in one line, and Ray Train restarts from the last
registered checkpoint (run.max_failures), instead of every rank waiting at the next save for ever."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import ray.train

from pipelines.config import ConfigError
from pipelines.zero import checkpoint_files as state
from pipelines.fit.attempts import Journal
from pipelines.storage import run_folder
from pipelines.zero.checkpoint_files import checkpoint_name
from tests.helpers import registered
from tests.pace import scaled
from tests.small_runs import config
from tests.test_guard_notice_loop import ONLY_ZEROSHOT, steps_trained
from tests.test_preemption import journal
from tests.test_registered_notice_save import RANK1_PART

TIMEOUT_S = 5  # train.upload_timeout_s of the run below
DEADLINE_S = 180  # the run's whole life on the reference machine, with room (it fails after ~30 s there)


def test_the_wait_passes_its_bound_to_ray_and_a_wait_that_long_is_an_error(monkeypatch, tmp_path):
    """Ray Train's get_all_reported_checkpoints returns what it has registered once its timeout_s passes, as it does
    when all is registered: the wait's length tells them apart. A knob below or at 0 is refused."""
    calls = []

    def ray_returns_after(seconds: float):
        def get_all_reported_checkpoints(**kwargs):
            calls.append(kwargs)
            time.sleep(seconds)
            return []
        return get_all_reported_checkpoints

    monkeypatch.setattr(ray.train, "get_all_reported_checkpoints", ray_returns_after(0.01))
    state.wait_for_uploads(7, 0.5)
    assert calls == [{"consistency_mode": ray.train.CheckpointConsistencyMode.COMMITTED, "timeout_s": 0.5}]
    monkeypatch.setattr(ray.train, "get_all_reported_checkpoints", ray_returns_after(0.5))
    with pytest.raises(state.UploadTimeout, match=r"^the checkpoint of step 7 not registered after 0\.\d s .*"
                                                  r"\(train.upload_timeout_s 0.5\): this attempt fails"):
        state.wait_for_uploads(7, 0.5)
    assert state.UPLOAD_TIMEOUT_S == 1800
    with pytest.raises(ConfigError, match="train.upload_timeout_s"):
        config(tmp_path, tmp_path, "x", "train.upload_timeout_s=0")


def end_the_run() -> list[int]:
    """SIGKILL to this process's Ray Train controller and workers (its Ray job's): the run's driver then fails at
    once (its controller died) instead of keeping this session's Ray busy for ever. Returns their pids."""
    from ray.util.state import list_actors

    context = ray.get_runtime_context()
    pids = [a.pid for cls in ("TrainController", "RayTrainWorker") for a in list_actors(context.gcs_address, filters=[
        ("class_name", "=", cls), ("state", "=", "ALIVE"), ("job_id", "=", context.get_job_id())], detail=True)]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


@pytest.mark.timeout(600)  # a backstop that only reports: its signal does not interrupt a driver inside ray.get
def test_an_upload_that_never_ends_fails_the_attempt_after_the_timeout(ray_local, digits_root, tmp_path):
    """A checkpoint every step, behind training. The file rank 1 uploads of step 1's checkpoint is a named pipe
    nobody reads (its open blocks): that checkpoint is never registered. Step 2 trains meanwhile; its save waits for
    the registration, TIMEOUT_S seconds, then every rank fails with one line naming the checkpoint and the wait, and
    with run.max_failures 0 the run ends there: no step 3, no checkpoint registered, one attempt. A wait without a
    bound never ends: the test's watchdog ends the run after DEADLINE_S (scaled) and the test fails saying so."""
    from pipelines.pretrain.job import run_pretrain

    name, audit = "stuck", tmp_path / "steps.txt"
    storage, snapshots = tmp_path / "ray", tmp_path / "snapshots"
    snapshots.mkdir()
    part = storage / name / checkpoint_name(1, 1) / "state" / RANK1_PART
    part.parent.mkdir(parents=True)
    os.mkfifo(part)
    cfg = config(tmp_path, digits_root, name, "train.steps=3", "train.log_every=1", "train.checkpoint_every=1",
                 "train.checkpoint_every_s=0", f"train.upload_timeout_s={TIMEOUT_S}", ONLY_ZEROSHOT,
                 "run.max_failures=0", f"run.audit_steps_to={audit}", f"train.checkpoint_snapshot_dir={snapshots}")
    done, ended = threading.Event(), []
    threading.Thread(target=lambda: done.wait(scaled(DEADLINE_S)) or ended.extend(end_the_run()), daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(Exception) as failed:
            run_pretrain(cfg)
    finally:
        done.set()
    took = time.monotonic() - start
    assert not ended, (f"the run still waited for step 1's upload {took:.0f} s after it started "
                       f"(train.upload_timeout_s {TIMEOUT_S}): ended by the test; the wait has no bound")
    line = re.compile(rf"UploadTimeout: the checkpoint of step 1 not registered after [\d.]+ s of waiting for every "
                      rf"rank's upload to run.storage_path \(train.upload_timeout_s {TIMEOUT_S}\): this attempt fails, "
                      r"and Ray Train restarts it from the last registered checkpoint while run.max_failures allows")
    assert line.search(str(failed.value)), str(failed.value)[-3000:]
    attempts = journal(storage, name)
    assert len(attempts) == 1, attempts
    failures = Journal.open(run_folder(str(storage), name), attempts[0]["job"]).failures(attempts[0])
    assert failures and all(line.fullmatch(f["error"]) for f in failures), failures  # each rank's, one line
    assert steps_trained(audit) == {1: [1, 2]}, steps_trained(audit)  # held at step 2's save, then failed
    assert registered(storage / name) == []
    print(f"\nthe run failed {took:.0f} s after it started (upload_timeout_s {TIMEOUT_S})")
