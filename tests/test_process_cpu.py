"""benchmarks/process_cpu.py reads the kernel's process accounting records (acct_v3) and names each process by what it
was: checked on records packed here, as the kernel lays them out (linux/acct.h)."""
from __future__ import annotations

from benchmarks.process_cpu import RECORD, kind, records, remember


def packed(pid: int, utime: int, stime: int, comm: bytes, version: int = 3) -> bytes:
    return RECORD.pack(0, version, 0, 0, 0, 0, pid, 1, 0, 0.0, utime, stime, 0, 0, 0, 0, 0, 0, comm)


def test_records_decode_comp_t_times_in_clock_ticks(tmp_path):
    # comp_t: 13-bit mantissa, base-8 exponent: 250 ticks is 250; 0x2000 | 100 is 100 * 8 = 800 ticks
    log = tmp_path / "acct"
    log.write_bytes(packed(7, 250, 0x2000 | 100, b"python\0") + packed(8, 1, 0, b"x", version=2)
                    + packed(9, 0, 3, b"ray::IDLE"))
    assert list(records(str(log))) == [(7, 10.5, "python"), (9, 0.03, "ray::IDLE")]  # a non-v3 record skipped


def test_processes_are_named_by_actor_module_script_or_thread():
    assert kind("ray::RayTrainWorker.init_train_context", "pt_gloo") == "ray::RayTrainWorker"
    assert kind("/venv/bin/python -m jobs.pretrain --config c.yaml", "python") == "python -m jobs.pretrain"
    assert kind("/venv/bin/python -u /venv/lib/ray/_private/log_monitor.py --x", "python") == "python log_monitor.py"
    assert kind("", "pt_gloo_runloop") == "[pt_gloo_runloop]"
    assert kind("/usr/bin/git status", "git") == "git"


def test_a_ray_worker_back_at_idle_keeps_the_name_of_what_it_ran():
    seen: dict[int, str] = {}
    for title in ("ray::IDLE", "ray::download_part", "ray::IDLE", ""):  # a task worker's life, then its zombie
        remember(seen, 7, title)
    remember(seen, 8, "ray::IDLE")  # a worker that never ran a task stays IDLE
    remember(seen, 9, "python -m pytest")
    remember(seen, 9, "ray::RayTrainWorker")  # a fork that took an actor's title takes it
    assert seen == {7: "ray::download_part", 8: "ray::IDLE", 9: "ray::RayTrainWorker"}
