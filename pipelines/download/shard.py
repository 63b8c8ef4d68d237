"""Download one planned part into one webdataset shard, inside a Ray worker.

We run img2dataset's per-shard worker (``img2dataset.downloader.Downloader``: fetch threads, resize,
``WebDatasetSampleWriter``, ``_stats.json``) rather than ``img2dataset.download()``: that spawns its
own process pool, whose parent can hang until killed when a child crashes; it would number every
part's shard 0; and each call pays a few seconds of imports. Here Ray's worker processes are the
processes and the imports are paid once per worker. The shard is written under ``_tmp/NAME/`` and
moved into place with its ``_stats.json`` last, so a shard counts as finished only once complete.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from models._imports import without
from pipelines.download.config import DownloadConfig
from pipelines.download.plan import PARTS_DIR
from pipelines.storage import fs_path, read_json, uri

TMP_DIR = "_tmp"


def shard_name(shard: int, digits: int) -> str:
    return f"{shard:0{digits}d}"


def shard_done(fs, out: str, name: str) -> bool:
    return fs.exists(f"{out}/{name}_stats.json") and fs.exists(f"{out}/{name}.tar")


@dataclass
class PartResult:
    shard: int
    rows: int
    ok: bool
    stats: dict = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0
    node: str | None = None  # the Ray node that ran it (the summary says which node did which part)


def _img2dataset():
    """img2dataset's downloader, shard writer and resizer, imported in the Ray task that downloads (after
    NO_ALBUMENTATIONS_UPDATE is set: albumentations would check PyPI on import). Without torch: the shard writer's
    webdataset imports torch when it is there, for its PyTorch datasets and loaders, which a download never uses
    (~1.5 CPU-s and ~450 MB of each download worker's memory); without it webdataset stands in its own empty classes.
    A process that has torch already keeps it."""
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    with without("torch"):
        from img2dataset.downloader import Downloader
        from img2dataset.resizer import Resizer
        from img2dataset.writer import WebDatasetSampleWriter
    return Downloader, Resizer, WebDatasetSampleWriter


def _resizer(Resizer, cfg: DownloadConfig):
    return Resizer(
        image_size=cfg.image_size, resize_mode=cfg.resize_mode, resize_only_if_bigger=False,
        encode_quality=cfg.encode_quality if cfg.encode_quality is not None else 9 if cfg.encode_format == "png" else 95,
        encode_format=cfg.encode_format, min_image_size=cfg.min_image_size,
        max_image_area=cfg.max_image_area if cfg.max_image_area is not None else float("inf"),
    )


def remove_folder(fs, path: str) -> None:
    """`path` and what it holds, if anything. An object store has no folders: one whose last object is gone does not
    exist, and s3fs's recursive delete of it raises FileNotFoundError after deleting its objects."""
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def download_part(settings: dict[str, Any], part: dict[str, Any], shard_digits: int, key_digits: int) -> dict:
    """img2dataset's per-shard downloader on one part, then move the shard into place (a PartResult as a dict)."""
    Downloader, Resizer, WebDatasetSampleWriter = _img2dataset()

    cfg = DownloadConfig.model_validate(settings)
    node = ray.get_runtime_context().get_node_id()
    t0 = time.perf_counter()
    shard = part["shard"]
    name = shard_name(shard, shard_digits)
    fs, out = fs_path(cfg.output)
    tmp = f"{out}/{TMP_DIR}/{name}"
    remove_folder(fs, tmp)  # left by an interrupted run
    fs.makedirs(tmp, exist_ok=True)
    with fs.open(f"{out}/{PARTS_DIR}/{part['file']}", "rb") as f:
        table = pq.read_table(f)
    columns = list(cfg.additional_columns) + (["caption"] if cfg.caption_col else []) + ["url"]
    feather = f"{tmp}/{name}.feather"
    with fs.open(feather, "wb") as f, pa.ipc.new_file(f, table.select(columns).schema) as writer:
        writer.write_table(table.select(columns))
    downloader = Downloader(
        sample_writer_class=WebDatasetSampleWriter, resizer=_resizer(Resizer, cfg), thread_count=cfg.threads_per_task,
        save_caption=cfg.caption_col is not None, extract_exif=cfg.extract_exif, output_folder=uri(fs, tmp),
        column_list=columns, timeout=cfg.timeout, number_sample_per_shard=10**key_digits,
        oom_shard_count=shard_digits, compute_hash=cfg.compute_hash, verify_hash_type=None,
        encode_format=cfg.encode_format, retries=cfg.retries, user_agent_token=cfg.user_agent_token,
        disallowed_header_directives=cfg.disallowed_header_directives or None,
    )
    ok, _ = downloader((shard, uri(fs, feather)))
    if not ok:
        return asdict(PartResult(shard, part["rows"], False, error="img2dataset shard error (see worker log)",
                                 seconds=time.perf_counter() - t0, node=node))
    # The stats file last: a shard is finished once its _stats.json sits next to its .tar.
    for suffix in (".tar", ".parquet", "_stats.json"):
        fs.mv(f"{tmp}/{name}{suffix}", f"{out}/{name}{suffix}")
    remove_folder(fs, tmp)
    stats = read_json(fs, f"{out}/{name}_stats.json")
    return asdict(PartResult(shard, part["rows"], True, stats=stats, seconds=time.perf_counter() - t0, node=node))
