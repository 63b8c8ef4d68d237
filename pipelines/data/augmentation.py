"""Training augmentation: RandomResizedCrop, colour jitter, grayscale and (optionally) horizontal flip.

RandomResizedCrop (scale 0.8-1.0, ratio 3/4-4/3), colour jitter (brightness / contrast / saturation
0.4, hue 0.1, applied with p=0.8), grayscale (p=0.2), flip (p=`flip_p`, default 0: captions may say
"left"). A numpy generator draws every parameter, so a seed makes them reproducible wherever they
are applied. Jitter and grayscale compose into one per-sample affine colour map.

Three ways to apply the same draws:
- `augment_uint8` (the reader, on CPUs): OpenCV crops and resizes the uint8 image and applies the colour
  map with saturation to uint8 (`cv2.transform`): a quarter of float32's bytes through the object store.
- `device_params` + `pipelines.data.device_augment` (the training worker's device): the reader ships
  the drawn parameters; crop, flip and colour map run there as batched tensor ops.
- `augment_batch` (float32 numpy): the reference the other two are tested against.
"""
from __future__ import annotations

import math

import numpy as np

from models.preprocess import opencv, resize

LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float64)
_RGB_TO_YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
_YIQ_TO_RGB = np.linalg.inv(_RGB_TO_YIQ)
# device_params columns: crop box (x0, y0, x1, y1) as fractions of the image, flip, then the colour map's
# A (3x3), b0 (3) and M (3x3), row-major (see color_params)
PARAM_COLUMNS = 26


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


def color_params(n: int, rng: np.random.Generator, brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1,
                 jitter_p=0.8, gray_p=0.2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sample affine colour maps x -> A x + b0 + M m (x in [0, 1] RGB, m the image's mean RGB) for colour
    jitter and grayscale: (A, b0, M) of shapes (n, 3, 3), (n, 3), (n, 3, 3).

    Jitter (with probability jitter_p) applies brightness, contrast and saturation factors drawn from
    [1-x, 1+x] and a hue rotation (in YIQ space) by a fraction in [-hue, hue] of a turn, in a random
    order per sample; then grayscale with probability gray_p. Contrast blends with the mean luma of the
    image as the maps so far left it, which is linear in m: carrying that dependence as M lets the maps be
    drawn before the image is cropped (on another process or device) and finished once m is known. Exact up
    to the clipping that torchvision does between steps and we do once at the end.
    """
    eye, ones = np.eye(3), np.ones(3)
    gray_mat = np.outer(ones, LUMA)
    a, b0, mm = np.tile(eye, (n, 1, 1)), np.zeros((n, 3)), np.zeros((n, 3, 3))
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
            elif op == 1:  # contrast: blend with the current mean luma, LUMA . ((A + M) m + b0)
                c = f_c[idx]
                luma_b0 = b0[idx] @ LUMA
                luma_m = np.einsum("j,bjk->bk", LUMA, a[idx] + mm[idx])
                a[idx] *= c[:, None, None]
                b0[idx] = c[:, None] * b0[idx] + ((1 - c) * luma_b0)[:, None]
                mm[idx] = c[:, None, None] * mm[idx] + (1 - c)[:, None, None] * ones[None, :, None] * luma_m[:, None, :]
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
            b0[idx] = np.einsum("bij,bj->bi", m, b0[idx])
            mm[idx] = m @ mm[idx]
    idx = np.flatnonzero(gray)
    a[idx] = gray_mat @ a[idx]
    b0[idx] = b0[idx] @ gray_mat.T
    mm[idx] = gray_mat @ mm[idx]
    return a, b0, mm


def color_maps(means: np.ndarray, rng: np.random.Generator, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """`color_params` finished for images of mean RGB `means` (n, 3): x -> A x + b, float32 (n, 3, 3) and (n, 3)."""
    a, b0, mm = color_params(len(means), rng, **kwargs)
    return a.astype(np.float32), (b0 + np.einsum("bij,bj->bi", mm, means)).astype(np.float32)


def _crops(images: list[np.ndarray], size: int, rng: np.random.Generator) -> list[np.ndarray]:
    boxes = random_crop_boxes(np.array([im.shape[0] for im in images]), np.array([im.shape[1] for im in images]), rng)
    return [resize(im, size, box) for im, box in zip(images, boxes)]


def augment_batch(images: list[np.ndarray], size: int, rng: np.random.Generator, flip_p: float = 0.0) -> np.ndarray:
    """The float32 reference: RandomResizedCrop + colour jitter + grayscale + flip -> (B, size, size, 3) in [0, 1]."""
    crops = np.stack(_crops(images, size, rng)).astype(np.float32) / 255.0
    b = len(crops)
    mats, biases = color_maps(crops.reshape(b, -1, 3).mean(axis=1, dtype=np.float64), rng)
    out = np.empty_like(crops)
    for i in range(3):
        out[..., i] = biases[:, None, None, i]
        for j in range(3):
            out[..., i] += mats[:, i, j, None, None] * crops[..., j]
    flips = np.flatnonzero(rng.random(b) < flip_p)
    out[flips] = out[flips, :, ::-1]
    return np.clip(out, 0.0, 1.0, out=out)


def augment_uint8(images: list[np.ndarray], size: int, rng: np.random.Generator, flip_p: float = 0.0) -> np.ndarray:
    """`augment_batch`'s augmentation on uint8 (same draws, rounded to uint8): (B, size, size, 3) uint8."""
    cv2 = opencv()
    crops = _crops(images, size, rng)
    means = np.array([cv2.mean(c)[:3] for c in crops], np.float64) / 255.0
    mats, biases = color_maps(means.reshape(-1, 3), rng)
    flips = rng.random(len(crops)) < flip_p
    out = np.empty((len(crops), size, size, 3), np.uint8)
    for i, crop in enumerate(crops):
        # x -> A x + 255 b on 0..255 values, rounded and saturated to uint8 in one pass
        out[i] = cv2.transform(crop, np.concatenate([mats[i], 255.0 * biases[i, :, None]], axis=1))
        if flips[i]:
            out[i] = out[i, :, ::-1]
    return out


def device_params(heights: np.ndarray, widths: np.ndarray, rng: np.random.Generator,
                  flip_p: float = 0.0) -> np.ndarray:
    """The same draws as `augment_batch`, unapplied: (B, PARAM_COLUMNS) float32 for `device_augment`."""
    n = len(heights)
    boxes = np.array(random_crop_boxes(heights, widths, rng), np.float64).reshape(n, 4)
    x0, y0 = boxes[:, 0] / widths, boxes[:, 1] / heights
    x1, y1 = (boxes[:, 0] + boxes[:, 2]) / widths, (boxes[:, 1] + boxes[:, 3]) / heights
    a, b0, mm = color_params(n, rng)
    flips = rng.random(n) < flip_p
    return np.concatenate([np.stack([x0, y0, x1, y1, flips], 1), a.reshape(n, 9), b0, mm.reshape(n, 9)],
                          axis=1).astype(np.float32)
