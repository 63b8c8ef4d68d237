"""How far each method's learning fit (tests/test_learning.py: its tiny config, its steps, batch 64, one torch thread,
in process) lands from its target over seeds and CPU kernels: held-out zero-shot top-1 per seed under torch's
`default` (scalar) kernels and the CPU's native vectorised ones, and the negative controls (CLIP untrained and CLIP
fitted up its loss), as a table (method, capability, each seed's top-1, min, mean, max, target, margin = min - target;
the controls' max must stay under the lowest target).

    .venv/bin/python -m tests.learning_spread                      # every method, seeds 0-4, default + native
    .venv/bin/python -m tests.learning_spread --methods siglip --set loss.params.init_bias=-4.0

`ATEN_CPU_CAPABILITY` picks torch's kernels when torch is imported, so each capability's fits run in a subprocess of
their own (at most `--jobs` at once, each with one torch thread, as the test). The seed is fit_in_process's (torch's
initialisation and the batches' draw); seed 0 is the test's. A capability only goes up to what the CPU has, and the
BLAS (oneDNN / MKL) picks its own kernels by CPU whatever the variable says: another machine's rounding differs from
both rows here, and the spread over seeds is the measure of how far rounding moves a fit.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTROLS = ("clip_untrained", "clip_climbed")  # tests/test_learning.py::test_broken_training_misses_the_targets


def work(tasks: list[tuple[str, int]], overrides: list[str]) -> None:
    """In the subprocess: each (method, seed) fitted and scored, one JSON line each on stdout."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    from models.objective import build_objective
    from pipelines.digits.arrays import digit_arrays
    from pipelines.digits_fit import fit_in_process
    from pipelines.pretrain.config import load_train_config
    from tests.test_learning import BATCH, CLASS_CAPTIONS, TARGETS, top1

    images, labels, _ = digit_arrays("test")
    held_out = (images, labels)
    capability = torch.backends.cpu.get_cpu_capability()
    for method, seed in tasks:
        name = "clip" if method in CONTROLS else method
        cfg = load_train_config(ROOT / "configs" / TARGETS[name][0], CLASS_CAPTIONS + overrides)
        steps = TARGETS[name][1]
        start = time.perf_counter()
        if method == "clip_untrained":
            torch.manual_seed(seed)
            got = top1(build_objective(cfg).model.eval(), held_out)
        else:
            sign = -1.0 if method == "clip_climbed" else 1.0
            got = top1(fit_in_process(cfg, steps, batch=BATCH, seed=seed, loss_sign=sign), held_out)
        print(json.dumps({"method": method, "seed": seed, "capability": capability, "top1": got,
                          "seconds": round(time.perf_counter() - start, 1)}), flush=True)


def run_chunk(capability: str, tasks: list[tuple[str, int]], overrides: list[str]) -> list[dict]:
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability != "native":
        env["ATEN_CPU_CAPABILITY"] = capability
    cmd = [sys.executable, "-m", "tests.learning_spread", "--worker", json.dumps(tasks),
           *(a for o in overrides for a in ("--set", o))]
    rows = []
    with tempfile.TemporaryFile("w+") as err, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                                stderr=err, text=True) as proc:
        for line in proc.stdout:  # each fit as it ends
            if line.startswith("{"):
                rows.append(r := json.loads(line))
                print(f"  {r['method']:<15} seed {r['seed']} {capability:>7} ({r['capability']}): {r['top1']:.3f} "
                      f"({r['seconds']} s)", flush=True)
        proc.wait()
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{capability} worker failed:\n{err.read()[-4000:]}")
    return rows


def table(rows: list[dict], targets: dict[str, float]) -> str:
    lines = ["| method | capability | top-1 per seed | min | mean | max | target | margin (min - target) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        groups = [(c, [r for r in mine if r["capability"] == c]) for c in dict.fromkeys(r["capability"] for r in mine)]
        if len(groups) > 1:
            groups.append(("all", mine))
        for capability, group in groups:
            got = [r["top1"] for r in sorted(group, key=lambda r: (r["seed"], r["capability"]))]
            target = targets.get(method)
            low = min(got)
            margin = f"{low - target:+.3f}" if target is not None else "-"
            seeds = " ".join(f"{g:.3f}" for g in got) if capability != "all" else f"{len(got)} fits"
            lines.append(f"| {method} | {capability.lower()} | {seeds} | {low:.3f} | {statistics.mean(got):.3f} | "
                         f"{max(got):.3f} | {target if target is not None else '-'} | {margin} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", help="tests/test_learning.py TARGETS keys (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--capabilities", nargs="+", default=["default", "native"],
                        help="ATEN_CPU_CAPABILITY values; native: the variable unset")
    parser.add_argument("--no-controls", action="store_true", help="leave out the negative controls")
    parser.add_argument("--set", action="append", default=[], dest="overrides",
                        help="a config override for every fitted method, e.g. loss.params.init_bias=-4.0")
    parser.add_argument("--jobs", type=int, default=2, help="subprocesses at once (one torch thread each)")
    parser.add_argument("--json", type=Path, help="also write every fit's row here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        work([tuple(t) for t in json.loads(args.worker)], args.overrides)
        return

    sys.path.insert(0, str(ROOT))
    from tests.test_learning import TARGETS  # imports torch here only, the workers choose their own kernels

    methods = args.methods or list(TARGETS)
    unknown = sorted(set(methods) - set(TARGETS))
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {list(TARGETS)}")
    tasks = [(m, s) for m in methods for s in args.seeds]
    if not args.no_controls:
        tasks += [(c, s) for c in CONTROLS for s in args.seeds]
    # Each capability's tasks in max(1, jobs // capabilities) interleaved chunks, one subprocess per chunk.
    per = max(1, args.jobs // len(args.capabilities))
    chunks = [(c, tasks[i::per]) for c in args.capabilities for i in range(per) if tasks[i::per]]
    start = time.perf_counter()
    print(f"{len(tasks) * len(args.capabilities)} fits in {len(chunks)} subprocesses, {args.jobs} at once; "
          f"overrides {args.overrides or 'none'}", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = [r for part in pool.map(lambda c: run_chunk(c[0], c[1], args.overrides), chunks) for r in part]
    order = {m: i for i, m in enumerate([*methods, *CONTROLS])}
    rows.sort(key=lambda r: (order[r["method"]], r["capability"], r["seed"]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    targets = {m: t for m, (_, _, t) in TARGETS.items()}
    controls = [r["top1"] for r in rows if r["method"] in CONTROLS]
    print(f"\n{table(rows, targets)}\n\nlowest target {min(targets.values())}"
          f"{f', highest control {max(controls):.3f}' if controls else ''}; chance 0.10; "
          f"{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
