"""Feature-cache accumulation (train.grad_accum, models.accumulate) against one pass over the same batch, per method.

Run (writes the section "accumulation" of docs/BENCHMARKS.md; run it on an otherwise idle machine):

    .venv/bin/python -m benchmarks.accumulation                # CPU: batch 256 at k=1 vs micro 32 x k=8
    .venv/bin/python -m benchmarks.accumulation --quick        # tiny sizes, prints the table, writes nothing

What is measured, per method (its default loss), on a CPU-sized backbone (``BENCH``: 64 px, patch 8, width 192 / 128,
4 + 4 blocks, embedding 128; Llip K = 16 mixture tokens), random images and digit captions, one process:

- time: a full training step (forward, backward, AdamW) of the batch in one pass and by k micro-batches, stepped
  round-robin after a warm-up so that machine load hits both alike; per-sample wall and CPU time, and the median
  over rounds of the back-to-back steps' ratio (target <= 1.4: the cached step encodes every micro-batch twice,
  ~4/3 of the tower work);
- memory: each (method, mode) in its own fresh process: after a warm-up step (AdamW's state exists), the extra peak
  resident memory of one step (the kernel's VmHWM after resetting it through /proc/self/clear_refs, minus the
  resident memory before the step), for the one-pass batch, for one micro-batch alone (the floor accumulation can
  reach) and for the cached step; beside it the size of the feature cache (the features of the whole batch).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.losses import status_kb
from benchmarks.report import load, machine, write_section
from benchmarks.train_step import captions
from models.accumulate import CachedBatch
from models.objective import build_objective
from models.registry import TINY
from models.towers import TowerConfig
from models.tokenizer import tokenize
from pipelines.config import ModelConfig
from pipelines.pretrain.config import TrainDocument
from pipelines.fit.optim import adamw, param_groups

METHODS = {"CLIP": "clip_tiny", "SigLIP": "siglip_tiny", "ProLIP": "prolip_tiny", "PCME++": "pcmepp_tiny",
           "Llip": "llip_tiny", "ProLIP-Llip": "prolip_llip_tiny"}
MIXTURE = {"llip_tiny", "prolip_llip_tiny"}
COMMAND = ".venv/bin/python -m benchmarks.accumulation"
# A backbone that steps batch 256 in a few seconds on 2 CPU cores: 64 px, patch 8 (64 patches), 4 + 4 blocks.
BENCH = TowerConfig(img_size=64, patch_size=8, vision_width=192, vision_depth=4, vision_heads=3, vision_pre_norm=False,
                    context_length=32, text_width=128, text_depth=4, text_heads=2, embed_dim=128)


def build(name: str, quick: bool):
    overrides = dataclasses.asdict(TINY if quick else BENCH)
    if name in MIXTURE:
        overrides["mixture_tokens"] = 4 if quick else 16
    torch.manual_seed(0)
    objective = build_objective(TrainDocument(model=ModelConfig(name=name, overrides=overrides))).train()
    return objective, adamw(param_groups(objective, 0.2), lr=1e-4)


def inputs(objective, batch: int):
    model = objective.model
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, model.img_size, model.img_size, generator=g)
    return images, tokenize(captions("short", batch), model.context_length)


def step(objective, optimizer, images, tokens, k: int) -> dict:
    """One training step; returns the size of the feature cache (bytes; 0 for one pass)."""
    optimizer.zero_grad(set_to_none=True)
    cache = 0
    if k == 1:
        objective(images, tokens)["loss"].backward()
    else:
        cached = CachedBatch(objective, images, tokens, k)
        cache = sum(t.numel() * t.element_size() for t in cached.leaves.values())
        cached.backward()
    optimizer.step()
    return {"cache_bytes": cache}


def measure_memory(name: str, batch: int, k: int, quick: bool) -> dict:
    """In a fresh process: the extra peak resident memory (MB) of one step after a warm-up step."""
    torch.set_num_threads(2)
    objective, optimizer = build(name, quick)
    images, tokens = inputs(objective, batch)
    step(objective, optimizer, images, tokens, k)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current resident size
    before = status_kb("VmRSS")
    info = step(objective, optimizer, images, tokens, k)
    return {"peak_mb": (status_kb("VmHWM") - before) / 1024, "cache_mb": info["cache_bytes"] / 2**20}


def memory(name: str, batch: int, k: int, quick: bool) -> dict:
    args = [sys.executable, "-m", "benchmarks.accumulation", "--memory", name, "--batch", str(batch), "--k", str(k)]
    done = subprocess.run(args + (["--quick"] if quick else []), capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def timing(batch: int, micro: int, repeats: int, quick: bool) -> dict:
    """Round-robin over methods and both modes in this process; per method the wall / CPU seconds per step."""
    torch.set_num_threads(2)
    built = {label: build(name, quick) for label, name in METHODS.items()}
    data = {label: inputs(objective, batch) for label, (objective, _) in built.items()}
    times = {label: {"one": [], "cached": [], "one_cpu": [], "cached_cpu": []} for label in METHODS}
    for round_ in range(repeats + 1):  # the first round warms up
        for label, (objective, optimizer) in built.items():
            for mode, k in (("one", 1), ("cached", batch // micro)):
                wall, cpu = time.perf_counter(), time.process_time()
                step(objective, optimizer, *data[label], k)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                if round_:
                    times[label][mode].append(wall)
                    times[label][f"{mode}_cpu"].append(cpu)
    return times


def gpu_rows(batch: int, micro: int, device: str, size_name: str, names: list[str]) -> list[str]:
    """``--gpu``: per method at the given backbone, bf16 autocast: the cached step over `batch` (micro-batches of
    `micro`) against one pass over `micro`: peak memory (``max_memory_allocated``, AdamW state included) and time
    per sample. One timed step each after a warm-up (a cached step of two micro-batches: the same shapes)."""
    from benchmarks.train_step import SIZES, batch_inputs, sync
    from benchmarks.train_step import build as build_on

    rows = []
    for label in names:
        objective, optimizer = build_on(METHODS[label], SIZES[size_name], 16, device)  # the --gpu step's model
        images, tokens = batch_inputs(SIZES[size_name], batch, device, ["full"])
        tokens = tokens["full"]

        def timed(n: int, k: int) -> float:
            sync(device)
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
                step(objective, optimizer, images[:n], tokens[:n], k)
            sync(device)
            return time.perf_counter() - t0

        timed(micro, 1), timed(2 * micro, 2)  # warm-up: AdamW state, both code paths
        cuda = device.startswith("cuda")

        def peak_of(n: int, k: int) -> tuple[float, float]:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            seconds = timed(n, k)
            return seconds, torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")

        one = statistics.median(timed(micro, 1) for _ in range(3))
        one_peak = peak_of(micro, 1)[1]
        try:
            cached, peak = peak_of(batch, batch // micro)
        except torch.OutOfMemoryError as err:
            rows.append(f"| {label} | {1e3 * one / micro:.3f} | OOM | - | {one_peak:.1f} | OOM: {str(err)[:80]} | - |")
            print(rows[-1], flush=True)
            continue
        finally:
            optimizer.zero_grad(set_to_none=True)
        rows.append(f"| {label} | {1e3 * one / micro:.3f} | {1e3 * cached / batch:.3f} | {cached / batch / (one / micro):.2f}x "
                    f"| {one_peak:.1f} | {peak:.1f} | {cached:.1f} |")
        print(rows[-1], flush=True)
        del objective, optimizer, images, tokens
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--memory", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gpu", action="store_true", help="the GPU part: ViT-B/16, bf16, --batch 16384 --micro 256")
    parser.add_argument("--device", default="cuda", help="--gpu: the device (cpu runs its code path at --size tiny)")
    parser.add_argument("--size", default="b16", help="--gpu: the backbone (benchmarks.train_step.SIZES)")
    parser.add_argument("--methods", default=",".join(METHODS), help="--gpu: comma-separated methods")
    args = parser.parse_args(argv)
    if args.gpu:
        return gpu_main(args, argv)
    if args.memory:
        print(json.dumps(measure_memory(args.memory, args.batch, args.k, args.quick)))
        return
    batch, micro = (32, 8) if args.quick else (args.batch, args.micro)
    k = batch // micro
    times = timing(batch, micro, args.repeats, args.quick)
    rows = []
    for label, name in METHODS.items():
        t = times[label]
        ratio = statistics.median(c / o for c, o in zip(t["cached"], t["one"]))
        cpu_ratio = statistics.median(c / o for c, o in zip(t["cached_cpu"], t["one_cpu"]))
        one, alone, cached = memory(name, batch, 1, args.quick), memory(name, micro, 1, args.quick), \
            memory(name, batch, k, args.quick)
        per = lambda xs: 1e3 * min(xs) / batch  # noqa: E731  ms per sample
        rows.append(f"| {label} | {per(t['one']):.2f} | {per(t['cached']):.2f} | {ratio:.2f}x | {cpu_ratio:.2f}x "
                    f"| {one['peak_mb']:.0f} | {alone['peak_mb']:.0f} | {cached['peak_mb']:.0f} "
                    f"| {cached['cache_mb']:.2f} |")
        print(rows[-1], flush=True)
    table = "\n".join([
        f"| method | one pass, ms/sample | {micro} x {k} cached, ms/sample | time ratio (wall) | (CPU) "
        f"| peak MB, batch {batch} | peak MB, batch {micro} alone | peak MB, {micro} x {k} cached | feature cache MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows])
    section = f"""## Feature-cache accumulation (CPU)

`{COMMAND}` ({machine()}; {load()}). Batch {batch} in one pass against {micro} x {k} micro-batches by
feature-cache accumulation (`train.grad_accum: {k}`): the same loss and gradients (tests/test_accumulation.py). Step
times: minimum over {args.repeats} round-robin rounds, per sample; ratios: median over rounds of back-to-back steps.
Peak MB: extra resident memory of one step after a warm-up step, each in a fresh process (one micro-batch alone is
the floor accumulation can reach); feature cache: the cached features of the whole batch. The GPU part (peak
`max_memory_allocated` and step time at ViT-B/16, batch 256 vs 32 x 8) was not run: no GPU in that session.

{table}
"""
    print(section)
    if not args.quick:
        write_section("accumulation", section)


def gpu_main(args: argparse.Namespace, argv: list[str] | None) -> None:
    batch = args.batch if args.batch != 256 else 16384
    micro = args.micro if args.micro != 32 else 256
    names = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({machine()})"
    head = [f"| method | one pass of {micro}, ms/sample | {micro} x {batch // micro} cached, ms/sample | time ratio "
            f"| peak GiB, one pass of {micro} | peak GiB, {batch} cached | cached step (s) |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    rows = gpu_rows(batch, micro, args.device, args.size, names)
    section = (f"## Feature-cache accumulation on a GPU: {card}\n\n"
               f"`python -m benchmarks.accumulation {' '.join(argv if argv is not None else sys.argv[1:])}` "
               f"(torch {torch.__version__}; {load()}). Backbone `{args.size}`, bf16 autocast, full captions: one "
               f"optimizer step over a contrastive batch of {batch} on one card by {batch // micro} micro-batches of "
               f"{micro} (`train.grad_accum: {batch // micro}`), against one pass over {micro}. One timed step after "
               f"a warm-up; peak: `torch.cuda.max_memory_allocated` over the step, AdamW state included.\n\n"
               + "\n".join(head + rows) + "\n")
    print(section)
    if args.device.startswith("cuda") and len(rows) == len(METHODS):
        write_section("accumulation_gpu", section)


if __name__ == "__main__":
    main()
