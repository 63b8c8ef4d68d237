"""Training-step time of each method against its deterministic baseline on the same backbone.

Run (one command; writes the "train_step" section of docs/BENCHMARKS.md):

    .venv/bin/python -m benchmarks.train_step                 # CPU, the "small" backbone below
    .venv/bin/python -m benchmarks.train_step --size b16 --device cuda --batch 256   # paper size, on a GPU
    .venv/bin/python -m benchmarks.train_step --quick         # tiny sizes, prints the table, writes nothing

What is timed: one full training step of ``Objective(model, default loss)`` in training mode --
forward (including ProLIP's masked copies and PCME++'s Mixup/CutMix), backward, AdamW step --
on random images and real tokenised captions, single process (the gather is the identity).
Pairs compared: ProLIP vs CLIP, PCME++ vs CLIP, Llip vs SigLIP, probabilistic Llip vs SigLIP,
each pair on the same tower sizes. All models are stepped round-robin in one process after a
warm-up, so machine load hits them alike; the per-model minimum over the repeats is the estimate
(the median is printed too), and the ratios divide minima.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from models import create_model, default_loss
from models.clip import B16, TINY
from models.losses import create_loss
from models.objective import Objective
from models.tokenizer import tokenize

# A CPU-sized ViT (width 384, 6 blocks) and text transformer (width 256, 6 blocks, context 32).
SMALL = dict(img_size=96, patch_size=16, vision_width=384, vision_depth=6, vision_heads=6,
             context_length=32, text_width=256, text_depth=6, text_heads=4, embed_dim=256)
SIZES = {"tiny": TINY, "small": SMALL, "b16": B16}
# (model, baseline): registry names at tiny size; the size's dimensions are passed as overrides.
PAIRS = [("prolip_tiny", "clip_tiny"), ("pcmepp_tiny", "clip_tiny"), ("llip_tiny", "siglip_tiny"),
         ("prolip_llip_tiny", "siglip_tiny")]
LABEL = {"clip_tiny": "CLIP", "siglip_tiny": "SigLIP", "prolip_tiny": "ProLIP", "pcmepp_tiny": "PCME++",
         "llip_tiny": "Llip", "prolip_llip_tiny": "ProLIP-Llip"}
CAPTIONS = ["the digit seven", "a handwritten digit", "a photo of the number three written by hand",
            "an odd digit", "a drawing of the digit 4"]


def build(name: str, size: dict, mixture_tokens: int, device: str):
    overrides = dict(size)
    if "llip" in name:
        overrides["mixture_tokens"] = mixture_tokens
    torch.manual_seed(0)
    objective = Objective(create_model(name, **overrides), create_loss(default_loss(name))).to(device).train()
    opt = torch.optim.AdamW(objective.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.2)
    return objective, opt


def step(objective, opt, images, tokens, dtype) -> None:
    with torch.autocast(images.device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = objective(images, tokens)
    out["loss"].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(size_name: str, batch: int, repeats: int, warmup: int, mixture_tokens: int, device: str,
            dtype: torch.dtype) -> dict[str, list[float]]:
    size = SIZES[size_name]
    names = sorted({n for pair in PAIRS for n in pair})
    runs = {n: build(n, size, mixture_tokens, device) for n in names}
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size["img_size"], size["img_size"], generator=g).to(device)
    tokens = tokenize([CAPTIONS[i % len(CAPTIONS)] for i in range(batch)], size["context_length"]).to(device)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        for n in names:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(*runs[n], images, tokens, dtype)
            if device == "cuda":
                torch.cuda.synchronize()
            if r >= warmup:
                times[n].append(time.perf_counter() - t0)
    return times


def table(times: dict[str, list[float]]) -> str:
    lines = ["| method | baseline | method step (ms, min / median) | baseline step (ms, min / median) | ratio (min) |",
             "| --- | --- | --- | --- | --- |"]
    for model, base in PAIRS:
        a, b = times[model], times[base]
        lines.append(f"| {LABEL[model]} | {LABEL[base]} | {1e3 * min(a):.1f} / {1e3 * statistics.median(a):.1f} "
                     f"| {1e3 * min(b):.1f} / {1e3 * statistics.median(b):.1f} | {min(a) / min(b):.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--mixture-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny size, few repeats, print only")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.batch, args.repeats, args.warmup = "tiny", 16, 3, 1
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    times = measure(args.size, args.batch, args.repeats, args.warmup, args.mixture_tokens, args.device, dtype)
    text = table(times)
    print(text)
    if args.quick:
        return
    from benchmarks.report import machine, write_section

    size = SIZES[args.size]
    setup = (f"Backbone `{args.size}`: image {size['img_size']}px, patch {size['patch_size']}, ViT width "
             f"{size['vision_width']} x {size['vision_depth']} blocks; text width {size['text_width']} x "
             f"{size['text_depth']} blocks, context {size['context_length']}; embedding {size['embed_dim']}; "
             f"Llip mixture tokens {args.mixture_tokens}; batch {args.batch}; {args.device}, "
             f"{'bf16 autocast' if args.bf16 else 'fp32'}; {args.repeats} round-robin repeats after {args.warmup} "
             f"warm-up steps. Machine: {machine()}.")
    write_section("train_step", "## Training step: each method vs its baseline (`benchmarks/train_step.py`)\n\n"
                  "One full step (forward incl. ProLIP's masked copies of 12.5% of the pairs / PCME++'s MSDA, "
                  "backward, AdamW) of model + default loss, single process, same backbone per pair. "
                  "Target for ProLIP vs CLIP: <= 1.05x.\n\n" + setup + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
