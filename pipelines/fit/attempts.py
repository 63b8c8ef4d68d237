"""What a run keeps about its attempts in its own storage (`run.storage_path`/NAME/probvlp/, object storage on a
cluster), so that any node's next attempt knows it without the tracking store: the journal of attempts (why the last
one ended, where it got to), the failures' one-line errors, the final report, and where rank 0's undelivered MLflow
calls wait (pipelines.tracking.outbox)."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

from pipelines.storage import fs_path, json_files, load_json, read_json, write_json

HEARTBEAT_S = 5.0  # how often rank 0 records the step it reached (off the training thread)


@dataclass
class Journal:
    """Rank 0's record of the run's attempts (attempts.json): one entry each, with the job that started it, the step
    and checkpoint it resumed from, the step it reached, and how it ended (a notice, finished)."""

    folder: str
    job: str
    entries: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, folder: str, job: str) -> "Journal":
        return cls(folder, job, list(load_json(f"{folder}/attempts.json") or []))

    @property
    def previous(self) -> dict | None:
        return self.entries[-2] if len(self.entries) > 1 else None

    @property
    def current(self) -> dict:
        return self.entries[-1]

    def begin(self, step: int, checkpoint: str | None) -> dict:
        self.entries.append({"attempt": len(self.entries) + 1, "job": self.job, "from_step": step,
                             "checkpoint": checkpoint, "reached": step, "started": time.time()})
        self.save()
        return self.current

    def update(self, **values) -> None:
        with self.lock:  # the training thread and the heartbeat's
            self.current.update(values)
            write_json(f"{self.folder}/attempts.json", self.entries)

    def save(self) -> None:
        with self.lock:
            write_json(f"{self.folder}/attempts.json", self.entries)

    def failures(self, entry: dict) -> list[dict]:
        """The one-line errors the ranks of attempt `entry` recorded as they failed."""
        fs, path = fs_path(f"{self.folder}/failures")
        found = [read_json(fs, name) for name in json_files(fs, path, f"attempt-{entry['attempt']:06d}-")]
        return [f for f in found if f]


def write_final_report(folder: str, job: str, report: dict) -> None:
    """Rank 0's final report of command `job` (after the final checkpoint, whose metrics are Ray Train's result)."""
    write_json(f"{folder}/final_report.json", {"job": job, **report})


def final_report(folder: str, job: str) -> dict:
    """The final report of command `job` ({} where the run's last one is another command's, or there is none)."""
    report = dict(load_json(f"{folder}/final_report.json") or {})
    return report if report.pop("job", None) == job else {}


def current_attempt(folder: str) -> int:
    """The number of the run's current attempt as rank 0's journal has it (for a rank other than 0, which keeps
    none): the journal's length, 1 before rank 0 has written it."""
    return len(load_json(f"{folder}/attempts.json") or []) or 1


def record_failure(folder: str, attempt: int, rank: int, error: BaseException, step: int | None = None) -> None:
    """A rank's error as its attempt fails (and the step it had reached), for the next attempt's line (best effort:
    the run is failing anyway)."""
    lines = str(error).strip().splitlines()
    write_json(f"{folder}/failures/attempt-{attempt:06d}-rank-{rank}.json",
               {"rank": rank, "error": f"{type(error).__name__}: {lines[0][:1000] if lines else ''}", "step": step})


def record_notice(folder: str, attempt: int, rank: int, step: int, sources: list[str], file_mtime: float = 0.0,
                  during: str = "") -> None:
    """A notice one rank saw where no collective tells rank 0 (before the first step, during rank 0's evaluation,
    after the final checkpoint), for rank 0 (`notice_during`) and the next attempt's line and guard. `file_mtime`:
    the time of the notice file whose save is done (the final checkpoint's), which no later attempt takes for a
    notice again (`taken_file_mtime`), even where renaming the file failed. `during`: the phase (a record of its own)."""
    write_json(f"{folder}/notices/attempt-{attempt:06d}-rank-{rank}{f'-{during}' if during else ''}.json",
               {"step": step, "sources": sources, "file_mtime": file_mtime, "during": during})


def notice_during(folder: str, attempt: int, step: int, during: str) -> bool:
    """Whether some rank recorded a notice during phase `during` of step `step` of attempt `attempt`."""
    return any(f.get("during") == during and f["step"] == step
               for f in _notice_records(folder, f"attempt-{attempt:06d}-"))


def _notice_records(folder: str, prefix: str = "") -> list[dict]:
    """The notices the ranks recorded (record_notice) whose file name starts with `prefix` (an attempt's)."""
    fs, path = fs_path(f"{folder}/notices")
    found = [read_json(fs, name) for name in json_files(fs, path, prefix)]
    return [f for f in found if f]


def taken_file_mtime(folder: str) -> float:
    """The newest notice file time the ranks recorded as taken (record_notice's `file_mtime`; 0: none)."""
    return max((float(f.get("file_mtime", 0.0)) for f in _notice_records(folder)), default=0.0)


def notices(folder: str, entry: dict) -> dict | None:
    """The notice of attempt `entry`: rank 0's record in the journal, else what its ranks recorded themselves."""
    if entry.get("notice"):
        return entry["notice"]
    found = _notice_records(folder, f"attempt-{entry['attempt']:06d}-")
    if not found:
        return None
    return {"step": min(f["step"] for f in found), "sources": sorted({s for f in found for s in f["sources"]})}


def stop_reason(folder: str, job: str, error_type: str) -> str | None:
    """The one-line error of type `error_type` a rank recorded as an attempt of `job` failed, if any (the latest)."""
    journal = Journal.open(folder, job)
    fs, path = fs_path(f"{folder}/failures")
    ours = {f"attempt-{e['attempt']:06d}-" for e in journal.entries if e["job"] == job}
    for name in reversed(json_files(fs, path)):
        if name.rsplit("/", 1)[-1][:15] not in ours:
            continue
        failure = read_json(fs, name) or {}
        if failure.get("error", "").startswith(f"{error_type}: "):
            return failure["error"][len(error_type) + 2:]
    return None


def why_restarted(journal: Journal, failures: list[dict]) -> tuple[str, int | None]:
    """Why the attempt before this one ended, and the step it had reached (None: unknown)."""
    prev = journal.previous
    if prev is None:
        return "", None
    notice = notices(journal.folder, prev)
    if notice:
        sources = ", ".join(notice["sources"]) or "another rank"
        # training on after the notice's save, the attempt reached its last save (a restart from the notice's
        # save, that last one cut short, runs those steps again)
        return f"a notice of preemption ({sources}) at step {notice['step']}", max(notice["step"],
                                                                                     prev.get("reached") or 0)
    if failures:
        first = failures[0]
        reached = max([prev.get("reached", 0), *(f["step"] for f in failures if f.get("step") is not None)])
        return f"rank {first['rank']} failed ({first['error']})", reached
    return "a worker or its node was lost", prev.get("reached")


def stalled(journal: Journal, step: int) -> int:
    """How many attempts of this job right before the current one resumed from `step`, trained no step and ended by
    a notice of preemption (rank 0's save on it, or a rank's record of one seen before the first step)."""
    count = 0
    for entry in reversed(journal.entries[:-1]):
        if entry["job"] != journal.job or entry["from_step"] != step or entry["reached"] > entry["from_step"] \
                or notices(journal.folder, entry) is None:
            break
        count += 1
    return count


class Heartbeat:
    """Rank 0's step, written to the journal at most every HEARTBEAT_S by a thread: the step an attempt reached
    before it was lost, for the next attempt's line."""

    def __init__(self, journal: Journal):
        self.journal, self.step, self.written = journal, journal.current["reached"], journal.current["reached"]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="probvlp-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            if self.step != self.written:
                self.written = self.step
                try:
                    self.journal.update(reached=self.step)
                except Exception as err:  # noqa: BLE001 - a storage hiccup costs the line a few steps, said once
                    print(f"[probvlp] could not record the step reached in {self.journal.folder}: "
                          f"{type(err).__name__}: {err}", flush=True)
                    return

    def close(self) -> None:
        self.stop.set()


class Attempt:
    """This worker's attempt of the run, as the run's storage keeps it for the next one, whatever the stage. Rank 0
    keeps the journal: the attempt begun with the step and checkpoint it resumes from, the step it reached (a
    heartbeat thread, from `under_way`), the steps it applied where asked (`audit_to`: run.audit_steps_to, one
    `ATTEMPT STEP TIME` line a step), and one line (and an MLflow tag) saying what it resumed and why. Any rank, as
    the attempt fails: its one-line error, and rank 0's undelivered metrics handed over to the run's storage."""

    def __init__(self, folder: str, job: str, rank: int, step: int, checkpoint: str | None,
                 audit_to: str | None = None):
        self.folder, self.rank = folder, rank
        self.journal: Journal | None = None
        self.heartbeat: Heartbeat | None = None
        self.audit = None
        self.number = 0  # rank 0's (the others read the journal's if they fail)
        if rank == 0:
            self.audit = open(audit_to, "a") if audit_to else None
            self.journal = Journal.open(folder, job)
            self.number = self.journal.begin(step, checkpoint)["attempt"]

    def under_way(self) -> None:
        """Rank 0, past the attempt's guard: the step reached is recorded from here on."""
        if self.journal:
            self.heartbeat = Heartbeat(self.journal)

    def on_step(self, step: int, applied: int) -> None:
        """A step applied (`applied`: the engine's own count of the optimizer steps it took)."""
        if self.audit:  # what this attempt really applied
            self.audit.write(f"{self.number} {applied} {time.time():.3f}\n")
            self.audit.flush()
        if self.heartbeat:
            self.heartbeat.step = step

    def say_resumed(self, step: int, logger, run_name: str, storage: str, left: int, nothing_left: str) -> None:
        """Rank 0 of an attempt that did not start at step 0: one line (and tag probvlp.attempt.K) saying what it
        resumed and why: a restart within the job (after a notice, a failure, a lost node; the steps it runs again),
        or a new command on an earlier run's storage (`left` steps to train; `nothing_left`: what it does then)."""
        journal = self.journal
        prev, checkpoint = journal.previous, journal.current["checkpoint"]
        record: dict = {"attempt": self.number, "resumed_from_step": step, "checkpoint": checkpoint}
        if prev is not None and prev["job"] == journal.job:
            why, reached = why_restarted(journal, journal.failures(prev))
            again = None if reached is None else max(0, reached - step)
            record.update(why=why, reached=reached, steps_again=again)
            print(f"[restart] attempt {self.number} of run {run_name}, after {why}: resumed from the checkpoint of "
                  f"step {step} ({checkpoint}); "
                  + (f"{again} step(s) to run again" if again is not None else "the steps it runs again are unknown"),
                  flush=True)
            if notices(journal.folder, prev):  # the steps between the notice and the checkpoint resumed from
                logger.log({"preemption_steps_lost": again}, step, event=True)
        else:
            record.update(why="a new command on the run's storage", steps_left=max(0, left))
            print(f"[resume] resumed run {run_name} from step {step} of its storage ({storage}): "
                  + (f"{left} step(s) left to train" if left > 0 else nothing_left), flush=True)
        logger.tag(f"probvlp.attempt.{self.number}", json.dumps(record))

    def abandon(self, err: BaseException, step: int | None, logger=None, outbox_folder: str = "") -> None:
        """The attempt fails (any rank): this rank's one-line error for the next attempt's line; rank 0's `logger`
        hands over what it did not deliver (its steps after the checkpoint a restart resumes from come again)."""
        try:
            record_failure(self.folder, self.number or current_attempt(self.folder), self.rank, err, step)
        except Exception as failure:  # noqa: BLE001 - the run's own error is the one that matters
            print(f"[probvlp] could not record rank {self.rank}'s failure: {failure}", flush=True)
        if logger:
            try:
                logger.persist(outbox_folder)
            except Exception as failure:  # noqa: BLE001
                print(f"[tracking] could not hand over what was not delivered: {failure}", flush=True)

    def close(self) -> None:
        if self.heartbeat:
            self.heartbeat.close()
        if self.audit:
            self.audit.close()
