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
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import ray.train
import torch
from fsspec.implementations.arrow import ArrowFSWrapper

from pipelines.compat.deepspeed_private import use_weights_only_checkpoint_loading
from pipelines.fit.progress import Progress
from pipelines.fit.registered import UploadTimeout, wait_for_uploads  # noqa: F401 - the workers' names
from pipelines.storage import fs_path
from pipelines.zero import reshard
from pipelines.zero.config import ZeroConfig
# the snapshot folders' names, and their removal after a kill: in the torch-free module the job's sweep runs on every node
from pipelines.zero.snapshot_sweep import SHM, SNAPSHOTS, remove_stale_snapshots  # noqa: F401 - the worker's name

TAG = "state"
_NAMED = re.compile(r"checkpoint_(?P<step>\d{8})_attempt(?P<attempt>\d{3,})(_\d+)?")
# cgroup v1's "no limit" is its page counter's maximum in bytes (9223372036854771712 with 4-KiB pages): at least this
_CGROUP_V1_UNLIMITED = 1 << 62
UPLOAD_TIMEOUT_S: float = ZeroConfig.model_fields["upload_timeout_s"].default


def use_weights_only_loading(engine) -> None:
    use_weights_only_checkpoint_loading(engine)


def save(engine, progress: Progress, metrics: dict[str, Any], *, behind: bool = False, name: str | None = None,
         snapshots: str = "auto", upload_timeout_s: float = UPLOAD_TIMEOUT_S) -> str | None:
    """Every rank writes its DeepSpeed shard to a folder of this node (`snapshots`, below); Ray Train uploads the
    ranks' files into one checkpoint, the folder `name` of the run's storage (rank 0's name counts; None: Ray's).
    `behind`: returns once the shard is written and hands the upload to Ray Train (returns the snapshot's folder,
    which Ray Train deletes once uploaded); otherwise returns once Ray Train has registered the checkpoint (every
    rank's part uploaded) and every earlier one, or raises UploadTimeout after `upload_timeout_s` (wait_for_uploads)."""
    tmp = tempfile.mkdtemp(prefix=f"{SNAPSHOTS}{os.getpid()}-", dir=snapshot_root(engine, snapshots))
    if not behind:
        try:
            write_shard(engine, tmp, progress)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), checkpoint_dir_name=name)
            # registered, not only uploaded: a notice's hold right after would otherwise race the controller's next
            # poll of the workers, and the restart would resume from the checkpoint before
            wait_for_uploads(progress.step, upload_timeout_s)
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
    the node's memory (/dev/shm, whose files are RAM) where it, the host's available memory and the room under this
    process's cgroup memory limit (a container's: a snapshot past it is an OOM kill) all hold a whole checkpoint
    twice over (weights and AdamW's two moments, 16 bytes a parameter: the ranks of a node share them), else the
    temporary folder ($TMPDIR)."""
    if choice != "auto":
        return choice
    need = 2 * 16 * sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    if not os.path.isdir(SHM):
        return tempfile.gettempdir()
    free = shutil.disk_usage(SHM).free
    if min(free, available_memory()) >= need:
        return SHM
    cgroup = cgroup_memory()
    # the container's limit alone sends it to disk: said once a process, as a snapshot there is slower
    if cgroup and cgroup.room < need <= min(free, host_available_memory()) and (cgroup.folder, need) not in _TOLD:
        _TOLD.add((cgroup.folder, need))
        print(f"[checkpoint] snapshots in $TMPDIR ({tempfile.gettempdir()}), not {SHM}: the memory limit of cgroup "
              f"{cgroup.folder} ({_gib(cgroup.limit)}, {_gib(cgroup.room)} of it free) is below the {_gib(need)} a "
              "checkpoint twice over needs there (the host has room; train.checkpoint_snapshot_dir can name another folder)",
              flush=True)
    return tempfile.gettempdir()


_TOLD: set[tuple[str, int]] = set()  # (cgroup, need) whose snapshots this process said go to $TMPDIR


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def available_memory(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                     mount: str = "/sys/fs/cgroup") -> int:
    """Bytes this process can still take: the host's MemAvailable, or less where its cgroup has less room."""
    host, cgroup = host_available_memory(meminfo), cgroup_memory(proc_cgroup, mount)
    return host if cgroup is None else min(host, cgroup.room)


def host_available_memory(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable of /proc/meminfo, in bytes (0 where it cannot be read). A container sees the host's."""
    try:
        with open(meminfo) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0


@dataclass(frozen=True)
class CgroupMemory:
    folder: str  # the cgroup whose limit leaves the least room: this process's or a parent's
    limit: int  # bytes
    room: int  # bytes it can still take before its OOM killer ends a process


def cgroup_memory(proc_cgroup: str = "/proc/self/cgroup", mount: str = "/sys/fs/cgroup") -> CgroupMemory | None:
    """The memory limit that leaves this process the least room: its cgroup's or a parent's readable under `mount`
    (cgroup v2's tree, or v1's memory controller at mount/memory); None where none is set or readable. The room is
    the limit less the usage the kernel cannot reclaim: the usage counts the page cache (the data files read), whose
    inactive part goes before an OOM kill, as a kubelet counts a pod's working set, and the files of a memory-backed
    /dev/shm (shmem, which nothing reclaims: a snapshot there is charged to the cgroup of the rank that writes it)."""
    root = Path(mount)
    lines = [line.split(":", 2) for line in _read(Path(proc_cgroup)).splitlines()]
    if "memory" in _read(root / "cgroup.controllers").split():
        files, inactive = ("memory.max", "memory.current"), "inactive_file"
        path = next((p[2] for p in lines if len(p) == 3 and p[0] == "0" and not p[1]), "/")
    else:
        root = root / "memory"
        files, inactive = ("memory.limit_in_bytes", "memory.usage_in_bytes"), "total_inactive_file"  # hierarchical
        path = next((p[2] for p in lines if len(p) == 3 and "memory" in p[1].split(",")), "/")
    leaf = Path(os.path.normpath(root / path.lstrip("/")))
    # in a container the mount is its own cgroup, whatever path the host's tree gives it (or "/.." in a namespace)
    if not leaf.is_dir() or not leaf.is_relative_to(root):
        leaf = root
    tightest = None
    for folder in [leaf, *(p for p in leaf.parents if p.is_relative_to(root))]:
        level = _cgroup_level(folder, *files, inactive)
        if level and (tightest is None or level.room < tightest.room):
            tightest = level
    return tightest


def _cgroup_level(folder: Path, limit_file: str, usage_file: str, inactive: str) -> CgroupMemory | None:
    """One cgroup's limit and room; None where it has no limit (v2 "max", v1's huge number) or its files are
    unreadable (a root cgroup has none)."""
    try:
        raw = (folder / limit_file).read_text().strip()
        if raw == "max" or int(raw) >= _CGROUP_V1_UNLIMITED:
            return None
        limit, usage = int(raw), int((folder / usage_file).read_text())
    except (OSError, ValueError):
        return None
    stat = (line.split() for line in _read(folder / "memory.stat").splitlines())
    reclaimable = next((int(f[1]) for f in stat if len(f) == 2 and f[0] == inactive), 0)
    return CgroupMemory(str(folder), limit, max(0, limit - usage + reclaimable))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # absent, or not ours to read: as if empty
        return ""


def report(metrics: dict[str, Any]) -> None:
    """Metrics without a checkpoint (an evaluation's), queued behind an upload in flight instead of waiting for it."""
    ray.train.report(metrics, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)


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


def restore(engine) -> tuple[Progress, dict | None] | None:
    """Load Ray Train's latest checkpoint (after a worker failure, a re-run with the same run name, or an elastic
    resize: a ZeRO-1/2/3 checkpoint of another world size loads resharded, pipelines.zero.reshard). Returns the
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
    known = {f.name for f in fields(Progress)}  # a checkpoint may carry counters this version no longer keeps
    return Progress(**{k: v for k, v in client_state["progress"].items() if k in known}), resharded
