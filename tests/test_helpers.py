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
