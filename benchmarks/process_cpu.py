"""Where a command's CPU goes, counted by the kernel: every process that exits while the command runs, however short,
with the CPU-seconds it used (Linux process accounting, acct(2): root only), grouped by what the process was.

    sudo .venv/bin/python -m benchmarks.process_cpu -- make test DURATIONS=0
    .venv/bin/python -m benchmarks.process_cpu --top 60 -- .venv/bin/python -m pytest -q tests/test_scale.py

A process's record carries its pid and the name of its last thread, not its title: Ray renames its workers after they
start (`ray::RayTrainWorker`, `ray::TrainController`), so the titles are read from /proc every half second beside
the command and joined by pid; a process that lived less than that is listed under its thread's name, in brackets.
A Ray worker back at `ray::IDLE` after its tasks is listed under the last task it ran.
Counted: the processes that ended before the command did (daemons that outlive it, and the machine's own, are not).
Unlike a /proc poller's last reading, nothing is lost between two readings. Nothing is timed against a target: the
table says where to cut (tests/conftest.py's notes, docs/RESULTS.md "Where `make test`'s CPU goes").
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import struct
import subprocess
import sys
import tempfile
import threading
import time

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime, etime (float), then eight
# comp_t (utime, stime, mem, io, rw, minflt, majflt, swaps) and the 16-byte command name
RECORD = struct.Struct("<BBHIIIIIIf8H16s")
TICKS = 100  # AHZ: the unit of acct_v3's times


def _comp(value: int) -> int:
    """comp_t: a 13-bit mantissa and a base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def records(path: str):
    """(pid, CPU-seconds, thread name) of each process in an acct_v3 file."""
    data = open(path, "rb").read()
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        fields = RECORD.unpack_from(data, offset)
        if fields[1] != 3:  # the kernel writes v3 records only
            continue
        cpu = (_comp(fields[10]) + _comp(fields[11])) / TICKS
        yield fields[6], cpu, fields[-1].split(b"\0")[0].decode(errors="replace")


def _accounting(path: str | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(path.encode() if path else None) != 0:
        raise SystemExit(f"acct(2) refused: {os.strerror(ctypes.get_errno())} (root only, and the kernel's "
                         "CONFIG_BSD_PROCESS_ACCT)")


def _titles(seen: dict[int, str], stop: threading.Event) -> None:
    """pid -> its latest command line: read again at every pass, since a process changes it after it started (a fork
    before its exec, a Ray worker taking its actor's title); a few hundred small reads a pass."""
    while not stop.is_set():
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    continue
                remember(seen, int(entry), title)
        stop.wait(0.5)


def remember(seen: dict[int, str], pid: int, title: str) -> None:
    """Keep `title` as `pid`'s, but for a zombie's (empty) and a Ray worker's return to `ray::IDLE` after a task: it
    keeps the name of the last task or actor it ran, which is what its CPU went to."""
    if title and not (title.startswith("ray::IDLE") and pid in seen):
        seen[pid] = title


def kind(title: str, thread: str) -> str:
    """What a process was, from its title: a Ray actor's class and method, a Python's module or script, a binary."""
    if not title:
        return f"[{thread}]"
    if title.startswith("ray::"):
        return title.split(" ")[0].split(".")[0][:48]
    words = title.split()
    exe = os.path.basename(words[0])
    module = re.search(r" -m (\S+)", title)
    script = next((os.path.basename(w) for w in words[1:] if w.endswith(".py")), None)
    if module:
        return f"{exe} -m {module.group(1)}"
    if script:
        return f"{exe} {script}"
    if " -c " in title:
        return f"{exe} -c {title.split(' -c ', 1)[1][:40]!r}"
    return exe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=40, help="rows of the table")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    log = tempfile.NamedTemporaryFile(prefix="acct_", delete=False).name
    titles: dict[int, str] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_titles, args=(titles, stop), daemon=True)
    sampler.start()
    _accounting(log)
    start = time.monotonic()
    try:
        rc = subprocess.call(command)
    finally:
        _accounting(None)
        stop.set()
    wall = time.monotonic() - start
    cpu: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for pid, seconds, thread in records(log):
        k = kind(titles.get(pid, ""), thread)
        cpu[k] += seconds
        count[k] += 1
    os.unlink(log)
    total = sum(cpu.values())
    print(f"\n{' '.join(command)}: exit {rc}, {wall:.0f} s wall, {total:.0f} CPU-s in {sum(count.values())} processes "
          f"({total / wall:.2f} cores on average)")
    print(f"{'CPU-s':>8} {'share':>6} {'procs':>6} {'each':>6}  process")
    for k, seconds in cpu.most_common(args.top):
        print(f"{seconds:8.1f} {seconds / total:6.1%} {count[k]:6d} {seconds / count[k]:6.2f}  {k}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
