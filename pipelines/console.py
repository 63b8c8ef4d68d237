"""Progress of long jobs: done / total, rates, elapsed and ETA; a bar on a terminal, one plain line per update
elsewhere (log files, `ray job submit`, Ray workers, whose output is never a terminal)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TextIO


def process_started_at() -> float:
    """When this process started (time.time's clock): its age from the kernel's clocks since boot (the start time in
    clock ticks, the uptime in seconds), not from the boot time in whole seconds that psutil adds to it. Where there is
    no /proc, now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


def clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLine:
    """`update(done, loss="2.31")` prints e.g. `[train] step 120/600 (20%) | loss 2.31 | elapsed 0:00:35 | ETA 0:02:20`.

    The ETA extrapolates the pace since the first update's `done` (a resumed run does not count the steps it
    skipped)."""

    def __init__(self, label: str, total: int, unit: str = "", stream: TextIO | None = None, width: int = 24):
        self.label, self.total, self.unit, self.width = label, max(int(total), 0), unit, width
        self._stream = stream  # None: sys.stdout when written (keeps the object picklable, as Tune callbacks must be)
        self.t0: float | None = None
        self.done0 = 0

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stdout

    @property
    def bar(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def text(self, done: int, fields: dict[str, str], now: float) -> str:
        if self.t0 is None:
            self.t0, self.done0 = now, done
        elapsed = now - self.t0
        pace = (done - self.done0) / elapsed if elapsed > 0 else 0.0
        eta = clock((self.total - done) / pace) if pace > 0 else "?"
        share = done / self.total if self.total else 1.0
        counter = f"{self.unit + ' ' if self.unit else ''}{done}/{self.total} ({share:.0%})"
        if self.bar:
            filled = int(round(share * self.width))
            counter = f"[{'#' * filled}{'.' * (self.width - filled)}] {counter}"
        parts = [f"[{self.label}] {counter}", *(f"{k} {v}" for k, v in fields.items()),
                 f"elapsed {clock(elapsed)}", f"ETA {eta}"]
        return " | ".join(parts)

    def line(self, done: int, **fields: str) -> str:
        """The text alone, for a caller that writes it itself."""
        return self.text(done, fields, time.monotonic())

    def update(self, done: int, **fields: str) -> str:
        line = self.line(done, **fields)
        if self.bar:
            end = "\n" if done >= self.total else ""
            self.stream.write("\r" + line + end)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        return line


def share_field(name: str, share: float) -> dict[str, str]:
    """A progress-line field for a share that only matters when it is not zero (e.g. samples skipped): {} at 0."""
    return {name: f"{share:.1%}"} if share > 0 else {}
