"""The no-progress guards of pipelines.train.worker (run.max_notices_without_progress): a run whose attempts keep
ending before they train a step, or that saves on a notice at every attempt's first step, stops with NoticeLoop
instead of restarting for ever. Each run is held as each attempt begins (faults.ATTEMPT_START, before its first step)
so that what the test does to an attempt (a kill, a notice file written again) happens before that attempt's first
step whatever the machine's speed; and each test bounds the attempts it acts on, so that a run without its guard
ends (and fails the test) instead of looping."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from pipelines.config import RunStopped
from pipelines.train.attempts import run_folder, stop_reason
from pipelines.train.faults import ATTEMPT_START, released_file
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


def test_attempts_that_end_before_their_first_step_stop_the_run(ray_local, digits_root, tmp_path):
    """Attempt 1 is held as it begins (its journal entry written, before its first step) and a training worker is
    killed there (run.max_failures 1): it ended without training a step. Attempt 2 resumes from the same step and,
    with run.max_notices_without_progress 1 such attempt behind it, stops as it begins (NoticeLoop, the start's check)
    instead of training: it never reaches the hold, the run fails naming the loop, and no step was trained."""
    name, audit = "stalled", tmp_path / "steps.txt"
    cfg = config(tmp_path, digits_root, name, "train.steps=1", ONLY_ZEROSHOT, "run.max_failures=1",
                 f"run.max_notices_without_progress={LIMIT}", f"run.audit_steps_to={audit}")
    start = Hold(tmp_path / "hold", ATTEMPT_START)

    def kill_as_the_first_attempt_begins(done: threading.Event) -> None:
        wait_for("attempt 1 held as it begins", lambda: start.held() >= 1, 300, 0.1)
        pids = wait_for("two training workers", lambda: len(p := train_workers()) == 2 and p, 60, 0.1)
        os.kill(pids[-1], signal.SIGKILL)
        # the guard stops attempt 2 as it begins; without it, attempt 2 is held there too (then released: it trains)
        wait_for("the run's end, or attempt 2 held as it begins", lambda: done.is_set() or start.held() >= 2, 300, 0.1)

    with pytest.raises(RunStopped) as stopped:  # the driver's one line, not Ray's traceback
        beside(cfg, kill_as_the_first_attempt_begins, (start,))
    attempts = journal(tmp_path / "ray", name)
    assert [(a["from_step"], a["reached"]) for a in attempts] == [(0, 0), (0, 0)], attempts
    assert start.held() == 1 and not steps_trained(audit), (start.held(), steps_trained(audit))
    # why attempt 1 ended: its node lost, or the other rank's error as the kill closed their connection (whichever
    # the surviving rank recorded first)
    line = (f"{LIMIT} attempts in a row restarted from step 0 without training a step "
            f"(run.max_notices_without_progress {LIMIT}; the last ended after ")
    assert line in str(stopped.value) and len(str(stopped.value).splitlines()) == 1, str(stopped.value)[-3000:]


def test_a_notice_at_every_attempts_first_step_stops_the_run_in_one_line(ray_local, digits_root, tmp_path):
    """The notice file is there as each attempt begins (written again, while the attempt is held before its first
    step, once the save before took it): every attempt trains one step and saves on the notice at once. With
    run.max_notices_without_progress 1, the second notice in a row at an attempt's first step stops the run
    (NoticeLoop, the notice streak) before its save: two attempts, one step each, and the driver's one line. The
    notice is written for LIMIT + 2 attempts, no more: a run without the guard then trains to its end (and fails the
    test) instead of looping."""
    name, audit, notice = "streak", tmp_path / "steps.txt", tmp_path / "notice"
    notice.write_text("0\n")  # the seconds left: none (Ray Train restarts the run once the save is done)
    cfg = config(tmp_path, digits_root, name, "train.steps=4", "train.log_every=1", ONLY_ZEROSHOT,
                 "run.max_failures=0", f"run.max_notices_without_progress={LIMIT}", f"run.notice_file={notice}",
                 f"run.audit_steps_to={audit}")
    start = Hold(tmp_path / "hold", ATTEMPT_START)
    noticed = LIMIT + 2  # the attempts that find a notice at their first step

    def a_notice_before_each_attempts_first_step(done: threading.Event) -> None:
        for stop in range(1, noticed + 1):
            wait_for(f"the run's end, or attempt {stop} held as it begins",
                     lambda: done.is_set() or start.held() >= stop, 300, 0.1)
            if done.is_set():
                return
            if not notice.exists():  # the save before took it (renamed)
                notice.write_text("0\n")
            released_file(start.folder, ATTEMPT_START, stop).touch()  # this attempt goes on, not the next

    with pytest.raises(RunStopped) as stopped:
        beside(cfg, a_notice_before_each_attempts_first_step, (start,))
    line = str(stopped.value)
    assert "\n" not in line and line.startswith(
        f"{LIMIT + 1} notices of preemption in a row at step 2 without a step trained between them "
        f"(run.max_notices_without_progress {LIMIT}; sources: file)"), line
    attempts = journal(tmp_path / "ray", name)
    assert [a["from_step"] for a in attempts] == [0, 1] and attempts[0]["notice"]["step"] == 1, attempts
    assert "notice" not in attempts[1]  # stopped before its save
    assert steps_trained(audit) == {1: [1], 2: [2]}, steps_trained(audit)  # one step an attempt, each once
    assert start.held() == 2 and notice.exists()  # no third attempt; the second's notice was never taken
    assert stop_reason(run_folder(str(tmp_path / "ray"), name), attempts[0]["job"], "NoticeLoop") in line
