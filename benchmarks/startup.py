"""Start-up: from a training command's start to its first step, and the CPU a small fit costs, by process kind and
by import, against a plain `torchrun` start of the same model on the same shards.

    .venv/bin/python -m benchmarks.startup                 # 40 steps, each command twice, alternating
    .venv/bin/python -m benchmarks.startup --steps 20 --repeats 1 --no-write

In one run on the idle machine, alternating:
- the product: `python -m jobs.pretrain --config configs/prolip_demo.yaml` (a local Ray, Ray Data reading the shards,
  Ray Train with 2 DeepSpeed ZeRO-2 workers, a fresh sqlite MLflow store as a new user's, the final evaluation);
- the reference: `torchrun --standalone --nproc_per_node 2 -m benchmarks.torchrun_fit` (DDP over gloo, webdataset in
  one DataLoader worker per rank, as open_clip starts; no tracking, no evaluation).
Both train the demo's ProLIP on the same digit shards (written once before), one torch thread per worker.

Measured: wall seconds from the command's start to the line its rank 0 prints after its first step (the product's
progress line of step 1, `train.log_every=1`); the CPU-seconds
every process of the command had used by then (a /proc poller over the command's process tree, every 0.1 s) and by
its end; those CPU-seconds by process kind. By import: a fresh Python importing the training worker's module
(`-X importtime`), its CPU-seconds and the packages that take them.
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")

# cmdline prefix -> kind (Ray names a worker process after what it runs: `ray::ClassName.method` / `ray::task`)
RAY_KINDS = [
    ("training workers", ("ray::RayTrainWorker",)),
    ("Train controller", ("ray::TrainController", "ray::PlacementGroupCleaner", "ray::SynchronizationActor")),
    ("project actors (stats, MLflow relay)", ("ray::ReaderStats", "ray::TrackingRelay", "ray::_RunStats")),
    ("Ray Data (reading, split, stats)", ("ray::ReadTar", "ray::ReadFiles", "ray::Read", "ray::MapBatches",
                                         "ray::SplitCoordinator", "ray::_StatsActor", "ray::AutoscalingRequester",
                                         "ray::_preprocess", "ray::DatasetManager", "ray::Map", "ray::Project")),
    ("Ray's idle workers", ("ray::IDLE",)),
]
IDLE = "Ray's idle workers"
# kinds a process leaves for a more specific one (a worker starts as default_worker.py, idles as ray::IDLE)
WEAK = {IDLE: 1}


def process_table() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command line, CPU-seconds used so far) of every process now."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        table[int(entry.name)] = (int(fields[1]), cmd.strip(), (int(fields[11]) + int(fields[12])) / TICK)
    return table


@dataclass
class Tree:
    """Every process under `root` seen by a poller: pid -> (kind, CPU-seconds when last seen)."""

    root: int
    classify: object  # (pid, cmd, depth) -> kind
    seen: dict[int, tuple[str, float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def sample(self) -> None:
        table = process_table()
        depth = {self.root: 0}
        grew = True
        while grew:
            grew = False
            for pid, (ppid, _, _) in table.items():
                if pid not in depth and ppid in depth:
                    depth[pid] = depth[ppid] + 1
                    grew = True
        with self.lock:
            for pid, d in depth.items():
                if pid in table:
                    _, cmd, cpu = table[pid]
                    kind, before = self.seen.get(pid, (None, 0.0))
                    # A Ray worker is renamed after what it runs (and an exited process's command line reads
                    # empty): the most specific name seen wins.
                    now = self.classify(pid, cmd, d) if cmd else None
                    if now and (kind is None or WEAK.get(now, 9) >= WEAK.get(kind, 9)):
                        kind = now
                    self.seen[pid] = (kind or "exited before it was seen", max(cpu, before))

    def by_kind(self) -> dict[str, tuple[int, float]]:
        """kind -> (processes, CPU-seconds)."""
        out: dict[str, list] = defaultdict(lambda: [0, 0.0])
        with self.lock:
            for kind, cpu in self.seen.values():
                out[kind][0] += 1
                out[kind][1] += cpu
        return {k: (n, s) for k, (n, s) in out.items()}

    def total(self) -> float:
        with self.lock:
            return sum(cpu for _, cpu in self.seen.values())


@dataclass
class Run:
    first_step_s: float | None
    first_step_cpu: float | None
    total_s: float
    total_cpu: float
    by_kind: dict[str, tuple[int, float]]
    output: str


def run(cmd: list[str], marker: str, classify, env: dict[str, str], log: Path | None = None,
        timeout_s: float = 1800) -> Run:
    """`cmd` to its end, polled: when `marker` appeared in its output, and the CPU its processes used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    tree = Tree(proc.pid, classify)
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            tree.sample()
            time.sleep(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    lines, first_s, first_cpu = [], None, None
    for line in proc.stdout:
        lines.append(line)
        if first_s is None and marker in line:
            first_s = time.monotonic() - t0
            tree.sample()
            first_cpu = tree.total()
        if time.monotonic() - t0 > timeout_s:
            proc.kill()
    proc.wait()
    total_s = time.monotonic() - t0
    done.set()
    poller.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    reaped = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    by_kind = tree.by_kind()
    # processes the poller missed between two samples (and the last 0.1 s of each), where their parents reaped them
    missed = reaped - tree.total()
    if missed > 0.5:
        by_kind["not seen by the poller (reaped)"] = (0, missed)
    out = "".join(lines)
    if log is not None:
        log.write_text(out)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-3000:]}")
    return Run(first_s, first_cpu, total_s, max(reaped, tree.total()), by_kind, out)


def product_kind(pid: int, cmd: str, depth: int) -> str:
    if depth == 0:
        return "driver (jobs.pretrain)"
    if cmd.startswith("ray::"):
        return next((kind for kind, prefixes in RAY_KINDS if cmd.startswith(prefixes)),
                    "other Ray workers: " + cmd.split(" ")[0].split(".")[0])
    if "default_worker.py" in cmd:
        return IDLE
    if "/ray/" in cmd:
        return "Ray system (GCS, raylet, dashboard, agents)"
    return "other: " + (cmd.split(" ")[0][-40:] or "?")


def torchrun_kind(pid: int, cmd: str, depth: int) -> str:
    return {0: "launcher (torchrun)", 1: "training workers"}.get(depth, "DataLoader workers")


def imports(module: str) -> tuple[float, float, list[tuple[str, float]]]:
    """A fresh Python importing `module`: (wall s, CPU s, [(top-level package, s of its own import time)])."""
    code = f"import resource, time; t = time.time(); import {module}; r = resource.getrusage(resource.RUSAGE_SELF); " \
           "print('TIMES', time.time() - t, r.ru_utime + r.ru_stime)"
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    wall, cpu = map(float, out.stdout.split("TIMES", 1)[1].split())
    own: dict[str, float] = defaultdict(float)
    for line in out.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
        if m:
            own[m.group(2).split(".")[0]] += int(m.group(1)) / 1e6
    return wall, cpu, sorted(own.items(), key=lambda kv: -kv[1])


def median(runs: list[Run], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="print the section, leave docs/BENCHMARKS.md as it is")
    args = ap.parse_args(argv)

    from pipelines.digits.shards import prepare_digits

    tmp = Path(tempfile.mkdtemp(prefix="probvlp_startup_"))
    data = tmp / "digits"
    prepare_digits(data)  # once, before anything is timed (its own local Ray, stopped after)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    product, reference = [], []
    for i in range(args.repeats):
        overrides = [f"data.root={data}", f"train.steps={args.steps}", f"run.storage_path={tmp}/ray{i}",
                     f"tracking.uri=sqlite:///{tmp}/mlflow{i}.db", "train.log_every=1"]
        product.append(run([sys.executable, "-m", "jobs.pretrain", "--config", "configs/prolip_demo.yaml",
                            *(a for kv in overrides for a in ("--set", kv))],
                           "[train] step 1/", product_kind, env, tmp / f"product{i}.log"))
        reference.append(run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              "-m", "benchmarks.torchrun_fit", str(data), str(args.steps)],
                             "[torchrun] first step done", torchrun_kind, env, tmp / f"torchrun{i}.log"))
        for name, r in (("product", product[-1]), ("torchrun", reference[-1])):
            print(f"{name} #{i + 1}: first step {r.first_step_s:.1f} s ({r.first_step_cpu:.0f} CPU-s), "
                  f"whole fit {r.total_s:.1f} s ({r.total_cpu:.0f} CPU-s)", flush=True)
    print(f"the commands' output: {tmp}/product*.log, {tmp}/torchrun*.log", flush=True)
    wall, cpu, top = imports("pipelines.pretrain.worker")
    markdown = section(args, product, reference, (wall, cpu, top))
    print(markdown)
    if not args.no_write:
        from benchmarks.report import write_section

        write_section("startup", markdown)
    return 0


def section(args, product: list[Run], reference: list[Run], worker_imports) -> str:
    from benchmarks.report import load, machine

    def row(label, a, b, unit):
        return f"| {label} | {a:.1f} {unit} | {b:.1f} {unit} | {a / b:.2f}x |"

    lines = [
        "## Start-up: command to first training step, product vs torchrun (`benchmarks/startup.py`)",
        "",
        f"`python -m benchmarks.startup --steps {args.steps} --repeats {args.repeats}`; {machine()}; "
        f"{time.strftime('%Y-%m-%d')}; medians of {args.repeats} alternating runs; {load()}.",
        "",
        f"The demo's ProLIP (configs/prolip_demo.yaml, 2 workers, batch 64) on the same digit shards, {args.steps} steps:",
        "",
        "| | `jobs.pretrain` (Ray Data, Ray Train, DeepSpeed ZeRO-2, MLflow) | `torchrun` + DDP + webdataset | ratio |",
        "|---|---|---|---|",
        row("wall, command start to first step", median(product, "first_step_s"), median(reference, "first_step_s"), "s"),
        row("CPU, command start to first step", median(product, "first_step_cpu"), median(reference, "first_step_cpu"),
            "CPU-s"),
        row(f"wall, whole command ({args.steps} steps; the product also evaluates)", median(product, "total_s"),
            median(reference, "total_s"), "s"),
        row("CPU, whole command", median(product, "total_cpu"), median(reference, "total_cpu"), "CPU-s"),
        "",
        "CPU-seconds of the whole command by process kind (the last run of each):",
        "",
        "| process kind | processes | CPU-s |",
        "|---|---|---|",
    ]
    for name, r in (("jobs.pretrain", product[-1]), ("torchrun", reference[-1])):
        for kind, (n, cpu) in sorted(r.by_kind.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"| {name}: {kind} | {n or ''} | {cpu:.1f} |")
    wall, cpu, top = worker_imports
    lines += ["", f"Importing the training worker (`import pipelines.pretrain.worker` in a fresh Python, what every Ray "
                  f"Train worker does first): {wall:.1f} s, {cpu:.1f} CPU-s; own import time by package: " +
              ", ".join(f"{name} {s:.2f} s" for name, s in top[:10]) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
