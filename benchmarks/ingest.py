"""Ingest: the real reader feeding a real Ray Train worker loop, today's data path against the new ones, in one run.

Run (each writes its own section of docs/BENCHMARKS.md):

    .venv/bin/python -m benchmarks.ingest                     # CPU: null and tiny model (section ingest_cpu)
    .venv/bin/python -m benchmarks.ingest --models null,b16 --device cuda --batch 256 --bf16   # a GPU (ingest_cuda)
    .venv/bin/python -m benchmarks.ingest --quick             # small sizes, prints only

Data: photo-like 256 px JPEGs in webdataset shards (`benchmarks.peers.write_photo_shards`, as `peers --data`),
read by `pipelines.data.reader.read_shards` with the training augmentation and file shuffling, 224 px out.
Paths, one Ray dataset each, all handed to one `TorchTrainer` worker that iterates them as `TrainWorker.batches`
does (`iter_torch_batches` with the run's prefetch, pinned memory on a GPU, a local shuffle buffer):
- today: float32 (3, 224, 224) images, augmented in the reader by the float reference (the float32 path uint8 reading replaced);
- reader: uint8 images augmented in the reader (OpenCV on uint8; data.augment_on: reader);
- device: uint8 images at the decode size plus the drawn parameters, augmented on the worker's device
  (data.augment_on: device);
- webdataset: the reader path with its tar files read by Ray's `read_webdataset` (Ray's own tar reader) instead
  of `pipelines.data.tars` (broken files skipped and counted): before / after on clean shards,
  `--paths webdataset,reader --section ingest_tars`.
Models: "null" (the augmented images are made and summed: the pure ingest ceiling), "tiny" (ProLIP, the
registry's tiny towers at 224 px with 32 px patches), "b16" (ProLIP ViT-B/16; for a GPU). Each step is forward,
backward and AdamW, and reads the loss back as the product's finiteness check does.

Per (path, model), over whole epochs after the first batch of each (the pipeline's start), rounds alternating:
samples/s, data_wait_frac (share of the loop spent waiting for the next batch, as `pipelines.fit.data_wait.DataWait`
counts it), CPU-seconds per sample (every process of this Ray session and this driver), bytes per sample that came
through the object store (the batch as the worker received it), and the model alone on a batch already on the
device (its step rate is the ceiling: end to end / model only is the share of it the data path delivers).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from benchmarks.peers import write_photo_shards
from benchmarks.report import load, machine, write_section
from benchmarks.train_step import SIZES, build, captions, step
from models.registry import TINY
from models.tokenizer import tokenize

PATHS = {"today": dict(uint8=False), "reader": dict(uint8=True, augment_on="reader"),
         "device": dict(uint8=True, augment_on="device"), "webdataset": dict(uint8=True, augment_on="reader")}
CONTEXT = 32
MODEL_SIZES = {"tiny": dataclasses.replace(TINY, img_size=224, patch_size=32, context_length=CONTEXT),
               "b16": SIZES["b16"]}


@contextlib.contextmanager
def tars_read_by(path: str):
    """`read_shards` reading its tar files with Ray's read_webdataset for the "webdataset" path (the datasource is
    built here, in the driver, and shipped to the read tasks), with pipelines.data.tars otherwise."""
    import ray.data

    import pipelines.data.reader as reader

    original = reader.read_tar_shards
    if path == "webdataset":
        reader.read_tar_shards = lambda paths, stats_name=None, shuffle=None: ray.data.read_webdataset(
            paths, decoder=None, shuffle=shuffle)
    try:
        yield
    finally:
        reader.read_tar_shards = original


class CpuClock:
    """CPU-seconds of this process and its descendants (a local Ray's processes), sampled every 0.2 s in a thread,
    read at any wall-clock time in between by interpolation."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._seen: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _total(self) -> float:
        me = psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                self._seen[p.pid] = t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass  # gone: its last reading stays counted
        return sum(self._seen.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._total()))
            self._stop.wait(0.2)

    def at(self, when: float) -> float:
        for (t0, c0), (t1, c1) in zip(self.samples, self.samples[1:]):
            if t0 <= when <= t1:
                return c0 + (c1 - c0) * (when - t0) / max(t1 - t0, 1e-9)
        return self.samples[-1][1] if when > self.samples[-1][0] else self.samples[0][1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def loop(config: dict) -> None:
    """The Ray Train worker: for each round, each path, each model, one epoch; reports every measurement."""
    import ray.train

    from pipelines.data.device_augment import model_images
    from pipelines.fit.data_wait import DataWait

    device = ray.train.torch.get_device()
    dtype = torch.bfloat16 if config["bf16"] else torch.float32
    size, batch = config["image_size"], config["batch"]
    runs = {name: (build("prolip_tiny", MODEL_SIZES[name], 0, str(device)) if name != "null" else None)
            for name in config["models"]}
    tokens = tokenize(captions("short", batch), CONTEXT).to(device)
    results = []

    def train_step(run, images, text) -> None:
        if run is None:
            images.sum().item()  # the augmented images exist (a GPU finished them) before the next batch
            return
        objective, opt = run
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = objective(images, text)
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["loss"].item()

    for r in range(config["rounds"]):
        for path in config["paths"]:
            shard = ray.train.get_dataset_shard(path)
            for name, run in runs.items():
                wait, seen, received = DataWait(), 0, 0
                stream = shard.iter_torch_batches(batch_size=batch, drop_last=True, device=device,
                                                  pin_memory=device.type == "cuda", prefetch_batches=config["prefetch"],
                                                  local_shuffle_buffer_size=4 * batch, local_shuffle_seed=r)
                wait.start()
                for i, b in enumerate(wait.timed(stream)):
                    if i == 0:  # from the first batch on: the epoch's pipeline start is not the steady state
                        waited0, loop0, t_first = wait.waited_s, wait.loop_s, time.time()
                    else:
                        seen += b["image"].shape[0]
                        received += sum(t.element_size() * t.numel() for t in b.values())
                    train_step(run, model_images(b, size), b["text"])
                results.append({"round": r, "path": path, "model": name, "samples": seen, "t0": t_first,
                                "t1": time.time(), "bytes": received / max(seen, 1),
                                "wait_frac": (wait.waited_s - waited0) / max(wait.loop_s - loop0, 1e-9)})
    for name, run in runs.items():  # the model alone, on a batch already on the device
        if run is None:
            continue
        images = torch.randn(batch, 3, size, size, device=device)
        for _ in range(2):
            train_step(run, images, tokens)
        t0 = time.perf_counter()
        for _ in range(config["model_steps"]):
            train_step(run, images, tokens)
        results.append({"model_only": name, "rate": batch * config["model_steps"] / (time.perf_counter() - t0)})
    # Ray Train V2 keeps reported metrics with checkpoints only: the driver reads a file (same machine)
    Path(config["out"]).write_text(json.dumps(results))


def measure(args) -> tuple[list[dict], dict[str, float]]:
    """(per-epoch results with CPU-seconds filled in, {model: model-only samples/s})."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from pipelines.cluster.runtime import init_ray
    from pipelines.data.reader import read_shards

    use_gpu = args.device == "cuda"
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        paths = write_photo_shards(tmp, args.samples, args.per_shard, 256)
        # the worker's CPU slot is a scheduling slot: Ray Data may still run a task on every core
        init_ray(num_cpus=(os.cpu_count() or 1) + args.cpus_per_worker)
        datasets, read_s = {}, {}
        for name in args.paths:  # in the order given: the first also pays the read tasks' start-up
            with tars_read_by(name):
                t0 = time.perf_counter()  # a cached set (the default sizes) reads its tars here, once
                datasets[name] = read_shards(paths, args.image_size, CONTEXT, seed=0, augment=True, shuffle=True,
                                             stats_name=None, batch_size=args.batch, decode_size=args.decode_size,
                                             **PATHS[name])
                read_s[name] = time.perf_counter() - t0
        args.read_s = read_s
        clock = CpuClock()
        trainer = TorchTrainer(
            loop, train_loop_config={"out": f"{tmp}/results.json", "models": args.models, "paths": args.paths,
                                     "rounds": args.rounds, "batch": args.batch, "image_size": args.image_size,
                                     "bf16": args.bf16,
                                     "prefetch": args.prefetch, "model_steps": args.model_steps},
            scaling_config=ray.train.ScalingConfig(num_workers=1, use_gpu=use_gpu,
                                                   resources_per_worker={"CPU": args.cpus_per_worker,
                                                                         **({"GPU": 1} if use_gpu else {})}),
            run_config=ray.train.RunConfig(name="bench-ingest", storage_path=f"{tmp}/ray"),
            datasets=datasets,
            dataset_config=ray.train.DataConfig(datasets_to_split=[]),
        )
        trainer.fit()
        results = json.loads(Path(tmp, "results.json").read_text())
        clock.stop()
        ray.shutdown()
    epochs = [r for r in results if "path" in r]
    for r in epochs:
        r["cpu_s"] = clock.at(r["t1"]) - clock.at(r["t0"])
    return epochs, {r["model_only"]: r["rate"] for r in results if "model_only" in r}


def table(epochs: list[dict], model_only: dict[str, float], cores: int) -> tuple[str, dict]:
    lines = ["| path | model | samples/s | per core | data_wait_frac | CPU-s per sample | object-store bytes per "
             "sample | model alone (samples/s) | end to end / model alone |", "| --- " * 9 + "|"]
    summary = {}
    for path in dict.fromkeys(r["path"] for r in epochs):
        for model in dict.fromkeys(r["model"] for r in epochs):
            rows = [r for r in epochs if r["path"] == path and r["model"] == model]
            rate = statistics.median(r["samples"] / (r["t1"] - r["t0"]) for r in rows)
            wait = statistics.median(r["wait_frac"] for r in rows)
            cpu = statistics.median(r["cpu_s"] / r["samples"] for r in rows)
            alone = model_only.get(model)
            summary[path, model] = {"rate": rate, "per_core": rate / cores, "wait": wait, "alone": alone}
            lines.append(f"| {path} | {model} | {rate:.0f} | {rate / cores:.0f} | {wait:.2f} | {1e3 * cpu:.2f} ms "
                         f"| {statistics.median(r['bytes'] for r in rows) / 1e3:.0f} KB | "
                         + (f"{alone:.0f} | {rate / alone:.2f} |" if alone else "- | - |"))
    return "\n".join(lines), summary


def verdicts(summary: dict, device: str) -> str:
    """Targets for the path data.augment_on: auto takes on this device (reader on CPUs, device on GPUs); the other
    is measured for comparison (the GPU's path on a CPU worker pays bicubic resampling on the worker's one core)."""
    out = []
    for (path, model), s in summary.items():
        if device == "cpu" and model == "null" and path == "reader":
            today = summary.get(("today", "null"))
            vs = f" ({s['rate'] / today['rate']:.2f}x today's path in this run)" if today else ""
            out.append(f"- {path}, null model: {s['per_core']:.0f} samples/s per core{vs}; target >= 300: "
                       f"**{'met' if s['per_core'] >= 300 else 'MISSED'}**.")
        if device == "cuda" and s["alone"] and path == "device":
            ok = s["rate"] >= 0.9 * s["alone"] and s["wait"] <= 0.1
            out.append(f"- {path}, {model}: end to end {s['rate'] / s['alone']:.2f}x the model alone, data_wait_frac "
                       f"{s['wait']:.2f}; target >= 0.9x and <= 0.10: **{'met' if ok else 'MISSED'}**.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="null,tiny", help="comma-separated: null, tiny, b16")
    parser.add_argument("--paths", default="today,reader,device", help="comma-separated: " + ", ".join(PATHS))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--per-shard", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--decode-size", type=int, default=None, help="data.decode_size (default: 8/7 of the output)")
    parser.add_argument("--prefetch", type=int, default=4, help="data.prefetch_batches")
    parser.add_argument("--cpus-per-worker", type=int, default=1, help="train.cpus_per_worker")
    parser.add_argument("--model-steps", type=int, default=10, help="steps timed for the model alone")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small sizes, one round, prints only")
    parser.add_argument("--section", default=None, help="docs/BENCHMARKS.md section (default ingest_<device>)")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.per_shard, args.rounds, args.batch, args.model_steps = 512, 128, 1, 64, 2
    args.models, args.paths = args.models.split(","), args.paths.split(",")
    epochs, model_only = measure(args)
    print("dataset set-up (tar files read into the cache): " + ", ".join(f"{k} {v:.2f} s" for k, v in args.read_s.items()))
    cores = os.cpu_count() or 1
    table_md, summary = table(epochs, model_only, cores)
    verdict = verdicts(summary, args.device)
    print(table_md + "\n\n" + verdict)
    if args.quick:
        return
    gpu = f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    write_section(args.section or f"ingest_{args.device}",
                  f"## Ingest: reader -> Ray Train worker, {args.device.upper()} (`benchmarks/ingest.py`)\n\n"
                  f"{args.samples} photo-like 256 px JPEGs in shards of {args.per_shard} -> {args.image_size} px with "
                  f"the training augmentation, batches of {args.batch}, one Ray Train worker ({args.cpus_per_worker} "
                  f"CPU{', one GPU' if gpu else ''}), Ray Data on the rest of the machine's {cores} cores; "
                  f"prefetch {args.prefetch}; {args.rounds} alternating rounds of one epoch per path and model, "
                  f"medians. Per core: samples/s over the machine's cores. Paths: today (float32 images augmented "
                  f"by the float reference in the reader, the float32 path uint8 reading replaced), reader (uint8, OpenCV in the "
                  f"reader; what a CPU worker gets), device (uint8 + drawn parameters, augmented on the worker's "
                  f"device; what a GPU worker gets), webdataset (the reader path with its tars read by Ray's "
                  f"read_webdataset, Ray's own tar reader; reader reads them with pipelines.data.tars). Dataset set-up "
                  f"(the tar files read into the cache, once): "
                  f"{', '.join(f'{k} {v:.2f} s' for k, v in args.read_s.items())}. Machine: "
                  f"{machine()}{gpu}; {load()}. Command: `python -m benchmarks.ingest "
                  f"{' '.join(argv if argv is not None else sys.argv[1:])}`.\n\n" + table_md + "\n\n" + verdict + "\n")


if __name__ == "__main__":
    main()
