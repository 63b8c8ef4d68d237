"""What resharding a ZeRO checkpoint costs (pipelines.zero.reshard): the universal conversion's time and storage.

Run (prints one JSON line per ZeRO stage; docs/SCALING.md "Elastic training" quotes it):

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.reshard --model clip_tiny --stages 2 3

Per stage, `--world` gloo ranks build the training workers' engine (AdamW, the warmup + cosine schedule, the workers'
DeepSpeed config) on the model, take one step and save; this process then times the conversion (``reshard.convert``,
one CPU worker as in a training worker) and sizes the checkpoint and the universal folder, per parameter.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def _save(rank: int, world: int, port: int, model: str, stage: int, folder: str) -> None:
    from benchmarks.engine import build_engine, random_batch
    from models.gather import World

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        engine, net = build_engine(model, stage, world)
        # one step on random inputs: Adam's moments exist, as in every checkpoint a run writes
        out = engine(*random_batch(net, 4), World.current())
        engine.backward(out["loss"])
        engine.step()
        engine.save_checkpoint(folder, tag="state")
    finally:
        dist.destroy_process_group()


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    from models.registry import create_model
    from pipelines.zero import reshard
    from tests.helpers import free_port

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="clip_tiny")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    params = sum(p.numel() for p in create_model(args.model).parameters())
    for stage in args.stages:
        with tempfile.TemporaryDirectory(prefix="probvlp-reshard-bench-") as tmp:
            saved, out = Path(tmp) / "checkpoint", Path(tmp) / "universal"
            mp.spawn(_save, args=(args.world, free_port(), args.model, stage, str(saved)), nprocs=args.world, join=True)
            t0 = time.perf_counter()
            reshard.convert(saved / "state", out)
            seconds = time.perf_counter() - t0
            checkpoint, universal = _bytes(saved / "state"), _bytes(out)
            print(json.dumps({"model": args.model, "parameters": params, "stage": stage, "world": args.world,
                              "convert_s": round(seconds, 2), "checkpoint_bytes": checkpoint,
                              "universal_bytes": universal,
                              "universal_bytes_per_param": round(universal / params, 2),
                              "files": sum(1 for p in out.rglob("*") if p.is_file())}), flush=True)
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
