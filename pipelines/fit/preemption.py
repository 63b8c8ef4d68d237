"""Notices of preemption, from every source a user has, turned into one rank-local flag per training worker.

The flag costs no collective of its own: the step's all-reduce (pipelines.zero.fit) carries it beside the
non-finite-loss flag, so every rank agrees at the same step boundary that some node is about to go, and the run saves
its normal checkpoint there (pipelines.pretrain.worker). The sources:

- Ray's drain of a node with reason PREEMPTION (the autoscaler on a spot reclaim, KubeRay, `ray drain-node`, and a
  `ray start --block` node that gets SIGTERM, which Ray 2.60 turns into such a drain): Ray Train's preemption watcher
  marks every worker of the run (its train context's `preemption_context`), which `Notice.pending` reads. Only drains
  of nodes that hold this run's workers count, so an idle drain (IDLE_TERMINATION) of another node changes nothing.
- SIGTERM to a training worker's own process (a SLURM step's or a process group's signal): the handler installed
  by `install_sigterm_handler` notes it with a deadline `run.sigterm_grace_s` away.
- The hook for any other source (a SLURM `--signal` trap, a cloud metadata poller): the file named by
  $PROBVLP_PREEMPTION_NOTICE_FILE on the worker's node, or `notify()` in the worker's process.

A notice that Ray did not see itself (the last two) is handed to Ray: to this worker's train context, so that Ray
Train's controller waits for the deadline and then restarts the run counting a preemption (run.max_preemptions, not
run.max_failures), and, off the head node, as a drain of this node with reason PREEMPTION, so that the restart places
no worker there. The head node is not drained: it holds the cluster's control plane, which goes with it (and a
one-machine run has nothing else to restart on)."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from pipelines.compat.ray_private import (default_preemption_deadline_s, drain_node_for_preemption, head_node_ids,
                                          set_worker_preemption_info, worker_preemption_info)

log = logging.getLogger(__name__)

# The hook: a file on the worker's node whose existence is a notice; its content, if a number, the seconds left at
# the time the file was written (its mtime). A SLURM batch script: `trap 'echo 120 > $PROBVLP_PREEMPTION_NOTICE_FILE'
# USR1` with `#SBATCH --signal=B:USR1@120`.
NOTICE_FILE_ENV = "PROBVLP_PREEMPTION_NOTICE_FILE"
# After the deadline the saved workers wait this much longer for Ray Train's restart before they train on: a notice
# whose machine never went (a drain undone) must not stop the run for good.
HOLD_SLACK_S = 60.0
# Training on after a notice's save, the last save is started this much earlier than its measured need (twice the
# notice's save and two slow steps): the node's own end may come a little before the deadline it announced.
NOTICE_MARGIN_S = 5.0


@dataclass
class Local:
    """Notices this process received itself (not through Ray): source -> deadline (epoch seconds, None: unknown).
    No lock: the SIGTERM handler writes here on the main thread, and a handler that waited for a lock the interrupted
    main thread holds would never return; one dict operation is atomic under the GIL, which is all this needs."""

    sources: dict[str, float | None] = field(default_factory=dict)
    # this process handed a notice to Ray: a SIGTERM now is Ray's teardown for the restart it asked for
    handed: bool = False


_LOCAL = Local()
_SIGTERM_GRACE_S = 30.0


def notify(source: str, deadline_s: float | None = None) -> None:
    """The hook for a source of notices that this module does not read: call it in the training worker's process
    (from a signal handler or a thread) with `deadline_s`, the seconds before the machine goes if known. The run then
    saves at the next step boundary on every rank, as for Ray's own notices."""
    _LOCAL.sources.setdefault(source, None if deadline_s is None else time.time() + deadline_s)


def _on_sigterm(signum, frame) -> None:
    # The second SIGTERM means now, and one after this process handed a notice to Ray is Ray's teardown for the
    # restart: Ray's own handler (a clean exit), not a notice.
    if ("SIGTERM" in _LOCAL.sources or _LOCAL.handed) and callable(_RAY_SIGTERM[0]):
        _RAY_SIGTERM[0](signum, frame)
    notify("SIGTERM", _SIGTERM_GRACE_S)


_RAY_SIGTERM: list = [None]


def _install_in_main_thread(grace_s: float) -> bool:
    global _SIGTERM_GRACE_S
    _SIGTERM_GRACE_S = grace_s
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    if previous is not _on_sigterm:
        _RAY_SIGTERM[0] = previous
    return True


def install_sigterm_handler(grace_s: float) -> bool:
    """Turn SIGTERM to this worker's process into a notice `grace_s` seconds ahead (a Kubernetes pod's grace
    period, docker stop's -t) instead of Ray's immediate exit. A signal handler is set from the main thread only, and
    a Ray Train worker runs its training function in another thread: the handler is set through the worker actor's
    own `execute`, which runs on the actor's main thread while the training thread waits for it."""
    if threading.current_thread() is threading.main_thread():
        return _install_in_main_thread(grace_s)
    import ray

    try:
        actor = ray.get_runtime_context().current_actor
        return ray.get(actor.execute.remote(_install_in_main_thread, grace_s))
    except Exception as err:  # not in a Ray actor (a test calling the loop directly): no handler, said once
        log.warning("SIGTERM is not turned into a notice of preemption here: %s", err)
        return False


def _restore_in_main_thread() -> bool:
    if _RAY_SIGTERM[0] is not None and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, _RAY_SIGTERM[0])
    return True


def restore_ray_sigterm() -> None:
    """Ray's own SIGTERM handler back (the training function is over: Ray's teardown of the worker is no notice)."""
    if threading.current_thread() is threading.main_thread():
        _restore_in_main_thread()
        return
    import ray

    try:
        ray.get(ray.get_runtime_context().current_actor.execute.remote(_restore_in_main_thread), timeout=10)
    except Exception as err:  # noqa: BLE001 - not in a Ray actor, or the actor is going away: said once
        log.warning("Ray's SIGTERM handler is not restored: %s", err)


def _ray_notice():
    """Ray Train's PreemptionInfo for this worker (set by its watcher on a drain), or None. Read from the worker's
    train context (what `ray.train.get_preemption_info()` reads before it broadcasts rank 0's, a collective of its
    own that the step's all-reduce makes unneeded)."""
    return worker_preemption_info()


def _file_notice(path: str, taken_mtime: float = 0.0) -> float | None | bool:
    """False without a notice file (or with one no newer than the last one taken); else its deadline (epoch
    seconds) or None."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_mtime <= taken_mtime:
        return False
    try:
        with open(path) as f:
            return st.st_mtime + float(f.read().strip())
    except (OSError, ValueError):
        return None


class Notice:
    """One training worker's view of notices of preemption. `pending()` once a step (a dictionary look-up and, with
    the hook's file named, one stat); `take()` when the ranks agreed, for what to log and how long to hold."""

    def __init__(self, sigterm_grace_s: float | None, taken_file_mtime: float = 0.0, file: str | None = None):
        """`taken_file_mtime`: the time of the last notice file a save consumed (from the checkpoint): a file no newer
        is not a notice, should removing it have failed. `file`: the hook's file (default $PROBVLP_PREEMPTION_NOTICE_FILE)."""
        self.file = file or os.environ.get(NOTICE_FILE_ENV) or None
        self.taken_file_mtime = taken_file_mtime
        self.handed_to_ray = self.ray_had_one = False
        self.dismissed = None  # Ray's notice of a false alarm (hold), no longer one
        self.installed = sigterm_grace_s is not None and install_sigterm_handler(sigterm_grace_s)

    def _sources(self) -> dict[str, float | None]:
        sources = dict(_LOCAL.sources)
        if self.file and "file" not in sources:
            deadline = _file_notice(self.file, self.taken_file_mtime)
            if deadline is not False:
                notify("file", None if deadline is None else deadline - time.time())
                sources["file"] = deadline
        return sources

    def pending(self) -> bool:
        """Whether this worker has a notice (from any source)."""
        ray_info = _ray_notice()
        return bool(self._sources() or (ray_info is not None and ray_info is not self.dismissed))

    def hand_over(self) -> None:
        """A notice of this worker's own (SIGTERM, the hook) handed to Ray, once, after the save it caused: Ray Train
        then restarts the run at its deadline counting a preemption, and a deadline already past (a file written
        long ago) cannot cut the save short."""
        local = self._sources()
        if local and not self.handed_to_ray:
            self.handed_to_ray = _LOCAL.handed = True
            ray_info = _ray_notice()
            self.ray_had_one = ray_info is not None and ray_info is not self.dismissed  # Ray's own, before ours
            deadline = min((d for d in local.values() if d is not None), default=None)
            threading.Thread(target=_hand_to_ray, args=(sorted(local), deadline), daemon=True,
                             name="probvlp-preemption").start()

    def take(self) -> dict:
        """What this worker knows of the notice: its sources and the seconds left to the earliest deadline (None:
        unknown; a rank that learned of it through the all-reduce only knows Ray's, if any)."""
        sources, deadline = self._known()
        return {"sources": sorted(sources), "deadline_in_s": None if deadline is None else deadline - time.time()}

    def deadline(self) -> float | None:
        """The earliest deadline (epoch seconds) of the notices this worker knows now, None: none known."""
        return self._known()[1]

    def _known(self) -> tuple[dict[str, float | None], float | None]:
        sources = self._sources()
        deadlines = [d for d in sources.values() if d is not None]
        info = _ray_notice()
        if info is not None and info is not self.dismissed:
            if not self.handed_to_ray or self.ray_had_one:  # else Ray's is the one this worker handed over
                sources = {**sources, "ray_drain": None}
            if info.deadline_ms:
                deadlines.append(info.deadline_ms / 1000)
        return sources, min(deadlines, default=None)

    def restore_ray_handler(self) -> None:
        if self.installed:
            restore_ray_sigterm()
            self.installed = False

    def file_mtime(self) -> float:
        """The time of this node's notice file (0: none)."""
        try:
            return os.stat(self.file).st_mtime if self.file else 0.0
        except OSError:
            return 0.0

    def consume_file(self, mtime: float) -> None:
        """The save a notice file caused is done: the file is taken away (renamed to FILE.taken, where a person can
        still read it), so no attempt reads it again; a file that cannot be moved is ignored up to `mtime` (the
        checkpoint keeps it) and said once."""
        self.taken_file_mtime = max(self.taken_file_mtime, mtime)
        if not self.file or not os.path.exists(self.file):
            return
        try:
            os.replace(self.file, f"{self.file}.taken")
        except OSError as err:
            log.warning("the notice file %s stays (%s): notices written before %s are ignored", self.file, err,
                        time.ctime(mtime))

    def hold(self, deadline_in_s: float | None) -> None:
        """After the agreed save: wait for Ray Train to restart the run (at the deadline, a preemption). Every step
        trained past the save would be run again, whichever node goes; past the deadline and HOLD_SLACK_S the notice
        is taken for a false alarm and training goes on."""
        # Ray Train's controller, given a notice without a deadline, restarts the run this long after it saw it
        wait = (default_preemption_deadline_s() if deadline_in_s is None else max(0.0, deadline_in_s)) + HOLD_SLACK_S
        print(f"[preemption] checkpoint saved; waiting up to {wait:.0f} s for the restart", flush=True)
        time.sleep(wait)
        print("[preemption] no restart came: a false alarm, training goes on", flush=True)
        _LOCAL.sources.clear()
        self.handed_to_ray = _LOCAL.handed = False
        self.dismissed = _ray_notice()


def _hand_to_ray(sources: list[str], deadline: float | None) -> None:
    """A notice Ray did not see: to this worker's train context (what the controller polls; it then restarts at the
    deadline, counting a preemption) and, off the head node, as a PREEMPTION drain of this node (no worker is placed
    there again; this node's actors dying count as preempted)."""
    try:
        import ray

        if not ray.is_initialized():  # a process outside Ray (notify() in a test): the save is all there is
            return
        node_id = ray.get_runtime_context().get_node_id()
        deadline_ms = None if deadline is None else int(deadline * 1000)
        if set_worker_preemption_info(node_id, deadline_ms=deadline_ms) is None:  # not a Ray Train worker
            return
        if node_id in head_node_ids():
            return
        accepted, why = drain_node_for_preemption(
            node_id, f"probvlp: notice of preemption from {', '.join(sources)}", deadline_ms)
        if not accepted:
            log.warning("the drain of node %s was refused: %s", node_id, why)
    except Exception:  # the save goes ahead on the all-reduce whatever Ray makes of it
        log.warning("could not hand the notice of preemption to Ray", exc_info=True)
