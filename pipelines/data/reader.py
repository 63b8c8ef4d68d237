"""Ray Data over webdataset shards: decode, augment, pick a caption, tokenize, hand batches to Ray Train.

- Shards: ``{root}/{split}/*.tar`` (or any list of ``.tar`` paths / URIs, e.g. a ``jobs.download``
  output folder), local or on an fsspec object store. Only ``.tar`` files are given to
  ``read_webdataset``: img2dataset's ``.parquet`` / ``_stats.json`` next to them are not webdataset.
- Cache: small shard sets (<= 512 MB by default) are read once into Ray's object store, still
  encoded; every epoch then only decodes, augments and tokenizes.
- Decode: a sample whose image cannot be decoded (or has no image, or unreadable json) is skipped
  and counted (`pipelines.data.stats`), never fatal.
- Augment (`pipelines.data.augmentation`): train only by default; off for evaluation.
- Caption (`pipelines.data.captions`): one drawn per sample from the levels in its json.
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

import hashlib
import json

import numpy as np

from models.preprocess import decode_image, resize, to_model_input
from pipelines.data.augmentation import augment_batch
from pipelines.data.captions import CaptionSampler
from pipelines.data.storage import fs_path, total_bytes, uri
from pipelines.data.stats import stats_actor
from pipelines.data.tokens import tokenize_cached

IMAGE_COLUMNS = ("jpg", "jpeg", "png", "webp")


def shard_paths(root: str, split: str | None) -> list[str]:
    """``{root}/{split}/*.tar`` (``{root}/*.tar`` when split is None), as URIs for remote stores."""
    fs, base = fs_path(root)
    pattern = f"{base}/{split}/*.tar" if split else f"{base}/*.tar"
    paths = sorted(fs.glob(pattern))
    if not paths:
        raise FileNotFoundError(f"no shards match {pattern}")
    return [uri(fs, p) for p in paths]


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

    def __init__(self, image_size: int, context_length: int, captions: CaptionSampler = CaptionSampler(),
                 seed: int | None = None, augment: bool = False, stats=None, stats_name: str | None = None):
        self.image_size, self.context_length, self.captions = image_size, context_length, captions
        self.seed, self.augment = seed, augment
        self.stats, self.stats_name = stats, stats_name
        self.rng = np.random.default_rng(seed)

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
            texts.append(self.captions.draw(meta, txt, self.rng))
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


def read_shards(paths: list[str], image_size: int, context_length: int, seed: int | None = None, *,
                captions: CaptionSampler = CaptionSampler(), augment: bool = False, shuffle: bool = False,
                stats_name: str | None = "default", batch_size: int = 256, cache: bool | None = None,
                cache_max_mb: float = 512.0, ordered: bool = False):
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
        cache = total_bytes(paths) <= cache_max_mb * 2**20
    if cache:
        if ordered:
            ds.context.execution_options.preserve_order = True
        ds = ds.materialize()
    stats = stats_actor() if stats_name else None
    # Tasks rather than an actor pool: each epoch re-executes the pipeline, and tasks start cheaply.
    return ds.map_batches(
        _preprocess, fn_kwargs=dict(image_size=image_size, context_length=context_length, captions=captions,
                                    seed=seed, augment=augment, stats=stats, stats_name=stats_name),
        batch_size=batch_size, batch_format="numpy",
    )


def read_split(root: str, split: str, image_size: int, context_length: int, seed: int | None = None, *,
               captions: CaptionSampler = CaptionSampler(), augment: bool | None = None,
               shuffle: bool | None = None, stats_name: str | None = None, cache: bool | None = None,
               ordered: bool = False):
    """{root}/{split}/*.tar; augmentation and file shuffling default to on for "train" only."""
    train = split == "train"
    return read_shards(shard_paths(root, split), image_size, context_length, seed, captions=captions,
                       augment=train if augment is None else augment, shuffle=train if shuffle is None else shuffle,
                       stats_name=stats_name or split, cache=cache, ordered=ordered)


def _preprocess(batch: dict[str, np.ndarray], **kwargs) -> dict[str, np.ndarray]:
    return Preprocess(**kwargs)(batch)
