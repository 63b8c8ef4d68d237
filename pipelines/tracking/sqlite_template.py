"""A new sqlite MLflow store from a copy of an empty one, instead of MLflow's own creation.

MLflow creates a sqlite store by running every schema migration since its first release: 4-6 s of CPU on 2 cores,
paid on the critical path of each job that opens a new store (a new user's first `make demo`, every test's
temporary store). The schema an MLflow version creates is always the same, so the first store is made once per
MLflow version in a cache folder (MLflow's own way) and copied for every new store after it: the copy opens at once.
The one row that depends on where a store is, the Default experiment's artifact location, is set as this project
sets every experiment's (`mlartifacts/` beside the store's file).
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import uuid
from pathlib import Path

PREFIX = "sqlite:///"


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "probvlp"


def _beside(path: Path) -> Path:
    """A new, unused name in `path`'s folder, to write a file whole before it takes `path`'s name."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.new")


def _template() -> Path:
    """The empty store of the installed MLflow version, made by MLflow once and kept."""
    from importlib.metadata import version

    path = _cache_dir() / f"mlflow-{version('mlflow')}-empty.db"
    if not path.exists():
        from mlflow import MlflowClient

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _beside(path)
        MlflowClient(f"{PREFIX}{tmp}").search_experiments()  # MLflow creates and migrates it
        os.replace(tmp, path)  # whole or not at all, whoever makes it first
    return path


def prepare_sqlite_store(uri: str, artifact_root: str | None) -> None:
    """Create the sqlite store of `uri` from the template where its file does not exist yet (any other URI, or an
    existing file: nothing done). `artifact_root`: the Default experiment's artifact folder's parent."""
    if not uri.startswith(PREFIX) or uri[len(PREFIX):] in ("", ":memory:"):
        return
    target = Path(uri[len(PREFIX):])
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        template = _template()
    except OSError:  # no writable cache folder (HOME elsewhere): MLflow creates the store itself, as always
        return
    tmp = _beside(target)
    try:
        shutil.copyfile(template, tmp)  # a new file, with the mode sqlite's own would have
        if artifact_root:
            db = sqlite3.connect(tmp)
            try:
                with db:
                    db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                               (f"{artifact_root.rstrip('/')}/0",))
            finally:
                db.close()
        try:
            os.link(tmp, target)  # fails where another process made the store meanwhile: theirs is kept
        except FileExistsError:
            pass
        except OSError:  # a filesystem without hard links: a rename, unless the store appeared meanwhile
            if not target.exists():
                os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
