"""Download a URL table into webdataset shards with img2dataset, spread over the Ray cluster.

Stages (what was chosen, and why):

1. **Plan** (Ray Data). The table (parquet / csv / tsv / jsonl; local or fsspec URI) is read with Ray
   Data. URL and caption columns are read as bytes and decoded as UTF-8, with replacement characters
   where a caption is not valid UTF-8 (counted, never fatal). Every row goes to bucket
   ``blake2b(url) % B`` with ``B = ceil(rows / rows_per_shard)``, so all copies of a URL meet in one
   bucket; a ``groupby(bucket).map_groups`` sorts each bucket by (url, caption) and keeps the first row
   of every URL (so a duplicated URL keeps its lexicographically first caption, whatever the file and
   block layout) and writes it as ``_parts/BBBBB.parquet``. Parts are therefore deterministic
   functions of the table: about ``rows_per_shard`` rows each, one part per output shard. A manifest
   (``_parts/_manifest.json``, written last) records the parts and the settings; a re-run reuses it,
   and a re-run with a different table or different image settings into the same folder is refused.
2. **Download** (Ray tasks). One task per part not yet finished runs img2dataset's own per-shard
   worker (``img2dataset.downloader.Downloader``, fetch threads + resize + ``WebDatasetSampleWriter`` +
   ``_stats.json``) with the part's shard id, so sample keys are unique across shards. We do not call
   ``img2dataset.download()``: its spawn-based process pool can hang when a child crashes (FACTS.md),
   it would number every part's shard 0, and each call costs a few seconds of imports; here Ray's
   worker processes are the processes and the imports are paid once per worker. The task writes into
   ``_tmp/NNNNN/`` and moves ``.tar``, ``.parquet`` and finally ``_stats.json`` into place, so a shard
   counts as finished only once complete: a re-run skips shards whose ``.tar`` and ``_stats.json``
   exist and downloads the rest. A driver-side watchdog cancels (force-kills) a part running longer
   than ``part_timeout_s``; a part that raises, crashes its worker or times out is counted as failed
   (its rows under ``part failed: ...``) and retried by the next run. Nothing else stops the run.
3. **Summary**: input rows, duplicates removed, rows without URL, written, failed by reason (merged
   per-shard ``status_dict``s of all finished shards plus failed parts), shard counts and throughput;
   printed, saved as ``_summary.json``, and logged to MLflow by ``jobs.download`` when tracking is set.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from pipelines.config import DownloadConfig

MANIFEST_VERSION = 1
PARTS_DIR, TMP_DIR = "_parts", "_tmp"
SUMMARY_FILE = "_summary.json"
# Settings that decide which rows go to which part (a change means a different plan).
PLAN_KEYS = ("input", "input_format", "url_col", "caption_col", "additional_columns", "rows_per_shard")
# Settings that decide what a finished shard holds (mixing them in one folder is refused).
IMAGE_KEYS = ("image_size", "resize_mode", "encode_format", "encode_quality", "min_image_size", "max_image_area",
              "compute_hash", "extract_exif")
FORMATS = {".parquet": "parquet", ".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl"}


class DownloadError(RuntimeError):
    """A problem with the input or the output folder, phrased as one line."""


# ----------------------------------------------------------------------------------------- files


def _fs(uri: str):
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path.rstrip("/")


def _is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def _write_bytes_atomic(fs, path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


def _read_json(fs, path: str) -> dict | None:
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as f:
        return json.loads(f.read())


def input_files(cfg: DownloadConfig) -> tuple[list[str], str]:
    """The table's files (fsspec URIs for remote stores) and their format."""
    fs, path = _fs(cfg.input)
    if any(ch in path for ch in "*?["):
        files = sorted(fs.glob(path))
    elif fs.isdir(path):
        files = sorted(p for p in fs.find(path) if os.path.splitext(p)[1].lower() in FORMATS
                       and not os.path.basename(p).startswith(("_", ".")))
    elif fs.exists(path):
        files = [path]
    else:
        raise DownloadError(f"download.input: no such file or folder: {cfg.input}")
    if not files:
        raise DownloadError(f"download.input: no .parquet/.csv/.tsv/.jsonl files under {cfg.input}")
    fmt = cfg.input_format
    if fmt == "auto":
        found = {FORMATS.get(os.path.splitext(p)[1].lower()) for p in files}
        if len(found) != 1 or None in found:
            raise DownloadError(f"download.input_format: cannot tell the format of {cfg.input} from its file "
                                "extensions; set input_format")
        fmt = found.pop()
    if not _is_local(fs):
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        files = [f"{protocol}://{p}" for p in files]
    return files, fmt


# ----------------------------------------------------------------------------------------- plan


def read_table(cfg: DownloadConfig):
    """Ray Dataset of the URL table: url and caption as binary (decoded later), additional columns as they are."""
    import pyarrow.csv as pacsv
    import ray.data

    files, fmt = input_files(cfg)
    wanted = [cfg.url_col] + ([cfg.caption_col] if cfg.caption_col else []) + list(cfg.additional_columns)
    if fmt == "parquet":
        ds = ray.data.read_parquet(files, columns=wanted)
    elif fmt in ("csv", "tsv"):
        text_cols = [cfg.url_col] + ([cfg.caption_col] if cfg.caption_col else [])
        ds = ray.data.read_csv(
            files, parse_options=pacsv.ParseOptions(delimiter="\t" if fmt == "tsv" else ",", newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(column_types={c: pa.binary() for c in text_cols},
                                                 include_columns=wanted),
        )
    else:  # jsonl: parsed here so that a line with invalid UTF-8 in a caption is repaired, not fatal
        ds = ray.data.read_binary_files(files).flat_map(_jsonl_rows, fn_kwargs={"columns": wanted})
    return ds


def planner(cfg: DownloadConfig) -> str:
    """ray_data for big tables; small ones (< plan_local_max_mb of files) are planned in the driver."""
    if cfg.planner != "auto":
        return cfg.planner
    files, _ = input_files(cfg)
    fs, _ = _fs(cfg.input)
    size = sum(fs.size(_fs(f)[1]) or 0 for f in files)
    return "driver" if size <= cfg.plan_local_max_mb * 2**20 else "ray_data"


def read_table_local(cfg: DownloadConfig) -> pa.Table:
    """The same table as `read_table`, read in this process (small inputs)."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    files, fmt = input_files(cfg)
    wanted = [cfg.url_col] + ([cfg.caption_col] if cfg.caption_col else []) + list(cfg.additional_columns)
    tables = []
    for uri in files:
        fs, path = _fs(uri)
        with fs.open(path, "rb") as f:
            if fmt == "parquet":
                tables.append(pq.read_table(f, columns=wanted))
            elif fmt in ("csv", "tsv"):
                text_cols = [cfg.url_col] + ([cfg.caption_col] if cfg.caption_col else [])
                tables.append(pacsv.read_csv(
                    f, parse_options=pacsv.ParseOptions(delimiter="\t" if fmt == "tsv" else ",",
                                                        newlines_in_values=True),
                    convert_options=pacsv.ConvertOptions(column_types={c: pa.binary() for c in text_cols},
                                                         include_columns=wanted)))
            else:
                tables.append(pa.Table.from_pylist(_jsonl_rows({"bytes": f.read()}, wanted)))
    return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]


def check_columns(cfg: DownloadConfig) -> None:
    """Fail before any Ray work when the first file lacks a configured column."""
    import pyarrow.parquet as pq

    files, fmt = input_files(cfg)
    fs, path = _fs(files[0])
    with fs.open(path, "rb") as f:
        if fmt == "parquet":
            names = pq.read_schema(f).names
        else:
            first = f.readline()
            if fmt == "jsonl":
                try:
                    names = list(json.loads(first.decode("utf-8", errors="replace")))
                except ValueError:
                    raise DownloadError(f"download.input: first line of {files[0]} is not a JSON object") from None
            else:
                import csv

                delimiter = "\t" if fmt == "tsv" else ","
                names = next(csv.reader([first.decode("utf-8", errors="replace")], delimiter=delimiter), [])
    needed = [cfg.url_col] + ([cfg.caption_col] if cfg.caption_col else []) + list(cfg.additional_columns)
    absent = [c for c in needed if c not in names]
    if absent:
        raise DownloadError(f"download: column(s) {', '.join(absent)} not in {files[0]} (has {', '.join(names)})")


def _jsonl_rows(row: dict, columns: list[str]) -> list[dict]:
    out = []
    for line in row["bytes"].splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8", errors="replace"))
        except ValueError:
            record = {}
        out.append({c: record.get(c) for c in columns})
    return out


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
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

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
        fs, parts_dir = _fs(parts_uri)
        sink = pa.BufferOutputStream()
        pq.write_table(part, sink)
        _write_bytes_atomic(fs, f"{parts_dir}/{bucket:08d}.parquet", sink.getvalue().to_pybytes())
    return pa.table({k: [v] for k, v in stats.items()})


def _settings(cfg: DownloadConfig, keys: tuple[str, ...]) -> dict[str, Any]:
    data = cfg.model_dump(mode="json")
    return {k: data[k] for k in keys}


def plan(cfg: DownloadConfig) -> dict[str, Any]:
    """Read, de-duplicate and split the table into parts; reuse the manifest of an earlier run."""
    import ray

    fs, out = _fs(cfg.output)
    manifest_path = f"{out}/{PARTS_DIR}/_manifest.json"
    manifest = _read_json(fs, manifest_path)
    if manifest is not None:
        for section, keys in (("plan", PLAN_KEYS), ("image", IMAGE_KEYS)):
            if manifest.get(section) != _settings(cfg, keys):
                diff = [k for k in keys if manifest.get(section, {}).get(k) != _settings(cfg, keys)[k]]
                raise DownloadError(f"download.output {cfg.output} holds a download with different "
                                    f"{', '.join(diff)}; use a new output folder or delete it")
        return manifest

    check_columns(cfg)
    parts_uri = cfg.output.rstrip("/") + "/" + PARTS_DIR
    fs.makedirs(f"{out}/{PARTS_DIR}", exist_ok=True)
    normalize = dict(url_col=cfg.url_col, caption_col=cfg.caption_col, extras=list(cfg.additional_columns))
    write = dict(parts_uri=parts_uri, has_caption=cfg.caption_col is not None)
    if planner(cfg) == "ray_data":
        ds = read_table(cfg)
        rows = ds.count()
        if rows == 0:
            raise DownloadError(f"download.input: {cfg.input} has no rows")
        buckets = max(1, math.ceil(rows / cfg.rows_per_shard))
        cpus = int(ray.cluster_resources().get("CPU", 1))
        partitions = max(1, min(buckets, max(cpus, math.ceil(rows / 1_000_000))))
        stats = (
            ds.map_batches(_normalize, batch_format="pyarrow", fn_kwargs=dict(normalize, buckets=buckets))
            .groupby("_bucket", num_partitions=partitions)
            .map_groups(_write_part, batch_format="pyarrow", fn_kwargs=write)
            .take_all()
        )
    else:  # the same functions in this process: identical parts, without Ray Data's start-up cost
        table = read_table_local(cfg)
        rows = table.num_rows
        if rows == 0:
            raise DownloadError(f"download.input: {cfg.input} has no rows")
        buckets = max(1, math.ceil(rows / cfg.rows_per_shard))
        table = _normalize(table, buckets=buckets, **normalize).sort_by("_bucket")
        ids = table["_bucket"].to_numpy()
        bounds = np.flatnonzero(np.diff(ids)) + 1
        stats = []
        for start, stop in zip(np.r_[0, bounds], np.r_[bounds, len(ids)]):
            stats += _write_part(table.slice(start, stop - start), **write).to_pylist()
    stats = sorted((s for s in stats if s["rows"] > 0), key=lambda s: s["bucket"])
    digits = max(5, len(str(len(stats) - 1)))
    manifest = {
        "version": MANIFEST_VERSION,
        "plan": _settings(cfg, PLAN_KEYS),
        "image": _settings(cfg, IMAGE_KEYS),
        "input_rows": rows,
        "duplicates_removed": sum(s["duplicates"] for s in stats),
        "captions_repaired": sum(s["captions_repaired"] for s in stats),
        "empty_captions": sum(s["empty_captions"] for s in stats),
        "shard_digits": digits,
        # Keys are shard * 10**key_digits + row: wide enough for the largest part.
        "key_digits": max(1, math.ceil(math.log10(max(max(s["rows"] for s in stats), 2)))) if stats else 1,
        "parts": [{"shard": i, "file": f"{s['bucket']:08d}.parquet", "rows": s["rows"]} for i, s in enumerate(stats)],
    }
    # Rows of buckets that lost every row (all without URL) are not in `stats`: count them from the total.
    manifest["missing_url"] = rows - manifest["duplicates_removed"] - sum(p["rows"] for p in manifest["parts"])
    _write_bytes_atomic(fs, manifest_path, json.dumps(manifest, indent=1).encode())
    return manifest


# ----------------------------------------------------------------------------------------- download


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


def download_part(settings: dict[str, Any], part: dict[str, Any], shard_digits: int, key_digits: int) -> dict:
    """Runs in a Ray worker: img2dataset's per-shard downloader on one part, then move the shard into place."""
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # albumentations would check PyPI on import
    import pyarrow.parquet as pq
    from img2dataset.downloader import Downloader
    from img2dataset.resizer import Resizer
    from img2dataset.writer import WebDatasetSampleWriter

    cfg = DownloadConfig.model_validate(settings)
    t0 = time.perf_counter()
    shard = part["shard"]
    name = shard_name(shard, shard_digits)
    fs, out = _fs(cfg.output)
    tmp = f"{out}/{TMP_DIR}/{name}"
    if fs.exists(tmp):
        fs.rm(tmp, recursive=True)  # left by an interrupted run
    fs.makedirs(tmp, exist_ok=True)
    with fs.open(f"{out}/{PARTS_DIR}/{part['file']}", "rb") as f:
        table = pq.read_table(f)
    columns = list(cfg.additional_columns) + (["caption"] if cfg.caption_col else []) + ["url"]
    feather = f"{tmp}/{name}.feather"
    with fs.open(feather, "wb") as f, pa.ipc.new_file(f, table.select(columns).schema) as writer:
        writer.write_table(table.select(columns))
    resizer = Resizer(
        image_size=cfg.image_size, resize_mode=cfg.resize_mode, resize_only_if_bigger=False,
        encode_quality=cfg.encode_quality if cfg.encode_quality is not None else 9 if cfg.encode_format == "png" else 95,
        encode_format=cfg.encode_format, min_image_size=cfg.min_image_size,
        max_image_area=cfg.max_image_area if cfg.max_image_area is not None else float("inf"),
    )
    tmp_uri = tmp if _is_local(fs) else f"{fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]}://{tmp}"
    downloader = Downloader(
        sample_writer_class=WebDatasetSampleWriter, resizer=resizer, thread_count=cfg.threads_per_task,
        save_caption=cfg.caption_col is not None, extract_exif=cfg.extract_exif, output_folder=tmp_uri,
        column_list=columns, timeout=cfg.timeout, number_sample_per_shard=10**key_digits,
        oom_shard_count=shard_digits, compute_hash=cfg.compute_hash, verify_hash_type=None,
        encode_format=cfg.encode_format, retries=cfg.retries, user_agent_token=cfg.user_agent_token,
        disallowed_header_directives=cfg.disallowed_header_directives or None,
    )
    feather_uri = feather if _is_local(fs) else f"{tmp_uri}/{name}.feather"
    ok, _ = downloader((shard, feather_uri))
    if not ok:
        return asdict(PartResult(shard, part["rows"], False, error="img2dataset shard error (see worker log)",
                                 seconds=time.perf_counter() - t0))
    # The stats file last: a shard is finished once its _stats.json sits next to its .tar.
    for suffix in (".tar", ".parquet", "_stats.json"):
        fs.mv(f"{tmp}/{name}{suffix}", f"{out}/{name}{suffix}")
    fs.rm(tmp, recursive=True)
    stats = _read_json(fs, f"{out}/{name}_stats.json")
    return asdict(PartResult(shard, part["rows"], True, stats=stats, seconds=time.perf_counter() - t0))


def _slots(cfg: DownloadConfig) -> int:
    import ray

    if cfg.max_parts_in_flight:
        return cfg.max_parts_in_flight
    return max(1, int(ray.cluster_resources().get("CPU", 1) // cfg.cpus_per_task))


def run_parts(cfg: DownloadConfig, manifest: dict, todo: list[dict], local_only: bool = False,
              log=print) -> list[PartResult]:
    """Run the parts as Ray tasks with a bounded number in flight and a per-part watchdog."""
    import ray
    from ray.exceptions import RayError

    options: dict[str, Any] = {"num_cpus": cfg.cpus_per_task, "max_retries": 1, "retry_exceptions": False}
    if local_only:  # URLs on this machine's loopback: keep the tasks on this node
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                        soft=False)
    task = ray.remote(download_part).options(**options)
    settings = cfg.model_dump(mode="json")
    from pipelines.progress import ProgressLine

    pending, inflight, results = list(todo), {}, []
    progress = ProgressLine("download", len(todo), unit="part")
    progress.line(0)  # the clock starts with the first part
    while pending or inflight:
        while pending and len(inflight) < _slots(cfg):
            part = pending.pop(0)
            ref = task.remote(settings, part, manifest["shard_digits"], manifest["key_digits"])
            inflight[ref] = (part, time.monotonic())
        ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
        for ref in ready:
            part, started = inflight.pop(ref)
            try:
                result = PartResult(**ray.get(ref))
            except RayError as err:
                first = str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__
                result = PartResult(part["shard"], part["rows"], False, error=f"{type(err).__name__}: {first}",
                                    seconds=time.monotonic() - started)
            results.append(result)
            _log_part(log, progress, result, len(results), manifest["shard_digits"])
        now = time.monotonic()
        for ref, (part, started) in list(inflight.items()):
            if now - started > cfg.part_timeout_s:
                ray.cancel(ref, force=True)
                del inflight[ref]
                result = PartResult(part["shard"], part["rows"], False, seconds=now - started,
                                    error=f"timed out after {cfg.part_timeout_s:g}s")
                results.append(result)
                _log_part(log, progress, result, len(results), manifest["shard_digits"])
    return results


def _log_part(log, progress, r: PartResult, done: int, digits: int) -> None:
    name = shard_name(r.shard, digits)
    if r.ok:
        s = r.stats
        shard = f"{name}: {s.get('successes', 0)}/{s.get('count', 0)} written in {r.seconds:.1f}s"
    else:
        shard = f"{name}: FAILED ({r.error}); its {r.rows} URLs count as failed, re-run to retry"
    log(progress.line(done, shard=shard))


# ----------------------------------------------------------------------------------------- summary


def summarize(cfg: DownloadConfig, manifest: dict, results: list[PartResult], skipped: int,
              seconds: float) -> dict[str, Any]:
    fs, out = _fs(cfg.output)
    reasons: Counter = Counter()
    written = complete = 0
    failed_parts = {r.shard: r for r in results if not r.ok}
    incomplete_rows = 0
    for part in manifest["parts"]:
        name = shard_name(part["shard"], manifest["shard_digits"])
        stats = _read_json(fs, f"{out}/{name}_stats.json") if shard_done(fs, out, name) else None
        if stats is None:
            r = failed_parts.get(part["shard"])
            reasons[f"part failed: {r.error}" if r else "not downloaded yet"] += part["rows"]
            incomplete_rows += part["rows"]
            continue
        complete += 1
        written += int(stats.get("successes", 0))
        for reason, n in (stats.get("status_dict") or {}).items():
            if reason != "success":
                reasons[reason] += int(n)
    this_run = sum(int(r.stats.get("count", 0)) for r in results if r.ok)
    written_this_run = sum(int(r.stats.get("successes", 0)) for r in results if r.ok)
    unique = sum(p["rows"] for p in manifest["parts"])
    return {
        "input": cfg.input,
        "output": cfg.output,
        "input_rows": manifest["input_rows"],
        "duplicates_removed": manifest["duplicates_removed"],
        "missing_url": manifest["missing_url"],
        "unique_urls": unique,
        "written": written,
        "failed": unique - written,
        "failed_by_reason": dict(reasons.most_common()),
        "captions_repaired": manifest["captions_repaired"],
        "empty_captions": manifest["empty_captions"],
        "shards": len(manifest["parts"]),
        "shards_complete": complete,
        "shards_skipped": skipped,
        "shards_downloaded": sum(r.ok for r in results),
        "shards_failed": len(failed_parts),
        "urls_fetched_this_run": this_run,
        "written_this_run": written_this_run,
        "seconds": round(seconds, 3),
        "images_per_s": round(written_this_run / seconds, 2) if seconds > 0 else 0.0,
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"download summary for {s['output']}",
        f"  input rows {s['input_rows']}, duplicates removed {s['duplicates_removed']}, "
        f"rows without URL {s['missing_url']}, unique URLs {s['unique_urls']}",
        f"  written {s['written']}, failed {s['failed']}",
    ]
    lines += [f"    {n:>8}  {reason}" for reason, n in s["failed_by_reason"].items()]
    lines.append(f"  shards {s['shards_complete']}/{s['shards']} complete (this run: {s['shards_downloaded']} "
                 f"downloaded, {s['shards_skipped']} already finished, {s['shards_failed']} failed)")
    lines.append(f"  captions repaired (not UTF-8) {s['captions_repaired']}, empty captions {s['empty_captions']}")
    lines.append(f"  {s['written_this_run']} images written this run in {s['seconds']:.1f}s "
                 f"({s['images_per_s']:.1f} images/s)")
    if s["shards_complete"] < s["shards"]:
        lines.append("  some shards are incomplete: run the same command again to finish them")
    return "\n".join(lines)


def run_download(cfg: DownloadConfig, local_only: bool = False, log=print) -> dict[str, Any]:
    """Plan (or reuse the plan), download every unfinished part, write and return the summary.

    Needs a running Ray (`pipelines.ray_env.init_ray`). `local_only` pins the tasks to this node
    (for URLs served on this machine's loopback).
    """
    t0 = time.perf_counter()
    fs, out = _fs(cfg.output)
    fs.makedirs(out, exist_ok=True)
    manifest = plan(cfg)
    todo, skipped = [], 0
    for part in manifest["parts"]:
        if shard_done(fs, out, shard_name(part["shard"], manifest["shard_digits"])):
            skipped += 1
        else:
            todo.append(part)
    log(f"{len(manifest['parts'])} shards planned from {manifest['input_rows']} rows: {skipped} already finished, "
        f"{len(todo)} to download")
    t1 = time.perf_counter()
    results = run_parts(cfg, manifest, todo, local_only=local_only, log=log)
    summary = summarize(cfg, manifest, results, skipped, time.perf_counter() - t1)
    summary["plan_seconds"] = round(t1 - t0, 3)
    if fs.exists(f"{out}/{TMP_DIR}") and not fs.ls(f"{out}/{TMP_DIR}"):
        fs.rm(f"{out}/{TMP_DIR}", recursive=True)
    _write_bytes_atomic(fs, f"{out}/{SUMMARY_FILE}", json.dumps(summary, indent=1).encode())
    return summary


def shard_tars(output: str) -> list[str]:
    """The finished shards' .tar paths (what a reader should be given), as URIs for remote stores."""
    fs, out = _fs(output)
    names = sorted(p for p in fs.glob(f"{out}/*.tar"))
    done = [p for p in names if fs.exists(p[: -len(".tar")] + "_stats.json")]
    if _is_local(fs):
        return done
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return [f"{protocol}://{p}" for p in done]
