"""The project's local state folder (pipelines.config.STATE_DIR: the default MLflow store, rank 0's tracking outboxes,
injected-failure markers, a sweep's rungs): $PROBVLP_HOME where set. tests/conftest.py sets it to a folder of the
pytest run's own, and fails a run that wrote into the checkout's .probvlp anyway (its pytest_sessionfinish, on
tests.helpers.files_under / written_between). Ray's workers see the same folder: tests/test_ray_env.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipelines.config import STATE_DIR
from tests.helpers import files_under, written_between
from tests.pace import scaled

ROOT = Path(__file__).resolve().parent.parent


def test_local_state_goes_to_the_runs_folder_not_the_checkout(monkeypatch):
    """The default MLflow store (no tracking.uri, no MLFLOW_TRACKING_URI) is made in $PROBVLP_HOME, where every
    STATE_DIR path lies; a fresh Python started in the checkout (a job, as the tests start them) finds the same."""
    from pipelines.tracking import OUTBOX_DIR, tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = tracking_uri()  # written first: where the folder is wrong, the session check names the file too
    home = Path(os.environ["PROBVLP_HOME"])
    assert uri == f"sqlite:///{home / 'mlflow.db'}" and (home / "mlflow.db").is_file()
    assert STATE_DIR == home and OUTBOX_DIR.parent == home and ROOT not in home.parents
    out = subprocess.run([sys.executable, "-c", "from pipelines.config import STATE_DIR; print(STATE_DIR)"], cwd=ROOT,
                         capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0 and out.stdout.strip() == str(home), out.stderr[-2000:]


def test_the_session_check_names_what_was_written(tmp_path):
    """What conftest compares: new files and folders, and files modified since (a folder's own time is not compared:
    it changes with every file made or removed in it)."""
    (tmp_path / "kept.txt").write_text("x")
    (tmp_path / "touched.txt").write_text("x")
    before = files_under(tmp_path)
    assert set(before) == {"kept.txt", "touched.txt"} and files_under(tmp_path / "absent") == {}
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "two_asha_rungs.json").write_text("{}")
    stamp = before["touched.txt"] + 10**9
    os.utime(tmp_path / "touched.txt", ns=(stamp, stamp))
    assert written_between(before, files_under(tmp_path)) == ["touched.txt", "tune", "tune/two_asha_rungs.json"]
    assert written_between(before, before) == []
