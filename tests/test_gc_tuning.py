"""CPython's collector tuned for start-up (pipelines.gc_tuning) in every process of a job: its driver, as jobs.cli
wraps every job's main, and each Ray worker, as the setup hook of the Ray it starts or joins runs there; actors
started with runtime environments of their own (Ray Train's controller and workers, the sweep's trials) among them."""
from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.gc_tuning import YOUNG_GC_THRESHOLD, collect_less
from tests.pace import scaled

ROOT = Path(__file__).resolve().parent.parent


def test_collect_less_raises_only_the_youngest_threshold_and_never_lowers_it_nor_turns_collection_on():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 11, 12)
        collect_less()
        assert gc.get_threshold() == (YOUNG_GC_THRESHOLD, 11, 12)
        gc.set_threshold(10 * YOUNG_GC_THRESHOLD, 11, 12)  # a process's own, larger setting stays
        collect_less()
        assert gc.get_threshold() == (10 * YOUNG_GC_THRESHOLD, 11, 12)
        gc.set_threshold(0, 11, 12)  # collection turned off stays off
        collect_less()
        assert gc.get_threshold() == (0, 11, 12)
    finally:
        gc.set_threshold(*before)


def test_a_jobs_main_runs_with_the_tuned_collector():
    code = ("import gc, jobs.cli as cli; print(gc.get_threshold()[0]); "
            "cli.job_main(lambda argv: print(gc.get_threshold()[0]) or 0)([])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=scaled(120))
    before, inside = map(int, out.stdout.split())
    assert before < YOUNG_GC_THRESHOLD and inside == YOUNG_GC_THRESHOLD  # CPython's default until the job's main runs


@pytest.mark.slow
def test_every_ray_worker_runs_with_the_tuned_collector(ray_local):
    ray = ray_local

    @ray.remote
    def threshold() -> int:
        return gc.get_threshold()[0]

    @ray.remote(runtime_env={"env_vars": {"PROBVLP_PROBE": "1"}})  # a runtime environment of its own, as Ray Train's
    class Probe:
        def threshold(self) -> int:
            return gc.get_threshold()[0]

    probe = Probe.remote()
    try:
        assert ray.get(threshold.remote(), timeout=scaled(120)) == YOUNG_GC_THRESHOLD
        assert ray.get(probe.threshold.remote(), timeout=scaled(120)) == YOUNG_GC_THRESHOLD
    finally:
        ray.kill(probe)
