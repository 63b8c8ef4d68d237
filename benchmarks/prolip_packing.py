"""ProLIP's masked image copies: a separate short-sequence pass (ours) against packing them into the main call.

    .venv/bin/python -m benchmarks.prolip_packing            # `small` image tower, batch 64, prints only

ProLIP encodes a masked copy of 12.5% of the images (the prefix tokens + 25% of the patches). Ours
runs those copies as a second, short-sequence call of the image tower. The alternative packs several
short copies into spare rows of the main call (each row as long as a full image's sequence) and keeps
them apart with a block-diagonal attention mask (timm's blocks take ``attn_mask``): one call, but
every row then takes SDPA's masked path. Both compute the same outputs (checked); each round times
forward + backward of both, and the median of the per-round ratios is printed.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.train_step import SIZES
from models.towers import ImageTower, random_keep


def packed_forward(tower: ImageTower, images: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor):
    """(full-image tokens, masked-copy tokens) from one call of the blocks over packed rows."""
    vit, b = tower.vit, images.shape[0]
    full, short = tower.embed(images), tower.embed(images[rows], keep)
    length, part = full.shape[1], short.shape[1]
    per_row = length // part
    n_rows = -(-len(rows) // per_row)
    width = full.shape[-1]
    slots = torch.cat([short, short.new_zeros(n_rows * per_row - len(rows), part, width)])
    packs = torch.cat([slots.reshape(n_rows, per_row * part, width),
                       short.new_zeros(n_rows, length - per_row * part, width)], dim=1)
    segment = torch.arange(length) // part
    mask = torch.ones(b + n_rows, 1, length, length, dtype=torch.bool)
    mask[b:] = segment[:, None] == segment[None, :]
    h = torch.cat([full, packs])
    for block in vit.blocks:
        h = block(h, attn_mask=mask)
    h = vit.norm(h)
    return h[:b], h[b:, : per_row * part].reshape(n_rows * per_row, part, width)[: len(rows)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    size = SIZES[args.size]
    torch.manual_seed(0)
    tower = ImageTower(size.img_size, size.patch_size, size.vision_width, size.vision_depth, size.vision_heads,
                       extra_tokens=1, pre_norm=False)
    images = torch.randn(args.batch, 3, size.img_size, size.img_size)
    rows = torch.arange(max(1, round(0.125 * args.batch)))
    keep = random_keep(len(rows), tower.num_patches, 0.75)

    def separate():
        return tower(images), tower(images[rows], keep)

    def packed():
        return packed_forward(tower, images, rows, keep)

    with torch.no_grad():
        for a, b in zip(separate(), packed()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    times = {"separate": [], "packed": []}
    for r in range(args.rounds + 1):
        for name, fn in (("separate", separate), ("packed", packed)):
            t0 = time.perf_counter()
            full, short = fn()
            (full[:, 0].sum() + short[:, 0].sum()).backward()
            tower.zero_grad(set_to_none=True)
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
    ratio = statistics.median(p / s for p, s in zip(times["packed"], times["separate"]))
    print(f"{args.size}, batch {args.batch}, {len(rows)} masked copies of {keep.shape[1]} patches: "
          f"separate {1e3 * min(times['separate']):.0f} ms, packed {1e3 * min(times['packed']):.0f} ms (minima); "
          f"packed / separate {ratio:.3f}x (median of {args.rounds} per-round ratios)")


if __name__ == "__main__":
    main()
