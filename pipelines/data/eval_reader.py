"""Evaluation shards read and decoded: by Ray Data (`read_eval_shards`) or in a plain loop (`iter_local_batches`).

The shards are a task's {data}/{split}/*.tar in CLIP_benchmark's webdataset layout (`pipelines.data.eval_tasks`).
Decoded batches: ``key`` (str), ``image`` (B,3,H,W) float32 normalised as in training (no
augmentation), ``captions`` (str, one caption per line; empty when there is none), ``cls``
(int64, -1 when there is none) and ``levels`` (str: the json's "captions" mapping of generality level ->
captions, as JSON; empty when the sample has none). A sample without what its task needs (an image, and a caption
for retrieval or a class for zero-shot), or with an undecodable or oversized image, unreadable json, is skipped and
counted by reason, and a broken tar file named and counted (`pipelines.data.stats`, `pipelines.data.tars`).
"""
from __future__ import annotations

import json

import numpy as np
import ray

from models.preprocess import resize, to_model_input
from pipelines.data.reader import IMAGE_COLUMNS, decode_row, present
from pipelines.data.stats import SkippedSample, stats_actor
from pipelines.storage import total_bytes
from pipelines.data.worker_reader import worker_shards
from pipelines.data.tars import blocks_here, cached_tar_shards, iter_tar_samples, read_tar_shards

# What a task's samples must carry besides an image (None: nothing else, e.g. jobs.embed)
REQUIRES = {"retrieval": "caption", "zeroshot": "class", "loss": "caption"}


def captions_of(txt, meta: dict) -> list[str]:
    """Non-empty captions: the lines of txt, else the json's "caption". SkippedSample ("caption not UTF-8") when txt
    is not UTF-8."""
    if present(txt):
        try:
            txt = bytes(txt).decode("utf-8")
        except UnicodeDecodeError:
            raise SkippedSample("caption not UTF-8") from None
    if not isinstance(txt, str):
        txt = ""
    if not txt and isinstance(meta.get("caption"), str):
        txt = meta["caption"]
    return [line.strip() for line in txt.splitlines() if line.strip()]


def class_of(value) -> int:
    """A cls column's value as an int (-1 when absent); SkippedSample ("no class") when it is not an integer."""
    if not present(value):
        return value if isinstance(value, int) else -1
    try:
        return int(bytes(value).decode("utf-8").strip())
    except ValueError:
        raise SkippedSample("no class", f"cls {bytes(value)[:20]!r}") from None


class EvalDecode:
    """Raw webdataset columns -> key, image, captions, cls (see module docstring). With `uint8`, images stay
    (B, H, W, 3) uint8 (a quarter of the bytes to move between processes; `to_model_input` finishes them).
    require: "caption" (retrieval) or "class" (zero-shot) skips samples without one; None keeps them (an image is
    enough, e.g. jobs.embed: a caption that is not UTF-8 then reads with replacement characters)."""

    def __init__(self, image_size: int, stats=None, stats_name: str | None = None, uint8: bool = False,
                 require: str | None = None):
        self.image_size, self.stats, self.stats_name, self.uint8 = image_size, stats, stats_name, uint8
        self.require = require

    def _captions(self, txt, meta: dict) -> list[str]:
        try:
            caps = captions_of(txt, meta)
        except SkippedSample:
            if self.require == "caption":
                raise
            caps = captions_of(bytes(txt).decode("utf-8", errors="replace"), meta)
        if not caps and self.require == "caption":
            raise SkippedSample("no caption")
        return caps

    def _class(self, value) -> int:
        try:
            label = class_of(value)
        except SkippedSample:
            if self.require == "class":
                raise
            return -1
        if label < 0 and self.require == "class":
            raise SkippedSample("no class")
        return label

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(next(iter(batch.values())))
        keys = [str(k) for k in batch.get("__key__", [f"row{i}" for i in range(n)])]
        image_cols = [batch[c] for c in IMAGE_COLUMNS if c in batch]
        txts, metas, clss = (batch.get(c, [None] * n) for c in ("txt", "json", "cls"))
        urls = batch.get("__url__", [""] * n)
        images, out_keys, captions, labels, levels, skipped = [], [], [], [], [], []
        for i in range(n):
            try:
                img, meta = decode_row(image_cols, metas, i)
                label = self._class(clss[i])
                caps = self._captions(txts[i], meta)
                img = resize(img, self.image_size)
            except SkippedSample as err:
                skipped.append((err.reason, str(urls[i]), keys[i]))
                continue
            images.append(img)
            out_keys.append(keys[i])
            captions.append("\n".join(caps))
            labels.append(label)
            levels.append(levels_of(meta))
        if self.stats is not None:
            ray.get(self.stats.add.remote(self.stats_name, len(images), skipped))
        size = self.image_size
        image = np.stack(images) if images else np.zeros((0, size, size, 3), np.uint8)
        if not self.uint8:
            image = to_model_input(image)
        return {
            "key": np.asarray(out_keys, dtype=object),
            "image": image,
            "captions": np.asarray(captions, dtype=object),
            "cls": np.asarray(labels, dtype=np.int64),
            "levels": np.asarray(levels, dtype=object),
        }


def levels_of(meta: dict) -> str:
    """A sample json's captions by generality level ({"captions": {level: [caption, ...]}}) as JSON, or ""."""
    caps = meta.get("captions") if isinstance(meta, dict) else None
    if not isinstance(caps, dict):
        return ""
    clean = {str(k): [str(c) for c in v] for k, v in caps.items() if isinstance(v, list) and v}
    return json.dumps(clean) if clean else ""


def parse_levels(value) -> dict[str, list[str]]:
    return json.loads(value) if isinstance(value, str) and value else {}


def read_eval_shards(paths: list[str], image_size: int, stats_name: str | None = None, batch_size: int = 256,
                     cache_max_mb: float = 512.0, uint8: bool = False, require: str | None = None,
                     worker_read: bool = False):
    """Ray Dataset of decoded evaluation batches, in file order. Sets read every epoch (a training run's eval
    tasks) are cached still encoded when small; a one-pass reader (batch inference) sets cache_max_mb=0 and
    streams. require: see EvalDecode (REQUIRES[task.kind] for a task). worker_read: a cached set comes back as
    `pipelines.data.worker_reader.WorkerShards` that each Ray Train worker reads whole."""
    stats = stats_actor() if stats_name else None
    kwargs = dict(image_size=image_size, stats=stats, stats_name=stats_name, uint8=uint8, require=require)
    small = total_bytes(paths) <= cache_max_mb * 2**20
    if small and worker_read:
        return worker_shards(blocks_here(paths, stats_name), _decode, kwargs, batch_size, split=False)
    if small:
        ds = cached_tar_shards(paths, stats_name)
        ds.context.execution_options.preserve_order = True  # the decoded batches too, in file order
    else:
        ds = read_tar_shards(paths, stats_name)
    return ds.map_batches(_decode, fn_kwargs=kwargs, batch_size=batch_size, batch_format="numpy")


def _decode(batch, **kwargs):
    return EvalDecode(**kwargs)(batch)


def iter_local_batches(paths: list[str], image_size: int, batch_size: int = 256, require: str | None = None):
    """The same decoded batches without Ray (a plain loop over the tar files, in order; bad samples and files
    skipped, uncounted)."""
    decode = EvalDecode(image_size, require=require)
    samples: list[dict] = []
    for sample in iter_tar_samples(paths):
        samples.append(sample)
        if len(samples) == batch_size:
            yield decode(_columns(samples))
            samples = []
    if samples:
        yield decode(_columns(samples))


def _columns(samples: list[dict]) -> dict[str, np.ndarray]:
    """Samples -> columns, None where a sample lacks a file."""
    columns = {}
    for k in dict.fromkeys(k for s in samples for k in s):
        col = np.empty(len(samples), dtype=object)
        col[:] = [s.get(k) for s in samples]
        columns[k] = col
    return columns
