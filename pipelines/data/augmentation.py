"""Training augmentation: RandomResizedCrop, colour jitter and grayscale on a batch of decoded images.

RandomResizedCrop (scale 0.8-1.0, ratio 3/4-4/3), colour jitter (brightness / contrast / saturation
0.4, hue 0.1, applied with p=0.8) and grayscale (p=0.2). Images are HWC uint8 RGB numpy arrays;
OpenCV crops and resizes (several times faster than PIL on small images). Jitter and grayscale are
composed into one per-sample affine colour map applied to the whole batch at once, because the
reader must outrun training (benchmarks/data.py). A numpy generator draws every parameter, so a
seed makes them reproducible.
"""
from __future__ import annotations

import math

import numpy as np

from models.preprocess import resize

LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float64)
_RGB_TO_YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
_YIQ_TO_RGB = np.linalg.inv(_RGB_TO_YIQ)


def random_crop_boxes(heights: np.ndarray, widths: np.ndarray, rng: np.random.Generator, scale=(0.8, 1.0),
                      ratio=(3 / 4, 4 / 3), tries: int = 10) -> list[tuple[int, int, int, int]]:
    """RandomResizedCrop's boxes (x, y, w, h), one per image: area fraction in `scale`, aspect ratio
    log-uniform in `ratio`; up to `tries` draws per image, the first that fits, else the central square."""
    n = len(heights)
    area = (heights * widths).astype(np.float64)[:, None]
    target = area * rng.uniform(scale[0], scale[1], (n, tries))
    aspect = np.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1]), (n, tries)))
    w = np.rint(np.sqrt(target * aspect)).astype(np.int64)
    h = np.rint(np.sqrt(target / aspect)).astype(np.int64)
    fits = (w > 0) & (h > 0) & (w <= widths[:, None]) & (h <= heights[:, None])
    first = fits.argmax(axis=1)
    u = rng.random((n, 2))
    boxes = []
    for i in range(n):
        if fits[i, first[i]]:
            bw, bh = int(w[i, first[i]]), int(h[i, first[i]])
        else:
            bw = bh = int(min(heights[i], widths[i]))
        x = int(u[i, 0] * (widths[i] - bw + 1)) if fits[i, first[i]] else (int(widths[i]) - bw) // 2
        y = int(u[i, 1] * (heights[i] - bh + 1)) if fits[i, first[i]] else (int(heights[i]) - bh) // 2
        boxes.append((x, y, bw, bh))
    return boxes


def color_maps(means: np.ndarray, rng: np.random.Generator, brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1,
               jitter_p=0.8, gray_p=0.2) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample affine colour maps x -> A x + b (x in [0, 1] RGB) for colour jitter and grayscale.

    Jitter (with probability jitter_p) applies brightness, contrast and saturation factors drawn from
    [1-x, 1+x] and a hue rotation (in YIQ space) by a fraction in [-hue, hue] of a turn, in a random
    order per sample; then grayscale with probability gray_p. Contrast blends with the image's mean
    luma, computed from `means` (each image's mean RGB) through the maps so far, so the composition
    is exact up to the clipping that torchvision does between steps and we do once at the end.
    Vectorised over the batch: (B, 3, 3) and (B, 3).
    """
    n = len(means)
    eye, ones = np.eye(3), np.ones(3)
    gray_mat = np.outer(ones, LUMA)
    a, b = np.tile(eye, (n, 1, 1)), np.zeros((n, 3))
    jitter = rng.random(n) < jitter_p
    order = np.argsort(rng.random((n, 4)), axis=1)  # a random permutation of the 4 operations per sample
    f_b = rng.uniform(1 - brightness, 1 + brightness, n)
    f_c = rng.uniform(1 - contrast, 1 + contrast, n)
    f_s = rng.uniform(1 - saturation, 1 + saturation, n)
    theta = 2 * np.pi * rng.uniform(-hue, hue, n)
    gray = rng.random(n) < gray_p
    for pos in range(4):
        for op in range(4):
            idx = np.flatnonzero(jitter & (order[:, pos] == op))
            if not len(idx):
                continue
            if op == 0:  # brightness
                m = f_b[idx, None, None] * eye
            elif op == 1:  # contrast: blend with the current mean luma
                c = f_c[idx]
                mean_luma = np.einsum("j,bj->b", LUMA, np.einsum("bij,bj->bi", a[idx], means[idx]) + b[idx])
                a[idx] *= c[:, None, None]
                b[idx] = c[:, None] * b[idx] + ((1 - c) * mean_luma)[:, None]
                continue
            elif op == 2:  # saturation: blend with luma
                s_ = f_s[idx, None, None]
                m = s_ * eye + (1 - s_) * gray_mat
            else:  # hue: rotate chroma (I, Q)
                cos, sin = np.cos(theta[idx]), np.sin(theta[idx])
                rot = np.zeros((len(idx), 3, 3))
                rot[:, 0, 0], rot[:, 1, 1], rot[:, 1, 2], rot[:, 2, 1], rot[:, 2, 2] = 1, cos, -sin, sin, cos
                m = _YIQ_TO_RGB @ rot @ _RGB_TO_YIQ
            a[idx] = m @ a[idx]
            b[idx] = np.einsum("bij,bj->bi", m, b[idx])
    idx = np.flatnonzero(gray)
    a[idx] = gray_mat @ a[idx]
    b[idx] = b[idx] @ gray_mat.T
    return a.astype(np.float32), b.astype(np.float32)


def augment_batch(images: list[np.ndarray], size: int, rng: np.random.Generator) -> np.ndarray:
    """RandomResizedCrop + colour jitter + grayscale -> (B, size, size, 3) float32 in [0, 1]."""
    boxes = random_crop_boxes(np.array([im.shape[0] for im in images]), np.array([im.shape[1] for im in images]), rng)
    crops = np.stack([resize(im, size, box) for im, box in zip(images, boxes)]).astype(np.float32) / 255.0
    b = len(crops)
    mats, biases = color_maps(crops.reshape(b, -1, 3).mean(axis=1, dtype=np.float64), rng)
    out = np.empty_like(crops)
    for i in range(3):  # nine broadcast multiply-adds beat einsum's generic loop here
        out[..., i] = biases[:, None, None, i]
        for j in range(3):
            out[..., i] += mats[:, i, j, None, None] * crops[..., j]
    return np.clip(out, 0.0, 1.0, out=out)
