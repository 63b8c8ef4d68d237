"""Secrets never printed nor stored by the tracking code: `hide_credentials` on the forms a store's URI or an error's
text carries them in, and the outbox's lines and files while the store behind a URI with a password is away."""
from __future__ import annotations

import json
import socket

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from pipelines.tracking import hide_credentials, redact
from pipelines.tracking.outbox import Outbox
from tests.pace import scaled

SECRET = "s3cr3t"


@pytest.mark.parametrize("text, shown", [
    ("http://alice:s3cr3t@127.0.0.1:5000", "http://***@127.0.0.1:5000"),
    ("https://user:pw@mlflow.example/x", "https://***@mlflow.example/x"),
    ("API request to http://alice:s3cr3t@127.0.0.1:1/api/2.0/mlflow/runs/log-batch failed",
     "API request to http://***@127.0.0.1:1/api/2.0/mlflow/runs/log-batch failed"),
    ("https://s3cr3t@github.com/org/repo.git", "https://***@github.com/org/repo.git"),  # a token as the user
    ("postgresql://mlflow:s3cr3t@db:5432/mlflow", "postgresql://***@db:5432/mlflow"),
    ("https://mlflow.example/api?run_id=1&token=s3cr3t", "https://mlflow.example/api?run_id=1&token=***"),
    ("https://h/x?access_token=s3cr3t&page=2", "https://h/x?access_token=***&page=2"),
    ("postgresql://db/mlflow?user=ml&password=s3cr3t", "postgresql://db/mlflow?user=ml&password=***"),
    ("https://www.googleapis.com/x?key=s3cr3t", "https://www.googleapis.com/x?key=***"),
    ("https://a.blob.core.windows.net/c/f?sv=2022&sig=s3cr3t", "https://a.blob.core.windows.net/c/f?sv=2022&sig=***"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F2024&"
     "X-Amz-Security-Token=s3cr3t&X-Amz-Signature=s3cr3t (expired)",
     "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***&"
     "X-Amz-Security-Token=***&X-Amz-Signature=*** (expired)"),
    ("https://b.s3.amazonaws.com/k?AWSAccessKeyId=AKIA&Signature=s3cr3t&Expires=1",
     "https://b.s3.amazonaws.com/k?AWSAccessKeyId=***&Signature=***&Expires=1"),
    ("https://h/x?client_secret=s3cr3t#frag", "https://h/x?client_secret=***#frag"),
])
def test_credentials_are_hidden_in_every_form_a_uri_carries_them(text, shown):
    assert hide_credentials(text) == shown
    assert hide_credentials(shown) == shown  # hiding twice changes nothing


@pytest.mark.parametrize("text", [
    "s3://bucket/tokens/a@b", "alice@example.com wrote", "http://127.0.0.1:5000/api/2.0/mlflow/metrics/get-history?"
    "run_id=1&metric_key=loss", "file:///tmp/x@y", "MLflow refused metric loss at step 5", "//host/path",
])
def test_what_is_no_secret_is_left_as_it_is(text):
    assert hide_credentials(text) == text


def test_params_hide_secret_keys_and_secrets_in_values():
    shown = redact({"tracking.uri": "https://h/x?token=s3cr3t", "hf_token": "s3cr3t", "data.root": "s3://b/tokens"})
    assert shown == {"tracking.uri": "https://h/x?token=***", "hf_token": "***", "data.root": "s3://b/tokens"}


def test_the_outbox_never_prints_nor_keeps_the_password_of_a_store_that_is_away(tmp_path, capfd, monkeypatch):
    """A store behind http://alice:s3cr3t@127.0.0.1:PORT that refuses every connection: the outbox's lines (its
    outage's, its end's) and what it keeps for a later delivery hold no password, though MLflow's errors name the URI
    the client was given."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as held:  # a port bound and never listened on: every connection refused
        held.bind(("127.0.0.1", 0))
        uri = f"http://alice:{SECRET}@127.0.0.1:{held.getsockname()[1]}"
        outbox = Outbox(MlflowClient(uri), "0" * 32, uri, tmp_path / "outbox")
        outbox.put_metrics([Metric("loss", 1.0, 1, 1)])
        outbox.wait(scaled(5))
        report = outbox.close(1, 0, keep_to=str(tmp_path / "kept"))
    out, err = capfd.readouterr()
    assert report.kept_in == str(tmp_path / "kept") and report.outages == 1
    assert "unreachable" in out and "http://***@127.0.0.1" in out, out
    assert SECRET not in out + err, out + err
    for path in (tmp_path / "kept").rglob("*.jsonl"):
        assert SECRET not in path.read_text(), path
    assert json.loads((tmp_path / "kept" / "pending.jsonl").read_text().splitlines()[0])["uri"].startswith(
        "http://***@")
