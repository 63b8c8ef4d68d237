"""Secrets never printed nor stored: `hide_credentials` on the forms a store's URI or an error's text carries them in,
a config's secrets hidden at any depth, the outbox's lines and files while the store behind a URI with a password is
away, and a whole job through an outage, a failure and a resume, searched everywhere a secret could end up."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from mlflow.entities import Metric

from pipelines.tracking import hide_credentials, redact, redact_yaml
from pipelines.tracking.outbox import Outbox
from tests.helpers import wait_for
from tests.pace import scaled
from tests.small_runs import SMALL, audited

ROOT = Path(__file__).resolve().parent.parent

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


def test_a_config_keeps_no_secret_at_any_depth():
    """The run's config.yaml (and a resume's, and a sweep's best config) as MLflow gets it: secret-looking keys hidden
    wherever they sit, credentials hidden in every string, the rest as it was (its order too)."""
    text = yaml.safe_dump({"tracking": {"uri": f"http://alice:{SECRET}@h:5000/gw?token={SECRET}"},
                           "data": {"root": "s3://b/data", "headers": {"api_key": SECRET}},
                           "eval": {"tasks": [{"name": "t", "data": f"https://h/x?sig={SECRET}"}]},
                           "model": {"overrides": {"mixture_tokens": 4}}}, sort_keys=False)
    shown = redact_yaml(text)
    assert SECRET not in shown
    assert yaml.safe_load(shown) == {"tracking": {"uri": "http://***@h:5000/gw?token=***"},
                                     "data": {"root": "s3://b/data", "headers": {"api_key": "***"}},
                                     "eval": {"tasks": [{"name": "t", "data": "https://h/x?sig=***"}]},
                                     "model": {"overrides": {"mixture_tokens": 4}}}
    assert redact_yaml(f"not: [a mapping\nhttp://u:{SECRET}@h") == "not: [a mapping\nhttp://***@h"


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


def test_a_credential_on_the_command_line_gets_a_warning_that_hides_it(capsys):
    from jobs.cli import config_parser

    parser = config_parser("jobs.pretrain", "doc", "the config", "train.steps=10")
    args = parser.parse_args(["--config", "c.yaml", "--set", "train.steps=10", "--set",
                              f"tracking.uri=http://alice:{SECRET}@h:5000", "--set", "data.root=s3://b/x@y"])
    assert args.overrides == ["train.steps=10", f"tracking.uri=http://alice:{SECRET}@h:5000", "data.root=s3://b/x@y"]
    [warning] = capsys.readouterr().err.splitlines()
    assert warning.startswith("warning: --set tracking.uri=http://***@h:5000 carries credentials") and \
        SECRET not in warning and "MLFLOW_TRACKING_URI" in warning


def _job(log: Path, overrides: list[str], env: dict[str, str], config: Path = ROOT / "configs" / "demo.yaml"
         ) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jobs.pretrain", "--config", str(config),
                             *(a for kv in overrides for a in ("--set", kv))],
                            cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _holding(folder: Path, secrets: dict[str, str]) -> list[str]:
    """Each file under `folder` that holds one of `secrets` (its bytes, any encoding a log writes), with which."""
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            found += [f"{path} holds the {what}" for what, secret in secrets.items() if secret.encode() in data]
    return found


# In the tier run alone (`make test-cluster`): two jobs of their own Ray, each a minute or more.
@pytest.mark.slow
@pytest.mark.cluster
def test_no_secret_reaches_a_log_a_run_or_rays_state_through_an_outage_a_failure_and_a_resume(
        digits_root, tmp_path, proxied_mlflow, proxy_store):
    """A password, a token as the URI's user and a token in its query (a gateway that takes one), and an AWS secret in
    the environment. The first job runs with the password's URI; its store answers 502 pages from step 12 (an
    outage: the outbox's lines print the failing calls' URLs), its one worker fails at step 25 (run.max_failures=0: the
    job fails, the store still away: the FAILED status is kept). The second command resumes the run with the token's
    URI and the store back, and ends it. Then none of the secrets is in: either job's console, any file of Ray's logs
    folder (every process's log, and Ray Train's run state as its export events write it: its loop config, runtime
    env and settings), the run's storage, the MLflow run's params, tags or any artifact (config.yaml, the resume's)."""
    secrets = {"password": f"pw{uuid.uuid4().hex[:12]}", "host token": f"ht{uuid.uuid4().hex[:12]}",
               "query token": f"qt{uuid.uuid4().hex[:12]}", "AWS secret": f"aws{uuid.uuid4().hex[:12]}"}
    port = proxy_store.port
    with_password = f"http://alice:{secrets['password']}@127.0.0.1:{port}/gw?token={secrets['query token']}"
    with_token = f"http://{secrets['host token']}@127.0.0.1:{port}/gw?token={secrets['query token']}"
    logs = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))  # Ray's temp folder, short: its socket paths
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": str(logs),
           "AWS_SECRET_ACCESS_KEY": secrets["AWS secret"], "AWS_ACCESS_KEY_ID": "probvlp-test",
           "RAY_TRAIN_ENABLE_STATE_TRACKING": "1", "RAY_enable_export_api_write": "1", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    audit, storage = tmp_path / "steps.txt", tmp_path / "ray"
    common = [f"data.root={digits_root}", f"run.storage_path={storage}", "run.name=secrets",
              "run.experiment=test-secrets", *SMALL, "train.steps=40", "train.checkpoint_every=10",
              "train.log_every=1", "train.num_workers=1", "run.max_failures=0", f"run.audit_steps_to={audit}"]
    # the ways a URI with credentials should come: the environment, then a config file (not the command line, which
    # every user of the machine sees and Ray keeps: the job warns of it, test_a_credential_on_the_command_line_...)
    with_token_config = tmp_path / "with_token.yaml"
    document = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    document.setdefault("tracking", {})["uri"] = with_token
    with_token_config.write_text(yaml.safe_dump(document, sort_keys=False))
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    job = _job(first_log, [*common, "train.fail_once_at_step=25"], {**env, "MLFLOW_TRACKING_URI": with_password})
    try:
        wait_for("step 12", lambda: job.poll() is not None or max(
            (s for steps in audited(audit).values() for s, _ in steps), default=0) >= 12, 300, 0.2)
        proxy_store.answer(502, "<html><body>502 Bad Gateway</body></html>")  # the outage, to the end of the job
        assert job.wait(timeout=scaled(600)) != 0
        first = first_log.read_text()
        assert "injected failure at step 25" in first and "FAILED status" in first, first[-3000:]
        assert f"http://***@127.0.0.1:{port}/gw?token=***" in first, first[-3000:]  # the URI was used, and hidden

        proxy_store.forward()
        job = _job(second_log, common, env, with_token_config)
        assert job.wait(timeout=scaled(600)) == 0, second_log.read_text()[-3000:]
        second = second_log.read_text()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
    ran = audited(audit)
    assert [s for s, _ in ran[max(ran)]] == list(range(21, 41)), ran  # the resume: from step 20's checkpoint
    client = MlflowClient(proxied_mlflow.uri)
    [run] = client.search_runs([client.get_experiment_by_name("test-secrets").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags.get("probvlp.resumes") == "1"

    found = [f"the {name} console holds the {what}" for name, text in (("first", first), ("second", second))
             for what, secret in secrets.items() if secret in text]
    exports = list(logs.rglob("event_EXPORT_TRAIN*"))
    assert exports and any(b"mlflow_run_id" in p.read_bytes() for p in exports), \
        sorted(str(p) for p in logs.rglob("export_events/*"))  # Ray Train's run state, its loop config included
    found += _holding(logs, secrets) + _holding(storage, secrets)
    found += [f"MLflow param {k} holds the {what}" for k, v in run.data.params.items()
              for what, secret in secrets.items() if secret in v]
    found += [f"MLflow tag {k} holds the {what}" for k, v in run.data.tags.items()
              for what, secret in secrets.items() if secret in v]
    artifacts = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts")))
    assert (artifacts / "config.yaml").is_file() and (artifacts / "config_resume_1.yaml").is_file()
    found += _holding(artifacts, secrets)
    assert not found, found
    shutil.rmtree(logs, ignore_errors=True)
