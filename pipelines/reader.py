"""Ray Data over webdataset shards: decode, augment, pick a caption, tokenize, hand batches to Ray Train.

- Shards: ``{root}/{split}/*.tar`` (or any list of ``.tar`` paths / URIs, e.g. a ``jobs.download``
  output folder), local or on an fsspec object store. Only ``.tar`` files are given to
  ``read_webdataset``: img2dataset's ``.parquet`` / ``_stats.json`` next to them are not webdataset.
- Decode: a sample whose image cannot be decoded (or has no image, or unreadable json) is skipped
  and counted, never fatal. Counts live in a small named Ray actor (`ReaderStats`) keyed by
  ``stats_name`` (default: the split); read them with `reader_stats(name)`. A corrupt sample is
  counted each time it is met (once per epoch); ``corrupt_unique`` counts distinct keys.
- Augment (train only by default; off for evaluation): RandomResizedCrop (scale 0.8-1.0, ratio
  3/4-4/3), colour jitter (brightness / contrast / saturation 0.4, hue 0.1, applied with p=0.8) and
  grayscale (p=0.2), implemented on PIL images with a numpy generator so that a seed makes them
  reproducible.
- Randomness: with ``seed`` set, each batch's generator is seeded from (seed, the batch's first
  key), so captions and augmentations do not depend on task scheduling; with ``seed=None`` they
  are fresh every run. Shuffling (train by default) randomizes the block order with the seed; Ray
  Train's ``iter_torch_batches(local_shuffle_buffer_size=..., local_shuffle_seed=...)`` shuffles
  within each worker's stream.
- Per-worker shards: pass the dataset to ``TorchTrainer(datasets=...)`` with
  ``DataConfig(datasets_to_split=["train"])``; each worker reads ``get_dataset_shard("train")``.
  Every sample reaches exactly one worker per epoch (tests/test_reader.py).

Output columns: ``image`` (B,3,H,W) float32, ``text`` (B,L) int64, ``label`` (B,) int64 (-1 when the
sample has none) and ``sample_id`` (B,) int64 (the webdataset key as a number).
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import math

import numpy as np
from PIL import Image, ImageEnhance

from models.tokenizer import tokenize

MEAN, STD = 0.5, 0.5
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
    """The job's `ReaderStats` actor (created on first use; lives as long as the driver)."""
    return _stats_actor_class().options(name=STATS_ACTOR, namespace=STATS_NAMESPACE, get_if_exists=True,
                                        lifetime=None).remote()


def reader_stats(name: str) -> dict:
    """{decoded, corrupt, corrupt_unique, corrupt_examples} for a dataset read with this stats_name."""
    import ray

    return ray.get(stats_actor().get.remote(name))


def reset_reader_stats(name: str) -> None:
    import ray

    ray.get(stats_actor().reset.remote(name))


# ------------------------------------------------------------------------------------ transforms


def random_resized_crop(img: Image.Image, size: int, rng: np.random.Generator, scale=(0.8, 1.0),
                        ratio=(3 / 4, 4 / 3)) -> Image.Image:
    """Crop a random area fraction in `scale` with aspect ratio in `ratio` (log-uniform), resize to size x size."""
    width, height = img.size
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            x, y = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            return img.resize((size, size), Image.BICUBIC, box=(x, y, x + w, y + h))
    side = min(width, height)  # fallback: central square
    x, y = (width - side) // 2, (height - side) // 2
    return img.resize((size, size), Image.BICUBIC, box=(x, y, x + side, y + side))


def _hue_shift(img: Image.Image, shift: float) -> Image.Image:
    hsv = np.asarray(img.convert("HSV")).copy()
    hsv[..., 0] = (hsv[..., 0].astype(np.int16) + int(round(shift * 255))) % 256
    return Image.fromarray(hsv, mode="HSV").convert("RGB")


def color_jitter(img: Image.Image, rng: np.random.Generator, brightness=0.4, contrast=0.4, saturation=0.4,
                 hue=0.1) -> Image.Image:
    """Brightness, contrast, saturation factors in [1-x, 1+x] and a hue shift in [-hue, hue], in random order."""
    ops = [
        lambda im: ImageEnhance.Brightness(im).enhance(rng.uniform(1 - brightness, 1 + brightness)),
        lambda im: ImageEnhance.Contrast(im).enhance(rng.uniform(1 - contrast, 1 + contrast)),
        lambda im: ImageEnhance.Color(im).enhance(rng.uniform(1 - saturation, 1 + saturation)),
        lambda im: _hue_shift(im, rng.uniform(-hue, hue)),
    ]
    for i in rng.permutation(len(ops)):
        img = ops[i](img)
    return img


def augment(img: Image.Image, size: int, rng: np.random.Generator, jitter_p: float = 0.8,
            gray_p: float = 0.2) -> Image.Image:
    img = random_resized_crop(img, size, rng)
    if rng.random() < jitter_p:
        img = color_jitter(img, rng)
    if rng.random() < gray_p:
        img = img.convert("L").convert("RGB")
    return img


# ------------------------------------------------------------------------------------ preprocess


def sample_id(key: str) -> int:
    """img2dataset keys are digits: use the number; anything else: a stable 63-bit hash."""
    if key.isdigit() and len(key) < 19:
        return int(key)
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


def _seed_of(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest(), "big")


class Preprocess:
    """Row batch of raw webdataset bytes -> image (B,3,H,W) float32, text (B,L) int64, label, sample_id."""

    def __init__(self, image_size: int, context_length: int, mid_prob: float = 0.0, general_prob: float = 0.0,
                 seed: int | None = None, augment: bool = False, stats=None, stats_name: str | None = None):
        self.image_size, self.context_length = image_size, context_length
        self.mid_prob, self.general_prob = mid_prob, general_prob
        self.seed, self.augment = seed, augment
        self.stats, self.stats_name = stats, stats_name
        self.rng = np.random.default_rng(seed)

    def caption(self, meta: dict, fallback: str) -> str:
        caps = meta.get("captions")
        if not caps:
            return fallback
        u = self.rng.random()
        level = "general" if u < self.general_prob else "mid" if u < self.general_prob + self.mid_prob else "specific"
        options = caps.get(level) or caps["specific"]
        return options[self.rng.integers(len(options))]

    def decode(self, data: bytes) -> Image.Image:
        img = Image.open(io.BytesIO(data))
        img.load()  # raises on truncated / corrupt data
        return img.convert("RGB")

    def image(self, img: Image.Image) -> np.ndarray:
        if self.augment:
            img = augment(img, self.image_size, self.rng)
        elif img.size != (self.image_size, self.image_size):
            img = img.resize((self.image_size, self.image_size), Image.BICUBIC)
        arr = np.asarray(img, dtype=np.float32) / 255.0
        return ((arr - MEAN) / STD).transpose(2, 0, 1)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(next(iter(batch.values())))
        keys = [str(k) for k in batch.get("__key__", [f"row{i}" for i in range(n)])]
        if self.seed is not None and n:
            self.rng = np.random.default_rng(_seed_of(self.seed, keys[0]))
        image_cols = [batch[c] for c in IMAGE_COLUMNS if c in batch]
        texts_in = batch.get("txt", [None] * n)
        metas_in = batch.get("json", [None] * n)
        images, texts, labels, ids, corrupt = [], [], [], [], []
        for i in range(n):
            try:
                data = next((col[i] for col in image_cols if col[i] is not None), None)
                if data is None:
                    raise ValueError("no image")
                meta = json.loads(metas_in[i]) if metas_in[i] is not None else {}
                if not isinstance(meta, dict):
                    raise ValueError("json is not an object")
                img = self.decode(data)
            except Exception:  # noqa: BLE001 - any undecodable sample is skipped and counted
                corrupt.append(keys[i])
                continue
            txt = texts_in[i]
            txt = txt.decode("utf-8", errors="replace") if isinstance(txt, bytes) else ("" if txt is None else str(txt))
            images.append(self.image(img))
            texts.append(self.caption(meta, txt))
            labels.append(int(meta.get("label", -1)))
            ids.append(sample_id(keys[i]))
        if self.stats is not None:
            import ray

            ray.get(self.stats.add.remote(self.stats_name, len(images), corrupt))
        size = self.image_size
        return {
            "image": np.stack(images) if images else np.zeros((0, 3, size, size), np.float32),
            "text": tokenize(texts, self.context_length).numpy() if texts else np.zeros((0, self.context_length),
                                                                                       np.int64),
            "label": np.asarray(labels, dtype=np.int64),
            "sample_id": np.asarray(ids, dtype=np.int64),
        }


def read_shards(paths: list[str], image_size: int, context_length: int, mid_prob: float = 0.0,
                general_prob: float = 0.0, seed: int | None = None, *, augment: bool = False, shuffle: bool = False,
                stats_name: str | None = "default", batch_size: int = 256):
    """Ray Dataset over webdataset .tar paths -> preprocessed numpy batches (see module docstring)."""
    import ray.data

    ds = ray.data.read_webdataset(paths, decoder=None)
    if shuffle:
        ds = ds.randomize_block_order(seed=seed)
    stats = stats_actor() if stats_name else None
    # Tasks rather than an actor pool: each epoch re-executes the pipeline, and tasks start cheaply.
    return ds.map_batches(
        _preprocess, fn_kwargs=dict(image_size=image_size, context_length=context_length, mid_prob=mid_prob,
                                    general_prob=general_prob, seed=seed, augment=augment, stats=stats,
                                    stats_name=stats_name),
        batch_size=batch_size, batch_format="numpy",
    )


def read_split(root: str, split: str, image_size: int, context_length: int, mid_prob: float = 0.0,
               general_prob: float = 0.0, seed: int | None = None, *, augment: bool | None = None,
               shuffle: bool | None = None, stats_name: str | None = None):
    """{root}/{split}/*.tar; augmentation and block shuffling default to on for "train" only."""
    train = split == "train"
    return read_shards(shard_paths(root, split), image_size, context_length, mid_prob, general_prob, seed,
                       augment=train if augment is None else augment, shuffle=train if shuffle is None else shuffle,
                       stats_name=stats_name or split)


def _preprocess(batch: dict[str, np.ndarray], **kwargs) -> dict[str, np.ndarray]:
    return Preprocess(**kwargs)(batch)
