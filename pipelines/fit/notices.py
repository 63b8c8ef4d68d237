"""A training attempt's notices of preemption on every rank, whatever the engine that trains: when a notice's save is
due, the notice's save and what follows it, the guard against notices that never clear, and the watchers of the
phases where no step runs (the attempt's start, an evaluation between steps, the end).

- Due (`due`, once a step, beside the step's all-reduce that joins the ranks): a new notice from any source
  (pipelines.fit.preemption), or, training on after one, the time of its last save (moved by a nearer deadline seen
  since: a SIGTERM's during a drain's, say).
- The save (`save`): the ranks' sources and earliest deadline gathered, the newest notice file kept in the
  checkpoint, the journal told, then the stage's own checkpoint (its one save order), the file taken, the notice
  handed to Ray Train (its restart counts as a preemption), the notice's records into the run's storage beside the
  queue that save wrote, the evaluation due at the step; then train on to a last save where the deadline leaves room
  for one (as Ray advises), else wait for the restart. Training on, the next due save is the last one.
- The guard (`guard`): past run.max_notices_without_progress attempts in a row that a notice ended before their first
  step, the run stops with one line (NoticeLoop) instead of restarting for ever.
- The watchers: a notice at the attempt's start, before its first step, is recorded (the guard counts only those);
  one during an evaluation between steps stops it (rank 0 checks before each batch; the others, waiting in a
  collective, record theirs in the run's storage for rank 0); one after the final checkpoint is handed to Ray and its
  file taken, its time recorded first.

The stage hands in what is its own: the checkpoint (a callable in its save order) and the evaluation."""
from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Callable

import torch

from models.gather import World
from pipelines.compat.ray_private import default_preemption_deadline_s
from pipelines.config import RunConfig
from pipelines.fit import attempts
from pipelines.fit.faults import ATTEMPT_START, NOTICE_SAVED
from pipelines.fit.preemption import NOTICE_MARGIN_S, Notice
from pipelines.fit.progress import Progress

# How often rank 0, evaluating, reads the notices the other ranks recorded meanwhile (the run's storage)
EVALUATION_POLL_S = 1.0


class NoticeLoop(RuntimeError):
    """Notices of preemption in a row without a step trained between them (run.max_notices_without_progress)."""


class Notices:
    """One attempt's notices (every rank). Made first, before the engine and the checkpoint: a SIGTERM from then on
    is a notice. Rank 0 is given its journal and hold once the attempt has begun (`begin`), its logger once made."""

    def __init__(self, run: RunConfig, world: World, rank: int, folder: str, outbox_folder: str):
        self.notice = Notice(run.sigterm_grace_s, file=run.notice_file)
        self.run, self.world, self.rank, self.folder, self.outbox_folder = run, world, rank, folder, outbox_folder
        self.attempt = 0  # rank 0's number of the attempt (0 on the others until they need it)
        self.journal = self.logger = self.hold = None
        # after a notice's save, training on to its last save: the deadline (epoch s), the seconds kept for the last
        # save, the notice's step
        self.train_on: dict[str, float] | None = None
        self.step_s, self.stepped_at = 0.0, None  # a step's seconds, the longest lately (the last save's reserve)
        self.agreed = False  # the ranks' votes at the last step (pipelines.fit.step.agree): some rank's save is due
        self._saves: tuple[Progress, Callable, Callable] | None = None  # the stage's (`save_with`)

    def save_with(self, progress: Progress, checkpoint: Callable[[dict[str, Any], bool], Any],
                  evaluation: Callable[[], None]) -> None:
        """The stage's own part of a notice's save (`save`): its progress, its checkpoint at once in its one save
        order, its evaluation (where one is due at the step)."""
        self._saves = (progress, checkpoint, evaluation)

    def resumed(self, progress: Progress) -> None:
        """The attempt resumed at `progress`: a notice file whose save is done (the checkpoint's, or one seen after the
        final checkpoint, recorded in the run's storage) is never a notice again."""
        self.notice.taken_file_mtime = max(progress.notice_file_mtime, attempts.taken_file_mtime(self.folder))

    def begin(self, attempt: attempts.Attempt, step: int, logger_for: Callable[[], Any], *,
              started: threading.Event | None = None, hold: Callable[[str], None] | None = None,
              then: Callable[[], None] | None = None) -> Any:
        """Rank 0, the attempt begun at `step` (its journal entry written), in the one order of every stage: the guard
        (which may stop the attempt first), the watcher of the start's notices (`started`: set by the first step),
        the hold (tests only), the stage's own (`then`: pretraining removes the uploads a restart cut short), the
        heartbeat, then the MLflow logger (`logger_for()`: what an earlier attempt had not delivered first), which the
        notices' records go through. Returns the logger."""
        self.attempt, self.journal, self.hold = attempt.number, attempt.journal, hold
        self.guard(step)
        if started is not None:
            self.watch_start(started, step)
        if hold:
            hold(ATTEMPT_START)
        if then:
            then()
        attempt.under_way()
        self.logger = logger_for()
        return self.logger

    def guard(self, step: int) -> None:
        """Rank 0 at the attempt's start: the attempts of this job right before this one that resumed from `step` and
        ended by a notice of preemption without training a step (its deadline came before the first step, again and
        again); past run.max_notices_without_progress of them, NoticeLoop, one line, recorded for the driver. An
        attempt that trained a step made progress, whatever ended it; one lost before its first step to anything but
        a notice (a node, a storage error) is a failure, bounded by run.max_failures, not a notice loop."""
        stalled = attempts.stalled(self.journal, step)
        limit = self.run.max_notices_without_progress
        if stalled >= limit:
            why, _ = attempts.why_restarted(self.journal, self.journal.failures(self.journal.previous))
            stop = NoticeLoop(f"{stalled} attempts in a row ended by a notice of preemption before training a step "
                              f"from step {step} (run.max_notices_without_progress {limit}; the last ended after "
                              f"{why}): a notice that never clears? (the notice file, the nodes' drains)")
            # recorded here: no worker was built, so the loop's failure path does not run, and the driver finds this
            # job's reason (one line) instead of Ray's traceback
            attempts.record_failure(self.folder, self.attempt, self.rank, stop, step)
            raise stop

    def on_step(self) -> None:
        """A step applied: its time counts towards the last save's reserve (logging, evaluating, a save behind: the
        slow steps count)."""
        now = time.monotonic()
        if self.stepped_at is not None:
            self.step_s = max(now - self.stepped_at, 0.9 * self.step_s)
        self.stepped_at = now

    def vote(self) -> bool:
        """This rank's vote at the step's all-reduce (pipelines.fit.step.agree): `due`."""
        return self.due()

    def noticed(self) -> bool:
        """The loop's question after a step: some rank's save for a notice is due (the ranks agreed at the step)."""
        return self.agreed

    def save_now(self, step: int, evaluate: bool) -> None:
        """The loop's call, every rank, at the step where they agreed on a notice: `save` with the stage's parts."""
        progress, checkpoint, evaluation = self._saves
        self.save(progress, evaluate, checkpoint, evaluation)

    def due(self) -> bool:
        """This rank's flag for the step's all-reduce: a save for a notice is due (a new notice, or, training on after
        one, the time of its last save)."""
        if self.train_on is None:
            return self.notice.pending()
        deadline = min(self.train_on["deadline"], self.notice.deadline() or math.inf)
        return time.time() >= deadline - self.train_on["reserve_s"]

    def save(self, progress: Progress, evaluate: bool, checkpoint: Callable[[dict[str, Any], bool], Any],
             evaluation: Callable[[], None]) -> None:
        """Every rank, at the step where they agreed that some node has a notice: `checkpoint(metrics, evaluate)`,
        the stage's checkpoint at once in its one save order (registered before it returns: a save that the
        machine's end cuts short is never resumed from; `evaluate`: the evaluation due at this step is recorded as
        not run), the notice's file taken, its own records handed over, `evaluation()` where due after it; then train
        on where the deadline leaves room for one more save, else wait for Ray Train's restart. Logged:
        `preemptions`, `preemption_save_s`, a tag per notice (its step, sources, seconds left, the save's seconds).
        Training on, the next call is the last save."""
        if self.train_on is not None:
            return self._last_save(progress, evaluate, checkpoint, evaluation)
        p = progress
        notice = self.notice.take()
        taken_at = time.time()
        if self.world.size > 1:  # every rank's sources (a SIGTERM reaches one process), the earliest deadline
            known: list = [None] * self.world.size
            torch.distributed.all_gather_object(known, notice)
            deadlines = [n["deadline_in_s"] for n in known if n["deadline_in_s"] is not None]
            notice = {"sources": sorted({s for n in known for s in n["sources"]}),
                      "deadline_in_s": min(deadlines, default=None)}
        # the newest notice file of any rank's node, kept in the checkpoint: never a notice again
        mtime = torch.tensor([self.notice.file_mtime()], dtype=torch.float64)
        if self.world.size > 1:
            torch.distributed.all_reduce(mtime, op=torch.distributed.ReduceOp.MAX)
        p.notice_file_mtime = max(p.notice_file_mtime, float(mtime.item()))
        if self.journal:  # before the save: a restart that finds it past its checkpoint knows the steps lost
            self.journal.update(notice={"step": p.step, "sources": notice["sources"]}, reached=p.step)
        p.preemptions += 1
        start = time.perf_counter()
        checkpoint({"step": p.step}, evaluate)
        if self.hold:  # tests only: the node may go from here on (the outbox went first)
            self.hold(NOTICE_SAVED)
        save_s = time.perf_counter() - start
        self.notice.consume_file(p.notice_file_mtime)
        self.notice.hand_over()
        if self.logger:
            self.logger.log({"preemptions": p.preemptions, "preemption_save_s": save_s}, p.step, event=True)
            self.logger.tag(f"probvlp.preemption.step_{p.step}", json.dumps({**notice, "save_s": round(save_s, 3)}))
            left = notice["deadline_in_s"]
            print(f"[preemption] notice ({', '.join(notice['sources']) or 'another rank'}"
                  f"{'' if left is None else f', {left:.0f} s left'}): checkpoint of step {p.step} saved in "
                  f"{save_s:.1f} s", flush=True)
            # the notice's own records too, before its evaluation (a restart evaluates again: one record either way),
            # beside the queue its save wrote (not the queue again)
            self.logger.persist_more(self.outbox_folder)
        if evaluate:  # after the save: a restart before its end evaluates again (evaluate_at), one record either way
            evaluation()
        left = default_preemption_deadline_s() if notice["deadline_in_s"] is None else notice["deadline_in_s"]
        if not self._train_on(taken_at + left, save_s, p.step):
            self.notice.hold(notice["deadline_in_s"])

    def _train_on(self, deadline: float, save_s: float, step: int) -> bool:
        """After a notice's save (every rank): whether to train on, as Ray advises for its notices, to a last save
        kept `reserve_s` before `deadline` (twice this save's seconds, two of the slow steps and a margin: the save
        may take longer, and it comes only at a step's end). Rank 0's answer for every rank (their clocks and saves
        differ a little); none without room, or with run.notice_train_on false."""
        reserve = 2 * save_s + 2 * self.step_s + NOTICE_MARGIN_S
        answer = torch.tensor([float(self.run.notice_train_on and deadline - time.time() > reserve), reserve],
                              dtype=torch.float64)
        if self.world.size > 1:
            torch.distributed.broadcast(answer, src=0)
        if not answer[0].item():
            return False
        self.train_on = {"deadline": deadline, "reserve_s": answer[1].item(), "step": step}
        if self.logger:
            print(f"[preemption] training on: {deadline - time.time():.0f} s to the deadline; the last save comes "
                  f"{answer[1].item():.0f} s before it", flush=True)
        return True

    def _last_save(self, progress: Progress, evaluate: bool, checkpoint: Callable[[dict[str, Any], bool], Any],
                   evaluation: Callable[[], None]) -> None:
        """Every rank, training on after a notice, when its last save is due: the checkpoint the restart resumes
        from, in the stage's one save order, the evaluation due at this step after it, then wait for the restart.
        Logged: `preemption_last_save_s`, `preemption_trained_on_steps` (the steps kept by training on)."""
        p, first = progress, self.train_on
        self.train_on = None
        if self.journal:
            self.journal.update(reached=p.step)
        start = time.perf_counter()
        checkpoint({"step": p.step}, evaluate)
        save_s, left = time.perf_counter() - start, first["deadline"] - time.time()
        if self.logger:
            kept = p.step - int(first["step"])
            self.logger.log({"preemption_last_save_s": save_s, "preemption_trained_on_steps": kept}, p.step,
                            event=True)
            print(f"[preemption] trained on {kept} step(s) after the notice's save; the last checkpoint, of step "
                  f"{p.step}, saved in {save_s:.1f} s, {left:.0f} s before the deadline", flush=True)
            self.logger.persist_more(self.outbox_folder)
        if evaluate:
            evaluation()
        self.notice.hold(first["deadline"] - time.time())

    def evaluation_stop(self, step: int) -> Callable[[], bool]:
        """Rank 0's check before each batch of an evaluation between steps, which may outlast a notice's deadline:
        its own notice (or, training on, the time of the last save), or another rank's recorded in the run's storage
        during this evaluation (read at most once a second)."""
        polled = [-math.inf]

        def stop() -> bool:
            if self.due():
                return True
            if self.world.size == 1 or time.monotonic() - polled[0] < EVALUATION_POLL_S:
                return False
            polled[0] = time.monotonic()
            return attempts.notice_during(self.folder, self.attempt, step, "evaluation")

        return stop

    def watch_evaluation(self, step: int) -> threading.Event:
        """A rank other than 0 while rank 0 evaluates between steps: a thread that records its notice (or, training
        on, the time of the last save) in the run's storage for rank 0, which no collective can tell meanwhile. Set
        the event returned when the evaluation is over."""
        done = threading.Event()

        def watch() -> None:
            while not done.wait(EVALUATION_POLL_S / 2):
                if self.due():
                    attempts.record_notice(self.folder, self._attempt(), self.rank, step,
                                           self.notice.take()["sources"], during="evaluation")
                    return

        threading.Thread(target=watch, daemon=True, name="probvlp-evaluation-notices").start()
        return done

    def watch_start(self, started: threading.Event, step: int) -> None:
        """Rank 0, from the attempt's start to its first step (`started`): a notice seen meanwhile (its node's SIGTERM
        or file, Ray's drain) is recorded in the run's storage, so that an attempt whose machine goes before it trains
        a step is known to have ended by a notice (the guard counts those only)."""
        def watch() -> None:
            while not started.wait(0.5):
                if self.notice.pending():
                    attempts.record_notice(self.folder, self.attempt, self.rank, step, self.notice.take()["sources"])
                    return

        threading.Thread(target=watch, daemon=True, name="probvlp-start-notices").start()

    def watch_final(self, step: int) -> threading.Event:
        """Every rank after the final checkpoint, until the event returned is set: a notice is handed to Ray (its
        restart then counts as a preemption and only finishes the evaluation and the model); its file is taken, as
        the final checkpoint is the save it asks for, and its time recorded in the run's storage first, so that no
        restart takes it for a notice again should renaming it fail."""
        done = threading.Event()

        def watch() -> None:
            recorded = False
            while not done.wait(1.0):
                if self.notice.pending():
                    sources, mtime = self.notice.take()["sources"], self.notice.file_mtime()
                    if not recorded:  # every rank: the one that saw it may be the only one left to tell
                        recorded = True  # before the file is taken: a restart must not take it for a notice again
                        attempts.record_notice(self.folder, self._attempt(), self.rank, step, sources,
                                               file_mtime=mtime)
                    self.notice.consume_file(mtime)
                    self.notice.hand_over()

        threading.Thread(target=watch, daemon=True, name="probvlp-notices").start()
        return done

    def _attempt(self) -> int:
        return self.attempt or attempts.current_attempt(self.folder)

    def close(self) -> None:
        """Ray's own SIGTERM handling back: Ray's teardown of a finished or failed worker is no notice."""
        self.notice.restore_ray_handler()
