"""A new sqlite MLflow store is a copy of an empty one (pipelines.tracking.sqlite_template): the same database MLflow makes, ready
at once, with the Default experiment's artifacts beside the store."""
from __future__ import annotations

import re
import sqlite3
import time

from mlflow import MlflowClient

from pipelines.tracking import tracking_uri


def schema(path) -> tuple[list, list]:
    """Every table, index and trigger with its SQL's clauses, and the alembic revision: what decides whether MLflow can
    use the store. The clauses as a set: MLflow's own creation lists a table's constraints in no fixed order."""
    db = sqlite3.connect(path)
    try:
        rows = db.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
        return (sorted((kind, name, sorted(c.strip() for c in re.split(r",\s*\n", sql or ""))) for kind, name, sql in rows),
                db.execute("SELECT version_num FROM alembic_version").fetchall())
    finally:
        db.close()


def test_a_new_store_is_the_database_mlflow_makes_and_opens_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the template made here, by MLflow, once
    made_by_mlflow = tmp_path / "mlflow_made" / "mlflow.db"
    made_by_mlflow.parent.mkdir()
    MlflowClient(f"sqlite:///{made_by_mlflow}").search_experiments()

    first = tracking_uri(f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}")  # makes the template, then copies it
    start = time.perf_counter()
    second = tracking_uri(f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}")
    copy_s = time.perf_counter() - start
    assert list((tmp_path / "cache" / "probvlp").glob("mlflow-*-empty.db"))
    for uri in (first, second):
        path = uri.removeprefix("sqlite:///")
        assert schema(path) == schema(made_by_mlflow)
        client = MlflowClient(uri)
        [default] = client.search_experiments()
        assert default.name == "Default" and default.artifact_location == (tmp_path / path.split("/")[-2] / "mlartifacts" / "0").as_uri()
        run = client.create_run(client.create_experiment("x"))
        client.log_metric(run.info.run_id, "loss", 1.5, step=3)
        assert client.get_metric_history(run.info.run_id, "loss")[0].value == 1.5
    print(f"a new store from the template: {copy_s * 1000:.0f} ms")


def test_an_existing_store_is_left_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    uri = tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("kept"))
    assert tracking_uri(uri) == uri
    assert MlflowClient(uri).get_run(run.info.run_id).info.experiment_id == run.info.experiment_id
    assert tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"  # a server: nothing made
