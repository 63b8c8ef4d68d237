"""How slow this machine is today, so that the tests' deadlines hold on a slow one.

Every deadline in the tests is written for the machine the project measures on (2 cores, idle) with room to spare,
and multiplied by `slowness()`: `PROBVLP_TEST_SLOWNESS` where the environment sets it (CI, or a person who knows
the machine), otherwise a calibration measured once when pytest starts (a fixed piece of Python on every core at
once, against the time it took on the reference machine). Machines of this kind differ up to ~2x from one session
to the next, and a busy machine (another suite, a CPU hog) is a slow one: both show in the calibration. A deadline is
a bound on a failure, never a claim about speed, so the factor only ever lengthens it (at least 1), and at most
`MOST` (4) times, whether measured or set: a failure is still reported within the hour."""
from __future__ import annotations

import math
import multiprocessing
import os
import time

ENV = "PROBVLP_TEST_SLOWNESS"
# Seconds the calibration's work takes per core (the median of 5 rounds of `_work()` on both cores at once) on a
# machine where the suite runs at the reference machine's pace (2-core x86_64, idle, 2026-11-28), set from the suite
# itself: that day's suite (90e21f3), run again from a fresh clone on 2026-12-06, took 1.21x its time in `make test`
# and 1.28x in `make test-cluster`, while this work took 0.41-0.50 s against 0.26 s (1.6-1.9x: the machine's AVX-512
# cores run the tests' torch and NumPy work relatively faster than pure Python). 0.45 / 1.25: a factor of ~1.25 there.
# Deadlines are bounds and lose nothing by being long, but a few waits are real (a drain's deadline, a SIGTERM's
# grace, waited out as the cloud would), and an inflated factor lengthens them for nothing.
REFERENCE_S = 0.36
# Ray's default priority for its worker processes (ray._private.ray_constants: RAY_worker_niceness)
RAY_WORKER_NICENESS = 15
# The largest factor, measured or set: a calibration caught in a burst of start-up work, or a value meant for another
# machine, must not turn a 5-minute wait into an hour.
MOST = 4.0


def _work(_=None) -> float:
    start = time.perf_counter()
    total = 0
    for i in range(6_000_000):
        total += i * i % 7
    return time.perf_counter() - start


def calibrate(rounds: int = 5) -> float:
    """Wall seconds the fixed work takes per core with every core busy with it (the median round), at the priority
    Ray gives its worker processes (nice 15, `RAY_worker_niceness`): what the tests wait for runs there, and a busy
    process at the default priority takes nearly all of a core from it, which a calibration at nice 0 would not see."""
    cores = max(1, min(os.cpu_count() or 1, 2))  # the tests' budget is 2 cores: more do not make a deadline shorter
    niceness = int(os.environ.get("RAY_worker_niceness", RAY_WORKER_NICENESS))
    with multiprocessing.get_context("fork").Pool(cores, initializer=os.nice, initargs=(niceness,)) as pool:
        times = sorted(max(pool.map(_work, range(cores))) for _ in range(rounds))
    return times[len(times) // 2]


def slowness() -> float:
    """The factor every deadline is multiplied by, from 1 to MOST: the environment's, else measured once and written
    to the environment, where pytest-xdist's workers and the processes the tests start read it."""
    if ENV not in os.environ:
        os.environ[ENV] = f"{clamp(calibrate() / REFERENCE_S):.2f}"
    return clamp(set_factor())


def set_factor() -> float:
    """The environment's factor as it is set (a positive number)."""
    try:
        factor = float(os.environ[ENV])
    except ValueError as err:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected a number such as 1.5") from err
    if not factor > 0:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: must be above 0")
    return factor


def clamp(factor: float) -> float:
    return min(MOST, max(1.0, factor))


def scaled(seconds: float) -> int:
    """`seconds` (a deadline on the reference machine) on this machine, in whole seconds rounded up: some APIs take
    only an int (Ray's state API refused 30.6)."""
    return math.ceil(seconds * slowness())
