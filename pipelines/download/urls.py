"""The download's input: a URL table (parquet / csv / tsv / jsonl; a file, a folder or a glob; local or fsspec).

URL and caption columns are read as bytes, so that a caption that is not valid UTF-8 is repaired
downstream rather than failing the read; jsonl is parsed here for the same reason.
"""
from __future__ import annotations

import csv
import json
import os

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import ray.data

from pipelines.download.config import DownloadConfig
from pipelines.storage import fs_path, uri

FORMATS = {".parquet": "parquet", ".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl"}


class DownloadError(RuntimeError):
    """A problem with the input or the output folder, phrased as one line."""


def input_files(cfg: DownloadConfig) -> tuple[list[str], str]:
    """The table's files (fsspec URIs for remote stores) and their format."""
    fs, path = fs_path(cfg.input)
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
    return [uri(fs, p) for p in files], fmt


def _text_columns(cfg: DownloadConfig) -> list[str]:
    return [cfg.url_col] + ([cfg.caption_col] if cfg.caption_col else [])


def _columns(cfg: DownloadConfig) -> list[str]:
    return _text_columns(cfg) + list(cfg.additional_columns)


def _csv_options(cfg: DownloadConfig, fmt: str) -> dict:
    """pyarrow.csv options shared by the Ray Data and the in-process reader, so both give the same table."""
    return dict(
        parse_options=pacsv.ParseOptions(delimiter="\t" if fmt == "tsv" else ",", newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(column_types={c: pa.binary() for c in _text_columns(cfg)},
                                             include_columns=_columns(cfg)),
    )


def read_table(cfg: DownloadConfig):
    """Ray Dataset of the URL table: url and caption as binary (decoded later), additional columns as they are."""
    files, fmt = input_files(cfg)
    wanted = _columns(cfg)
    if fmt == "parquet":
        return ray.data.read_parquet(files, columns=wanted)
    if fmt in ("csv", "tsv"):
        return ray.data.read_csv(files, **_csv_options(cfg, fmt))
    return ray.data.read_binary_files(files).flat_map(_jsonl_rows, fn_kwargs={"columns": wanted})


def read_table_local(cfg: DownloadConfig) -> pa.Table:
    """The same table as `read_table`, read in this process (small inputs)."""
    files, fmt = input_files(cfg)
    wanted = _columns(cfg)
    tables = []
    for file in files:
        fs, path = fs_path(file)
        with fs.open(path, "rb") as f:
            if fmt == "parquet":
                tables.append(pq.read_table(f, columns=wanted))
            elif fmt in ("csv", "tsv"):
                tables.append(pacsv.read_csv(f, **_csv_options(cfg, fmt)))
            else:
                tables.append(pa.Table.from_pylist(_jsonl_rows({"bytes": f.read()}, wanted)))
    return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]


def check_columns(cfg: DownloadConfig) -> None:
    """Fail before any Ray work when the first file lacks a configured column."""
    files, fmt = input_files(cfg)
    fs, path = fs_path(files[0])
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
                delimiter = "\t" if fmt == "tsv" else ","
                names = next(csv.reader([first.decode("utf-8", errors="replace")], delimiter=delimiter), [])
    absent = [c for c in _columns(cfg) if c not in names]
    if absent:
        raise DownloadError(f"download: column(s) {', '.join(absent)} not in {files[0]} (has {', '.join(names)})")


def _jsonl_rows(row: dict, columns: list[str]) -> list[dict]:
    """One file's bytes -> its records; a line that is not JSON becomes a row of nulls (counted as no URL)."""
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
