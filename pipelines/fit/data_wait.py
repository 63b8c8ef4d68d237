"""How long the training loop waits for its batches (logged as data_wait_frac / data_wait_ms)."""
from __future__ import annotations

import time


class DataWait:
    """How long the training loop waits for its batches: per logging window and over the run. A step ends with a
    host sync (the loss's finiteness check), so time spent waiting here is time the device had nothing to do."""

    def __init__(self):
        self.waited_s = self.loop_s = 0.0
        self._window_wait = self._window_steps = 0
        self._window_start = self._last = time.perf_counter()

    def start(self) -> None:
        self._window_start = self._last = time.perf_counter()

    def timed(self, batches):
        """Yield `batches`, timing each wait for the next one."""
        it = iter(batches)
        while True:
            before = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            now = time.perf_counter()
            self.waited_s += now - before
            self._window_wait += now - before
            self.loop_s += now - self._last
            self._last = now
            self._window_steps += 1
            yield batch

    def window(self) -> tuple[float, float]:
        """(share of the time since the last call spent waiting, mean wait per batch in ms), then a new window."""
        now = time.perf_counter()
        elapsed, steps = now - self._window_start, max(self._window_steps, 1)
        frac = self._window_wait / elapsed if elapsed > 0 else 0.0
        ms = 1000 * self._window_wait / steps
        self._window_start, self._window_wait, self._window_steps = now, 0.0, 0
        return frac, ms

    def mean(self) -> float:
        return self.waited_s / self.loop_s if self.loop_s > 0 else 0.0
