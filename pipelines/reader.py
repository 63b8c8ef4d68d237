"""Ray Data over webdataset shards: decode, augment, pick a caption, tokenize, hand batches to Ray Train.

- Shards: ``{root}/{split}/*.tar`` (or any list of ``.tar`` paths / URIs, e.g. a ``jobs.download``
  output folder), local or on an fsspec object store. Only ``.tar`` files are given to
  ``read_webdataset``: img2dataset's ``.parquet`` / ``_stats.json`` next to them are not webdataset.
- Cache: small shard sets (<= 512 MB by default) are read once into Ray's object store, still
  encoded; every epoch then only decodes, augments and tokenizes.
- Decode: a sample whose image cannot be decoded (or has no image, or unreadable json) is skipped
  and counted, never fatal. Counts live in a small named Ray actor (`ReaderStats`) keyed by
  ``stats_name`` (default: the split); read them with `reader_stats(name)`. A corrupt sample is
  counted each time it is met (once per epoch); ``corrupt_unique`` counts distinct keys.
- Augment (train only by default; off for evaluation): RandomResizedCrop (scale 0.8-1.0, ratio
  3/4-4/3), colour jitter (brightness / contrast / saturation 0.4, hue 0.1, applied with p=0.8) and
  grayscale (p=0.2). OpenCV decodes and resizes; jitter and grayscale are one affine colour map per
  sample applied to the whole batch (benchmarks/data.py: the reader must outrun training). A numpy
  generator draws every parameter, so a seed makes them reproducible.
- Randomness: with ``seed`` set, each batch's generator is seeded from (seed, the batch's first
  key), so captions and augmentations do not depend on task scheduling; with ``seed=None`` they
  are fresh every run. Shuffling (train by default) shuffles the order of the shard files as they
  are read (seeded, reseeded each epoch; a cached set keeps the order of its one read); Ray Train's
  ``iter_torch_batches(local_shuffle_buffer_size=..., local_shuffle_seed=...)`` shuffles within
  each worker's stream.
- Per-worker shards: pass the dataset to ``TorchTrainer(datasets=...)`` with
  ``DataConfig(datasets_to_split=["train"])``; each worker reads ``get_dataset_shard("train")``.
  Every sample reaches exactly one worker per epoch (tests/test_reader.py).

Output columns: ``image`` (B,3,H,W) float32, ``text`` (B,L) int64, ``label`` (B,) int64 (-1 when the
sample has none) and ``sample_id`` (B,) int64 (the webdataset key as a number).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math

import numpy as np

from models.preprocess import decode_image, resize, to_model_input
from models.tokenizer import tokenize

IMAGE_COLUMNS = ("jpg", "jpeg", "png", "webp")
STATS_ACTOR, STATS_NAMESPACE = "probvlp_reader_stats", "probvlp"


def shard_paths(root: str, split: str | None) -> list[str]:
    """``{root}/{split}/*.tar`` (``{root}/*.tar`` when split is None), as URIs for remote stores."""
    import fsspec

    fs, _, [base] = fsspec.get_fs_token_paths(root)
    pattern = f"{base.rstrip('/')}/{split}/*.tar" if split else f"{base.rstrip('/')}/*.tar"
    paths = sorted(fs.glob(pattern))
    if not paths:
        raise FileNotFoundError(f"no shards match {pattern}")
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return paths if protocol in ("file", "local") else [f"{protocol}://{p}" for p in paths]


# ------------------------------------------------------------------------------------ statistics


@functools.lru_cache(maxsize=None)
def _stats_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class ReaderStats:
        """Decoded / corrupt sample counts per dataset name, and a capped set of corrupt keys."""

        MAX_KEYS = 100_000

        def __init__(self):
            self.counts: dict[str, dict[str, int]] = {}
            self.keys: dict[str, set] = {}

        def add(self, name: str, decoded: int, corrupt_keys: list[str]) -> None:
            c = self.counts.setdefault(name, {"decoded": 0, "corrupt": 0})
            c["decoded"] += decoded
            c["corrupt"] += len(corrupt_keys)
            keys = self.keys.setdefault(name, set())
            for key in corrupt_keys:
                if len(keys) < self.MAX_KEYS:
                    keys.add(key)

        def get(self, name: str) -> dict:
            c = dict(self.counts.get(name, {"decoded": 0, "corrupt": 0}))
            c["corrupt_unique"] = len(self.keys.get(name, ()))
            c["corrupt_examples"] = sorted(self.keys.get(name, ()))[:20]
            return c

        def reset(self, name: str) -> None:
            self.counts.pop(name, None)
            self.keys.pop(name, None)

    return ReaderStats


def stats_actor():
    """The cluster's `ReaderStats` actor (created on first use).

    Detached: a non-detached actor dies once the last handle to it is dropped (when a dataset is
    freed), and a later run in the same driver would get the dying actor by name.
    """
    return _stats_actor_class().options(name=STATS_ACTOR, namespace=STATS_NAMESPACE, get_if_exists=True,
                                        lifetime="detached").remote()


def reader_stats(name: str) -> dict:
    """{decoded, corrupt, corrupt_unique, corrupt_examples} for a dataset read with this stats_name."""
    import ray

    return ray.get(stats_actor().get.remote(name))


def reset_reader_stats(name: str) -> None:
    import ray

    ray.get(stats_actor().reset.remote(name))


# ------------------------------------------------------------------------------------ transforms
# Images are HWC uint8 RGB numpy arrays. Decoding and resizing use OpenCV (installed with img2dataset;
# several times faster than PIL on small images); colour jitter and grayscale are composed into one
# per-sample affine colour map and applied to the whole batch at once.

LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float64)
_RGB_TO_YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
_YIQ_TO_RGB = np.linalg.inv(_RGB_TO_YIQ)


def random_crop_box(height: int, width: int, rng: np.random.Generator, scale=(0.8, 1.0),
                    ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box (x, y, w, h): area fraction in `scale`, aspect ratio log-uniform in `ratio`."""
    return random_crop_boxes(np.array([height]), np.array([width]), rng, scale, ratio)[0]


def random_crop_boxes(heights: np.ndarray, widths: np.ndarray, rng: np.random.Generator, scale=(0.8, 1.0),
                      ratio=(3 / 4, 4 / 3), tries: int = 10) -> list[tuple[int, int, int, int]]:
    """Vectorised random_crop_box: up to `tries` draws per image, the first that fits; else the central square."""
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


def random_resized_crop(arr: np.ndarray, size: int, rng: np.random.Generator, scale=(0.8, 1.0),
                        ratio=(3 / 4, 4 / 3)) -> np.ndarray:
    return resize(arr, size, random_crop_box(arr.shape[0], arr.shape[1], rng, scale, ratio))


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


def augment(arr: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """One image (HWC uint8) -> augmented HWC uint8 (for inspection and tests)."""
    return np.rint(augment_batch([arr], size, rng)[0] * 255).astype(np.uint8)


_TOKEN_CACHE: dict[tuple[str, int], np.ndarray] = {}


def tokenize_cached(texts: list[str], context_length: int) -> np.ndarray:
    """Tokenize each distinct caption once per worker process (templated captions repeat a lot)."""
    missing = list({t for t in texts if (t, context_length) not in _TOKEN_CACHE})
    if missing:
        if len(_TOKEN_CACHE) > 200_000:
            _TOKEN_CACHE.clear()
        for text, row in zip(missing, tokenize(missing, context_length).numpy()):
            _TOKEN_CACHE[(text, context_length)] = row
    if not texts:
        return np.zeros((0, context_length), np.int64)
    return np.stack([_TOKEN_CACHE[(t, context_length)] for t in texts])


# ------------------------------------------------------------------------------------ preprocess


def sample_id(key: str) -> int:
    """img2dataset keys are digits: use the number; anything else: a stable 63-bit hash."""
    if key.isdigit() and len(key) < 19:
        return int(key)
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


def _seed_of(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest(), "big")


def decode_row(image_cols: list, metas: list, i: int) -> tuple[np.ndarray, dict]:
    """Row i's image (HWC uint8 RGB) and json object; ValueError when either is missing or unreadable."""
    data = next((col[i] for col in image_cols if col[i] is not None), None)
    if data is None:
        raise ValueError("no image")
    meta = json.loads(metas[i]) if metas[i] is not None else {}
    if not isinstance(meta, dict):
        raise ValueError("json is not an object")
    return decode_image(data), meta


class Preprocess:
    """Row batch of raw webdataset bytes -> image (B,3,H,W) float32, text (B,L) int64, label, sample_id."""

    def __init__(self, image_size: int, context_length: int, mid_prob: float = 0.0, general_prob: float = 0.0,
                 seed: int | None = None, augment: bool = False, stats=None, stats_name: str | None = None,
                 instance_prob: float = 0.0):
        self.image_size, self.context_length = image_size, context_length
        self.mid_prob, self.general_prob, self.instance_prob = mid_prob, general_prob, instance_prob
        self.seed, self.augment = seed, augment
        self.stats, self.stats_name = stats, stats_name
        self.rng = np.random.default_rng(seed)

    def caption(self, meta: dict, fallback: str) -> str:
        caps = meta.get("captions")
        if not caps or not isinstance(caps, dict):  # a user's json may carry anything under "captions"
            return fallback
        u = self.rng.random()
        level = "specific"
        for name, share in (("general", self.general_prob), ("mid", self.mid_prob), ("instance", self.instance_prob)):
            if u < share:
                level = name
                break
            u -= share
        options = caps.get(level) or caps.get("specific")
        if not isinstance(options, list) or not options:
            return fallback
        return str(options[self.rng.integers(len(options))])

    def images(self, decoded: list[np.ndarray]) -> np.ndarray:
        size = self.image_size
        if not decoded:
            return np.zeros((0, 3, size, size), np.float32)
        if self.augment:
            return to_model_input(augment_batch(decoded, size, self.rng))
        return to_model_input([resize(im, size) for im in decoded])

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(next(iter(batch.values())))
        keys = [str(k) for k in batch.get("__key__", [f"row{i}" for i in range(n)])]
        if self.seed is not None and n:
            self.rng = np.random.default_rng(_seed_of(self.seed, keys[0]))
        image_cols = [batch[c] for c in IMAGE_COLUMNS if c in batch]
        texts_in = batch.get("txt", [None] * n)
        metas_in = batch.get("json", [None] * n)
        decoded, texts, labels, ids, corrupt = [], [], [], [], []
        for i in range(n):
            try:
                img, meta = decode_row(image_cols, metas_in, i)
            except Exception:  # noqa: BLE001 - any undecodable sample is skipped and counted
                corrupt.append(keys[i])
                continue
            txt = texts_in[i]
            txt = txt.decode("utf-8", errors="replace") if isinstance(txt, bytes) else ("" if txt is None else str(txt))
            decoded.append(img)
            texts.append(self.caption(meta, txt))
            labels.append(int(meta.get("label", -1)))
            ids.append(sample_id(keys[i]))
        if self.stats is not None:
            import ray

            ray.get(self.stats.add.remote(self.stats_name, len(decoded), corrupt))
        return {
            "image": self.images(decoded),
            "text": tokenize_cached(texts, self.context_length),
            "label": np.asarray(labels, dtype=np.int64),
            "sample_id": np.asarray(ids, dtype=np.int64),
        }


def _total_bytes(paths: list[str]) -> int:
    import fsspec

    total = 0
    for path in paths:
        fs, p = fsspec.core.url_to_fs(path)
        total += fs.size(p) or 0
    return total


def read_shards(paths: list[str], image_size: int, context_length: int, mid_prob: float = 0.0,
                general_prob: float = 0.0, seed: int | None = None, *, augment: bool = False, shuffle: bool = False,
                stats_name: str | None = "default", batch_size: int = 256, cache: bool | None = None,
                cache_max_mb: float = 512.0, ordered: bool = False, instance_prob: float = 0.0):
    """Ray Dataset over webdataset .tar paths -> preprocessed numpy batches (see module docstring).

    cache: keep the raw (still encoded) samples in Ray's object store after one read, so later
    epochs only decode and augment; None: when the shards total at most cache_max_mb (re-reading a
    handful of small tar files each epoch costs more than preprocessing them).
    ordered: the cached blocks keep the file order (else they come in read-task completion order,
    which differs between runs); needed, with a seed and ordered execution, for exact resumes.
    """
    import ray.data

    # File-order shuffling at read time (reseeded every epoch) streams; randomize_block_order would be a
    # barrier that reads the whole dataset before the first batch.
    file_shuffle = ray.data.FileShuffleConfig(seed=seed) if shuffle else None
    ds = ray.data.read_webdataset(paths, decoder=None, shuffle=file_shuffle)
    if cache is None:
        cache = _total_bytes(paths) <= cache_max_mb * 2**20
    if cache:
        if ordered:
            ds.context.execution_options.preserve_order = True
        ds = ds.materialize()
    stats = stats_actor() if stats_name else None
    # Tasks rather than an actor pool: each epoch re-executes the pipeline, and tasks start cheaply.
    return ds.map_batches(
        _preprocess, fn_kwargs=dict(image_size=image_size, context_length=context_length, mid_prob=mid_prob,
                                    general_prob=general_prob, seed=seed, augment=augment, stats=stats,
                                    stats_name=stats_name, instance_prob=instance_prob),
        batch_size=batch_size, batch_format="numpy",
    )


def read_split(root: str, split: str, image_size: int, context_length: int, mid_prob: float = 0.0,
               general_prob: float = 0.0, seed: int | None = None, *, augment: bool | None = None,
               shuffle: bool | None = None, stats_name: str | None = None, cache: bool | None = None,
               ordered: bool = False, instance_prob: float = 0.0):
    """{root}/{split}/*.tar; augmentation and file shuffling default to on for "train" only."""
    train = split == "train"
    return read_shards(shard_paths(root, split), image_size, context_length, mid_prob, general_prob, seed,
                       augment=train if augment is None else augment, shuffle=train if shuffle is None else shuffle,
                       stats_name=stats_name or split, cache=cache, ordered=ordered, instance_prob=instance_prob)


def _preprocess(batch: dict[str, np.ndarray], **kwargs) -> dict[str, np.ndarray]:
    return Preprocess(**kwargs)(batch)
