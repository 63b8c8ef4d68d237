"""The memory a snapshot in /dev/shm may take (pipelines.zero.checkpoint_files.available_memory): the host's MemAvailable, or
less where this process's cgroup (a Kubernetes container's limit) has less room, read from cgroup v2 and v1 trees.
The trees here are folders laid out as the kernel's, in tmp_path; one test reads this machine's own."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipelines.zero import checkpoint_files as state
from pipelines.zero.checkpoint_files import CgroupMemory, available_memory, cgroup_memory, host_available_memory

GiB = 2**30
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 writes for no limit (4-KiB pages)
SLACK = 256 * 2**20  # what a machine's memory may move between two reads of it


def meminfo(tmp: Path, available: int) -> str:
    path = tmp / "meminfo"
    path.write_text(f"MemTotal:       {4 * available // 1024} kB\nMemAvailable:   {available // 1024} kB\n")
    return str(path)


def v2_tree(tmp: Path, path: str, levels: dict[str, tuple[str, int, int]]) -> tuple[str, str]:
    """A cgroup v2 mount and /proc/self/cgroup for a process in `path`: `levels` maps a cgroup (relative to the
    mount, "" the root) to its memory.max, memory.current and the inactive_file of its memory.stat."""
    mount = tmp / "cgroup"
    mount.mkdir()
    (mount / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for folder, (limit, current, inactive) in levels.items():
        (mount / folder).mkdir(parents=True, exist_ok=True)
        (mount / folder / "memory.max").write_text(f"{limit}\n")
        (mount / folder / "memory.current").write_text(f"{current}\n")
        (mount / folder / "memory.stat").write_text(f"anon 1\nfile {inactive}\nshmem 5\ninactive_file {inactive}\n")
    proc = tmp / "proc_cgroup"
    proc.write_text(f"0::{path}\n")
    return str(proc), str(mount)


def v1_tree(tmp: Path, path: str, levels: dict[str, tuple[int, int, int]]) -> tuple[str, str]:
    """The same for cgroup v1: the memory controller's hierarchy at mount/memory (memory.limit_in_bytes,
    memory.usage_in_bytes, total_inactive_file), beside another controller's, as the kernel mounts them."""
    mount = tmp / "cgroup"
    (mount / "cpu").mkdir(parents=True)
    (mount / "unified").mkdir()  # a hybrid host's cgroup2 mount, without the memory controller
    (mount / "unified" / "cgroup.controllers").write_text("")
    for folder, (limit, usage, inactive) in levels.items():
        level = mount / "memory" / folder
        level.mkdir(parents=True, exist_ok=True)
        (level / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (level / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (level / "memory.stat").write_text(f"inactive_file 7\nshmem 5\ntotal_inactive_file {inactive}\n")
    proc = tmp / "proc_cgroup"
    proc.write_text(f"9:name=systemd:/\n4:memory:{path}\n3:cpu,cpuacct:/\n0::/\n")
    return str(proc), str(mount)


def test_cgroup_v2_the_tightest_of_the_process_and_its_parents(tmp_path):
    """Room = limit - usage + reclaimable page cache (inactive_file), the least of this cgroup's and its parents'
    up to the mount; "max" is no limit; the root has no memory.max (never read as one)."""
    pod, container = "kubepods.slice/pod1", "kubepods.slice/pod1/ctr"
    proc, mount = v2_tree(tmp_path, f"/{container}", {
        container: ("max", 3 * GiB, 1 * GiB),  # no limit of its own
        pod: (str(8 * GiB), 7 * GiB, 2 * GiB),  # the pod's: 8 - 7 + 2 = 3 GiB of room
        "kubepods.slice": (str(64 * GiB), 10 * GiB, 0)})
    assert cgroup_memory(proc, mount) == CgroupMemory(str(Path(mount) / pod), 8 * GiB, 3 * GiB)
    assert available_memory(meminfo(tmp_path, 100 * GiB), proc, mount) == 3 * GiB
    assert available_memory(meminfo(tmp_path, 2 * GiB), proc, mount) == 2 * GiB  # the host has less
    # usage past the limit (reclaim pending): no room, never negative
    (Path(mount) / pod / "memory.current").write_text(f"{11 * GiB}\n")
    assert cgroup_memory(proc, mount).room == 0


def test_cgroup_v2_inside_a_container_its_mount_is_its_own_cgroup(tmp_path):
    """With a cgroup namespace /proc/self/cgroup says "/" (or "/.."), and without one it names the host's path,
    absent from the container's mount: both read the mount's own files. No limit anywhere: None."""
    for i, path in enumerate(("/", "/../other", "/kubepods/pod1/ctr")):
        tmp = tmp_path / str(i)
        tmp.mkdir()
        proc, mount = v2_tree(tmp, path, {"": (str(4 * GiB), 3 * GiB, GiB // 2)})
        assert cgroup_memory(proc, mount) == CgroupMemory(str(Path(mount)), 4 * GiB, GiB + GiB // 2), path
        (Path(mount) / "memory.max").write_text("max\n")
        assert cgroup_memory(proc, mount) is None
        assert available_memory(meminfo(tmp, 5 * GiB), proc, mount) == 5 * GiB


def test_cgroup_v1_memory_controller(tmp_path):
    """v1: the memory controller's line of /proc/self/cgroup, its hierarchy at mount/memory; the huge number is no
    limit; the hierarchical total_inactive_file counts as reclaimable, not the cgroup's own inactive_file."""
    proc, mount = v1_tree(tmp_path, "/docker/abc", {
        "": (V1_UNLIMITED, 50 * GiB, 0), "docker": (V1_UNLIMITED, 40 * GiB, 0),
        "docker/abc": (6 * GiB, 5 * GiB, GiB)})
    assert cgroup_memory(proc, mount) == CgroupMemory(str(Path(mount) / "memory" / "docker/abc"), 6 * GiB, 2 * GiB)
    assert available_memory(meminfo(tmp_path, 30 * GiB), proc, mount) == 2 * GiB
    (Path(mount) / "memory" / "docker" / "memory.limit_in_bytes").write_text(f"{41 * GiB}\n")  # 1 GiB of room
    assert cgroup_memory(proc, mount).limit == 41 * GiB
    (Path(mount) / "memory" / "docker/abc" / "memory.limit_in_bytes").write_text(f"{V1_UNLIMITED}\n")
    (Path(mount) / "memory" / "docker" / "memory.limit_in_bytes").write_text(f"{V1_UNLIMITED}\n")
    assert cgroup_memory(proc, mount) is None
    assert cgroup_memory(str(tmp_path / "absent"), str(tmp_path / "absent")) is None  # nothing readable: no limit


def _real_leaf() -> tuple[Path, Path, tuple[str, str]] | None:
    """This process's memory cgroup folder, the mount above it, and its limit and usage files, read here apart from
    pipelines.zero.checkpoint_files: v2 where /sys/fs/cgroup has the memory controller, else v1's memory hierarchy."""
    lines = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
    mount = Path("/sys/fs/cgroup")
    controllers = mount / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        path, files = next(p[2] for p in lines if p[0] == "0"), ("memory.max", "memory.current")
    elif (mount / "memory").is_dir():
        mount = mount / "memory"
        path = next(p[2] for p in lines if "memory" in p[1].split(","))
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    else:
        return None
    leaf = mount / path.lstrip("/")
    return (leaf if leaf.is_dir() and ".." not in path else mount), mount, files


def test_this_machines_cgroup(capsys):
    """On this machine: at most MemAvailable (read before and after: it moves), and where some cgroup from this
    process's up to the mount sets a limit, the least of them at most (the room under it, never more than it)."""
    before = host_available_memory()
    available, found = available_memory(), cgroup_memory()
    after = host_available_memory()
    assert 0 < available <= max(before, after) + SLACK
    real = _real_leaf()
    if real is None:
        assert found is None
        return
    leaf, mount, (limit_file, _) = real
    limits = {}
    for folder in [leaf, *(p for p in leaf.parents if p.is_relative_to(mount))]:
        try:
            raw = (folder / limit_file).read_text().strip()
        except OSError:
            continue
        if raw != "max" and int(raw) < V1_UNLIMITED - 2**30:
            limits[str(folder)] = int(raw)
    with capsys.disabled():
        print(f"\n[this machine] {mount}, {leaf}: limits {limits or 'none'}; available {available / GiB:.2f} GiB")
    if not limits:
        assert found is None and min(before, after) - SLACK <= available
        return
    assert found is not None and found.folder in limits and found.limit == limits[found.folder]
    assert 0 <= found.room <= found.limit and available <= found.room + SLACK


def engine(module: torch.nn.Module) -> SimpleNamespace:
    return SimpleNamespace(module=module)


def test_a_container_limit_below_the_need_sends_the_snapshot_to_disk_while_the_host_has_room(tmp_path, monkeypatch,
                                                                                            capsys):
    """A 1M-parameter model needs 32 MB in /dev/shm (a checkpoint twice over, 16 bytes a parameter). The host (its
    /dev/shm and MemAvailable) holds it; a cgroup limit with 16 MiB of room does not: the snapshot goes to $TMPDIR,
    said once in one line naming the limit and the need. With room enough, /dev/shm as before."""
    model = torch.nn.Linear(1000, 1000, bias=False)
    need = 32 * 1000 * 1000
    if not os.path.isdir(state.SHM) or min(shutil.disk_usage(state.SHM).free, host_available_memory()) < 2 * need:
        pytest.skip("this host's /dev/shm or memory holds no 32-MB snapshot: the test's premise")
    proc, mount = v2_tree(tmp_path, "/pod/ctr", {"pod/ctr": (str(GiB), GiB - 16 * 2**20, 0)})
    monkeypatch.setattr(state, "cgroup_memory", lambda *_: cgroup_memory(proc, mount))  # the real roots' stand-in
    assert state.snapshot_root(engine(model)) == state.tempfile.gettempdir()
    assert state.snapshot_root(engine(model)) == state.tempfile.gettempdir()
    out = capsys.readouterr().out.splitlines()
    assert out == [f"[checkpoint] snapshots in $TMPDIR ({state.tempfile.gettempdir()}), not /dev/shm: the memory "
                   f"limit of cgroup {Path(mount) / 'pod/ctr'} (1 GiB, 0.0156 GiB of it free) is below the 0.0298 GiB "
                   "a checkpoint twice over needs there (the host has room; train.checkpoint_snapshot_dir can name "
                   "another folder)"], out
    (Path(mount) / "pod/ctr" / "memory.current").write_text(f"{GiB - 2 * need}\n")
    assert state.snapshot_root(engine(model)) == state.SHM
    assert state.snapshot_root(engine(model), str(tmp_path)) == str(tmp_path)  # a folder given: as given
    assert capsys.readouterr().out == ""
