"""The tests' own helpers that judge what a job printed (tests/helpers.py)."""
from __future__ import annotations

from tests.helpers import tracebacks

# What Ray printed in CI when it SIGTERMed a finished Tune trial's actor inside a finaliser (the job succeeded)
TEARDOWN = """\x1b[36m(run_trial pid=17046)\x1b[0m Exception ignored in: <function WeakSet.__init__.<locals>._remove at 0x7f>
\x1b[36m(run_trial pid=17046)\x1b[0m Traceback (most recent call last):
\x1b[36m(run_trial pid=17046)\x1b[0m   File "/usr/lib/python3.11/_weakrefset.py", line 39, in _remove
\x1b[36m(run_trial pid=17046)\x1b[0m     def _remove(item, selfref=ref(self)):
\x1b[36m(run_trial pid=17046)\x1b[0m 
\x1b[36m(run_trial pid=17046)\x1b[0m   File "/venv/lib/python3.11/site-packages/ray/_private/worker.py", line 1063, in sigterm_handler
\x1b[36m(run_trial pid=17046)\x1b[0m     raise_sys_exit_with_custom_error_message(
\x1b[36m(run_trial pid=17046)\x1b[0m SystemExit: 1
best digits_zeroshot/top1 = 0.0891
"""
# What Ray Train's controller printed in CI as a sweep's trial ended on a loaded machine (the job succeeded)
CLEANER = """\x1b[36m(run_trial pid=1409)\x1b[0m 2026-12-06 20:53:30,255\tERROR placement_group_callback.py:132 -- Failed to stop PlacementGroupCleaner gracefully.
\x1b[36m(run_trial pid=1409)\x1b[0m Traceback (most recent call last):
\x1b[36m(run_trial pid=1409)\x1b[0m   File "/venv/lib/python3.11/site-packages/ray/train/v2/_internal/callbacks/placement_group_callback.py", line 126, in _stop_cleaner
\x1b[36m(run_trial pid=1409)\x1b[0m     ray.get(self._cleaner.stop.remote(), timeout=self._stop_timeout)
\x1b[36m(run_trial pid=1409)\x1b[0m   File "/venv/lib/python3.11/site-packages/ray/_private/worker.py", line 3009, in get
\x1b[36m(run_trial pid=1409)\x1b[0m     values, debugger_breakpoint = worker.get_objects(
\x1b[36m(run_trial pid=1409)\x1b[0m                                   ^^^^^^^^^^^^^^^^^^^
\x1b[36m(run_trial pid=1409)\x1b[0m   File "python/ray/includes/common.pxi", line 107, in ray._raylet.check_status
\x1b[36m(run_trial pid=1409)\x1b[0m ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready.
"""
FAILURE = """\x1b[36m(RayTrainWorker pid=8)\x1b[0m Traceback (most recent call last):
\x1b[36m(RayTrainWorker pid=8)\x1b[0m   File "/work/pipelines/pretrain/worker.py", line 10, in train_loop
\x1b[36m(RayTrainWorker pid=8)\x1b[0m     worker.fit()
\x1b[36m(RayTrainWorker pid=8)\x1b[0m RuntimeError: injected failure at step 3
"""


def test_tracebacks_finds_every_one_but_rays_teardown():
    assert tracebacks(TEARDOWN) == []
    found = tracebacks(TEARDOWN + FAILURE)
    assert len(found) == 1 and found[0].endswith("RuntimeError: injected failure at step 3")
    assert found[0].splitlines()[1].startswith('  File "/work/pipelines/pretrain/worker.py"')  # Ray's prefix gone
    # the same block outside a finaliser, or ending otherwise, is a traceback of the run's own
    assert len(tracebacks(TEARDOWN.replace("Exception ignored in", "Error in"))) == 1
    assert len(tracebacks(TEARDOWN.replace("SystemExit: 1", "ValueError: bad"))) == 1
    assert tracebacks("no traceback here\n") == []


def test_tracebacks_leaves_out_ray_trains_cleaner_stop_at_a_runs_end_only():
    assert tracebacks(CLEANER) == [] and len(tracebacks(CLEANER + FAILURE)) == 1
    # a timeout elsewhere, or another error from the cleaner's stop, is a traceback to look at
    assert len(tracebacks(CLEANER.replace("in _stop_cleaner", "in after_worker_group_start"))) == 1
    assert len(tracebacks(CLEANER.replace("ray.exceptions.GetTimeoutError", "ray.exceptions.RaySystemError"))) == 1
