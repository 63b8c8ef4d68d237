"""Training-step time of each method against its deterministic baseline on the same backbone.

Run (one command per backbone; each writes its own section of docs/BENCHMARKS.md):

    .venv/bin/python -m benchmarks.train_step                 # CPU, the "small" backbone below
    .venv/bin/python -m benchmarks.train_step --size b16 --batch 16 --pairs ProLIP --repeats 5 --warmup 1
    .venv/bin/python -m benchmarks.train_step --size b16 --device cuda --batch 256 --bf16   # paper size, on a GPU
    .venv/bin/python -m benchmarks.train_step --quick         # tiny sizes, prints the table, writes nothing

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
import statistics
import sys
import time

import torch

from models.objective import build_objective
from models.registry import TINY, VIT_B16
from models.tokenizer import tokenize
from models.towers import TowerConfig
from pipelines.config import Config, ModelConfig
from pipelines.train.optim import adamw, param_groups

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
    objective = build_objective(Config(model=ModelConfig(name=name, overrides=overrides))).to(device).train()
    opt = adamw(param_groups(objective, 0.2), lr=1e-4, betas=(0.9, 0.95))  # the trainer's optimizer
    return objective, opt


def step(objective, opt, images, tokens, dtype) -> None:
    with torch.autocast(images.device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = objective(images, tokens)
    out["loss"].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(size_name: str, batch: int, repeats: int, warmup: int, mixture_tokens: int, device: str,
            dtype: torch.dtype, pairs: list[tuple[str, str]], caption_kinds: list[str]) -> dict:
    """{(model, caption kind): [seconds per step]} for every model of `pairs`, stepped round-robin."""
    size = SIZES[size_name]
    names = sorted({n for pair in pairs for n in pair})
    runs = {n: build(n, size, mixture_tokens, device) for n in names}
    return step_times(runs, size, batch, repeats, warmup, device, dtype, caption_kinds)


def step_times(runs: dict, size: TowerConfig, batch: int, repeats: int, warmup: int, device: str, dtype: torch.dtype,
               caption_kinds: list[str]) -> dict:
    """{(name, caption kind): [seconds per step]}: every (objective, optimizer) of `runs` stepped round-robin on
    the same images and tokens, the first `warmup` rounds untimed."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size.img_size, size.img_size, generator=g).to(device)
    tokens = {k: tokenize(captions(k, batch), size.context_length).to(device) for k in caption_kinds}
    times: dict = {(n, k): [] for n in runs for k in caption_kinds}
    for r in range(warmup + repeats):
        for k in caption_kinds:
            for n in runs:
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(*runs[n], images, tokens[k], dtype)
                if device == "cuda":
                    torch.cuda.synchronize()
                if r >= warmup:
                    times[n, k].append(time.perf_counter() - t0)
    return times


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
    for k in caption_kinds if ("prolip_tiny", "clip_tiny") in pairs else []:
        a, b = times["prolip_tiny", k], times["clip_tiny", k]
        ratio = round_ratio(a, b)
        out.append(f"- ProLIP vs CLIP, {k} captions: {ratio:.3f}x (median of per-round ratios; ratio of minima "
                   f"{min(a) / min(b):.3f}x); target <= 1.05x: **{'met' if ratio <= 1.05 else 'MISSED'}**.")
    return "\n".join(out)


def step_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a step comparison (this module's and benchmarks.peers')."""
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--batch", type=int, help="default 64 (benchmarks.peers --data: 128)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--captions", choices=["short", "full", "both"], default="both")


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
    args = parser.parse_args(argv)
    args.batch = args.batch or 64
    if args.quick:
        args.size, args.batch, args.repeats, args.warmup = "tiny", 16, 3, 1
    wanted = {w.strip() for w in args.pairs.split(",")}
    pairs = [(m, b) for m, b in PAIRS if LABEL[m] in wanted]
    if not pairs or len(pairs) != len(wanted):
        parser.error(f"--pairs takes a comma-separated subset of {', '.join(LABEL[m] for m, _ in PAIRS)}")
    kinds = ["short", "full"] if args.captions == "both" else [args.captions]
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    times = measure(args.size, args.batch, args.repeats, args.warmup, args.mixture_tokens, args.device, dtype,
                    pairs, kinds)
    text = table(times, pairs, kinds) + "\n\n" + verdicts(times, pairs, kinds)
    print(text)
    if args.quick:
        return
    from benchmarks.report import write_section

    setup = setup_text(args, argv, "train_step", f"Llip mixture tokens {args.mixture_tokens}; ")
    write_section(f"train_step_{args.size}",
                  f"## Training step, `{args.size}` backbone: each method vs its baseline (`benchmarks/train_step.py`)\n\n"
                  "One full step (forward incl. ProLIP's masked copies of 12.5% of the pairs / PCME++'s MSDA, "
                  "backward, AdamW) of model + default loss, single process, same backbone per pair. "
                  "Target for ProLIP vs CLIP: <= 1.05x.\n\n" + setup + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
