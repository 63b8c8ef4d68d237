"""Ray Train's registration of the checkpoints a worker reported, waited for within a bound: a checkpoint counts only
once Ray Train has registered it (every rank's part uploaded), and a restart resumes from the latest it registered.
A save that must be in before the worker goes on (a notice's, the final one) waits here; so does a periodic save for
the upload before it (one in flight)."""
from __future__ import annotations

import time

import ray.train

UPLOAD_TIMEOUT_S = 1800.0  # the default bound (pretraining's train.upload_timeout_s)


class UploadTimeout(RuntimeError):
    """A checkpoint Ray Train did not register within the bound (an upload stuck on some rank)."""


def wait_for_uploads(step: int | None = None, timeout_s: float = UPLOAD_TIMEOUT_S) -> None:
    """Until every checkpoint this rank reported (the latest of step `step`) is uploaded by every rank and registered
    by Ray Train; UploadTimeout after `timeout_s` (train.upload_timeout_s): an upload stuck on one rank would
    otherwise hold every rank here for ever."""
    start = time.monotonic()
    ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED,
                                           timeout_s=timeout_s)
    waited = time.monotonic() - start
    # at its timeout Ray returns what it has registered so far, saying nothing: only a wait this long tells it
    if waited >= timeout_s:
        what = "the checkpoints reported" if step is None else f"the checkpoint of step {step}"
        raise UploadTimeout(f"{what} not registered after {waited:.1f} s of waiting for every rank's upload to "
                            f"run.storage_path (train.upload_timeout_s {timeout_s:g}): this attempt fails, and Ray "
                            "Train restarts it from the last registered checkpoint while run.max_failures allows")
