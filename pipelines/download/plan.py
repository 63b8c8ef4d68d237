"""Plan a download: de-duplicate the URL table and split it into parts, one per output shard.

Every row goes to bucket ``blake2b(url) % B`` with ``B = ceil(rows / rows_per_shard)``, so all
copies of a URL meet in one bucket; each bucket is sorted by (url, caption) and keeps the first row
of every URL, so a duplicated URL keeps its lexicographically first caption whatever the file and
block layout. Parts are therefore deterministic functions of the table. The manifest, written last,
lets a re-run reuse the plan and refuse a different table or image settings in the same folder.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from pipelines.download.config import DownloadConfig
from pipelines.storage import fs_path, read_json, total_bytes, write_bytes_atomic
from pipelines.download.urls import DownloadError, check_columns, input_files, read_table, read_table_local

MANIFEST_VERSION = 1
PARTS_DIR = "_parts"
# Settings that decide which rows go to which part (a change means a different plan).
PLAN_KEYS = ("input", "input_format", "url_col", "caption_col", "additional_columns", "rows_per_shard")
# Settings that decide what a finished shard holds (mixing them in one folder is refused).
IMAGE_KEYS = ("image_size", "resize_mode", "encode_format", "encode_quality", "min_image_size", "max_image_area",
              "compute_hash", "extract_exif")


def planner(cfg: DownloadConfig) -> str:
    """ray_data for big tables; small ones (< plan_local_max_mb of files) are planned in the driver."""
    if cfg.planner != "auto":
        return cfg.planner
    files, _ = input_files(cfg)
    return "driver" if total_bytes(files) <= cfg.plan_local_max_mb * 2**20 else "ray_data"


def _text(value: Any) -> tuple[str, bool]:
    """(text, repaired): bytes decoded as UTF-8, invalid sequences replaced."""
    if value is None:
        return "", False
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8"), False
        except UnicodeDecodeError:
            return value.decode("utf-8", errors="replace"), True
    return str(value), False


def bucket_of(url: str, buckets: int) -> int:
    """Stable across processes and machines (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(url.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big") % buckets


def _normalize(batch: pa.Table, url_col: str, caption_col: str | None, extras: list[str], buckets: int) -> pa.Table:
    urls, captions, bucket, missing, repaired = [], [], [], [], []
    raw_caps = batch[caption_col].to_pylist() if caption_col else [None] * batch.num_rows
    for raw_url, raw_cap in zip(batch[url_col].to_pylist(), raw_caps):
        url = _text(raw_url)[0].strip()
        cap, bad = _text(raw_cap)
        urls.append(url)
        captions.append(cap)
        missing.append(not url)
        repaired.append(bad)
        bucket.append(bucket_of(url, buckets))
    cols = {"url": pa.array(urls, pa.string()), "caption": pa.array(captions, pa.string())}
    cols.update({c: batch[c] for c in extras})
    cols.update({"_bucket": pa.array(bucket, pa.int64()), "_missing": pa.array(missing), "_repaired": pa.array(repaired)})
    return pa.table(cols)


def _write_part(group: pa.Table, parts_uri: str, has_caption: bool) -> pa.Table:
    """One bucket: drop rows without URL, sort, keep the first row per URL, write the part file."""
    bucket = group["_bucket"][0].as_py()
    rows_in = group.num_rows
    group = group.filter(pc.invert(group["_missing"]))
    missing = rows_in - group.num_rows
    group = group.sort_by([("url", "ascending"), ("caption", "ascending")])
    urls = group["url"].to_numpy(zero_copy_only=False)
    keep = np.ones(len(urls), dtype=bool)
    if len(urls) > 1:
        keep[1:] = urls[1:] != urls[:-1]
    part = group.filter(pa.array(keep))
    stats = {
        "bucket": bucket, "rows_in": rows_in, "missing_url": missing, "rows": part.num_rows,
        "duplicates": int(group.num_rows - part.num_rows),
        "captions_repaired": int(pc.sum(part["_repaired"]).as_py() or 0),
        "empty_captions": int(pc.sum(pc.equal(part["caption"], "")).as_py() or 0) if has_caption else 0,
    }
    part = part.drop_columns(["_bucket", "_missing", "_repaired"] + ([] if has_caption else ["caption"]))
    if part.num_rows:
        fs, parts_dir = fs_path(parts_uri)
        sink = pa.BufferOutputStream()
        pq.write_table(part, sink)
        write_bytes_atomic(fs, f"{parts_dir}/{bucket:08d}.parquet", sink.getvalue().to_pybytes())
    return pa.table({k: [v] for k, v in stats.items()})


def _settings(cfg: DownloadConfig, keys: tuple[str, ...]) -> dict[str, Any]:
    data = cfg.model_dump(mode="json")
    return {k: data[k] for k in keys}


def _check_reusable(cfg: DownloadConfig, manifest: dict) -> None:
    for section, keys in (("plan", PLAN_KEYS), ("image", IMAGE_KEYS)):
        if manifest.get(section) != _settings(cfg, keys):
            diff = [k for k in keys if manifest.get(section, {}).get(k) != _settings(cfg, keys)[k]]
            raise DownloadError(f"download.output {cfg.output} holds a download with different "
                                f"{', '.join(diff)}; use a new output folder or delete it")


def _buckets(cfg: DownloadConfig, rows: int) -> int:
    if rows == 0:
        raise DownloadError(f"download.input: {cfg.input} has no rows")
    return max(1, math.ceil(rows / cfg.rows_per_shard))


def _part_stats(cfg: DownloadConfig, parts_uri: str) -> tuple[int, list[dict]]:
    """(input rows, per-bucket stats): the parts written with Ray Data or, for small tables, in this process."""
    normalize = dict(url_col=cfg.url_col, caption_col=cfg.caption_col, extras=list(cfg.additional_columns))
    write = dict(parts_uri=parts_uri, has_caption=cfg.caption_col is not None)
    if planner(cfg) == "ray_data":
        ds = read_table(cfg)
        rows = ds.count()
        buckets = _buckets(cfg, rows)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        partitions = max(1, min(buckets, max(cpus, math.ceil(rows / 1_000_000))))
        return rows, (
            ds.map_batches(_normalize, batch_format="pyarrow", fn_kwargs=dict(normalize, buckets=buckets))
            .groupby("_bucket", num_partitions=partitions)
            .map_groups(_write_part, batch_format="pyarrow", fn_kwargs=write)
            .take_all()
        )
    # The same functions in this process: identical parts, without Ray Data's start-up cost.
    table = read_table_local(cfg)
    rows = table.num_rows
    buckets = _buckets(cfg, rows)
    table = _normalize(table, buckets=buckets, **normalize).sort_by("_bucket")
    ids = table["_bucket"].to_numpy()
    bounds = np.flatnonzero(np.diff(ids)) + 1
    stats = []
    for start, stop in zip(np.r_[0, bounds], np.r_[bounds, len(ids)]):
        stats += _write_part(table.slice(start, stop - start), **write).to_pylist()
    return rows, stats


def plan(cfg: DownloadConfig) -> dict[str, Any]:
    """Read, de-duplicate and split the table into parts; reuse the manifest of an earlier run."""
    fs, out = fs_path(cfg.output)
    manifest_path = f"{out}/{PARTS_DIR}/_manifest.json"
    manifest = read_json(fs, manifest_path)
    if manifest is not None:
        _check_reusable(cfg, manifest)
        return manifest

    check_columns(cfg)
    fs.makedirs(f"{out}/{PARTS_DIR}", exist_ok=True)
    rows, stats = _part_stats(cfg, cfg.output.rstrip("/") + "/" + PARTS_DIR)
    stats = sorted((s for s in stats if s["rows"] > 0), key=lambda s: s["bucket"])
    manifest = {
        "version": MANIFEST_VERSION,
        "plan": _settings(cfg, PLAN_KEYS),
        "image": _settings(cfg, IMAGE_KEYS),
        "input_rows": rows,
        "duplicates_removed": sum(s["duplicates"] for s in stats),
        "captions_repaired": sum(s["captions_repaired"] for s in stats),
        "empty_captions": sum(s["empty_captions"] for s in stats),
        "shard_digits": max(5, len(str(len(stats) - 1))),
        # Keys are shard * 10**key_digits + row: wide enough for the largest part.
        "key_digits": max(1, math.ceil(math.log10(max(max(s["rows"] for s in stats), 2)))) if stats else 1,
        "parts": [{"shard": i, "file": f"{s['bucket']:08d}.parquet", "rows": s["rows"]} for i, s in enumerate(stats)],
    }
    # Rows of buckets that lost every row (all without URL) are not in `stats`: count them from the total.
    manifest["missing_url"] = rows - manifest["duplicates_removed"] - sum(p["rows"] for p in manifest["parts"])
    write_bytes_atomic(fs, manifest_path, json.dumps(manifest, indent=1).encode())
    return manifest
