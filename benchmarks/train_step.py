"""Training-step time of each method against its deterministic baseline on the same backbone.

Run (one command per backbone; each writes its own section of docs/BENCHMARKS.md):

    .venv/bin/python -m benchmarks.train_step                 # CPU, the "small" backbone below
    .venv/bin/python -m benchmarks.train_step --size b16 --batch 16 --pairs ProLIP --repeats 5 --warmup 1
    .venv/bin/python -m benchmarks.train_step --size b16 --device cuda --batch 256 --bf16   # paper size, on a GPU
    .venv/bin/python -m benchmarks.train_step --quick         # tiny sizes, prints the table, writes nothing
    .venv/bin/python -m benchmarks.train_step --gpu           # on a GPU: the section "train_step_gpu" (below)
    .venv/bin/python -m benchmarks.train_step --gpu --device cpu --size tiny --batch 8 --memory-batches 8,16  # its code path

``--gpu`` (defaults: ``--size b16 --device cuda --batch 256 --bf16 --captions full --repeats 8 --warmup 3``) measures,
on whatever card it finds, and writes with the card's name: (1) every pair's step times and ratios, each method's
whole-step training FLOPs per sample (counted once by ``torch.utils.flop_counter`` on a forward + backward at the
benchmark batch: the towers' matmuls, convolutions and attention plus the heads, mixer and losses) and its model
FLOPs utilisation against the card's dense bf16 peak; (2) peak GPU memory (``torch.cuda.max_memory_allocated`` over
a steady-state step, optimizer state included) per method at per-GPU batches 256 and 512, with and without
``train.grad_checkpointing``, and the step-time cost of checkpointing; (3) ``train.compile``: compile time and the
compiled / eager step ratio for ``--compile-models``. ``--parts`` runs a subset of (1)-(3).

What is timed: one full training step of ``build_objective`` (model + default loss) in training mode --
forward (including ProLIP's masked copies and PCME++'s Mixup/CutMix), backward, AdamW step --
on random images and real tokenised captions, single process (the gather is the identity).
Pairs compared: ProLIP vs CLIP, PCME++ vs CLIP, Llip vs SigLIP, probabilistic Llip vs SigLIP,
each pair on the same tower sizes. Two caption sets: "short" (digit captions, 3-9 words; the text
tower cuts the padding after the batch's longest caption) and "full" (every caption fills the
context: the most text work, where ProLIP's masked caption copies cost the most). All models are
stepped round-robin in one process after a warm-up, so machine load hits them alike; the
ratios are given two ways: minimum over minimum, and the median over rounds of the two
back-to-back steps' ratio (robust to load that drifts during the run; the verdict uses it).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from models.objective import build_objective
from models.registry import TINY, VIT_B16
from models.tokenizer import tokenize
from models.towers import TowerConfig, compile_blocks, set_grad_checkpointing
from pipelines.config import ModelConfig
from pipelines.pretrain.config import TrainDocument
from pipelines.fit.optim import adamw, param_groups

# A CPU-sized ViT (width 384, 6 blocks) and text transformer (width 256, 6 blocks, context 32).
SMALL = TowerConfig(img_size=96, patch_size=16, vision_width=384, vision_depth=6, vision_heads=6, vision_pre_norm=False,
                    context_length=32, text_width=256, text_depth=6, text_heads=4, embed_dim=256)
SIZES = {"tiny": TINY, "small": SMALL, "b16": VIT_B16}
# (model, baseline): registry names at tiny size; the size's dimensions are passed as overrides.
PAIRS = [("prolip_tiny", "clip_tiny"), ("pcmepp_tiny", "clip_tiny"), ("llip_tiny", "siglip_tiny"),
         ("prolip_llip_tiny", "siglip_tiny")]
LABEL = {"clip_tiny": "CLIP", "siglip_tiny": "SigLIP", "prolip_tiny": "ProLIP", "pcmepp_tiny": "PCME++",
         "llip_tiny": "Llip", "prolip_llip_tiny": "ProLIP-Llip"}
# Models with Llip's mixture tokens: --mixture-tokens sets their K.
MIXTURE_MODELS = {"llip_tiny", "prolip_llip_tiny"}
# The step-time targets: each method's step at most this many times its baseline's (b16, batch 256, bf16 on a GPU;
# the same targets for the CPU figures at `small` and `b16`).
TARGETS = {"prolip_tiny": 1.15, "pcmepp_tiny": 1.15, "llip_tiny": 1.10, "prolip_llip_tiny": 1.20}
CAPTIONS = ["the digit seven", "a handwritten digit", "a photo of the number three written by hand",
            "an odd digit", "a drawing of the digit 4"]


def captions(kind: str, batch: int) -> list[str]:
    """`batch` captions: the short digit captions, or ("full") each repeated until it fills any context."""
    texts = [CAPTIONS[i % len(CAPTIONS)] for i in range(batch)]
    return texts if kind == "short" else [" ".join([t] * 40) for t in texts]


def build(name: str, size: TowerConfig, mixture_tokens: int, device: str):
    overrides = dataclasses.asdict(size)
    if name in MIXTURE_MODELS:
        overrides["mixture_tokens"] = mixture_tokens
    torch.manual_seed(0)
    objective = build_objective(TrainDocument(model=ModelConfig(name=name, overrides=overrides))).to(device).train()
    opt = adamw(param_groups(objective, 0.2), lr=1e-4, betas=(0.9, 0.95))  # the trainer's optimizer
    return objective, opt


def step(objective, opt, images, tokens, dtype) -> None:
    with torch.autocast(images.device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = objective(images, tokens)
    out["loss"].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(size_name: str, batch: int, repeats: int, warmup: int, mixture_tokens: int, device: str,
            dtype: torch.dtype, pairs: list[tuple[str, str]], caption_kinds: list[str]) -> tuple[dict, dict]:
    """Every model of `pairs` stepped round-robin: ({(model, caption kind): [seconds per step]}, {model: training
    FLOPs per sample}, counted once at this batch with full captions)."""
    size = SIZES[size_name]
    names = sorted({n for pair in pairs for n in pair})
    runs = {n: build(n, size, mixture_tokens, device) for n in names}
    times = step_times(runs, size, batch, repeats, warmup, device, dtype, caption_kinds)
    return times, flops_per_sample(runs, size, batch, device, dtype)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_times(runs: dict, size: TowerConfig, batch: int, repeats: int, warmup: int, device: str, dtype: torch.dtype,
               caption_kinds: list[str]) -> dict:
    """{(name, caption kind): [seconds per step]}: every (objective, optimizer) of `runs` stepped round-robin on
    the same images and tokens, the first `warmup` rounds untimed."""
    images, tokens = batch_inputs(size, batch, device, caption_kinds)
    times: dict = {(n, k): [] for n in runs for k in caption_kinds}
    for r in range(warmup + repeats):
        for k in caption_kinds:
            for n in runs:
                sync(device)
                t0 = time.perf_counter()
                step(*runs[n], images, tokens[k], dtype)
                sync(device)
                if r >= warmup:
                    times[n, k].append(time.perf_counter() - t0)
    return times


def batch_inputs(size: TowerConfig, batch: int, device: str, caption_kinds: list[str]):
    """Random images and {caption kind: tokens} for a benchmark batch (the same on every call)."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size.img_size, size.img_size, generator=g).to(device)
    return images, {k: tokenize(captions(k, batch), size.context_length).to(device) for k in caption_kinds}


def table(times: dict, pairs: list[tuple[str, str]], caption_kinds: list[str]) -> str:
    lines = ["| method | baseline | captions | method step (ms, min / median) | baseline step (ms, min / median) "
             "| ratio of minima | median of per-round ratios |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for model, base in pairs:
        for k in caption_kinds:
            a, b = times[model, k], times[base, k]
            lines.append(f"| {LABEL[model]} | {LABEL[base]} | {k} | {1e3 * min(a):.1f} / {1e3 * statistics.median(a):.1f} "
                         f"| {1e3 * min(b):.1f} / {1e3 * statistics.median(b):.1f} "
                         f"| {min(a) / min(b):.3f}x | {round_ratio(a, b):.3f}x |")
    return "\n".join(lines)


def round_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of method / baseline: the two ran back to back in each round, so load drift cancels."""
    return statistics.median(x / y for x, y in zip(a, b))


def verdicts(times: dict, pairs: list[tuple[str, str]], caption_kinds: list[str]) -> str:
    out = []
    for model, base in pairs:
        for k in caption_kinds:
            a, b = times[model, k], times[base, k]
            ratio, target = round_ratio(a, b), TARGETS[model]
            out.append(f"- {LABEL[model]} vs {LABEL[base]}, {k} captions: {ratio:.3f}x (median of per-round ratios; "
                       f"ratio of minima {min(a) / min(b):.3f}x); target <= {target:.2f}x: "
                       f"**{'met' if ratio <= target else 'MISSED'}**.")
    return "\n".join(out)


def count_flops(objective, images: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype) -> float:
    """Training FLOPs of one step's forward + backward (matmuls, convolutions, attention), as torch counts them."""
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(images.device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = objective(images, tokens)
        out["loss"].backward()
    objective.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def flops_per_sample(runs: dict, size: TowerConfig, batch: int, device: str, dtype: torch.dtype) -> dict:
    """{name: training FLOPs per sample} at this batch, full captions (counted once per model)."""
    images, tokens = batch_inputs(size, batch, device, ["full"])
    return {n: count_flops(obj, images, tokens["full"], dtype) / batch for n, (obj, _) in runs.items()}


def flops_table(flops: dict, pairs: list[tuple[str, str]]) -> str:
    lines = ["| model | training GFLOP per sample (step, counted) | vs its baseline |", "| --- | --- | --- |"]
    for n in dict.fromkeys(x for pair in pairs for x in reversed(pair)):
        base = next((b for m, b in pairs if m == n), None)
        rel = f"{flops[n] / flops[base]:.3f}x" if base else "-"
        lines.append(f"| {LABEL[n]} | {flops[n] / 1e9:.4g} | {rel} |")
    return "\n".join(lines)


# Dense bf16 tensor-core peak (TFLOP/s, vendors' datasheets, no sparsity) by a part of the CUDA device name; the
# first match wins (so "H100 PCIe" before "H100", "L40S" before "L4"). --peak-tflops overrides.
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.4), ("H200", 989.4), ("H100", 989.4),
                    ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0)]


def card(device: str, peak_tflops: float | None = None) -> tuple[str, float | None]:
    """The device's name and its dense bf16 peak in TFLOP/s (None where unknown: no utilisation is printed)."""
    from benchmarks.report import machine

    if not device.startswith("cuda"):
        return f"CPU ({machine()})", peak_tflops
    name = torch.cuda.get_device_name(torch.device(device))
    peak = next((v for part, v in PEAK_BF16_TFLOPS if part in name), None)
    return name, peak_tflops or peak


def gpu_step_table(times: dict, flops: dict, pairs: list[tuple[str, str]], batch: int, peak: float | None) -> str:
    """Per method and baseline: step time, samples/s, training FLOPs per sample, model FLOPs utilisation."""
    lines = ["| model | baseline | step (ms, median) | samples/s | ratio (median of per-round ratios) | target "
             "| GFLOP / sample (counted) | FLOPs vs baseline | MFU |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n in dict.fromkeys(x for pair in pairs for x in reversed(pair)):
        base = next((b for m, b in pairs if m == n), None)
        t = statistics.median(times[n, "full"])
        rate = batch / t
        mfu = f"{100 * flops[n] * rate / (peak * 1e12):.1f}%" if peak else "n/a (no peak given)"
        if base:
            ratio = round_ratio(times[n, "full"], times[base, "full"])
            cells = [LABEL[base], f"{1e3 * t:.1f}", f"{rate:.0f}", f"{ratio:.3f}x",
                     f"<= {TARGETS[n]:.2f}x: **{'met' if ratio <= TARGETS[n] else 'MISSED'}**",
                     f"{flops[n] / 1e9:.4g}", f"{flops[n] / flops[base]:.3f}x", mfu]
        else:
            cells = ["-", f"{1e3 * t:.1f}", f"{rate:.0f}", "1.000x", "-", f"{flops[n] / 1e9:.4g}", "1.000x", mfu]
        lines.append(f"| {LABEL[n]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peak_bytes(device: str) -> int | None:
    return torch.cuda.max_memory_allocated(torch.device(device)) if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def memory_rows(names: list[str], size: TowerConfig, mixture_tokens: int, batches: list[int], repeats: int,
                device: str, dtype: torch.dtype) -> dict:
    """{(name, batch, checkpointing): (peak bytes | None (CPU) | "OOM", [step seconds])}, one model on the device at a
    time. Peak: one steady-state step (AdamW state already allocated), params + grads + optimizer + activations.
    Times: with and without checkpointing stepped alternately, `repeats` rounds after one warm-up each."""
    out: dict = {}
    for name in names:
        run = build(name, size, mixture_tokens, device)
        for batch in batches:
            images, tokens = batch_inputs(size, batch, device, ["full"])
            times: dict = {False: [], True: []}
            peaks: dict = {}
            for r in range(repeats + 1):
                for ckpt in (False, True):
                    if peaks.get(ckpt) == "OOM":
                        continue
                    set_grad_checkpointing(run[0].model, ckpt)
                    try:
                        if r == 0:
                            step(*run, images, tokens["full"], dtype)  # warm-up: optimizer state exists
                            reset_peak(device)
                        sync(device)
                        t0 = time.perf_counter()
                        step(*run, images, tokens["full"], dtype)
                        sync(device)
                        if r == 0:
                            peaks[ckpt] = peak_bytes(device)
                        else:
                            times[ckpt].append(time.perf_counter() - t0)
                    except torch.OutOfMemoryError:
                        peaks[ckpt] = "OOM"
                    if peaks.get(ckpt) == "OOM":  # outside the handler: its traceback no longer pins the activations
                        run[1].zero_grad(set_to_none=True)
                        gc.collect()
                        torch.cuda.empty_cache()
            for ckpt in (False, True):
                out[name, batch, ckpt] = (peaks[ckpt], times[ckpt])
        set_grad_checkpointing(run[0].model, False)
        del run
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def memory_table(rows: dict, names: list[str], batches: list[int]) -> str:
    def gib(v) -> str:
        return "OOM" if v == "OOM" else "n/a (CPU)" if v is None else f"{v / 2**30:.1f}"

    head = " | ".join(f"batch {b}: peak GiB, off / on" for b in batches)
    lines = [f"| model | {head} | checkpointing step time, on / off (batch {batches[0]}, median of per-round ratios) |",
             "| --- | " + " | ".join("---" for _ in batches) + " | --- |"]
    for n in names:
        cells = [f"{gib(rows[n, b, False][0])} / {gib(rows[n, b, True][0])}" for b in batches]
        off, on = rows[n, batches[0], False][1], rows[n, batches[0], True][1]
        cost = f"{round_ratio(on, off):.3f}x" if off and on else "-"
        lines.append(f"| {LABEL[n]} | " + " | ".join(cells) + f" | {cost} |")
    return "\n".join(lines)


def compile_rows(names: list[str], size: TowerConfig, mixture_tokens: int, batch: int, repeats: int, warmup: int,
                 device: str, dtype: torch.dtype) -> dict:
    """{name: (compile seconds, [eager s], [compiled s])}: compile seconds = the compiled model's first 1 + warmup
    steps (every block shape compiled: full images, masked copies, captions) less as many eager steps."""
    out = {}
    for name in names:
        eager = build(name, size, mixture_tokens, device)
        compiled = build(name, size, mixture_tokens, device)
        compile_blocks(compiled[0].model)
        images, tokens = batch_inputs(size, batch, device, ["full"])
        first = {"eager": 0.0, "compiled": 0.0}
        times: dict = {"eager": [], "compiled": []}
        for r in range(1 + warmup + repeats):
            for which, run in (("eager", eager), ("compiled", compiled)):
                sync(device)
                t0 = time.perf_counter()
                step(*run, images, tokens["full"], dtype)
                sync(device)
                dt = time.perf_counter() - t0
                if r <= warmup:
                    first[which] += dt
                else:
                    times[which].append(dt)
        out[name] = (first["compiled"] - first["eager"], times["eager"], times["compiled"])
        print(f"compile {LABEL[name]}: {out[name][0]:.0f} s, compiled / eager {round_ratio(times['compiled'], times['eager']):.3f}x",
              flush=True)
        del eager, compiled
        torch._dynamo.reset()
    return out


def trace_rows(names: list[str], size: TowerConfig, mixture_tokens: int, batch: int, device: str,
               dtype: torch.dtype, out_dir: str) -> str:
    """A CUDA trace of one step per model after three warm-up steps (``torch.profiler``): the step's wall time, its
    kernels' summed time and count (the GPU's busy share of the step), the host's synchronising calls, and the top
    kernels by time, written to ``out_dir/trace_<model>.txt`` with a Chrome trace beside it (gzipped)."""
    import gzip
    import os
    import shutil

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    lines = ["| model | step (ms, traced) | kernels | kernel time (ms) | GPU busy share | host syncs "
             "(cudaStreamSynchronize / cudaDeviceSynchronize / item, nonzero) |", "| --- | --- | --- | --- | --- | --- |"]
    for name in names:
        run = build(name, size, mixture_tokens, device)
        images, tokens = batch_inputs(size, batch, device, ["full"])
        for _ in range(3):
            step(*run, images, tokens["full"], dtype)
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            step(*run, images, tokens["full"], dtype)
            sync(device)
            wall = time.perf_counter() - t0
        events = prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1e3  # microseconds -> ms
        syncs = {k: sum(1 for e in events if e.name == k) for k in
                 ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::_local_scalar_dense",
                  "aten::item", "aten::nonzero")}
        label = LABEL[name].replace("+", "p")
        with open(os.path.join(out_dir, f"trace_{label}.txt"), "w") as f:
            f.write(f"{LABEL[name]}: step {1e3 * wall:.1f} ms, {len(kernels)} kernels, {busy:.1f} ms of kernels; "
                    f"{syncs}\n\n")
            f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=45))
            f.write("\n\n")
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
        raw = os.path.join(out_dir, f"trace_{label}.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
        host = f"{syncs['cudaStreamSynchronize']} / {syncs['cudaDeviceSynchronize']} / {syncs['aten::_local_scalar_dense']} item, {syncs['aten::nonzero']} nonzero"
        lines.append(f"| {LABEL[name]} | {1e3 * wall:.1f} | {len(kernels)} | {busy:.1f} | {busy / (1e3 * wall):.0%} | {host} |")
        print(lines[-1], flush=True)
        del run
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return "\n".join(lines)


def compile_table(rows: dict) -> str:
    lines = ["| model | compile time (s) | compiled / eager step (median of per-round ratios) |", "| --- | --- | --- |"]
    for n, (secs, eager, comp) in rows.items():
        lines.append(f"| {LABEL[n]} | {secs:.0f} | {round_ratio(comp, eager):.3f}x |")
    return "\n".join(lines)


def gpu_main(args: argparse.Namespace, argv: list[str] | None, pairs: list[tuple[str, str]]) -> None:
    """``--gpu``: the step, FLOPs / MFU, memory and compile tables of the card it runs on; writes "train_step_gpu"
    when that is a CUDA device (elsewhere it prints: the code path runs anywhere, the section is the card's)."""
    from benchmarks.report import load, write_section

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    name, peak = card(args.device, args.peak_tflops)
    size = SIZES[args.size]
    parts, text = set(args.parts.split(",")), []
    names = [n for n in LABEL if any(n in pair for pair in pairs)]
    if "time" in parts:
        times, flops = measure(args.size, args.batch, args.repeats, args.warmup, args.mixture_tokens, args.device,
                               dtype, pairs, ["full"])
        text.append(f"### Step time, FLOPs and utilisation, per-GPU batch {args.batch}\n\n"
                    + gpu_step_table(times, flops, pairs, args.batch, peak)
                    + f"\n\nMFU = counted training FLOPs per sample x samples/s / the card's dense bf16 peak "
                    f"({f'{peak:.0f} TFLOP/s' if peak else 'unknown'}).")
    if "memory" in parts:
        batches = [int(b) for b in args.memory_batches.split(",")]
        rows = memory_rows(names, size, args.mixture_tokens, batches, max(2, args.repeats // 2), args.device, dtype)
        text.append("### Memory: peak per GPU with and without `train.grad_checkpointing`\n\n"
                    + memory_table(rows, names, batches))
    if "compile" in parts:
        wanted = {w.strip() for w in args.compile_models.split(",")}
        comp = compile_rows([n for n in LABEL if LABEL[n] in wanted], size, args.mixture_tokens, args.batch,
                            max(2, args.repeats // 2), 2, args.device, dtype)
        text.append(f"### `train.compile` (torch.compile of every block), batch {args.batch}\n\n" + compile_table(comp))
    if "trace" in parts:
        wanted = {w.strip() for w in args.trace_models.split(",")}
        text.append(f"### One traced step (`torch.profiler`, CUDA), batch {args.batch}\n\n"
                    + trace_rows([n for n in LABEL if LABEL[n] in wanted], size, args.mixture_tokens, args.batch,
                                 args.device, dtype, args.trace_dir))
    body = "\n\n".join(text)
    print(body)
    if not args.device.startswith("cuda"):
        print("\n(not written: docs/BENCHMARKS.md's GPU section is refreshed from a CUDA device)")
        return
    command = " ".join(argv if argv is not None else sys.argv[1:])
    # The step table's run owns the section; a run of other parts alone (say compile, a long one) writes its own.
    write_section("train_step_gpu" if "time" in parts else "train_step_gpu_" + "_".join(sorted(parts)),
                  f"## Training step on a GPU: {name} (`benchmarks/train_step.py --gpu`)\n\n"
                  f"Backbone `{args.size}`, per-GPU batch {args.batch}, {'bf16 autocast' if args.bf16 else 'fp32'}, full "
                  f"captions, Llip mixture tokens {args.mixture_tokens}; {args.repeats} round-robin repeats after "
                  f"{args.warmup} warm-up steps; torch {torch.__version__}; {load()}. Command: "
                  f"`python -m benchmarks.train_step {command}`.\n\n" + body + "\n")


def step_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a step comparison (this module's and benchmarks.peers')."""
    parser.add_argument("--size", choices=sorted(SIZES), help="default small (--gpu: b16)")
    parser.add_argument("--batch", type=int, help="default 64 (--gpu: 256; benchmarks.peers --data: 128)")
    parser.add_argument("--repeats", type=int, help="default 15 (--gpu: 8)")
    parser.add_argument("--warmup", type=int, help="default 3")
    parser.add_argument("--device", help="default cpu (--gpu: cuda)")
    parser.add_argument("--bf16", action="store_true", default=None, help="(--gpu: on)")
    parser.add_argument("--captions", choices=["short", "full", "both"], help="default both (--gpu: full)")
    parser.add_argument("--gpu", action="store_true", help="the GPU section: b16, cuda, batch 256, bf16, full captions")


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Options not given take the CPU defaults, or with --gpu the GPU ones (the measurement the targets are set on)."""
    gpu = dict(size="b16", batch=256, repeats=8, warmup=3, device="cuda", bf16=True, captions="full")
    cpu = dict(size="small", batch=None, repeats=15, warmup=3, device="cpu", bf16=False, captions="both")
    for key, value in (gpu if args.gpu else cpu).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def setup_text(args: argparse.Namespace, argv: list[str] | None, module: str, extra: str = "") -> str:
    """What a step comparison ran: backbone shape, batch, device, precision, repeats, machine and the command."""
    from benchmarks.report import load, machine

    size = SIZES[args.size]
    return (f"Backbone `{args.size}`: image {size.img_size}px, patch {size.patch_size}, ViT width "
            f"{size.vision_width} x {size.vision_depth} blocks; text width {size.text_width} x "
            f"{size.text_depth} blocks, context {size.context_length}; embedding {size.embed_dim}; {extra}"
            f"batch {args.batch}; {args.device}, {'bf16 autocast' if args.bf16 else 'fp32'}; {args.repeats} "
            f"round-robin repeats after {args.warmup} warm-up steps. Machine: {machine()}; {load()}. Command: "
            f"`python -m benchmarks.{module} {' '.join(argv if argv is not None else sys.argv[1:])}`.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    step_arguments(parser)
    parser.add_argument("--mixture-tokens", type=int, default=16)
    parser.add_argument("--pairs", default=",".join(LABEL[m] for m, _ in PAIRS),
                        help="comma-separated methods to compare with their baselines, e.g. ProLIP,Llip")
    parser.add_argument("--quick", action="store_true", help="tiny size, few repeats, print only")
    parser.add_argument("--parts", default="time,memory,compile", help="--gpu: a subset of time,memory,compile,trace")
    parser.add_argument("--memory-batches", default="256,512", help="--gpu: per-GPU batches of the memory table")
    parser.add_argument("--compile-models", default="CLIP,ProLIP", help="--gpu: models whose compile is measured")
    parser.add_argument("--trace-models", default="CLIP,PCME++,ProLIP-Llip", help="--gpu: models of the trace part")
    parser.add_argument("--trace-dir", default="gpu-out", help="--gpu: where the trace part writes its files")
    parser.add_argument("--peak-tflops", type=float, help="--gpu: the card's dense bf16 peak, if not in the table")
    args = fill_defaults(parser.parse_args(argv))
    args.batch = args.batch or 64
    if args.quick:
        args.size, args.batch, args.repeats, args.warmup = "tiny", 16, 3, 1
    wanted = {w.strip() for w in args.pairs.split(",")}
    pairs = [(m, b) for m, b in PAIRS if LABEL[m] in wanted]
    if not pairs or len(pairs) != len(wanted):
        parser.error(f"--pairs takes a comma-separated subset of {', '.join(LABEL[m] for m, _ in PAIRS)}")
    if args.gpu:
        return gpu_main(args, argv, pairs)
    kinds = ["short", "full"] if args.captions == "both" else [args.captions]
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    times, flops = measure(args.size, args.batch, args.repeats, args.warmup, args.mixture_tokens, args.device, dtype,
                           pairs, kinds)
    text = table(times, pairs, kinds) + "\n\n" + flops_table(flops, pairs) + "\n\n" + verdicts(times, pairs, kinds)
    print(text)
    if args.quick:
        return
    from benchmarks.report import write_section

    setup = setup_text(args, argv, "train_step", f"Llip mixture tokens {args.mixture_tokens}; ")
    write_section(f"train_step_{args.size}",
                  f"## Training step, `{args.size}` backbone: each method vs its baseline (`benchmarks/train_step.py`)\n\n"
                  "One full step (forward incl. ProLIP's masked copies of 12.5% of the pairs / PCME++'s MSDA, "
                  "backward, AdamW) of model + default loss, single process, same backbone per pair. Targets: "
                  "ProLIP and PCME++ <= 1.15x CLIP, Llip <= 1.10x SigLIP, ProLIP-Llip <= 1.20x SigLIP. "
                  "GFLOP per sample: one forward + backward at this batch with full captions, counted by "
                  "`torch.utils.flop_counter` (matmuls, convolutions, attention): the ratio to the baseline is the "
                  "method's inherent extra arithmetic.\n\n" + setup + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
