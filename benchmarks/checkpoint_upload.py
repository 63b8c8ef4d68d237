"""What a periodic checkpoint costs the training loop (pipelines.zero.checkpoint_files): uploaded at once against behind training.

Run (one JSON line per storage and mode; with --write, its section of docs/BENCHMARKS.md):

    .venv/bin/python -m benchmarks.checkpoint_upload --model prolip_vit_b16 --steps 24 --every 6 --storages local --write

Two CPU Ray Train workers (gloo) build the pretraining workers' engine on the model (AdamW, ZeRO-2, the workers'
DeepSpeed config) and step on one fixed random batch. Per storage (this machine's disk; moto's S3 server on
127.0.0.1) and mode, one Ray Train run: `--steps` steps with a checkpoint every `--every` steps, saved at once (`sync`:
the shard written, uploaded, registered before the loop goes on) or behind training (`behind`: the loop waits for the
shard's snapshot on the node, pipelines.zero.checkpoint_files.save(behind=True)), against the same steps with no checkpoint
(`never`, run first and last: the ratios are to their mean). Per run: steps/s over the loop, its ratio to `never`, the
seconds each periodic save blocked the loop, then one more save timed alone: the snapshot (the shard written where
`snapshot_root` puts it), the whole save at once, and the upload behind training (from the report to Ray Train's
registration). The S3 server runs on the same cores as the workers here.

This machine's speed drifts between runs (the baseline moved 22% from the first `never` run to the last, 2026-11-29),
so each run also reads its cost within itself: per save, the seconds the loop was blocked plus what the `--after`
steps after it took beyond the run's median step (the upload's share of the cores), and from it the steps/s of a run
saving every 60 s of training against one that never saves: 60 / (60 + cost).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import ray.train
import torch
from ray.train.torch import TorchTrainer

BUCKET = "probvlp-bench"
INTERVAL_S = 60.0  # the interval the cost per save is read against: the goal, a save every 60 s of training


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _loop(config: dict) -> None:
    from benchmarks.engine import build_engine, random_batch
    from models.gather import World
    from pipelines.zero import checkpoint_files as state
    from pipelines.fit.progress import Progress
    from pipelines.zero.fit import train_step

    torch.set_num_threads(1)
    world = World.current()
    engine, model = build_engine(config["model"], 2, world.size)
    images, tokens = random_batch(model, config["batch"])
    mode, every, steps = config["mode"], config["every"], config["steps"]
    progress = Progress()

    def step() -> None:
        train_step(engine, images, tokens, 1, world)
        progress.step += 1

    step()  # Adam's moments exist, as in every checkpoint a run writes
    blocked: list[float] = []
    uploading = False
    durations: dict[int, float] = {}  # each step's own seconds, for the cost within this run (below)
    start = time.perf_counter()
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        step()
        durations[i] = time.perf_counter() - t0
        if mode == "never" or i % every:
            continue
        t0 = time.perf_counter()
        if mode == "behind" and uploading:
            state.wait_for_uploads()  # one upload in flight, as the workers do (TrainWorker._wait_for_upload)
        state.save(engine, progress, {"step": progress.step}, behind=mode == "behind")
        uploading = mode == "behind"
        blocked.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    state.wait_for_uploads()
    result = {"steps_per_s": steps / elapsed, "saves": len(blocked),
              "blocked_s": sum(blocked) / len(blocked) if blocked else 0.0}
    if blocked and steps > every:
        # Within this run, so that the machine's drift between runs cancels: what a save costs is the loop's blocked
        # time plus what the steps right after it (the upload's, behind training) took beyond the run's other steps
        after = [i for i in durations if i > every and (i - 1) % every < config["after"]]
        clean = sorted(d for i, d in durations.items() if i not in after)
        typical = clean[len(clean) // 2]
        saves_followed = len(after) / config["after"]
        result["after_save_excess_s"] = sum(durations[i] - typical for i in after) / saves_followed
        result["cost_per_save_s"] = result["blocked_s"] + result["after_save_excess_s"]
        result["step_s"] = typical
    if mode != "never":  # one save of each kind alone: its parts
        with tempfile.TemporaryDirectory(dir=state.snapshot_root(engine)) as tmp:
            result["snapshot_s"] = _timed(lambda: state.write_shard(engine, tmp, progress))
            result["checkpoint_bytes"] = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
        result["sync_save_s"] = _timed(lambda: state.save(engine, progress, {"step": progress.step}))
        t0 = time.perf_counter()
        state.save(engine, progress, {"step": progress.step}, behind=True)
        result["behind_blocked_s"] = time.perf_counter() - t0
        result["upload_s"] = _timed(state.wait_for_uploads)
        result["snapshot_in"] = state.snapshot_root(engine)
    shared = [result]
    torch.distributed.broadcast_object_list(shared, src=0)
    # the checkpoint bytes of all ranks: rank 0's share is the model's states and its optimizer partition
    if "checkpoint_bytes" in result:
        total = torch.tensor([result["checkpoint_bytes"]], dtype=torch.float64)
        torch.distributed.all_reduce(total)
        shared[0]["checkpoint_bytes"] = int(total.item())
    if world.rank == 0:  # Ray Train's result holds the last checkpoint's metrics, not a later report's
        Path(config["out"]).write_text(json.dumps(shared[0]))


def _run(storage: str, name: str, mode: str, args) -> dict:
    out = Path(args.tmp) / f"{name}.json"
    config = {"model": args.model, "batch": args.batch, "mode": mode, "every": args.every, "steps": args.steps,
              "after": args.after, "out": str(out)}
    trainer = TorchTrainer(
        _loop, train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=name, storage_path=storage,
                                       checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
                                       logging_config=ray.train.LoggingConfig(log_level="WARNING")))
    trainer.fit()
    return json.loads(out.read_text())


def section(never: list[float], rows: list[dict], args, command: str) -> str:
    """The docs/BENCHMARKS.md section of one run: a row per storage and mode."""
    from benchmarks.report import load, machine

    base = sum(never) / len(never)
    sync = {r["storage"]: r["blocked_s"] for r in rows if r["mode"] == "sync"}
    lines = [
        "## Checkpoints: saved at once against behind training (`benchmarks/checkpoint_upload.py`)", "",
        f"`{command}` ({args.model}, AdamW, ZeRO-2, two CPU workers of one core, {args.batch} samples each; "
        f"{machine()}; {load()}; {time.strftime('%Y-%m-%d')}). A checkpoint is "
        f"{rows[0]['checkpoint_gb']} GB; snapshots in `{rows[0]['snapshot_in']}`; a save every {args.every} steps "
        f"(~{args.every / base:.0f} s of training); no checkpoint: {' and '.join(f'{x:.4f}' for x in never)} steps/s "
        "(first and last run).", "",
        "| storage | mode | loop blocked per save, s | of the save at once | steps after it, s more | cost per save, s "
        "| steps/s saving every 60 s, from the cost | steps/s vs none | snapshot alone, s | save at once alone, s "
        "| upload behind, to registration, s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        of_sync = f"{r['blocked_s'] / sync[r['storage']]:.0%}" if r["storage"] in sync else ""
        lines.append(f"| {r['storage']} | {r['mode']} | {r['blocked_s']:.2f} | {of_sync} "
                     f"| {r['after_save_excess_s']:.2f} | {r['cost_per_save_s']:.2f} | {r['at_60s']:.3f} "
                     f"| {r['steps_per_s'] / base:.3f} | {r['snapshot_s']:.2f} | {r['sync_save_s']:.2f} "
                     f"| {r['upload_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    from pipelines.cluster import services
    from pipelines.cluster.runtime import init_ray
    from tests.helpers import free_port

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="prolip_vit_b16")
    ap.add_argument("--batch", type=int, default=2, help="per worker")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--storages", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    ap.add_argument("--modes", nargs="+", default=["sync", "behind"], choices=["sync", "behind"])
    ap.add_argument("--after", type=int, default=2,
                    help="the steps after a save counted as its upload's (more than the upload takes; < --every)")
    ap.add_argument("--write", action="store_true", help="write its section of docs/BENCHMARKS.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="probvlp-checkpoint-bench-") as tmp:
        args.tmp = tmp
        port = free_port()
        os.environ.update(services.s3_env(f"http://127.0.0.1:{port}"))  # before Ray: its workers inherit it
        server = services.start_s3(port, Path(tmp) / "s3.log", [BUCKET]) if "s3" in args.storages else None
        try:
            init_ray(num_cpus=4)
            never = _run(f"{tmp}/runs", "never", "never", args)
            print(json.dumps({"model": args.model, "mode": "never", "steps": args.steps,
                              "steps_per_s": round(never["steps_per_s"], 4)}), flush=True)
            rows = []
            for storage in args.storages:
                where = f"{tmp}/runs" if storage == "local" else f"s3://{BUCKET}/runs"
                for mode in args.modes:
                    got = _run(where, f"{storage}-{mode}", mode, args)
                    rows.append({"model": args.model, "storage": storage, "mode": mode, "steps": args.steps,
                                      "every": args.every, "saves": got["saves"],
                                      "steps_per_s": round(got["steps_per_s"], 4),
                                      "blocked_s": round(got["blocked_s"], 2),
                                      "snapshot_s": round(got["snapshot_s"], 2),
                                      "sync_save_s": round(got["sync_save_s"], 2),
                                      "behind_blocked_s": round(got["behind_blocked_s"], 2),
                                      "upload_s": round(got["upload_s"], 2),
                                      "cost_per_save_s": round(got["cost_per_save_s"], 2),
                                      "after_save_excess_s": round(got["after_save_excess_s"], 2),
                                      "step_s": round(got["step_s"], 2),
                                      "at_60s": round(INTERVAL_S / (INTERVAL_S + got["cost_per_save_s"]), 3),
                                      "snapshot_in": got["snapshot_in"],
                                      "checkpoint_gb": round(got["checkpoint_bytes"] / 1e9, 2)})
                    print(json.dumps(rows[-1]), flush=True)
            # the baseline again, after: the ratios are to the mean of the two (this machine drifts between runs)
            again = _run(f"{tmp}/runs", "never-again", "never", args)
            base = (never["steps_per_s"] + again["steps_per_s"]) / 2
            print(json.dumps({"model": args.model, "mode": "never", "steps": args.steps,
                              "steps_per_s": round(again["steps_per_s"], 4), "mean_never": round(base, 4)}), flush=True)
            for row in rows:
                print(json.dumps({**row, "vs_never": round(row["steps_per_s"] / base, 3)}), flush=True)
            if args.write:
                from benchmarks.report import write_section

                write_section("checkpoint_upload", section([never["steps_per_s"], again["steps_per_s"]], rows, args,
                                                           "python -m benchmarks.checkpoint_upload " +
                                                           " ".join(sys.argv[1:])))
        finally:
            if server is not None:
                services.stop(server)


if __name__ == "__main__":
    main()
