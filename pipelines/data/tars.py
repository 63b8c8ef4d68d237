"""Webdataset tar files read one file at a time, a broken file skipped, named and counted, never fatal.

A shard half-copied when a transfer died keeps the samples before the break; a file that is not a tar, an empty
file, or an object the store cannot serve (after its own retries) gives no sample. Each is reported once per read
of the file (once per epoch, or once for a cached set) to the reader's stats (`pipelines.data.stats`) with its
name and reason. `TarShards` is the Ray Data datasource (`ray.data.read_webdataset`'s output columns:
``__key__``, ``__url__`` and one bytes column per extension, None where a sample lacks it); `iter_tar_samples`
the same samples in a plain loop; `write_tar` writes such a file.
"""
from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path
from typing import Callable, Iterator

import fsspec
import numpy as np
import pandas as pd
import ray
import ray.data
from ray.data.datasource import FileBasedDatasource

from pipelines.cluster.check import only_here
from pipelines.data.stats import stats_actor

# key = everything before the first "." of the member's base name, directories included (webdataset's rule)
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")
CHUNK_ROWS = 512  # rows per block, as read_webdataset's


class BrokenFile(Exception):
    """A tar file that could not be read to its end: `reason` (one of FILE_REASONS), what was said, samples kept."""

    def __init__(self, reason: str, detail: str, kept: int):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.kept = reason, detail, kept


FILE_REASONS = ("truncated tar", "not a tar file", "empty file", "unreadable file")


class _Head:
    """A read-only stream that keeps its first bytes: enough to tell a cut tar from a file that never was one."""

    def __init__(self, f, keep: int = 512):
        self.f, self.keep, self.head = f, keep, b""

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        if len(self.head) < self.keep:
            self.head += data[: self.keep - len(self.head)]
        return data

    def looks_like_tar(self) -> bool:
        # POSIX / GNU tar headers carry "ustar" at 257; compressed tars start with their codec's magic
        return self.head[257:262] == b"ustar" or self.head[:2] == b"\x1f\x8b" or self.head[:3] in (b"BZh", b"\xfd7z")


def _file_reason(err: BaseException, head: _Head) -> str:
    if not head.head:
        return "empty file"
    if isinstance(err, (tarfile.TarError, EOFError, ValueError)):
        return "truncated tar" if head.looks_like_tar() else "not a tar file"
    return "unreadable file"


def tar_samples(fileobj) -> Iterator[dict]:
    """{"__key__": key, ext: bytes, ...} per sample of a tar stream, in order; BrokenFile (after the samples
    before the break) when the stream is not a whole tar. A sample cut by the break is not yielded."""
    kept, head = 0, _Head(fileobj)
    sample: dict | None = None
    try:
        with tarfile.open(fileobj=head, mode="r|*") as tar:
            for member in tar:
                if not member.isreg():
                    continue
                match = _KEY_EXT.match(member.name)
                if match is None:
                    continue
                key, ext = match.groups()
                if sample is not None and sample["__key__"] != key:  # complete: the next sample has begun
                    kept += 1
                    yield sample
                    sample = None
                if sample is None:
                    sample = {"__key__": key}
                sample[ext.lower()] = tar.extractfile(member).read()
    except Exception as err:  # noqa: BLE001 - whatever the stream or tarfile raise, the file is reported
        raise BrokenFile(_file_reason(err, head), f"{type(err).__name__}: {err}", kept) from None
    if sample is not None:
        yield sample


def iter_tar_samples(paths: list[str], limit: int | None = None,
                     on_broken: Callable[[str, BrokenFile], None] | None = None) -> Iterator[dict]:
    """Samples of tar files (local or fsspec paths), in order, keys without their folders; a broken file gives
    the samples before its break and is passed to `on_broken` (path, BrokenFile), never raised."""
    seen = 0
    for path in paths:
        try:
            with fsspec.open(path, "rb") as f:
                for sample in tar_samples(f):
                    yield {**sample, "__key__": sample["__key__"].rsplit("/", 1)[-1]}
                    seen += 1
                    if limit is not None and seen >= limit:
                        return
        except BrokenFile as err:
            if on_broken is not None:
                on_broken(path, err)
        except OSError as err:  # could not be opened
            if on_broken is not None:
                on_broken(path, BrokenFile("unreadable file", f"{type(err).__name__}: {err}", 0))


class _Unopened:
    """What `_open_input_source` hands on for a file the store could not open: `_read_stream` reports it."""

    def __init__(self, err: BaseException):
        self.err = err

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _block(rows: list[dict]):
    columns = list(dict.fromkeys(c for row in rows for c in row))
    # object columns with None where a sample lacks an extension (from_records would put NaN there)
    return pd.DataFrame({c: pd.Series([row.get(c) for row in rows], dtype=object) for c in columns})


class TarShards(FileBasedDatasource):
    """Webdataset .tar files -> blocks of raw samples; broken files reported to the stats actor under `stats_name`."""

    _FILE_EXTENSIONS = ["tar"]

    def __init__(self, paths: list[str], stats=None, stats_name: str | None = None, **kwargs):
        super().__init__(paths, **kwargs)
        self.stats, self.stats_name = stats, stats_name

    def _open_input_source(self, filesystem, path: str, **open_args):
        try:  # the filesystem wrapper has already retried the store's transient errors
            return super()._open_input_source(filesystem, path, **open_args)
        except Exception as err:  # noqa: BLE001 - reported by _read_stream, named
            return _Unopened(err)

    def _read_stream(self, f, path: str):
        if isinstance(f, _Unopened):
            self._report(path, BrokenFile("unreadable file", f"{type(f.err).__name__}: {f.err}", 0))
            return
        rows: list[dict] = []
        try:
            for sample in tar_samples(f):
                sample["__url__"] = path
                rows.append(sample)
                if len(rows) >= CHUNK_ROWS:
                    yield _block(rows)
                    rows = []
        except BrokenFile as err:
            self._report(path, err)
        if rows:
            yield _block(rows)

    def blocks(self, path: str):
        """The blocks of one file (local or fsspec URI), read in this process."""
        try:
            f = fsspec.open(path, "rb").open()
        except Exception as err:  # noqa: BLE001 - reported by _read_stream, named
            yield from self._read_stream(_Unopened(err), path)
            return
        with f:
            yield from self._read_stream(f, path)

    def _report(self, path: str, err: BrokenFile) -> None:
        print(f"[probvlp] skipped {'the rest of ' if err.kept else ''}{path}: {err.reason} after {err.kept} "
              f"samples ({err.detail})", flush=True)
        if self.stats is not None:
            ray.get(self.stats.add_file.remote(self.stats_name, path, err.reason, err.detail, err.kept))


def read_tar_shards(paths: list[str], stats_name: str | None = None, shuffle=None):
    """A Ray Dataset of the raw samples of webdataset .tar files (`TarShards`); `shuffle`: a FileShuffleConfig."""
    if only_here(paths):
        # this node's files on a cluster whose other nodes do not see them (the bundled digits, a small local set):
        # read here, and sent to the readers through Ray's object store
        return _read_here(paths, stats_name)
    return ray.data.read_datasource(TarShards(paths, stats_actor() if stats_name else None, stats_name,
                                              shuffle=shuffle))


def _read_here(paths: list[str], stats_name: str | None):
    """The samples of local tar files read in this process, as a dataset already in Ray's object store (block
    metadata computed here: no Ray task)."""
    return ray.data.from_blocks(blocks_here(paths, stats_name) or [_block([])])


def blocks_here(paths: list[str], stats_name: str | None = None) -> list:
    """The raw samples of tar files read in this process: each file's blocks of CHUNK_ROWS rows, in file order."""
    source = TarShards(paths, stats_actor() if stats_name else None, stats_name)
    return [block for path in paths for block in source.blocks(path)]


def cached_tar_shards(paths: list[str], stats_name: str | None = None, shuffle=None):
    """The raw samples of tar files small enough to keep (the readers' cache_max_mb, 512 MB by default), read once,
    in this process, into Ray's object store, in file order (`shuffle`: the order Ray Data's first read would draw).
    Each file's blocks of CHUNK_ROWS rows whatever cluster reads them, so that the same files give the same
    batches on one machine and from object storage (a Ray Data read splits its blocks by the cluster's size); and no
    Ray Data execution on a job's driver before its training starts (its actors and read tasks cost seconds, for
    files read here in well under one)."""
    return _read_here(shuffled_paths(paths, shuffle), stats_name)


def shuffled_paths(paths: list[str], shuffle=None) -> list[str]:
    """The files in the order Ray Data's first read would draw with `shuffle` (a FileShuffleConfig; None: as given)."""
    if shuffle is None:
        return list(paths)
    paths = list(paths)
    np.random.default_rng(shuffle.get_seed(0)).shuffle(paths)
    return paths


def write_tar(path: Path, samples: list[dict[str, bytes]]) -> None:
    """Samples {"__key__": key, ext: bytes} -> a webdataset tar (members key.ext, fixed mtime)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        for sample in samples:
            for ext, data in sample.items():
                if ext == "__key__":
                    continue
                info = tarfile.TarInfo(f"{sample['__key__']}.{ext}")
                info.size, info.mtime = len(data), 0
                tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)
