"""Local folders and fsspec object stores (s3://, gs://, ...) behind one set of small helpers."""
from __future__ import annotations

import contextlib
import json
import uuid

import fsspec


def fs_path(uri: str):
    """(filesystem, path without trailing slash) for a local path or an fsspec URI."""
    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path.rstrip("/")


def run_folder(storage_path: str, run_name: str) -> str:
    """Where a training run keeps its own records in its storage, beside Ray Train's checkpoints: the attempts'
    journal, rank 0's undelivered tracking calls, its MLflow run."""
    return f"{storage_path.rstrip('/')}/{run_name}/probvlp"


def outbox_folder(storage_path: str, run_name: str) -> str:
    """Where rank 0 of a training run (pretraining, the adapter) leaves the MLflow calls it has not delivered: at every
    checkpoint, as an attempt fails and at the end (pipelines.tracking.outbox). The next attempt's rank 0, on any node,
    and the driver find them there without the tracking store."""
    return f"{run_folder(storage_path, run_name)}/tracking_outbox"


def _protocol(fs) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def is_local(fs) -> bool:
    return _protocol(fs) in ("file", "local")


def uri(fs, path: str) -> str:
    """A path of `fs` as other processes open it: as it is on local disk, else with its protocol prefix."""
    return path if is_local(fs) else f"{_protocol(fs)}://{path}"


def total_bytes(uris: list[str]) -> int:
    total = 0
    for u in uris:
        fs, path = fs_path(u)
        total += fs.size(path) or 0
    return total


def write_bytes_atomic(fs, path: str, data: bytes) -> None:
    """Readers see the old file or the whole new one, never a partial write."""
    with open_atomic(fs, path) as f:
        f.write(data)


@contextlib.contextmanager
def open_atomic(fs, path: str):
    """A binary file to write `path` through, a piece at a time: readers see the old file or the whole new one,
    never a partial write (it is written beside, then moved; dropped where the writing fails)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with fs.open(tmp, "wb") as f:
            yield f
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp)
        raise
    fs.mv(tmp, path)


def write_json(uri: str, value) -> None:
    """`value` as JSON at `uri` (a local path or an fsspec URI), its folder made, written atomically."""
    fs, path = fs_path(uri)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    write_bytes_atomic(fs, path, json.dumps(value).encode())


def load_json(uri: str):
    """The JSON at `uri`, None where there is no such file."""
    fs, path = fs_path(uri)
    return read_json(fs, path)


def json_files(fs, folder: str, prefix: str = "") -> list[str]:
    """The paths of the whole JSON files in `folder` whose name starts with `prefix`, sorted: not a write in progress,
    nor one a kill cut short (open_atomic's `<name>.tmp-<id>` beside it, which may be empty)."""
    if not fs.exists(folder):
        return []
    names = sorted(fs.ls(folder, detail=False))
    return [n for n in names if (base := n.rsplit("/", 1)[-1]).startswith(prefix) and base.endswith(".json")]


def read_json(fs, path: str) -> dict | None:
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as f:
        return json.loads(f.read())
