"""The run's journal of attempts in its storage (pipelines.fit.attempts): what a restart says about the attempt
before it, and when a run that restarts without training stops."""
from __future__ import annotations

from pipelines.fit import attempts


def test_a_restart_knows_why_the_attempt_before_it_ended(tmp_path):
    folder = str(tmp_path / "run" / "probvlp")
    journal = attempts.Journal.open(folder, "job-a")
    journal.begin(0, None)
    journal.update(reached=37, notice={"step": 37, "sources": ["file"]})
    journal = attempts.Journal.open(folder, "job-a")  # the next attempt, on any node: read back from storage
    journal.begin(37, "ckpt-37")
    assert attempts.why_restarted(journal, []) == ("a notice of preemption (file) at step 37", 37)
    journal.update(reached=52)
    attempts.record_failure(folder, 2, 1, RuntimeError("boom\nsecond line"))
    journal = attempts.Journal.open(folder, "job-a")
    journal.begin(50, "ckpt-50")
    failures = journal.failures(journal.previous)
    assert failures == [{"rank": 1, "error": "RuntimeError: boom", "step": None}]
    assert attempts.why_restarted(journal, failures) == ("rank 1 failed (RuntimeError: boom)", 52)
    journal = attempts.Journal.open(folder, "job-a")
    journal.begin(50, "ckpt-50")
    assert attempts.why_restarted(journal, journal.failures(journal.previous)) == \
        ("a worker or its node was lost", 50)
    assert [e["attempt"] for e in journal.entries] == [1, 2, 3, 4]


def test_a_restart_after_training_on_knows_the_steps_it_runs_again(tmp_path):
    """Trained on after the notice's save (step 37) to a last save at step 60 that the machine's end cut short: the
    restart from the notice's save runs 23 steps again, and says so."""
    folder = str(tmp_path / "probvlp")
    journal = attempts.Journal.open(folder, "job")
    journal.begin(0, None)
    journal.update(notice={"step": 37, "sources": ["ray_drain"]}, reached=60)
    journal = attempts.Journal.open(folder, "job")
    journal.begin(37, "ckpt-37")
    assert attempts.why_restarted(journal, []) == ("a notice of preemption (ray_drain) at step 37", 60)


def test_attempts_a_notice_ended_without_a_step_are_counted_until_another_one(tmp_path):
    """Attempts of this job restarted from the same step that a notice ended without a step trained count (rank 0's
    save on it, or a rank's record of one seen before the first step); one that trained, one that ended without a
    notice (a failure), another step, or an earlier job's attempt ends the count."""
    folder = str(tmp_path / "probvlp")
    old = attempts.Journal.open(folder, "earlier-job")
    old.begin(10, None)  # an earlier command's attempt at the same step: not this job's loop
    old.update(notice={"step": 10, "sources": ["file"]})
    journal = attempts.Journal.open(folder, "job")
    journal.begin(10, "c10")
    journal.update(reached=11, notice={"step": 11, "sources": ["file"]})  # trained a step
    journal = attempts.Journal.open(folder, "job")
    journal.begin(10, "c10")  # lost without a notice: a failure, not a notice loop
    for n in range(3):
        journal = attempts.Journal.open(folder, "job")
        journal.begin(10, "c10")
        assert attempts.stalled(journal, 10) == n
        if n % 2:  # a notice seen before the first step, recorded by the rank that saw it
            attempts.record_notice(folder, journal.current["attempt"], 0, 10, ["SIGTERM"])
        else:  # a save on a notice at the step resumed from (a step that applied nothing)
            journal.update(notice={"step": 10, "sources": ["ray_drain"]})
    journal = attempts.Journal.open(folder, "job")
    journal.begin(10, "c10")
    assert attempts.stalled(journal, 10) == 3
    assert attempts.stalled(journal, 11) == 0


def test_a_run_stopped_on_purpose_is_told_by_its_own_attempts_error(tmp_path):
    """The driver's one line for a run its workers stopped (NoticeLoop): this job's recorded error, not an earlier
    job's, nor another kind of failure."""
    folder = str(tmp_path / "probvlp")
    earlier = attempts.Journal.open(folder, "earlier")
    earlier.begin(0, None)
    attempts.record_failure(folder, 1, 0, type("NoticeLoop", (RuntimeError,), {})("an earlier job's loop"))
    journal = attempts.Journal.open(folder, "job")
    journal.begin(5, "c5")
    assert attempts.stop_reason(folder, "job", "NoticeLoop") is None
    attempts.record_failure(folder, 2, 1, ValueError("another failure"))
    assert attempts.stop_reason(folder, "job", "NoticeLoop") is None
    attempts.record_failure(folder, 2, 0, type("NoticeLoop", (RuntimeError,), {})("3 notices in a row"))
    assert attempts.stop_reason(folder, "job", "NoticeLoop") == "3 notices in a row"


def test_a_notice_one_rank_saw_alone_tells_the_restart(tmp_path):
    """After the final checkpoint no collective tells rank 0 of another rank's notice: each rank records what it saw,
    and the next attempt's line joins them."""
    folder = str(tmp_path / "probvlp")
    journal = attempts.Journal.open(folder, "job")
    journal.begin(35, "c35")
    attempts.record_notice(folder, 1, 1, 40, ["file"])
    attempts.record_notice(folder, 1, 0, 40, ["SIGTERM"])
    journal = attempts.Journal.open(folder, "job")
    journal.begin(40, "c40")
    assert attempts.why_restarted(journal, []) == ("a notice of preemption (SIGTERM, file) at step 40", 40)


def test_a_record_a_kill_cut_short_is_not_read(tmp_path):
    """A rank killed while it writes its failure or notice record leaves the write's file beside the record
    (pipelines.storage.open_atomic: `<name>.tmp-<id>`, empty or half written). The driver's one line, the restart's
    and the guard's count read the whole records and pass over it, instead of failing on it."""
    folder = str(tmp_path / "probvlp")
    journal = attempts.Journal.open(folder, "job")
    journal.begin(5, "c5")
    attempts.record_failure(folder, 1, 0, type("NoticeLoop", (RuntimeError,), {})("2 notices in a row"))
    attempts.record_notice(folder, 1, 0, 5, ["SIGTERM"])
    for kind, name in (("failures", "attempt-000001-rank-1.json"), ("notices", "attempt-000001-rank-1.json")):
        (tmp_path / "probvlp" / kind / f"{name}.tmp-0badc0de").write_bytes(b"")
        (tmp_path / "probvlp" / kind / f"{name}.tmp-1badc0de").write_bytes(b'{"rank": 1, "err')
    assert attempts.stop_reason(folder, "job", "NoticeLoop") == "2 notices in a row"
    assert journal.failures(journal.current) == [{"rank": 0, "error": "NoticeLoop: 2 notices in a row", "step": None}]
    assert attempts.notices(folder, journal.current) == {"step": 5, "sources": ["SIGTERM"]}
    journal = attempts.Journal.open(folder, "job")
    journal.begin(5, "c5")
    assert attempts.stalled(journal, 5) == 1
