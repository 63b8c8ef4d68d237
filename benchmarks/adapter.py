"""What the ProbVLM adapter costs next to its source model: training samples/s side by side in one run.

Run:

    .venv/bin/python -m benchmarks.adapter                    # tiny (the demo) and small backbones, CPU
    .venv/bin/python -m benchmarks.adapter --sizes b16 --batch 16 --repeats 5   # paper size (slow on a CPU)
    .venv/bin/python -m benchmarks.adapter --quick            # prints, writes nothing

Timed, single process, round-robin after a warm-up so machine load hits all alike:
- adapter step: forward + backward + AdamW of the ProbVLM adapter (image and text MLPs, hidden 256) with
  `ProbVLMLoss` on a batch of (image, caption) embedding pairs -- what each Ray Train worker of `jobs.adapt` does;
- source step: one training step of the source CLIP (forward + backward + AdamW, InfoNCE) on images and
  captions -- what training (or fine-tuning) the model itself costs per pair;
- source embedding: the source's forward pass without gradient on the same pairs, the one-off cost of
  embedding the training pairs (Ray Data batch inference in `jobs.adapt`), per pair.
Ratios are the median over rounds of the back-to-back per-sample times.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.train_step import CAPTIONS, SIZES
from models.clip import CLIP
from models.losses import create_loss
from models.objective import Objective
from models.probvlm import ProbVLMAdapter
from models.tokenizer import tokenize


def build(size: dict, batch: int):
    torch.manual_seed(0)
    source = Objective(CLIP(**size), create_loss("infonce")).train()
    source_opt = torch.optim.AdamW(source.parameters(), lr=1e-4)
    adapter = ProbVLMAdapter(size["embed_dim"], hidden=256, dropout=0.1).train()
    loss = create_loss("probvlm")
    adapter_opt = torch.optim.AdamW(adapter.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size["img_size"], size["img_size"], generator=g)
    tokens = tokenize([CAPTIONS[i % len(CAPTIONS)] for i in range(batch)], size["context_length"])
    pairs = torch.nn.functional.normalize(torch.randn(2, batch, size["embed_dim"], generator=g), dim=-1)

    def source_step():
        out = source(images, tokens)
        out["loss"].backward()
        source_opt.step()
        source_opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def source_embed():
        source.model.encode_image(images)
        source.model.encode_text(tokens)

    def adapter_step():
        out = loss(adapter(pairs[0], pairs[1]))
        out["loss"].backward()
        adapter_opt.step()
        adapter_opt.zero_grad(set_to_none=True)

    return {"adapter step": adapter_step, "source step": source_step, "source embedding": source_embed}


def measure(size: dict, batch: int, repeats: int, warmup: int, adapter_steps: int) -> dict[str, list[float]]:
    """Seconds per pair of each job; the adapter is stepped `adapter_steps` times per round (it is that fast)."""
    jobs = build(size, batch)
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for r in range(warmup + repeats):
        for name, fn in jobs.items():
            n = adapter_steps if name == "adapter step" else 1
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            if r >= warmup:
                times[name].append((time.perf_counter() - t0) / (n * batch))
    return times


def rows(size_name: str, size: dict, batch: int, times: dict[str, list[float]]) -> list[str]:
    a, s, e = times["adapter step"], times["source step"], times["source embedding"]
    ratio = statistics.median(y / x for x, y in zip(a, s))
    embed_ratio = statistics.median(y / x for x, y in zip(a, e))
    rate = {k: 1.0 / statistics.median(v) for k, v in times.items()}
    return [f"| `{size_name}` (D={size['embed_dim']}, ViT {size['vision_width']}x{size['vision_depth']}, "
            f"{size['img_size']}px) | {batch} | {rate['adapter step']:,.0f} | {rate['source step']:,.1f} | "
            f"{rate['source embedding']:,.1f} | **{_x(ratio)}** | {_x(embed_ratio)} |"]


def _x(ratio: float) -> str:
    return f"{ratio:,.0f}x" if ratio >= 10 else f"{ratio:.2f}x"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small", help="comma-separated backbones of benchmarks.train_step")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--adapter-steps", type=int, default=20, help="adapter steps per round")
    parser.add_argument("--quick", action="store_true", help="tiny only, few repeats, print only")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.warmup = "tiny", 3, 1
    torch.set_num_threads(max(1, torch.get_num_threads()))
    lines = ["| backbone | batch | adapter step, pairs/s | source training step, pairs/s | source embedding, pairs/s "
             "| adapter / source training speed | adapter / source embedding speed |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in args.sizes.split(","):
        size = SIZES[name.strip()]
        lines += rows(name.strip(), size, args.batch, measure(size, args.batch, args.repeats, args.warmup,
                                                              args.adapter_steps))
    text = "\n".join(lines) + (
        "\n\nThe adapter's cost does not grow with the backbone (only with the embedding width), the source's "
        "does: at the `tiny` size the CLIP itself is a 2-block, 64-wide model, narrower than the adapter's "
        "256-wide MLPs, so the ratio is small there; at the `small` backbone the adapter trains ~two orders of "
        "magnitude faster than one CLIP step, and it needs the embedding pass only once per pair.")
    print(text)
    if args.quick:
        return
    from benchmarks.report import load, machine, write_section

    write_section("adapter", "## ProbVLM adapter vs its source model (`benchmarks/adapter.py`)\n\n"
                  "Training samples (image-caption pairs) per second, single process, measured side by side "
                  "(round-robin, median over rounds): the adapter's step on embeddings (ProbVLM MLPs, hidden 256, "
                  "`ProbVLMLoss`) against a training step of the CLIP it adapts and against that CLIP's "
                  "no-gradient embedding pass (the one-off cost of embedding the pairs). The paper's claim: the "
                  "adapter is cheap next to training the model (ProbVLM Sec. 1, 5).\n\n"
                  f"Machine: {machine()}; {load()} "
                  f"(other jobs share the 2 cores; the side-by-side ratios are what matter); {args.repeats} rounds after {args.warmup} warm-up, "
                  f"{args.adapter_steps} adapter steps per round. Command: `python -m benchmarks.adapter "
                  f"{' '.join(argv if argv is not None else sys.argv[1:])}`.\n\n" + text + "\n")


if __name__ == "__main__":
    main()
