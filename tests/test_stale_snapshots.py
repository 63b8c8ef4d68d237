"""A killed upload's snapshot (a folder `probvlp-snapshot-<pid>-*` that Ray Train would have deleted once uploaded) is
removed at the next job's start on every node that holds one (pipelines.zero.snapshot_sweep, awaited by the driver
before its workers start), not only where a later training worker starts: a node that gets none would keep it in its
memory (/dev/shm) for as long as it runs. A live process's snapshot stays."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from pipelines.zero.checkpoint_files import SNAPSHOTS
from tests.pace import scaled
from tests.small_runs import ROOT, config
from tests.test_guard_notice_loop import ONLY_ZEROSHOT

# One line of pipelines.zero.snapshot_sweep's, with the count per node: "1 on node 127.0.0.1 0123abcd, 2 on node ..."
REMOVED = re.compile(r"^\[checkpoint\] removed (\d+) snapshot\(s\) of killed uploads at the job's start: (.*)$", re.M)
# A driver of its own for the two-node cluster (the pytest process may hold the session's local Ray): per line of
# its input, [folder, timeout_s], the sweep's result as one JSON line after what the sweep printed.
SWEEP = """
import json, sys, ray
from pipelines.zero.snapshot_sweep import SnapshotSweep
ray.init(address=sys.argv[1], logging_level="ERROR")
for line in sys.stdin:
    folder, timeout_s = json.loads(line)
    print("result " + json.dumps(SnapshotSweep(folder, timeout_s).wait()), flush=True)
"""


def dead_pid() -> int:
    """The pid of a process that has ended (as a killed rank's has)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def plant(folder: Path, pid: int, name: str = "xyz") -> Path:
    """A snapshot folder as pipelines.zero.checkpoint_files.save names them, of process `pid`, with a shard file inside."""
    snapshot = folder / f"{SNAPSHOTS}{pid}-{name}"
    (snapshot / "state").mkdir(parents=True)
    (snapshot / "state" / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 1024)
    return snapshot


def removed_per_node(console: str) -> dict[str, int]:
    """The driver's line, read back: short node id -> how many it removed there."""
    lines = REMOVED.findall(console)
    assert len(lines) == 1, console
    total, per_node = lines[0]
    counts = {m[2]: int(m[1]) for m in re.finditer(r"(\d+) on node \S+ ([0-9a-f]{8})", per_node)}
    assert sum(counts.values()) == int(total), console
    return counts


def test_a_job_removes_killed_uploads_snapshots_before_its_workers_start(ray_local, digits_root, tmp_path, capfd):
    """The job's snapshot folder (train.checkpoint_snapshot_dir) holds a dead process's snapshot and a live one's
    (this process's) before the job starts. Its training worker would remove the dead one too, silently: the driver's
    line, naming this node, says that the job's start did, before any worker. The live one stays."""
    from pipelines.pretrain.job import run_pretrain

    snapshots = tmp_path / "snapshots"
    stale, live = plant(snapshots, dead_pid()), plant(snapshots, os.getpid())
    cfg = config(tmp_path, digits_root, "stale", "train.steps=1", "train.num_workers=1", "train.checkpoint_every_s=0",
                 ONLY_ZEROSHOT, "run.max_failures=0", f"train.checkpoint_snapshot_dir={snapshots}")
    result = run_pretrain(cfg)
    assert result.metrics["step"] == 1
    console = capfd.readouterr().out
    here = ray_local.get_runtime_context().get_node_id()
    assert removed_per_node(console) == {here[:8]: 1}, console
    assert not stale.exists() and live.exists()


@pytest.mark.cluster
def test_every_node_removes_its_own_and_a_node_that_does_not_answer_is_skipped(two_node_ray):
    """A head with no CPUs and two worker nodes with a /tmp each (tests/multinode.py): the same folder name holds
    other snapshots on each. The sweep runs on every node, each on its own folder: the head removes its dead one and
    keeps a live process's, node A removes both of its, node B has no folder. Then node B's processes are stopped (a
    node that hangs) with a dead snapshot of its own planted: the sweep returns after its timeout without it, naming
    it in one line, and fails nothing; B's snapshot is still there."""
    cluster, _ = two_node_ray
    a, b = cluster.nodes
    folder = Path(tempfile.mkdtemp(prefix="probvlp_stale_", dir="/tmp"))  # the head's; each node has its own /tmp

    def on(node, path: Path = folder) -> Path:
        return Path(f"/proc/{node.process.pid}/root{path}")  # the path in that node's view of the filesystem

    # the cluster's loopback address as it is (Ray would otherwise turn it into the machine's external one)
    driver = subprocess.Popen([sys.executable, "-c", SWEEP, cluster.address], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})

    def sweep(timeout_s: float) -> tuple[dict[str, int], str]:
        """The driver's sweep of `folder`: its result and what it printed meanwhile. A driver that hangs is ended
        (its output then ends) well after the sweep's own timeout."""
        watchdog = threading.Timer(timeout_s + scaled(60), driver.kill)
        watchdog.start()
        try:
            driver.stdin.write(json.dumps([str(folder), timeout_s]) + "\n")
            driver.stdin.flush()
            lines = []
            while not (line := driver.stdout.readline()).startswith("result ") and line:
                lines.append(line)
        finally:
            watchdog.cancel()
        assert line, f"the driver ended: {''.join(lines)}"
        return json.loads(line.removeprefix("result ")), "".join(lines)

    stopped: list[int] = []
    try:
        head = (cluster.alive() - {a.node_id, b.node_id}).pop()
        stale, live = plant(folder, dead_pid()), plant(folder, os.getpid())
        for name in ("one", "two"):
            plant(on(a), dead_pid(), name)
        (on(a) / "not-a-snapshot").mkdir()
        removed, console = sweep(scaled(60))
        assert removed == {head: 1, a.node_id: 2, b.node_id: 0}, console
        assert removed_per_node(console) == {head[:8]: 1, a.node_id[:8]: 2}, console
        assert not stale.exists() and live.exists() and not on(b).exists()
        assert [p.name for p in on(a).iterdir()] == ["not-a-snapshot"]

        hung = plant(on(b), dead_pid())
        stopped = list(b.pids())
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):  # a worker that ended meanwhile
                os.kill(pid, signal.SIGSTOP)
        # short: B never answers, so the sweep lasts its whole timeout (the head, whose idle worker Ray may have
        # ended meanwhile, may need longer for a new one: then it is skipped too, as the line says)
        removed, console = sweep(scaled(5))
        assert b.node_id not in removed and set(removed) <= {head, a.node_id} and not any(removed.values()), console
        skipped = re.findall(r"^\[checkpoint\] snapshots of killed uploads not looked for on (.*): they stay until a "
                             r"later job or training worker there$", console, re.M)
        assert len(skipped) == 1 and re.search(rf"node \S+ {b.node_id[:8]} \((no answer within [\d.]+ s|\w+Error)\)",
                                               skipped[0]), console
        assert not REMOVED.search(console) and hung.exists()
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        driver.stdin.close()
        try:
            driver.wait(scaled(60))
        finally:
            driver.kill()
        shutil.rmtree(folder, ignore_errors=True)
