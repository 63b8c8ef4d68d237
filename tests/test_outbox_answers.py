"""What the outbox (pipelines/tracking/outbox.py) makes of the answers a real tracking server, and what stands in front
of it, give a call: a real `mlflow server` behind tests/multinode.py's `ProxyStore` (an ingress, nginx, a gateway),
switched by each test. Only MLflow's own JSON refusal of a call is a refusal, and a refused call is set aside
(refused.jsonl) without stopping training or the queue; a proxy's page, a call held past the client's timeout, a
body over a proxy's limit are not refusals; a duplicate the store says it has is delivered."""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from pipelines.tracking import deliver
from pipelines.tracking.outbox import Outbox, metrics_op
from tests.pace import scaled

PAGE_404 = ("<html>\r\n<head><title>404 Not Found</title></head>\r\n<body>\r\n<center><h1>404 Not Found</h1></center>"
            "\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")
PAGE_401 = "<html><head><title>401 Authorization Required</title></head><body>401 Authorization Required</body></html>"
PAGE_413 = ("<html>\r\n<head><title>413 Request Entity Too Large</title></head>\r\n<body>\r\n<center><h1>413 Request "
            "Entity Too Large</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")
PAGE_502 = "<html><head><title>502 Bad Gateway</title></head><body>502 Bad Gateway</body></html>"
# MLflow's own answer (its basic-auth app) to credentials it does not accept
DENIED = json.dumps({"error_code": "PERMISSION_DENIED", "message": "Permission denied"})
# what MLflow's SQL store answered the retry of a batch whose first copy, held by a proxy past the client's timeout,
# reached it late (the issue's; the server here dedups a duplicate, so the proxy gives the answer)
UNIQUE_FAILED = json.dumps({"error_code": "BAD_REQUEST", "message": "(sqlite3.IntegrityError) UNIQUE constraint "
                            "failed: metrics.key, metrics.timestamp, metrics.step, metrics.run_uuid, metrics.value, "
                            "metrics.is_nan"})
BAD_KEY = "bad key!"  # MLflow refuses the name: 400, INVALID_PARAMETER_VALUE


@pytest.fixture(autouse=True)
def quick_http(monkeypatch):
    """The outbox's own client settings (it sets them in the process's environment), undone after each test."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


def new_run(uri: str) -> tuple[MlflowClient, str]:
    client = MlflowClient(uri)
    return client, client.create_run(client.create_experiment(f"answers-{uuid.uuid4().hex[:8]}")).info.run_id


def loss(step: int) -> Metric:
    return Metric("loss", float(step), 1_000 + step, step)


def history(client: MlflowClient, run_id: str, key: str = "loss") -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def refused_in(folder: Path) -> list[dict]:
    path = folder / "refused.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("status, body, content_type, credentials", [
    (404, PAGE_404, "text/html", False),  # an ingress in front of a store that is down
    (401, PAGE_401, "text/html", True),  # a proxy's authentication
    (403, DENIED, "application/json", True),  # MLflow's own: credentials rotated under a running job
    (502, PAGE_502, "text/html", False),
], ids=["404-page", "401-page", "403-mlflow", "502-page"])
def test_an_answer_that_is_not_the_stores_refusal_is_an_outage(proxied_mlflow, proxy_store, tmp_path, capfd,
                                                               status, body, content_type, credentials):
    """A proxy answers every call for a while (its page, or MLflow's 403 to credentials that will work again): the
    outbox takes it for the store being away, keeps what is logged, and delivers it once the answers are MLflow's
    again: nothing refused, every metric once, one outage, a line that says so (and names the credentials)."""
    client, run_id = new_run(proxied_mlflow.uri)
    proxy_store.answer(status, body, content_type)
    outbox = Outbox(MlflowClient(proxy_store.uri), run_id, proxy_store.uri, tmp_path / "outbox")
    for step in range(1, 21):
        outbox.put_metrics([loss(step)])  # never raises
        if step == 10:  # the outbox got the answer twice: it is trying again
            proxy_store.wait_count("/api/2.0/mlflow/", 2, 30)
    outbox.put({"tag": ["probvlp.after", "yes"]})
    proxy_store.forward()
    report = outbox.close(20, scaled(30), summary=False)
    out = capfd.readouterr().out
    assert report.kept_in is None and report.outages == 1 and report.refused == 0, out
    assert history(client, run_id) == [(s, float(s)) for s in range(1, 21)]
    assert client.get_run(run_id).data.tags["probvlp.after"] == "yes"
    assert f"{proxy_store.uri} unreachable" in out and "refused" not in out, out
    assert ("credentials" in out) == credentials, out


@pytest.mark.slow
def test_a_batch_held_past_the_clients_timeout_and_delivered_twice_is_not_a_refusal(proxied_mlflow, proxy_store,
                                                                                    tmp_path, monkeypatch, capfd):
    """The proxy holds the first log-batch past the client's timeout (2 s), then passes it on: the server writes it
    late. The outbox's retry reaches the server too, and gets the answer MLflow's SQL store gave such a duplicate in
    the issue (400 BAD_REQUEST, UNIQUE constraint failed). Delivery is at least once: the outbox reads the run, finds
    the batch there and goes on. Nothing refused, training never hears of it, every metric in MLflow once."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")  # before the outbox: its own 30 s is a default
    client, run_id = new_run(proxied_mlflow.uri)
    outbox = Outbox(MlflowClient(proxy_store.uri), run_id, proxy_store.uri, tmp_path / "outbox")
    assert outbox.wait(scaled(30))  # the run read: the next call is a batch
    proxy_store.hold_then_forward(4, path="runs/log-batch", times=1)
    proxy_store.forward_then_answer(400, UNIQUE_FAILED, path="runs/log-batch", times=1)
    for step in range(1, 11):
        outbox.put_metrics([loss(step), Metric("lr", 1.0 / step, 1_000 + step, step)])
    proxy_store.wait_count("runs/log-batch", 2, 30)
    for step in range(11, 21):
        outbox.put_metrics([loss(step), Metric("lr", 1.0 / step, 1_000 + step, step)])  # never raises
    report = outbox.close(20, scaled(30), summary=False)
    proxy_store.wait_settled(30)  # the held copy reached the server, late
    out = capfd.readouterr().out
    assert report.kept_in is None and report.refused == 0 and report.outages == 1, out
    assert "refused" not in out, out
    assert history(client, run_id) == [(s, float(s)) for s in range(1, 21)]
    assert history(client, run_id, "lr") == [(s, 1.0 / s) for s in range(1, 21)]
    assert not proxy_store.rules  # the held batch and the answered duplicate both happened
    assert 400 in [status for _, path, status in proxy_store.answered if "log-batch" in path]
    # step 1 went in the held call and in its retry, never again: the outbox did not send what the store had
    sent = [json.loads(body)["metrics"] for path, body in proxy_store.received if path.endswith("runs/log-batch")]
    assert sum({"key": "loss", "value": 1.0, "timestamp": 1_001, "step": 1} in batch for batch in sent) == 2, sent


@pytest.mark.slow
def test_batches_over_a_proxys_body_limit_are_split_until_they_pass(proxied_mlflow, proxy_store, tmp_path, capfd):
    """nginx in front of the store answers 413 (its page) to a batch of over 50 metrics: the outbox halves its
    batches until they pass, one op of 120 metrics included, and delivers everything; no refusal, no outage."""
    limit = 50
    client, run_id = new_run(proxied_mlflow.uri)
    proxy_store.answer(413, PAGE_413, "text/html", path="runs/log-batch",
                       only=lambda body: len(json.loads(body).get("metrics", [])) > limit)
    # 40 steps of 5 metrics queued before the thread starts (carried): one call's worth, 200 metrics
    carried = [metrics_op([Metric(f"m{k}", float(step), 1_000 + step, step) for k in range(5)], -1)
               for step in range(1, 41)]
    outbox = Outbox(MlflowClient(proxy_store.uri), run_id, proxy_store.uri, tmp_path / "outbox", carried=carried)
    outbox.put_metrics([Metric(f"eval{k}", float(k), 2_000, 40) for k in range(120)])
    report = outbox.close(40, scaled(20), summary=False)
    out = capfd.readouterr().out
    assert report.kept_in is None and report.refused == 0 and report.outages == 0, out
    for k in range(5):
        assert history(client, run_id, f"m{k}") == [(s, float(s)) for s in range(1, 41)]
    assert {key: m for key, m in client.get_run(run_id).data.metrics.items() if key.startswith("eval")} == \
        {f"eval{k}": float(k) for k in range(120)}
    statuses = [status for _, path, status in proxy_store.answered if "log-batch" in path]
    assert statuses[0] == 413 and statuses.count(200) >= 200 // limit + 120 // limit, statuses


@pytest.mark.slow
def test_a_call_the_store_refuses_is_set_aside_and_never_replayed(proxied_mlflow, proxy_store, tmp_path, capfd):
    """A metric whose name MLflow refuses (400 INVALID_PARAMETER_VALUE), logged with good ones: training never hears
    of it, the store gets everything else, the refused metric alone is set aside in refused.jsonl (one line printed,
    the store's answer kept), counted, persisted with the queue to the run's storage, and neither the next attempt
    nor `deliver` replays it."""
    client, run_id = new_run(proxied_mlflow.uri)
    outbox = Outbox(MlflowClient(proxy_store.uri), run_id, proxy_store.uri, tmp_path / "outbox")
    for step in range(1, 6):
        outbox.put_metrics([loss(step), *([Metric(BAD_KEY, 1.0, 1_005, 5)] if step == 5 else [])])  # never raises
    assert outbox.wait(scaled(30))
    assert history(client, run_id) == [(s, float(s)) for s in range(1, 6)]
    proxy_store.refuse()  # the store goes away; the attempt ends before it is back, its queue in the run's storage
    for step in range(6, 9):
        outbox.put_metrics([loss(step)])
    storage = tmp_path / "storage"
    report = outbox.close(8, 0, keep_to=str(storage), summary=False)
    out = capfd.readouterr().out
    assert report.refused == 1 and report.kept_in == str(storage) and report.pending == 3, out
    [said] = [line for line in out.splitlines() if "MLflow refused" in line]
    assert BAD_KEY in said and f"{tmp_path / 'outbox'}/refused.jsonl" in said and "not retried" in said, out
    [kept] = refused_in(storage)
    assert kept["op"]["metrics"] == [[BAD_KEY, 1.0, 1_005, 5]] and "INVALID_PARAMETER_VALUE" in kept["answer"]
    assert refused_in(tmp_path / "outbox") == [kept]  # where the line said

    proxy_store.forward()
    batches = proxy_store.count("runs/log-batch")
    assert deliver.main([str(storage), proxy_store.uri]) == 0
    out = capfd.readouterr().out
    assert proxy_store.count("runs/log-batch") == batches + 1 and "MLflow refused" not in out, out  # steps 6-8 only
    assert "1 call" in out and "refused.jsonl" in out, out
    assert history(client, run_id) == [(s, float(s)) for s in range(1, 9)]
    assert refused_in(storage) == [kept]


@pytest.mark.slow
def test_an_artifact_whose_copy_is_gone_is_set_aside_not_retried_forever(proxied_mlflow, proxy_store, tmp_path, capfd):
    """The outbox's copy of a queued artifact is gone (a cleaned disk, a carried folder without it): no try can
    upload it. It is set aside as refused; the calls after it are delivered."""
    client, run_id = new_run(proxied_mlflow.uri)
    proxy_store.refuse()
    outbox = Outbox(MlflowClient(proxy_store.uri), run_id, proxy_store.uri, tmp_path / "outbox")
    for name in ("card.md", "notes.md"):
        (tmp_path / name).write_text(name)
        outbox.put_file(tmp_path / name, "model")
    gone = outbox.snapshot()[0]["file"]
    shutil.rmtree(outbox.files / gone.split("/")[0])
    outbox.put_metrics([loss(1)])
    proxy_store.forward()
    report = outbox.close(1, scaled(20), summary=False)
    out = capfd.readouterr().out
    assert report.kept_in is None and report.refused == 1, out
    assert [a.path for a in client.list_artifacts(run_id, "model")] == ["model/notes.md"]
    assert history(client, run_id) == [(1, 1.0)]
    [kept] = refused_in(tmp_path / "outbox")
    assert kept["op"]["file"] == gone and "FileNotFoundError" in kept["answer"]


def test_an_s3_refusal_of_an_artifact_is_set_aside_and_its_throttling_is_an_outage(tmp_path):
    """botocore's ClientError, as boto3 raises it (an upload's S3UploadFailedError made while handling it): S3's
    AccessDenied or NoSuchBucket is a refusal; its throttling, an expired session token and a 5xx are an outage."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import ClientError

    from pipelines.tracking.outbox import OUTAGE, REFUSED, answer_of

    def raised(code: str, status: int) -> BaseException:
        try:
            try:
                raise ClientError({"Error": {"Code": code, "Message": code},
                                   "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
            except ClientError as err:
                raise S3UploadFailedError(f"Failed to upload card.md to bucket/key: {err}")
        except S3UploadFailedError as err:
            return err

    op = {"file": "abc/card.md", "to": "model"}
    (tmp_path / "abc").mkdir()
    (tmp_path / "abc" / "card.md").write_text("a card")
    assert answer_of(raised("AccessDenied", 403), op, tmp_path) == REFUSED
    assert answer_of(raised("NoSuchBucket", 404), op, tmp_path) == REFUSED
    for code, status in [("SlowDown", 503), ("ThrottlingException", 400), ("ExpiredToken", 400),
                         ("InternalError", 500), ("RequestTimeout", 400)]:
        assert answer_of(raised(code, status), op, tmp_path) == OUTAGE, code


@pytest.mark.slow
def test_an_artifact_over_a_proxys_body_limit_is_set_aside_with_its_answer_and_no_password(proxied_mlflow, proxy_store,
                                                                                           tmp_path, capfd):
    """nginx answers 413 to an artifact's upload (a file cannot be split): it is set aside as refused, what follows
    is delivered; the line and refused.jsonl keep the answer without the password of the URI the client was given."""
    client, run_id = new_run(proxied_mlflow.uri)
    proxy_store.answer(413, PAGE_413, "text/html", path="big.bin")
    uri = proxy_store.uri_with("alice:s3cr3t")
    outbox = Outbox(MlflowClient(uri), run_id, uri, tmp_path / "outbox")
    (tmp_path / "big.bin").write_bytes(b"0" * 100_000)
    outbox.put_file(tmp_path / "big.bin", "model")
    outbox.put_metrics([loss(1)])
    report = outbox.close(1, scaled(20), summary=False)
    out, err = capfd.readouterr()
    assert report.kept_in is None and report.refused == 1 and report.outages == 0, out
    assert history(client, run_id) == [(1, 1.0)] and client.list_artifacts(run_id, "model") == []
    [kept] = refused_in(tmp_path / "outbox")
    assert kept["op"]["to"] == "model" and "413" in kept["answer"], kept
    assert "s3cr3t" not in out + err + (tmp_path / "outbox" / "refused.jsonl").read_text(), out + err


@pytest.mark.slow
def test_the_calls_of_a_run_the_store_does_not_have_are_set_aside_at_once(proxy_store, tmp_path, capfd):
    """A run the store does not have (deleted, another store's): its read is refused, and so is each call; each call
    is set aside at once (a batch of metrics whole: the refusal is the run's, not a metric's), none blocks the queue."""
    outbox = Outbox(MlflowClient(proxy_store.uri), "0" * 32, proxy_store.uri, tmp_path / "outbox")
    outbox.put_metrics([Metric(f"m{k}", 1.0, 1_000, 1) for k in range(300)])
    outbox.put({"tag": ["probvlp.tag", "x"]})
    report = outbox.close(1, scaled(20), summary=False)
    out = capfd.readouterr().out
    assert report.kept_in is None and report.refused == 2 and report.outages == 0, out
    assert all("RESOURCE_DOES_NOT_EXIST" in kept["answer"] for kept in refused_in(tmp_path / "outbox"))
    assert proxy_store.count("runs/log-batch") == 1 and proxy_store.count("runs/set-tag") == 1, proxy_store.counts


@pytest.mark.slow
def test_a_job_that_fails_while_the_store_hangs_fails_at_once_and_its_failed_status_is_kept(
        proxied_mlflow, proxy_store, tmp_path, monkeypatch, capfd):
    """The job's run fails while the store behind the proxy holds every call unanswered (a hung ingress): the job's
    own error comes out while the proxy still holds the one call the end made (the tracking.flush_timeout_s of 600 s
    is not waited for, nor the client's retries), with one line; the run's FAILED status is kept after what rank 0
    left in the run's storage, and `deliver` ends the run FAILED with all of it once the store answers."""
    from pipelines.tracking.outbox import write_pending
    from pipelines.tracking.runs import tracked_run

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    storage = tmp_path / "storage"
    with pytest.raises(RuntimeError, match="the job's own error"):
        with tracked_run(proxy_store.uri, f"fails-{uuid.uuid4().hex[:8]}", "fails", resumed=False, params={},
                         config_yaml="a: 1\n", tags={}) as run:
            run.pending_in, run.flush_timeout_s = str(storage), 600.0
            # what rank 0 handed over as its attempt failed
            write_pending(str(storage), run.run_id, proxy_store.uri, [metrics_op([loss(s)], 0) for s in (1, 2, 3)],
                          tmp_path / "files", 0.0)
            proxy_store.hold_then_forward(3600)
            raise RuntimeError("the job's own error")
    out = capfd.readouterr().out
    held = proxy_store.count("/api/2.0/mlflow/")
    assert held >= 1 and len(proxy_store.answered) < sum(proxy_store.counts.values()), \
        (proxy_store.counts, proxy_store.answered)  # the end's call still held: the job did not wait for it
    assert f"{run.run_id}'s FAILED status and 3 calls before it are kept in {storage}" in out, out
    assert "python -m pipelines.tracking.deliver" in out
    client = MlflowClient(proxied_mlflow.uri)
    assert client.get_run(run.run_id).info.status == "RUNNING"
    proxy_store.forward()
    assert deliver.main([str(storage), proxied_mlflow.uri]) == 0
    assert client.get_run(run.run_id).info.status == "FAILED"
    assert history(client, run.run_id) == [(1, 1.0), (2, 2.0), (3, 3.0)]
