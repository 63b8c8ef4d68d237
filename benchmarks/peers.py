"""Our CLIP training step against open_clip's on the same shapes, batch, precision and threads.

Run (each size writes its own section of docs/BENCHMARKS.md):

    .venv/bin/python -m benchmarks.peers                              # CPU, the "small" backbone
    .venv/bin/python -m benchmarks.peers --size b16 --batch 8 --repeats 5 --warmup 1
    .venv/bin/python -m benchmarks.peers --gpu        # on a GPU: b16, batch 256, bf16, full captions; section peers_gpu
    .venv/bin/python -m benchmarks.peers --quick                      # tiny size, prints only
    .venv/bin/python -m benchmarks.peers --data                       # the loaders (section peers_data)
    .venv/bin/python -m benchmarks.peers --size b16 --batch 8 --towers  # each tower alone (prints only)
    .venv/bin/python -m benchmarks.peers --data --quick

What is timed: one full step (forward, InfoNCE loss, backward, AdamW) of our `clip` objective
(``build_objective``) and of an open_clip ``CLIP`` built from a model config of the same shape (vision
and text widths, depths, heads, patch, image size, context, embedding width) with open_clip's
``ClipLoss``, both randomly initialised, stepped round-robin in one process after a warm-up on the
same images and tokens (open_clip's tokenizer, which this project uses). Each side steps the optimizer its
trainer uses: ours the fused AdamW of `pipelines.fit.optim.adamw`, open_clip's `torch.optim.AdamW` as its
`open_clip_train` creates it (the per-tensor loop on CPU, foreach on GPU). Two caption sets: "short"
(digit captions; our text tower drops the padding after the batch's longest caption, open_clip's
runs the whole context) and "full" (every caption fills the context: the same text work for both).
The verdict uses the median over rounds of the two back-to-back steps' ratio.

The data side (``--data``): samples/s of our Ray Data reader (``pipelines.data.reader.read_shards`` as a CPU
training run reads its train split: uint8 images, augmented in the reader; iterated with ``iter_torch_batches``
as a Train worker does and made the model's float32 input in this process, as the worker does on its device,
``pipelines.data.device_augment.model_images``) against open_clip's own webdataset
loader (``open_clip_train.data.get_wds_dataset``: shard shuffle, sample shuffle buffer, PIL decode,
its train transform, its tokenizer, ``WebLoader`` with worker processes), on the same shards
(photo-like JPEGs written by this script), the same output size and batch, two CPUs each (two
Ray Data CPUs / two DataLoader workers). Two settings: without augmentation (ours: resize;
open_clip: its eval transform, resize + centre crop) and with the training augmentation (ours:
random crop + colour jitter; open_clip: its default RandomResizedCrop, no colour jitter). Each
loader runs whole epochs after a warm-up epoch (worker start, open_clip's persistent workers, our
object-store cache); the two alternate and the median per-round ratio is the verdict.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn as nn

from benchmarks.train_step import (SIZES, build, captions, card, fill_defaults, round_ratio, setup_text, step_arguments,
                                   step_times)
from models.tokenizer import VOCAB_SIZE, tokenize
from models.towers import TowerConfig


class OpenClipObjective(nn.Module):
    """open_clip's CLIP and ClipLoss behind the (images, tokens) -> {"loss"} call of our objectives."""

    def __init__(self, size: TowerConfig):
        super().__init__()
        from open_clip.loss import ClipLoss
        from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

        vision = CLIPVisionCfg(layers=size.vision_depth, width=size.vision_width,
                               head_width=size.vision_width // size.vision_heads, patch_size=size.patch_size,
                               image_size=size.img_size)
        text = CLIPTextCfg(context_length=size.context_length, vocab_size=VOCAB_SIZE, width=size.text_width,
                           heads=size.text_heads, layers=size.text_depth)
        self.model = CLIP(size.embed_dim, vision, text, output_dict=True)
        self.loss = ClipLoss()

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.model(images, tokens)
        return {"loss": self.loss(out["image_features"], out["text_features"], out["logit_scale"])}


def build_open_clip(size: TowerConfig, device: str):
    torch.manual_seed(0)
    objective = OpenClipObjective(size).to(device).train()
    opt = torch.optim.AdamW(objective.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.2)
    return objective, opt


def measure(size_name: str, batch: int, repeats: int, warmup: int, device: str, dtype: torch.dtype,
            caption_kinds: list[str]) -> dict:
    """{(name, caption kind): [seconds per step]} for "ours" and "open_clip", stepped round-robin."""
    size = SIZES[size_name]
    runs = {"ours": build("clip_tiny", size, 0, device), "open_clip": build_open_clip(size, device)}
    return step_times(runs, size, batch, repeats, warmup, device, dtype, caption_kinds)


def measure_towers(size_name: str, batch: int, repeats: int, device: str) -> dict:
    """{(name, tower): [seconds]}: forward + backward of each tower alone (full captions), round-robin."""
    size = SIZES[size_name]
    ours, theirs = build("clip_tiny", size, 0, device)[0].model, build_open_clip(size, device)[0].model
    images = torch.randn(batch, 3, size.img_size, size.img_size).to(device)
    tokens = tokenize(captions("full", batch), size.context_length).to(device)
    calls = {("ours", "image"): lambda: ours.encode_image(images)["mu"],
             ("open_clip", "image"): lambda: theirs.encode_image(images),
             ("ours", "text"): lambda: ours.encode_text(tokens)["mu"],
             ("open_clip", "text"): lambda: theirs.encode_text(tokens)}
    times: dict = {k: [] for k in calls}
    for r in range(repeats + 1):
        for k, call in calls.items():
            t0 = time.perf_counter()
            call().sum().backward()
            if r:  # round 0 warms up
                times[k].append(time.perf_counter() - t0)
    return times


def table(times: dict, caption_kinds: list[str], batch: int) -> str:
    lines = ["| captions | ours (ms, min / median) | open_clip (ms, min / median) | ours samples/s | open_clip samples/s "
             "| ratio of minima | median of per-round ratios (ours / open_clip) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for k in caption_kinds:
        a, b = times["ours", k], times["open_clip", k]
        lines.append(f"| {k} | {1e3 * min(a):.1f} / {1e3 * statistics.median(a):.1f} "
                     f"| {1e3 * min(b):.1f} / {1e3 * statistics.median(b):.1f} "
                     f"| {batch / statistics.median(a):.1f} | {batch / statistics.median(b):.1f} "
                     f"| {min(a) / min(b):.3f}x | {round_ratio(a, b):.3f}x |")
    return "\n".join(lines)


def verdicts(times: dict, caption_kinds: list[str]) -> str:
    out = []
    for k in caption_kinds:
        ratio = round_ratio(times["ours", k], times["open_clip", k])
        out.append(f"- {k} captions: our step {ratio:.3f}x open_clip's; target <= 1.0x: "
                   f"**{'met' if ratio <= 1.0 else 'MISSED'}**.")
    return "\n".join(out)


def write_photo_shards(folder, n: int, per_shard: int, size: int, seed: int = 0) -> list[str]:
    """Webdataset shards of smooth, photo-like JPEGs (gradients + ellipses) with a caption each."""
    import io
    import json
    import tarfile
    from pathlib import Path

    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    paths = []
    for shard in range(-(-n // per_shard)):
        path = Path(folder) / f"{shard:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(shard * per_shard, min(n, (shard + 1) * per_shard)):
                a, b, c = rng.random((3, 3))
                pixels = (255 * np.clip(a[None, None] * xx[..., None] + b[None, None] * yy[..., None] + 0.3 * c, 0, 1))
                image = Image.fromarray(pixels.astype(np.uint8))
                draw = ImageDraw.Draw(image)
                for _ in range(4):
                    x0, y0 = rng.integers(0, size - 32, 2)
                    w, h = rng.integers(16, size // 2, 2)
                    draw.ellipse([x0, y0, x0 + w, y0 + h], fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
                jpg = io.BytesIO()
                image.save(jpg, format="JPEG", quality=90)
                caption = f"a photo of {rng.integers(2, 9)} coloured shapes on a gradient, number {i}"
                for ext, data in (("jpg", jpg.getvalue()), ("txt", caption.encode()),
                                  ("json", json.dumps({"caption": caption}).encode())):
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


def measure_loaders(n: int, per_shard: int, source_size: int, image_size: int, batch: int, rounds: int,
                    context_length: int = 32) -> dict:
    """{(loader, setting): [samples/s per round]}: ours and open_clip's, alternating, whole epochs."""
    import tempfile
    from argparse import Namespace

    import functools

    import open_clip
    import open_clip_train.data
    import ray
    from open_clip_train.data import get_wds_dataset
    from webdataset.tariterators import tar_file_expander

    # open_clip_train pins webdataset <= 0.2.86; later ones end each shard with an empty marker its
    # grouping does not expect (KeyError 'fname'; webdataset#384, open_clip#935): their fix, eof_value=None.
    open_clip_train.data.tar_file_expander = functools.partial(tar_file_expander, eof_value=None)

    from pipelines.cluster.runtime import init_ray
    from pipelines.data.device_augment import model_images
    from pipelines.data.reader import read_shards

    settings = {"no augmentation": False, "training augmentation": True}
    rates: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-peers-data-") as tmp:
        paths = write_photo_shards(tmp, n, per_shard, source_size)
        init_ray(num_cpus=2)

        def tokenizer(texts):
            return open_clip.tokenize(texts, context_length=context_length)

        loaders = {}
        for name, augment in settings.items():
            ours = read_shards(paths, image_size, context_length, augment=augment, shuffle=augment, stats_name=None,
                               uint8=True, augment_on="reader")
            args = Namespace(train_data="::".join(paths), val_data="::".join(paths), train_num_samples=n,
                             val_num_samples=n, dataset_resampled=False, train_data_upsampling_factors=None,
                             seed=0, workers=2, world_size=1, batch_size=batch)
            transform = open_clip.image_transform(image_size, is_train=augment)
            theirs = get_wds_dataset(args, transform, is_train=augment, tokenizer=tokenizer).dataloader
            loaders[name] = {"ours": lambda ds=ours: ({"image": model_images(b, image_size)}
                                                      for b in ds.iter_torch_batches(batch_size=batch)),
                             "open_clip": lambda dl=theirs: dl}

        def epoch(make) -> float:
            seen, t0 = 0, time.perf_counter()
            for b in make():
                seen += (b["image"] if isinstance(b, dict) else b[0]).shape[0]
            return seen / (time.perf_counter() - t0)

        for name in settings:
            for which in ("ours", "open_clip"):
                epoch(loaders[name][which])  # warm-up: workers, imports, our object-store cache
        for _ in range(rounds):
            for name in settings:
                for which in ("ours", "open_clip"):
                    rates.setdefault((which, name), []).append(epoch(loaders[name][which]))
        ray.shutdown()
    return rates


def loader_table(rates: dict) -> tuple[str, str]:
    lines = ["| setting | ours (samples/s, median) | open_clip (samples/s, median) | median of per-round ratios "
             "(ours / open_clip) |", "| --- | --- | --- | --- |"]
    verdict = []
    for name in dict.fromkeys(k for _, k in rates):
        a, b = rates["ours", name], rates["open_clip", name]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        lines.append(f"| {name} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | {ratio:.3f}x |")
        verdict.append(f"- {name}: our reader {ratio:.3f}x open_clip's loader; target >= 1.0x: "
                       f"**{'met' if ratio >= 1.0 else 'MISSED'}**.")
    return "\n".join(lines), "\n".join(verdict)


def data_main(args, argv) -> None:
    n, per_shard, rounds = (400, 100, 1) if args.quick else (args.samples, 500, args.rounds)
    rates = measure_loaders(n, per_shard, 256, 224, args.batch, rounds)
    table_md, verdict = loader_table(rates)
    print(table_md + "\n\n" + verdict)
    if args.quick:
        return
    from benchmarks.report import load, machine, write_section

    write_section("peers_data",
                  "## Data loader against open_clip's (`benchmarks/peers.py --data`)\n\n"
                  f"{n} JPEGs of 256x256 in shards of {per_shard}, output 224x224 float32 images and 32-token captions "
                  "(ours: uint8 through the object store, augmented in Ray Data's tasks as a CPU training run reads "
                  "them, made float32 in the consuming process), "
                  f"batches of {args.batch}, two CPUs for each loader, {rounds} alternating rounds of one epoch each "
                  f"after a warm-up epoch. Machine: {machine()}; {load()}. Command: `python -m benchmarks.peers "
                  f"{' '.join(argv if argv is not None else sys.argv[1:])}`. Target: ours >= 1.0x.\n\n"
                  + table_md + "\n\n" + verdict + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    step_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="tiny size, few repeats, print only")
    parser.add_argument("--data", action="store_true", help="compare the data loaders instead of the steps")
    parser.add_argument("--towers", action="store_true", help="time each tower alone (forward + backward), print only")
    parser.add_argument("--samples", type=int, default=4000, help="--data: images in the shards")
    parser.add_argument("--rounds", type=int, default=3, help="--data: alternating epochs per loader")
    args = fill_defaults(parser.parse_args(argv))
    if args.data:
        args.batch = args.batch or 128
        return data_main(args, argv)
    args.batch = args.batch or 64
    if args.towers:
        times = measure_towers(args.size, args.batch, args.repeats, args.device)
        for tower in ("image", "text"):
            a, b = times["ours", tower], times["open_clip", tower]
            print(f"{tower}: ours {1e3 * min(a):.0f} ms, open_clip {1e3 * min(b):.0f} ms (minima); ours / open_clip "
                  f"{round_ratio(a, b):.3f}x (median of per-round ratios)")
        return
    if args.quick:
        args.size, args.batch, args.repeats, args.warmup = "tiny", 16, 3, 1
    kinds = ["short", "full"] if args.captions == "both" else [args.captions]
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    times = measure(args.size, args.batch, args.repeats, args.warmup, args.device, dtype, kinds)
    text = table(times, kinds, args.batch) + "\n\n" + verdicts(times, kinds)
    print(text)
    if args.quick:
        return
    from benchmarks.report import write_section

    setup = setup_text(args, argv, "peers")
    if args.gpu and not args.device.startswith("cuda"):
        print("\n(not written: the peers_gpu section is refreshed from a CUDA device)")
        return
    where = f"on a GPU: {card(args.device)[0]}" if args.gpu else f"`{args.size}` backbone"
    write_section("peers_gpu" if args.gpu else f"peers_{args.size}",
                  f"## Training step against open_clip, {where} (`benchmarks/peers.py`)\n\n"
                  "One full CLIP step (forward, InfoNCE, backward, AdamW) of ours and of open_clip's `CLIP` with a "
                  "model config of the same shape, same batch, precision and threads. Target: ours <= 1.0x.\n\n"
                  + setup + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
