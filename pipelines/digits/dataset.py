"""The bundled dataset: scikit-learn's 1,797 real handwritten digits as image-text pairs.

Each image carries captions at four levels of generality, which is what the probabilistic
models' uncertainty is asked to reflect (more general captions should be more uncertain):
"instance" (the class plus three attributes measured on that image: ink, width, slant, each as a
within-class tertile, e.g. "a bold wide seven, slanted right": 27 kinds per class, so ~1 match in a
batch of 128), "specific" (the class: the zero-shot templates), "mid" (parity / size) and "general"
(every image). `pipelines.digits.shards` writes them as webdataset shards and eval sets.
"""
from __future__ import annotations

from dataclasses import dataclass

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
# Deliberately wrong zero-shot prompts: off the digits' domain, no class named (docs/RESULTS.md "Zero-shot prompt
# weighting with wrong prompts")
OFF_DOMAIN = ["a photo of a car", "a red bicycle", "a cat sleeping on a sofa", "a bowl of soup",
              "a mountain at sunset"]
SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = (0.7, 0.1, 0.2)


def specific_captions(label: int) -> list[str]:
    return [t.format(name=NAMES[label], digit=label) for t in SPECIFIC_TEMPLATES]


ATTRIBUTE_WORDS = (("thin", "medium", "bold"), ("narrow", "medium-width", "wide"),
                   ("slanted left", "upright", "slanted right"))


def attribute_values(pixels: np.ndarray) -> np.ndarray:
    """(N, 8, 8) digit arrays -> (N, 3): ink (total intensity), width (ink-weighted horizontal spread),
    slant (ink-weighted regression of x on height; > 0 leans right)."""
    w = pixels.astype(np.float64)
    total = w.sum(axis=(1, 2))
    ys, xs = np.indices(pixels.shape[1:])
    mx = (w * xs).sum(axis=(1, 2)) / total
    my = (w * ys).sum(axis=(1, 2)) / total
    dx, dy = xs[None] - mx[:, None, None], my[:, None, None] - ys[None]  # dy > 0 upwards
    width = np.sqrt((w * dx**2).sum(axis=(1, 2)) / total)
    slant = (w * dx * dy).sum(axis=(1, 2)) / (w * dy**2).sum(axis=(1, 2))
    return np.stack([total, width, slant], axis=1)


def attribute_levels(values: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(N, 3) values -> (N, 3) levels 0..2: the tertile of each value among the images of the same class."""
    levels = np.zeros(values.shape, dtype=np.int64)
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        for j in range(values.shape[1]):
            rank = np.argsort(np.argsort(values[idx, j], kind="stable"), kind="stable")
            levels[idx, j] = rank * 3 // len(idx)
    return levels


def instance_captions(label: int, levels) -> list[str]:
    ink, width, slant = (words[int(i)] for words, i in zip(ATTRIBUTE_WORDS, levels))
    return [f"a {ink} {width} {NAMES[label]}, {slant}", f"a {ink}, {width} handwritten {label}, {slant}"]


def mid_captions(label: int) -> list[str]:
    parity = "an odd digit" if label % 2 else "an even digit"
    size = "a digit greater than four" if label > 4 else "a digit less than five"
    return [parity, size]


def captions_for(label: int, levels=None) -> dict[str, list[str]]:
    """Captions by level; "instance" only with the image's attribute levels."""
    caps = {"specific": specific_captions(label), "mid": mid_captions(label), "general": list(GENERAL_CAPTIONS)}
    if levels is not None:
        caps["instance"] = instance_captions(label, levels)
    return caps


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


@dataclass
class DigitSample:
    key: str
    label: int
    split: str
    image: Image.Image
    attributes: tuple[int, int, int]  # ink, width, slant levels (0..2) within the class

    @property
    def meta(self) -> dict:
        return {"label": self.label, "split": self.split, "captions": captions_for(self.label, self.attributes)}


def iter_digits(image_size: int, seed: int = 0):
    from sklearn.datasets import load_digits  # deferred: ~1.3 s to import, which the names and captions do not need

    digits = load_digits()
    splits = split_of(len(digits.target), seed)
    levels = attribute_levels(attribute_values(digits.images), digits.target)
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        yield DigitSample(f"{i:06d}", int(label), str(splits[i]), digit_image(pixels, image_size),
                          tuple(int(v) for v in levels[i]))


# Evaluation sets: the zero-shot set in CLIP_benchmark's webdataset layout, and image-caption pairs for
# retrieval, both from the downloaded val/test shards (the same image bytes as the held-out splits).
EVAL_TEMPLATES = ["the digit {c}", "a photo of the number {c}", "the number {c} written by hand"]


def retrieval_captions(meta: dict) -> list[str]:
    """Two captions per image: one of the class templates (shared by ~a fifth of the class) and its
    instance caption (class + ink, width, slant: shared by a few images)."""
    caps = meta["captions"]
    return [caps["specific"][int(meta["digit_index"]) % len(caps["specific"])], caps["instance"][0]]
