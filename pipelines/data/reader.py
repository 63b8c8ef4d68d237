"""Ray Data over webdataset shards: decode, augment, pick a caption, tokenize, hand batches to Ray Train.

- Shards: ``{root}/{split}/*.tar`` (or any list of ``.tar`` paths / URIs, e.g. a ``jobs.download``
  output folder), local or on an fsspec object store. Only ``.tar`` files are read (`pipelines.data.tars`):
  img2dataset's ``.parquet`` / ``_stats.json`` next to them are not webdataset.
- Cache: small shard sets (<= 512 MB by default) are read once into Ray's object store, still
  encoded; every epoch then only decodes, augments and tokenizes.
- Files (`pipelines.data.tars`): a broken tar (truncated: the samples before the break are kept; not a tar,
  empty, unreadable) is skipped, named in the log and counted, never fatal.
- Decode: a sample with no image, an undecodable one, one over the pixel limit
  (`models.preprocess.MAX_IMAGE_PIXELS`), unreadable json, or no caption (none, empty or not UTF-8) is skipped and
  counted by reason (`pipelines.data.stats`), never fatal.
- Augment (`pipelines.data.augmentation`): train only by default; off for evaluation. Training reads images as
  uint8 (a quarter of float32's bytes through the object store), augmented here (OpenCV) or, with
  ``augment_on="device"``, on the training worker's device from the parameters drawn here
  (`pipelines.data.device_augment`).
- Caption (`pipelines.data.captions`): one drawn per sample from the levels in its json.
- Randomness: with ``seed`` set, each batch's generator is seeded from (seed, the batch's first
  key), so captions and augmentations do not depend on task scheduling; with ``seed=None`` they
  are fresh every run. Shuffling (train by default) shuffles the order of the shard files as they
  are read (seeded, reseeded each epoch; a cached set keeps the order of its one read); Ray Train's
  ``iter_torch_batches(local_shuffle_buffer_size=..., local_shuffle_seed=...)`` shuffles within
  each worker's stream.
- Per-worker shards: pass the dataset to ``TorchTrainer(datasets=...)`` with
  ``DataConfig(datasets_to_split=["train"])``; each worker reads ``get_dataset_shard("train")``.
  Every sample reaches exactly one worker per epoch (tests/test_reader.py). ``worker_read=True`` (a training run's
  ``data.reader: auto``): a cached set comes back as `pipelines.data.worker_reader.WorkerShards`, read by the workers
  themselves with the same map function (`pipelines.data.worker_reader.dataset_shard`), no Ray Data execution.

Output columns: ``image`` (B,3,H,W) float32 (uint8=False; uint8=True: see `Preprocess`), ``text`` (B,L) int64,
``label`` (B,) int64 (-1 when the sample has none) and ``sample_id`` (B,) int64 (the webdataset key as a number).
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import ray
import ray.data

from models.preprocess import ImageTooLarge, decode_image, resize, to_model_input
from pipelines.data.augmentation import PARAM_COLUMNS, augment_batch, augment_uint8, device_params
from pipelines.data.captions import CaptionSampler
from pipelines.storage import fs_path, total_bytes, uri
from pipelines.data.stats import SkippedSample, stats_actor
from pipelines.data.worker_reader import worker_shards
from pipelines.data.tars import blocks_here, cached_tar_shards, read_tar_shards, shuffled_paths
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


def present(value) -> bool:
    """A column's value for a sample that has that file (a sample lacking it reads None, or NaN after a block
    concatenation)."""
    return isinstance(value, (bytes, bytearray, memoryview))


def row_data(image_cols: list, metas: list, i: int) -> tuple[bytes, dict]:
    """Row i's encoded image and json object; SkippedSample ("no image", "unreadable json") otherwise."""
    data = next((col[i] for col in image_cols if present(col[i])), None)
    if data is None:
        raise SkippedSample("no image")
    try:
        meta = json.loads(metas[i]) if present(metas[i]) else {}
    except ValueError as err:  # not JSON, or not UTF-8
        raise SkippedSample("unreadable json", str(err)) from None
    if not isinstance(meta, dict):
        raise SkippedSample("unreadable json", "not an object")
    return data, meta


def decode_checked(data: bytes, min_size: int | None = None) -> np.ndarray:
    """decode_image, its failures as SkippedSample ("image too large", "undecodable image")."""
    try:
        return decode_image(data, min_size)
    except ImageTooLarge as err:
        raise SkippedSample("image too large", str(err)) from None
    except Exception as err:  # noqa: BLE001 - whatever the decoders raise on bad bytes
        raise SkippedSample("undecodable image", str(err)) from None


def decode_row(image_cols: list, metas: list, i: int) -> tuple[np.ndarray, dict]:
    """Row i's image (HWC uint8 RGB, full size) and json object; SkippedSample when either is missing or unreadable."""
    data, meta = row_data(image_cols, metas, i)
    return decode_checked(data), meta


def json_label(meta: dict) -> int:
    """The json's integer "label" (-1 without one); SkippedSample ("unreadable json") when it is not an integer."""
    try:
        return int(meta.get("label", -1))
    except (TypeError, ValueError):
        raise SkippedSample("unreadable json", f"label {meta.get('label')!r}") from None


def caption_text(value) -> str | None:
    """A txt column's value as text ("" when absent); None when it is not UTF-8."""
    if not present(value):
        return value if isinstance(value, str) else ""
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        return None


class Preprocess:
    """Row batch of raw webdataset bytes -> image, text (B,L) int64, label, sample_id (and augment).

    uint8=False: image (B,3,S,S) float32 in [-1, 1], augmented by the float reference (`augment_batch`).
    uint8=True: image (B,S,S,3) uint8, augmented here (`augment_uint8`) or, with augment_on="device", image
    (B,D,D,3) uint8 at the decode size D and `augment` (B, PARAM_COLUMNS) float32: the drawn parameters that
    `pipelines.data.device_augment` applies on the training worker's device.
    """

    def __init__(self, image_size: int, context_length: int, captions: CaptionSampler = CaptionSampler(),
                 seed: int | None = None, augment: bool = False, stats=None, stats_name: str | None = None,
                 uint8: bool = False, augment_on: str = "reader", decode_size: int | None = None, flip_p: float = 0.0,
                 stats_sync: bool = False):
        self.image_size, self.context_length, self.captions = image_size, context_length, captions
        self.stats_sync = stats_sync
        self.seed, self.augment, self.uint8, self.flip_p = seed, augment, uint8, flip_p
        self.on_device = augment and uint8 and augment_on == "device"
        self.decode_size = decode_size or default_decode_size(image_size)
        self.stats, self.stats_name = stats, stats_name
        self.rng = np.random.default_rng(seed)

    def decode(self, data: bytes) -> tuple[np.ndarray, tuple[int, int]]:
        """The image to batch, and the (height, width) its crop box is drawn on (the decoded image's)."""
        # Augmented crops keep 80-100% of the area: decoding at >= the decode size keeps them at full resolution.
        # Unaugmented images decode in full, as evaluation and serving decode them.
        image = decode_checked(data, self.decode_size if self.augment and self.uint8 else None)
        shape = image.shape[:2]
        return (resize(image, self.decode_size) if self.on_device else image), shape

    def images(self, decoded: list[np.ndarray], shapes: np.ndarray) -> dict[str, np.ndarray]:
        size = self.decode_size if self.on_device else self.image_size
        if not decoded:
            empty = {"image": np.zeros((0, size, size, 3), np.uint8) if self.uint8 else
                     np.zeros((0, 3, size, size), np.float32)}
            return {**empty, "augment": np.zeros((0, PARAM_COLUMNS), np.float32)} if self.on_device else empty
        if self.on_device:
            return {"image": np.stack(decoded), "augment": device_params(shapes[:, 0], shapes[:, 1], self.rng, self.flip_p)}
        if self.augment and self.uint8:
            return {"image": augment_uint8(decoded, size, self.rng, self.flip_p)}
        if self.augment:
            return {"image": to_model_input(augment_batch(decoded, size, self.rng, self.flip_p))}
        resized = np.stack([resize(im, size) for im in decoded])
        return {"image": resized if self.uint8 else to_model_input(resized)}

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(next(iter(batch.values())))
        keys = [str(k) for k in batch.get("__key__", [f"row{i}" for i in range(n)])]
        if self.seed is not None and n:
            self.rng = np.random.default_rng(_seed_of(self.seed, keys[0]))
        image_cols = [batch[c] for c in IMAGE_COLUMNS if c in batch]
        texts_in = batch.get("txt", [None] * n)
        metas_in = batch.get("json", [None] * n)
        urls = batch.get("__url__", [""] * n)
        decoded, shapes, texts, labels, ids, skipped = [], [], [], [], [], []
        for i in range(n):
            try:
                data, meta = row_data(image_cols, metas_in, i)
                img, shape = self.decode(data)
                txt = caption_text(texts_in[i])
                caption = self.captions.draw(meta, txt or "", self.rng).strip()
                if not caption:
                    raise SkippedSample("no caption" if txt is not None else "caption not UTF-8")
                label = json_label(meta)
            except SkippedSample as err:
                skipped.append((err.reason, str(urls[i]), keys[i]))
                continue
            decoded.append(img)
            shapes.append(shape)
            texts.append(caption)
            labels.append(label)
            ids.append(sample_id(keys[i]))
        if self.stats is not None:
            # Not waited for (training): a synchronous call per batch would stall the reader on the (head-node)
            # actor. A one-pass evaluation read waits, so its counts are complete when its data is.
            ref = self.stats.add.remote(self.stats_name, len(decoded), skipped)
            if self.stats_sync:
                ray.get(ref)
        return {
            **self.images(decoded, np.array(shapes, np.int64).reshape(-1, 2)),
            "text": tokenize_cached(texts, self.context_length),
            "label": np.asarray(labels, dtype=np.int64),
            "sample_id": np.asarray(ids, dtype=np.int64),
        }


def default_decode_size(image_size: int) -> int:
    """8/7 of the output (256 px for 224): a crop keeping 80% of the area still has >= the output's pixels."""
    return -(-image_size * 8 // 7)


def read_shards(paths: list[str], image_size: int, context_length: int, seed: int | None = None, *,
                captions: CaptionSampler = CaptionSampler(), augment: bool = False, shuffle: bool = False,
                stats_name: str | None = "default", batch_size: int = 256, cache: bool | None = None,
                cache_max_mb: float = 512.0, uint8: bool = False, augment_on: str = "reader",
                decode_size: int | None = None, flip_p: float = 0.0, stats_sync: bool = False, worker_read: bool = False,
                split: bool = True):
    """Ray Dataset over webdataset .tar paths -> preprocessed numpy batches (see module docstring).

    cache: keep the raw (still encoded) samples in Ray's object store after one read, so later
    epochs only decode and augment; None: when the shards total at most cache_max_mb (re-reading a
    handful of small tar files each epoch costs more than preprocessing them).
    uint8, augment_on, decode_size, flip_p: see `Preprocess`. stats_sync: each batch's counts reach the stats
    before the batch goes on (evaluation reads; training sends them without waiting). worker_read: a cached set comes back
    as `pipelines.data.worker_reader.WorkerShards` for Ray Train workers to read themselves (`split`: each worker its share of
    the rows, else all of them).
    """
    # File-order shuffling at read time (reseeded every epoch) streams; randomize_block_order would be a
    # barrier that reads the whole dataset before the first batch.
    file_shuffle = ray.data.FileShuffleConfig(seed=seed) if shuffle else None
    if cache is None:
        cache = total_bytes(paths) <= cache_max_mb * 2**20
    stats = stats_actor() if stats_name else None
    kwargs = dict(image_size=image_size, context_length=context_length, captions=captions, seed=seed, augment=augment,
                  stats=stats, stats_name=stats_name, uint8=uint8, augment_on=augment_on, decode_size=decode_size,
                  flip_p=flip_p, stats_sync=stats_sync)
    if cache and worker_read:
        return worker_shards(blocks_here(shuffled_paths(paths, file_shuffle), stats_name), _preprocess, kwargs,
                            batch_size, split)
    if cache:
        ds = cached_tar_shards(paths, stats_name, shuffle=file_shuffle)
    else:
        ds = read_tar_shards(paths, stats_name, shuffle=file_shuffle)
    # Tasks rather than an actor pool: each epoch re-executes the pipeline, and tasks start cheaply.
    return ds.map_batches(_preprocess, fn_kwargs=kwargs, batch_size=batch_size, batch_format="numpy")


def read_split(root: str, split: str, image_size: int, context_length: int, seed: int | None = None, *,
               captions: CaptionSampler = CaptionSampler(), augment: bool | None = None,
               shuffle: bool | None = None, stats_name: str | None = None, cache: bool | None = None,
               **image_options):
    """{root}/{split}/*.tar; augmentation and file shuffling default to on for "train" only. image_options:
    read_shards' uint8, augment_on, decode_size, flip_p (`train_options`)."""
    train = split == "train"
    return read_shards(shard_paths(root, split), image_size, context_length, seed, captions=captions,
                       augment=train if augment is None else augment, shuffle=train if shuffle is None else shuffle,
                       stats_name=stats_name or split, cache=cache, **image_options)


def train_options(cfg) -> dict:
    """read_split's image options for a training run's train split (`cfg`: a `pipelines.pretrain.config.TrainDocument`): uint8
    images, augmented where data.augment_on says."""
    where = cfg.data.augment_on if cfg.data.augment_on != "auto" else ("device" if cfg.train.use_gpu else "reader")
    return dict(uint8=True, augment_on=where, decode_size=cfg.data.decode_size, flip_p=cfg.data.flip_prob)


def _preprocess(batch: dict[str, np.ndarray], **kwargs) -> dict[str, np.ndarray]:
    return Preprocess(**kwargs)(batch)
