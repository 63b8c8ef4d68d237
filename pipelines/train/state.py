"""DeepSpeed checkpoints through Ray Train: saved behind training or at once, loaded without unpickling code.

A periodic checkpoint stops the loop only while each rank writes its shard to a folder of its node (a snapshot, in
memory where it has room: `snapshot_root`); Ray Train uploads it to run.storage_path on its own thread and registers
the checkpoint once every rank's upload is whole, so a kill during an upload resumes from the checkpoint before. The
next save waits for that registration (`wait_for_uploads`): at most one upload is in flight. A notice's save and the
final checkpoint upload at once, before the call returns.

DeepSpeed writes torch pickles and its own loader unpickles them with weights_only=False. We swap
in a checkpoint engine that loads with ``weights_only=True`` and allow-lists only the few plain
DeepSpeed data types those files hold (an enum, the loss-scaler
state and fragment addresses; found by loading stage 0-3 checkpoints, tests/test_scale.py).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray.train
import torch
from fsspec.implementations.arrow import ArrowFSWrapper

from pipelines.compat.deepspeed_private import use_weights_only_checkpoint_loading
from pipelines.fit.progress import Progress
from pipelines.storage import fs_path
from pipelines.train import reshard

TAG = "state"
_NAMED = re.compile(r"checkpoint_(?P<step>\d{8})_attempt(?P<attempt>\d{3,})(_\d+)?")
# Each rank's snapshot waits for its upload in a folder of this name (snapshot_root; Ray Train deletes it once uploaded)
SNAPSHOTS = "probvlp-snapshot-"
SHM = "/dev/shm"


def use_weights_only_loading(engine) -> None:
    use_weights_only_checkpoint_loading(engine)


def save(engine, progress: Progress, metrics: dict[str, Any], *, behind: bool = False, name: str | None = None,
         snapshots: str = "auto") -> str | None:
    """Every rank writes its DeepSpeed shard to a folder of this node (`snapshots`, below); Ray Train uploads the
    ranks' files into one checkpoint, the folder `name` of the run's storage (rank 0's name counts; None: Ray's).
    `behind`: returns once the shard is written and hands the upload to Ray Train (returns the snapshot's folder,
    which Ray Train deletes once uploaded); otherwise returns once Ray Train has registered the checkpoint (every
    rank's part uploaded) and every earlier one."""
    tmp = tempfile.mkdtemp(prefix=f"{SNAPSHOTS}{os.getpid()}-", dir=snapshot_root(engine, snapshots))
    if not behind:
        try:
            write_shard(engine, tmp, progress)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), checkpoint_dir_name=name)
            # registered, not only uploaded: a notice's hold right after would otherwise race the controller's next
            # poll of the workers, and the restart would resume from the checkpoint before
            wait_for_uploads()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return None
    try:
        write_shard(engine, tmp, progress)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), checkpoint_dir_name=name,
                     checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                     delete_local_checkpoint_after_upload=True)
    return tmp


def write_shard(engine, folder: str, progress: Progress) -> None:
    """This rank's DeepSpeed files in `folder`, written without the zip records' CRC-32 (torch.save's own switch):
    computing it was half of the time the loop waits for a snapshot, and torch.load never checks it; a checkpoint
    counts once Ray Train registers it whole, not by a checksum."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        engine.save_checkpoint(folder, tag=TAG, client_state={"progress": asdict(progress)})
    finally:
        torch.serialization.set_crc32_options(before)


def snapshot_root(engine, choice: str = "auto") -> str:
    """Where this rank writes its shard before the upload: `choice` (train.checkpoint_snapshot_dir), or with "auto"
    the node's memory (/dev/shm, whose files are RAM) where both it and the memory still available hold a whole
    checkpoint twice over (weights and AdamW's two moments, 16 bytes a parameter: the ranks of a node share them),
    else the temporary folder ($TMPDIR)."""
    if choice != "auto":
        return choice
    need = 2 * 16 * sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    if os.path.isdir(SHM) and min(shutil.disk_usage(SHM).free, _available_memory()) >= need:
        return SHM
    return tempfile.gettempdir()


def _available_memory() -> int:
    """MemAvailable of /proc/meminfo, in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0


def report(metrics: dict[str, Any]) -> None:
    """Metrics without a checkpoint (an evaluation's), queued behind an upload in flight instead of waiting for it."""
    ray.train.report(metrics, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)


def wait_for_uploads() -> None:
    """Until every checkpoint this rank reported is uploaded by every rank and registered by Ray Train."""
    ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)


def checkpoint_name(step: int, attempt: int) -> str:
    """The checkpoint's folder in the run's storage: its step and the attempt that saved it (a restart's save of a
    step never lands in the folder of an upload that a kill cut short)."""
    return f"checkpoint_{step:08d}_attempt{attempt:03d}"


def remove_cut_short(run_dir: str, resumed_step: int, attempt: int) -> list[str]:
    """Rank 0 at the start of attempt `attempt` (no upload in flight: Ray Train ended the workers before): the
    checkpoint folders of earlier attempts past the step this one resumed from, which Ray Train never registered (it
    resumes from the latest it did), removed from the run's storage. Returns their names."""
    fs, root = fs_path(run_dir)
    if not fs.exists(root):
        return []
    removed = []
    for path in fs.ls(root, detail=False):
        match = _NAMED.fullmatch(path.rstrip("/").rsplit("/", 1)[-1])
        if match and int(match["step"]) > resumed_step and int(match["attempt"]) < attempt:
            fs.rm(path, recursive=True)
            removed.append(match[0])
    return sorted(removed)


def remove_stale_snapshots(choice: str = "auto") -> int:
    """The snapshots of this node's processes that ended before their upload did (killed, preempted): removed, as
    nothing will upload them. Returns how many."""
    removed = 0
    for root in {tempfile.gettempdir(), SHM} if choice == "auto" else {choice}:
        for entry in os.listdir(root) if os.path.isdir(root) else []:
            pid = entry[len(SNAPSHOTS):].split("-", 1)[0]
            if entry.startswith(SNAPSHOTS) and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
                removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def restore(engine) -> tuple[Progress, dict | None] | None:
    """Load Ray Train's latest checkpoint (after a worker failure, a re-run with the same run name, or an elastic
    resize: a ZeRO-1/2/3 checkpoint of another world size loads resharded, pipelines.train.reshard). Returns the
    progress and the resharding's record (None where the checkpoint loaded as saved)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    # Ray's own filesystem for the checkpoint, as fsspec: an object store keeps the endpoint and credentials Ray has
    fs = ArrowFSWrapper(checkpoint.filesystem)
    with checkpoint.as_directory() as folder:
        path, client_state, resharded = reshard.load(engine, fs, checkpoint.path.rstrip("/"), Path(folder), TAG)
    if path is None:
        raise RuntimeError(f"checkpoint {checkpoint.path} holds no DeepSpeed state with tag {TAG!r}")
    return Progress(**client_state["progress"]), resharded
