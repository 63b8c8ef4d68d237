"""What killed uploads left on the cluster's nodes, removed at a job's start.

A periodic checkpoint's snapshot waits for its upload in a folder of its node (pipelines.zero.checkpoint_files.save), in memory
where it is in /dev/shm, and Ray Train deletes it once uploaded; a process killed before that leaves it there. A
training worker removes those of its own node when it starts (state.remove_stale_snapshots), so a node that gets no
later training worker would keep them for as long as it runs: the driver of every job sweeps every alive node too.
It launches the sweep as soon as Ray is up and waits for it just before its workers start; the task's module imports
neither torch nor Ray Train, so a node's first sweep costs a Ray worker's start, not the training stack's imports."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

TIMEOUT_S = 30.0  # from the launch: a node that has not answered by then is skipped
# Each rank's snapshot waits for its upload in a folder of this name (pipelines.zero.checkpoint_files.snapshot_root; Ray Train
# deletes it once uploaded)
SNAPSHOTS = "probvlp-snapshot-"
SHM = "/dev/shm"


def remove_stale_snapshots(choice: str = "auto") -> int:
    """The snapshots of this node's processes that ended before their upload did (killed, preempted): removed, as
    nothing will upload them. Returns how many."""
    removed = 0
    for root in {tempfile.gettempdir(), SHM} if choice == "auto" else {choice}:
        for entry in os.listdir(root) if os.path.isdir(root) else []:
            pid = entry[len(SNAPSHOTS):].split("-", 1)[0]
            if entry.startswith(SNAPSHOTS) and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
                removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class SnapshotSweep:
    """remove_stale_snapshots(`choice`, train.checkpoint_snapshot_dir) on every alive node, launched here: one Ray
    task a node, pinned there (hard node affinity: a task run on another node would look at that node's folders)
    and asking for no CPU, so that a node whose CPUs other work holds, or that has none (a head), runs it at once
    too. It removes only the snapshots of processes that have ended (a live one's upload is still to come)."""

    def __init__(self, choice: str = "auto", timeout_s: float = TIMEOUT_S):
        self.timeout_s, self.deadline = timeout_s, time.monotonic() + timeout_s
        self.names = {n["NodeID"]: f"node {n['NodeManagerAddress']} {n['NodeID'][:8]}"
                      for n in ray.nodes() if n["Alive"]}
        task = ray.remote(num_cpus=0, max_retries=0)(remove_stale_snapshots)
        self.tasks = {task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            choice): node for node in self.names}

    def wait(self) -> dict[str, int]:
        """The nodes' answers, awaited until `timeout_s` after the launch at most: node id -> how many snapshots it
        removed. Says in one line how many were removed on which nodes, and in another which nodes did not answer in
        time or whose task failed: they are skipped (their snapshots wait for a later job, or a training worker
        there), never the job's failure."""
        ready, late = ray.wait(list(self.tasks), num_returns=len(self.tasks),
                               timeout=max(0.0, self.deadline - time.monotonic())) if self.tasks else ([], [])
        removed, skipped = {}, []
        for ref in ready:
            try:
                removed[self.tasks[ref]] = ray.get(ref)
            except ray.exceptions.RayError as error:  # the node died meanwhile, or its folder could not be read
                skipped.append(f"{self.names[self.tasks[ref]]} ({type(error).__name__})")
        for ref in late:
            ray.cancel(ref)  # a task still waiting for its node goes, not left to run some time later
            skipped.append(f"{self.names[self.tasks[ref]]} (no answer within {self.timeout_s:g} s)")
        if skipped:
            print(f"[checkpoint] snapshots of killed uploads not looked for on {', '.join(sorted(skipped))}: they "
                  "stay until a later job or training worker there", flush=True)
        if sum(removed.values()):
            counts = sorted((self.names[node], n) for node, n in removed.items() if n)
            print(f"[checkpoint] removed {sum(removed.values())} snapshot(s) of killed uploads at the job's start: "
                  + ", ".join(f"{n} on {name}" for name, n in counts), flush=True)
        return removed
