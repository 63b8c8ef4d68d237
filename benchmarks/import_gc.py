"""A process's start-up imports under CPython's default collector thresholds and under the project's
(pipelines.gc_tuning.collect_less): the CPU each fresh Python spends importing what a training worker imports.

    .venv/bin/python -m benchmarks.import_gc [--rounds 8] [--no-write]

Rounds alternate the two settings (default first, then the project's), each a new Python; the table gives the
medians and the median of the per-round ratios, and is written to docs/BENCHMARKS.md (section import_gc).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a training worker imports before its first step (pipelines.pretrain.worker and what it loads: torch, Ray
# Train, DeepSpeed; timm as its towers are built; MLflow on rank 0)
CHILD = """
import gc, json, sys, time
if sys.argv[1] == "project":
    from pipelines.gc_tuning import collect_less
    collect_less()
start = time.process_time()
import ray.train.torch, pipelines.pretrain.worker
from models.towers import _timm
_timm()
import pipelines.tracking
print(json.dumps({"cpu_s": time.process_time() - start, "threshold": gc.get_threshold(), "modules": len(sys.modules)}))
"""


def one(setting: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, setting], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    one("default")  # the first import of a session reads the files from disk: not a round
    rounds = []
    for _ in range(args.rounds):
        rounds.append({setting: one(setting) for setting in ("default", "project")})
        print(json.dumps(rounds[-1]), flush=True)
    default = [r["default"]["cpu_s"] for r in rounds]
    project = [r["project"]["cpu_s"] for r in rounds]
    ratio = statistics.median(p / d for p, d in zip(project, default))
    from benchmarks.report import load, machine, write_section

    table = (f"## Start-up imports and CPython's collector (`benchmarks/import_gc.py`)\n\n"
             f"A fresh Python importing what a training worker imports ({rounds[0]['default']['modules']:,} modules), "
             f"CPU seconds; {args.rounds} rounds alternating the two settings; {machine()}; {load()}. Command: "
             f"`python -m benchmarks.import_gc --rounds {args.rounds}`.\n\n"
             "| collector thresholds | CPU-s (median) | min - max | vs default (median of per-round ratios) |\n"
             "| --- | --- | --- | --- |\n"
             f"| CPython's default {tuple(rounds[0]['default']['threshold'])} | {statistics.median(default):.2f} | "
             f"{min(default):.2f} - {max(default):.2f} | 1.00x |\n"
             f"| the project's (`pipelines.gc_tuning`) {tuple(rounds[0]['project']['threshold'])} | "
             f"{statistics.median(project):.2f} | {min(project):.2f} - {max(project):.2f} | {ratio:.2f}x |\n")
    print(table)
    if not args.no_write:
        write_section("import_gc", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
