"""The no-progress guard of pipelines.pretrain.worker (run.max_notices_without_progress): a run whose attempts keep
ending by a notice before they train a step stops with NoticeLoop instead of restarting for ever; an attempt that
trained a step, or that a kill without a notice ended, is no notice loop. Each run is held as each attempt begins (faults.ATTEMPT_START, before its first step)
so that what the test does to an attempt (a kill, a notice file written again) happens before that attempt's first
step whatever the machine's speed; and each test bounds the attempts it acts on, so that a run without its guard
ends (and fails the test) instead of looping. One training worker: the guard is rank 0's count of the journal's
attempts (a second rank adds two process starts an attempt; the ranks agreeing on a notice are test_preemption's)."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from pipelines.config import RunStopped
from pipelines.storage import run_folder
from pipelines.fit.faults import ATTEMPT_START, released_file
from tests.helpers import Hold, pretrain_beside, wait_for
from tests.small_runs import config
from tests.test_preemption import journal, train_workers

# the digits' zero-shot task alone: the final evaluation of a run that gets there, no more than it needs
ONLY_ZEROSHOT = ('eval.tasks=[{name: digits_zeroshot, kind: zeroshot, data: "{data.root}/eval/zeroshot", '
                 'templates: "{data.root}/eval/zeroshot/prompts.json"}]')
LIMIT = 1  # run.max_notices_without_progress: the smallest, the fewest attempts


def steps_trained(audit) -> dict[int, list[int]]:
    """The optimizer steps each attempt applied, as rank 0 wrote them (run.audit_steps_to: `ATTEMPT STEP TIME` a
    line): attempt -> its steps in order."""
    steps: dict[int, list[int]] = {}
    for line in audit.read_text().splitlines() if audit.exists() else []:
        attempt, step = line.split()[:2]
        steps.setdefault(int(attempt), []).append(int(step))
    return steps


def beside(cfg, action, holds: tuple[Hold, ...]):
    """pretrain_beside, with `action(done)`: `done` is set once the run has ended (either way), for an action that
    waits for something only a run that goes on would show."""
    done = threading.Event()
    try:
        return pretrain_beside(cfg, lambda: action(done), holds=holds)
    finally:
        done.set()


def test_attempts_that_a_notice_ends_before_their_first_step_stop_the_run_and_no_other_loss_does(
        ray_local, digits_root, tmp_path):
    """Each attempt is held as it begins (its journal entry written, before its first step):
    - attempt 1: the training worker is killed there (a node lost, no notice): a failure (run.max_failures), not a
      notice loop; attempt 2 is not stopped by the guard.
    - attempt 2: SIGTERM to the training worker (a notice, run.sigterm_grace_s ahead), seen and recorded by rank 0
      before any step, then it is killed (its machine gone at the deadline): ended by a notice without progress.
    - attempt 3 resumes from the same step with one such attempt behind it (run.max_notices_without_progress 1) and
      stops as it begins (NoticeLoop, one line naming one attempt: the kill's does not count), never reaching its
      hold; no step was trained."""
    name, audit = "stalled", tmp_path / "steps.txt"
    cfg = config(tmp_path, digits_root, name, "train.steps=1", "train.num_workers=1", ONLY_ZEROSHOT,
                 "run.max_failures=2", f"run.max_notices_without_progress={LIMIT}", f"run.audit_steps_to={audit}")
    start = Hold(tmp_path / "hold", ATTEMPT_START)
    recorded = run_folder(str(tmp_path / "ray"), name) + "/notices/attempt-000002-rank-0.json"

    def kill_then_notice_then_kill(done: threading.Event) -> None:
        wait_for("attempt 1 held as it begins", lambda: start.held() >= 1, 300, 0.1)
        pids = wait_for("the training worker", lambda: len(p := train_workers()) == 1 and p, 60, 0.1)
        os.kill(pids[-1], signal.SIGKILL)
        wait_for("attempt 2 held as it begins (not stopped by the guard)",
                 lambda: done.is_set() or start.held() >= 2, 300, 0.1)
        if done.is_set():
            return
        pids = wait_for("attempt 2's training worker", lambda: len(p := train_workers()) == 1
                        and not set(p) & set(pids) and p, 60, 0.1)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        wait_for("rank 0's record of the notice", lambda: os.path.exists(recorded), 60, 0.1)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        # the guard stops attempt 3 as it begins; without it, attempt 3 is held there too (then released: it trains)
        wait_for("the run's end, or attempt 3 held as it begins", lambda: done.is_set() or start.held() >= 3, 300, 0.1)

    with pytest.raises(RunStopped) as stopped:  # the driver's one line, not Ray's traceback
        beside(cfg, kill_then_notice_then_kill, (start,))
    attempts = journal(tmp_path / "ray", name)
    assert [(a["from_step"], a["reached"]) for a in attempts] == [(0, 0)] * 3, attempts
    assert start.held() == 2 and not steps_trained(audit), (start.held(), steps_trained(audit))
    line = (f"{LIMIT} attempts in a row ended by a notice of preemption before training a step from step 0 "
            f"(run.max_notices_without_progress {LIMIT}; the last ended after a notice of preemption (SIGTERM) at step 0)")
    assert line in str(stopped.value) and len(str(stopped.value).splitlines()) == 1, str(stopped.value)[-3000:]


def test_a_notice_at_every_attempts_first_step_is_progress_and_the_run_ends(ray_local, digits_root, tmp_path):
    """The notice file is there as each of the first two attempts begins (written again, while the attempt is held
    before its first step, once the save before took it): each trains one step and saves on the notice at once, as in
    a storm of spot reclaims during start-ups. A step trained is progress: with run.max_notices_without_progress 1,
    the run is not stopped; attempt 3 trains the rest and the run ends, every step trained once."""
    name, audit, notice = "storm", tmp_path / "steps.txt", tmp_path / "notice"
    notice.write_text("0\n")  # the seconds left: none (Ray Train restarts the run once the save is done)
    cfg = config(tmp_path, digits_root, name, "train.steps=3", "train.num_workers=1", "train.log_every=1",
                 ONLY_ZEROSHOT, "run.max_failures=0", f"run.max_notices_without_progress={LIMIT}",
                 f"run.notice_file={notice}", f"run.audit_steps_to={audit}")
    start = Hold(tmp_path / "hold", ATTEMPT_START)
    noticed = LIMIT + 1  # the attempts that find a notice at their first step

    def a_notice_before_each_attempts_first_step(done: threading.Event) -> None:
        for stop in range(1, noticed + 2):
            wait_for(f"the run's end, or attempt {stop} held as it begins",
                     lambda: done.is_set() or start.held() >= stop, 300, 0.1)
            if done.is_set():
                return
            if stop <= noticed and not notice.exists():  # the save before took it (renamed)
                notice.write_text("0\n")
            released_file(start.folder, ATTEMPT_START, stop).touch()  # this attempt goes on, not the next

    result = beside(cfg, a_notice_before_each_attempts_first_step, (start,))
    attempts = journal(tmp_path / "ray", name)
    assert result.metrics["step"] == 3, result.metrics
    assert [a["from_step"] for a in attempts] == [0, 1, 2], attempts
    assert [a["notice"]["step"] for a in attempts[:2]] == [1, 2] and "notice" not in attempts[2], attempts
    assert steps_trained(audit) == {1: [1], 2: [2], 3: [3]}, steps_trained(audit)  # one step an attempt, each once
