"""A save at once (a notice's) returns only once Ray Train has registered the checkpoint (pipelines.zero.checkpoint_files.save:
every rank waits for it after its own upload), so the restart the notice asks for resumes from it. Ray Train registers
a checkpoint once every rank's part is uploaded; the test holds rank 1's upload, and a rank 0 that did not wait would
hand its notice to Ray meanwhile, whose restart would resume from the checkpoint before."""
from __future__ import annotations

import fcntl
import os
import shutil

import ray
from mlflow import MlflowClient
from ray.util.state import list_tasks

from pipelines.zero.checkpoint_files import checkpoint_name
from tests.helpers import pretrain_beside, registered, wait_for
from tests.small_runs import config
from tests.test_guard_notice_loop import ONLY_ZEROSHOT, steps_trained
from tests.test_preemption import journal

RANK1_PART = "zero_pp_rank_1_mp_rank_00_optim_states.pt"  # rank 1's file of a ZeRO checkpoint (rank 0 has its own)
# What a rank waiting for the registration calls (pipelines.zero.checkpoint_files.wait_for_uploads): the controller's method
REGISTRATION_WAIT = "TrainController.get_all_reported_checkpoints"


def registration_waits() -> set[str]:
    """The calls of REGISTRATION_WAIT that the local Ray has seen so far (its task events), by task id."""
    tasks = list_tasks(ray.get_runtime_context().gcs_address, filters=[("name", "=", REGISTRATION_WAIT)],
                       limit=10_000, raise_on_missing_output=False)
    return {t.task_id for t in tasks}


def test_a_notices_save_returns_only_once_ray_train_registered_it(ray_local, digits_root, tmp_path):
    """The notice file is there before the run: both ranks save at step 1 at once. The file rank 1 uploads into the
    run's storage is a named pipe nobody reads (its open blocks): rank 1's part never arrives, so Ray Train cannot
    register the checkpoint. Rank 0, its own part uploaded, must wait for the registration (seen as its call to the
    controller) and not take the notice's file or hand the notice to Ray, whose restart would resume from nothing;
    the checkpoint is not registered meanwhile. Then rank 1's part goes through (its bytes already in place, from its
    snapshot, before the pipe is read), the checkpoint is registered, the notice handed over, and the restart
    resumes from step 1: no step lost (the steps each attempt trained, counted)."""
    name, audit, notice = "registered", tmp_path / "steps.txt", tmp_path / "notice"
    storage, snapshots = tmp_path / "ray", tmp_path / "snapshots"
    snapshots.mkdir()
    notice.write_text("0\n")  # the seconds left: none (Ray Train restarts the run once the notice is handed over)
    part = storage / name / checkpoint_name(1, 1) / "state" / RANK1_PART  # the notice's save: step 1, attempt 1
    part.parent.mkdir(parents=True)
    os.mkfifo(part)
    cfg = config(tmp_path, digits_root, name, "train.steps=3", "train.log_every=1", "train.checkpoint_every_s=0",
                 ONLY_ZEROSHOT, "run.max_failures=0", f"run.notice_file={notice}", f"run.audit_steps_to={audit}",
                 f"train.checkpoint_snapshot_dir={snapshots}")
    earlier = registration_waits()  # other runs' on this Ray
    seen: dict = {}

    def hold_rank_1s_part() -> None:
        seen["first"] = wait_for(
            "rank 0 waiting for the notice's checkpoint to be registered, or its save returned (the notice file taken)",
            lambda: "save returned" if not notice.exists() else "waiting" if registration_waits() - earlier else None,
            300, 0.2)
        seen["registered"] = registered(storage / name)
        if seen["first"] != "waiting":
            return  # the restart the notice asked for ends rank 1 with its upload
        # rank 1 wrote its snapshot before its upload began; its part goes in place first, then the pipe is read:
        # the upload (larger than the pipe holds) cannot end, nor the checkpoint be registered, before it is there
        source, = snapshots.glob(f"*/state/{RANK1_PART}")
        pipe = os.open(part, os.O_RDONLY)  # until rank 1's upload opens it
        try:
            seen["bytes"], seen["pipe"] = source.stat().st_size, fcntl.fcntl(pipe, fcntl.F_GETPIPE_SZ)
            shutil.copyfile(source, part.with_name(part.name + ".part"))
            os.replace(part.with_name(part.name + ".part"), part)
            while os.read(pipe, 1 << 20):
                pass
        finally:
            os.close(pipe)

    result = pretrain_beside(cfg, hold_rank_1s_part)
    assert seen["first"] == "waiting", ("rank 0's save at once returned (it took the notice file) while rank 1's part "
                                        "of the checkpoint was still uploading: before Ray Train registered it")
    assert seen["registered"] == [] and seen["bytes"] > seen["pipe"], seen
    attempts = journal(storage, name)
    assert [a["from_step"] for a in attempts] == [0, 1] and attempts[0]["notice"]["step"] == 1, attempts
    assert steps_trained(audit) == {1: [1], 2: [2, 3]}, steps_trained(audit)  # every step once, none lost
    run = MlflowClient(result.mlflow_uri).get_run(result.mlflow_run_id)
    assert run.data.tags["probvlp.resumed_from_step"] == "1" and result.metrics["step"] == 3
