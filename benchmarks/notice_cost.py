"""What a notice of preemption costs a run: holding from the notice's save to the restart, against training on to a
last save before the deadline (run.notice_train_on, pipelines.pretrain.worker).

Run (one JSON line per deadline and mode, then a markdown table):

    .venv/bin/python -m benchmarks.notice_cost --deadlines 30 120

Per deadline and mode, one `jobs.pretrain` of the demo's small model on the bundled digits (two CPU Ray Train workers,
its own local Ray), the notice file written after step 10 with the deadline as its seconds left: both ranks save at
once, then hold or train on; Ray Train restarts the run at the deadline, and the job is stopped at the restart's
first step. Counted from what each attempt applied (run.audit_steps_to) and its journal: the steps attempt 1 trained
after the notice's step and kept (the restart resumed after them), the steps trained twice, and the seconds from
attempt 1's last applied step to the deadline, per worker (a worker holding its device without training: idle),
then to the restart's first step.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 2
SMALL = ["model.overrides.vision_depth=1", "model.overrides.text_depth=1", "train.batch_size=32",
         "train.warmup_steps=2", "data.augment=false", "train.eval_every=0", "train.log_every=10",
         "train.checkpoint_every=100000", f"train.num_workers={WORKERS}", "run.max_failures=0"]


def _audited(path: Path) -> dict[int, list[tuple[int, float]]]:
    steps: dict[int, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        attempt, step, at = line.split()
        steps.setdefault(int(attempt), []).append((int(step), float(at)))
    return steps


def one(data: str, deadline_s: float, train_on: bool, work: Path) -> dict:
    """One run with a notice of `deadline_s` after step 10; stopped at the restart's first step."""
    notice, audit, storage = work / "notice", work / "steps.txt", work / "ray"
    overrides = [f"data.root={data}", f"tracking.uri=sqlite:///{work / 'mlflow.db'}", f"run.storage_path={storage}",
                 "run.name=notice", "train.steps=100000", f"run.notice_train_on={str(train_on).lower()}",
                 f"run.notice_file={notice}", f"run.audit_steps_to={audit}", *SMALL]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with (work / "job.log").open("w") as log:
        job = subprocess.Popen([sys.executable, "-m", "jobs.pretrain", "--config", str(ROOT / "configs" / "demo.yaml"),
                                *(a for kv in overrides for a in ("--set", kv))], cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while max((s for s, _ in _audited(audit).get(1, [])), default=0) < 10:
            if job.poll() is not None:
                raise RuntimeError(f"the job ended before step 10: {(work / 'job.log').read_text()[-2000:]}")
            time.sleep(0.1)
        notice.write_text(f"{deadline_s:g}\n")
        deadline = notice.stat().st_mtime + deadline_s
        while 2 not in _audited(audit):
            if job.poll() is not None:
                raise RuntimeError(f"the job ended before its restart: {(work / 'job.log').read_text()[-2000:]}")
            time.sleep(0.2)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    from pipelines.storage import load_json, run_folder

    attempts = load_json(f"{run_folder(str(storage), 'notice')}/attempts.json")
    ran = _audited(audit)
    noticed = attempts[0]["notice"]["step"]
    resumed = attempts[1]["from_step"]
    first, second = ran[1], ran[2]
    steps = [s for s, _ in first] + [s for s, _ in second]
    return {"deadline_s": deadline_s, "mode": "train on" if train_on else "hold", "notice_step": noticed,
            "resumed_from": resumed, "steps_kept_after_notice": resumed - noticed,
            "steps_trained_twice": len(steps) - len(set(steps)),
            "idle_to_deadline_worker_s": round(WORKERS * (deadline - first[-1][1]), 1),
            "last_step_to_restart_s": round(second[0][1] - first[-1][1], 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadlines", type=float, nargs="+", default=[30.0, 120.0])
    args = parser.parse_args(argv)
    from pipelines.digits.shards import write_digit_shards

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "digits"
        write_digit_shards(data, image_size=32, shard_size=500)
        for deadline in args.deadlines:
            for train_on in (False, True):
                work = Path(tmp) / f"{deadline:g}-{train_on}"
                work.mkdir()
                rows.append(one(str(data), deadline, train_on, work))
                print(json.dumps(rows[-1]), flush=True)
    print("\n| deadline | after the notice's save | steps kept after the notice | steps trained twice | "
          "idle worker-s to the deadline | last step to the restart's first |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['deadline_s']:g} s | {r['mode']} | {r['steps_kept_after_notice']} | {r['steps_trained_twice']} | "
              f"{r['idle_to_deadline_worker_s']:g} | {r['last_step_to_restart_s']:g} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
