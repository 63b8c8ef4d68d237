"""The bundled dataset: scikit-learn's 1,797 real handwritten digits as image-text pairs.

Each image carries captions at three levels of generality, which is what the probabilistic
models' uncertainty is asked to reflect (general captions should be more uncertain).
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SPECIFIC_TEMPLATES = [
    "the digit {name}",
    "a handwritten {digit}",
    "a photo of the number {name}",
    "a drawing of the digit {digit}",
    "the number {name} written by hand",
]
GENERAL_CAPTIONS = ["a handwritten digit", "a number", "a scanned handwritten number"]
SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = (0.7, 0.1, 0.2)


def specific_captions(label: int) -> list[str]:
    return [t.format(name=NAMES[label], digit=label) for t in SPECIFIC_TEMPLATES]


def mid_captions(label: int) -> list[str]:
    parity = "an odd digit" if label % 2 else "an even digit"
    size = "a digit greater than four" if label > 4 else "a digit less than five"
    return [parity, size]


def captions_for(label: int) -> dict[str, list[str]]:
    return {"specific": specific_captions(label), "mid": mid_captions(label), "general": list(GENERAL_CAPTIONS)}


def split_of(n: int, seed: int = 0) -> np.ndarray:
    """Deterministic split by image: array of split names, one per image index."""
    order = np.random.default_rng(seed).permutation(n)
    bounds = np.cumsum([int(round(f * n)) for f in SPLIT_FRACTIONS[:-1]])
    names = np.empty(n, dtype=object)
    for name, idx in zip(SPLITS, np.split(order, bounds)):
        names[idx] = name
    return names


def digit_image(pixels: np.ndarray, size: int) -> Image.Image:
    """8x8 array in 0..16 -> size x size RGB image (white ink on black)."""
    gray = Image.fromarray(np.clip(pixels * 16, 0, 255).astype(np.uint8), mode="L")
    return gray.resize((size, size), Image.BILINEAR).convert("RGB")


def encode_jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=95)
    return buf.getvalue()


@dataclass
class DigitSample:
    key: str
    label: int
    split: str
    image: Image.Image

    @property
    def meta(self) -> dict:
        return {"label": self.label, "split": self.split, "captions": captions_for(self.label)}


def iter_digits(image_size: int, seed: int = 0):
    from sklearn.datasets import load_digits

    digits = load_digits()
    splits = split_of(len(digits.target), seed)
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        yield DigitSample(f"{i:06d}", int(label), str(splits[i]), digit_image(pixels, image_size))


def write_digit_shards(root: str | Path, image_size: int = 32, shard_size: int = 500, seed: int = 0) -> dict[str, int]:
    """Write {root}/{split}/NNNNN.tar webdataset shards (jpg, txt, json). Idempotent: skips if complete."""
    import webdataset as wds

    root = Path(root)
    marker = root / "_SUCCESS.json"
    wanted = {"image_size": image_size, "shard_size": shard_size, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()).get("params") == wanted:
        return json.loads(marker.read_text())["counts"]
    by_split: dict[str, list[DigitSample]] = {s: [] for s in SPLITS}
    for sample in iter_digits(image_size, seed):
        by_split[sample.split].append(sample)
    counts = {}
    for split, samples in by_split.items():
        folder = root / split
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.tar"):
            old.unlink()
        for shard, start in enumerate(range(0, len(samples), shard_size)):
            tmp = folder / f"{shard:05d}.tar.tmp"
            with wds.TarWriter(str(tmp)) as sink:
                for s in samples[start : start + shard_size]:
                    sink.write({"__key__": s.key, "jpg": encode_jpeg(s.image),
                                "txt": specific_captions(s.label)[0], "json": json.dumps(s.meta).encode()})
            tmp.rename(folder / f"{shard:05d}.tar")  # a shard is visible only once complete
        counts[split] = len(samples)
    marker.write_text(json.dumps({"params": wanted, "counts": counts}))
    return counts
