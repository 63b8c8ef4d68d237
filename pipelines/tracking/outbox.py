"""Rank 0's MLflow calls during training, queued in an `Outbox` and delivered in order by a background thread that
retries while the store is unreachable. What is queued travels with the run, not the node: `persist` writes it to the
run's storage (`run.storage_path`, object storage on a cluster) at every checkpoint, before a notice's hold and at the
end, and the next attempt's rank 0 (any node) or the driver delivers it first (`load`). What a store that never came
back missed stays there for `python -m pipelines.tracking.deliver FOLDER [URI]` (`deliver_kept`).

A restart replays the steps after its checkpoint, some of which an earlier attempt may have delivered already. The
queue's metrics carry the step the attempt that logged them resumed from (`from`); before its first delivery the
thread reads the run once: its `probvlp.logged_through` tag (the highest step delivered, written with every batch of
metrics) and each metric's latest step, and drops of the metrics from `from` on those whose key the store has at that
step or later (`_kept`). The restart itself never waits for the
store: the read is the thread's, and it is retried as any delivery is. Redelivering a call is harmless (MLflow keeps one
copy of a metric with the same key, value, step and time; a tag or an artifact is overwritten), so a copy persisted
while the call was in flight may go twice.

What a failed call's error means is `answer_of`'s: only the store's own refusal (MLflow's JSON answer, S3 refusing an
artifact, an artifact whose copy is gone) is one; a proxy's page, a timeout, a 5xx, a 401/403 are the store away, and
a 413 a batch too big for a proxy (it is split). A refused call never stops training nor the queue: it is set aside
in the folder's refused.jsonl (`REFUSED_FILE`), with the store's answer, printed once, persisted with the queue and
never tried again; a refused batch of metrics that the store holds already (a call that reached it late and was
retried) was delivered."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Iterator

from mlflow import MlflowClient
from mlflow.entities import Metric, RunTag
from mlflow.exceptions import MlflowException, RestException

from pipelines.storage import fs_path, open_atomic, write_bytes_atomic
from pipelines.tracking.store import hide_credentials, no_links_with_credentials

LOGGED_THROUGH_TAG = "probvlp.logged_through"  # the highest step a run's metrics are in MLflow for
BATCH = 1000  # metrics per log_batch (MLflow's limit)
UNREACHABLE_METRIC = "tracking_unreachable_s"
UNREACHABLE_TAG = "probvlp.tracking_unreachable_s"
# MLflow's own defaults (7 retries, backoff factor 2, a 120-s timeout) hold one call for minutes, during which the
# thread cannot see the server come back; the outbox retries instead. The user's own settings win.
QUICK_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
RETRY_MAX_S = 5.0  # the longest pause between two tries: how late a returning server is seen at most
MEMORY_METRICS = 200_000  # ~40 MB of queued metrics, then the queue continues in a file
PENDING = "pending.jsonl"  # in a persisted outbox folder: a head line (run, store, seconds unreachable), then the ops
MORE = "more-{id}.jsonl"  # beside it: the calls added after it was written (add_to_pending), named by its head's id
COMMAND = "python -m pipelines.tracking.deliver"  # pipelines/tracking/deliver.py
RESUMES_TAG = "probvlp.resumes"  # how many times a command resumed the run
RESUME_KEY_TAG = "probvlp.resume"  # .N: the key of the N-th resume (outbox.reopen: a resume done twice counts once)
REFUSED_FILE = "refused.jsonl"  # in an outbox's folder and a persisted one: the calls set aside, one a line
REFUSALS_SHOWN = 10  # refusals printed one line each; past it only refused.jsonl has them (a deleted run refuses all)

OUTAGE, REFUSED, TOO_LARGE = "outage", "refused", "too large"  # what a failed call's error means (`answer_of`)
# MLflow's error_code of a call it read and refuses as it is: the same call can never succeed
STORE_REFUSALS = frozenset({"INVALID_PARAMETER_VALUE", "MALFORMED_REQUEST", "BAD_REQUEST", "INVALID_STATE",
                            "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS"})
# S3's 4xx answers that a later try does not get: throttling, a slow request, an expired session token (renewed)
S3_TRANSIENT = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "RequestTimeout",
                          "ExpiredToken", "RequestExpired", "TokenRefreshRequired", "RequestTimeTooSkewed"})
# MLflow's text for an answer that is not JSON (rest_utils.verify_rest_response): its status is only in the text
_NOT_JSON_STATUS = re.compile(r"failed with error code (\d{3}) != \d{3}")


def fail_fast(uri: str) -> None:
    """An HTTP store's calls in this process (and those it starts) tried once, with QUICK_HTTP's timeout, unless the
    environment says otherwise: what waits on the store never waits for MLflow's minutes of retries."""
    if uri.startswith(("http://", "https://")):
        for key, value in QUICK_HTTP.items():
            os.environ.setdefault(key, value)


def one_line(err: BaseException) -> str:
    """`err` in one line, credentials hidden: MLflow's errors name the URI the client was given."""
    text = str(err).strip().splitlines()
    return hide_credentials(f"{type(err).__name__}: {text[0][:300] if text else ''}")


def _s3_error(err: BaseException) -> dict | None:
    """The response of a botocore ClientError in `err` or what it was raised from (boto3's upload raises its
    S3UploadFailedError while handling one)."""
    while err is not None:
        response = getattr(err, "response", None)
        if isinstance(response, dict) and "Error" in response:
            return response
        err = err.__cause__ or err.__context__
    return None


def http_status(err: BaseException) -> int | None:
    """The HTTP status a failed call was answered with, where its error says (None: no answer)."""
    if (s3 := _s3_error(err)) is not None:
        return s3.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if getattr(err, "response", None) is not None:  # requests.HTTPError of an artifact upload through the server
        return getattr(err.response, "status_code", None)
    if isinstance(err, RestException):
        return err.get_http_status_code()
    found = _NOT_JSON_STATUS.search(str(err)) if isinstance(err, MlflowException) else None
    return int(found[1]) if found else None


def answer_of(err: BaseException, op: dict, files: Path) -> str:
    """What the error of a failed call of `op` says (the first rule that applies): REFUSED (never tried again),
    TOO_LARGE (a smaller call may pass) or OUTAGE (the same call is tried again)."""
    # a queued artifact whose copy is gone: no try can upload it
    if isinstance(err, FileNotFoundError) and "file" in op and not (files / op["file"]).exists():
        return REFUSED
    status = http_status(err)
    # a body over a proxy's limit (nginx's client_max_body_size answers 413 with its page, not MLflow)
    if status == 413:
        return TOO_LARGE
    # MLflow read the call and refused it: its answer is JSON with an error_code (a proxy's page is not). Its 401 and
    # 403 are not among these: credentials rotated under a running job work again once renewed.
    if isinstance(err, RestException) and err.json.get("error_code") in STORE_REFUSALS:
        return REFUSED
    # S3 refusing an artifact (AccessDenied, NoSuchBucket): a 4xx, but throttling and an expired session token
    s3 = _s3_error(err)
    if s3 is not None and status is not None and 400 <= status < 500 and status not in (408, 429) \
            and s3["Error"].get("Code") not in S3_TRANSIENT:
        return REFUSED
    # anything else: a proxy's page (404, 401, 403, 502), MLflow's 401/403, 408, 429, 5xx, no connection, a timeout
    return OUTAGE


def metrics_op(metrics: list[Metric], replay_from: int, event: bool = False) -> dict:
    """`event`: what this attempt did (a save's seconds, a notice, a start-up), never a replay of an earlier attempt's
    record, so never dropped by the replay rule."""
    op = {"metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics], "from": replay_from}
    return {**op, "event": True} if event else op


def _kept(op: dict, state: dict) -> list[list]:
    """A metrics op's entries that are not replays of what an earlier attempt delivered: of the steps from the op's
    `from` on, those whose key the store holds at that step or later. Per key, not up to the run's horizon: an attempt
    that delivered the last step's loss and died before the final evaluation did not deliver the evaluation's metrics
    at that step (delivery is in order, so a key's latest step bounds what was delivered of it). `latest` grows with
    each delivery, so a record an earlier attempt handed over and this attempt made again (the evaluation at a notice's
    step, which the restart repeats) lands once. An op filtered by the attempt that knew the store's steps, and an
    event's, keep their entries."""
    if op.get("filtered") or op.get("event"):
        return op["metrics"]
    low, latest = op.get("from", -1), state["latest"]
    return [m for m in op["metrics"] if not replayed(m[0], m[3], low, latest)]


def replayed(key: str, step: int, resumed_from: int, latest: dict[str, int]) -> bool:
    """Whether the metric `key` at `step`, logged by an attempt that resumed from `resumed_from`, is a replay of one an
    earlier attempt delivered: the store (`latest`: each key's latest step there) holds the key at that step or later."""
    return step >= resumed_from and latest.get(key, -1) >= step


def _deliver(client, run_id: str, batch: list[dict], files: Path, unreachable_s: float, state: dict) -> None:
    """One MLflow call for `batch` (consecutive metrics together). `state`: the run's horizon and highest step
    delivered (updated only once the call went through)."""
    op = batch[0]
    if "metrics" in op:
        entries = [m for o in batch for m in _kept(o, state)]
        if not entries:
            return
        through = max(state["through"], max(m[3] for m in entries))
        client.log_batch(run_id, metrics=[Metric(k, v, ts, step) for k, v, ts, step in entries],
                         tags=[RunTag(LOGGED_THROUGH_TAG, str(through))])
        state["through"] = through
        latest = state["latest"]
        for key, _, _, step in entries:
            latest[key] = max(latest.get(key, -1), step)
    elif "tag" in op:
        client.set_tag(run_id, *op["tag"])
    elif "file" in op:
        path = files / op["file"]
        (client.log_artifacts if path.is_dir() else client.log_artifact)(run_id, str(path), op["to"])
    elif "summary" in op:  # how long the store was unreachable over every attempt, which this call ends
        seconds = round(unreachable_s, 1)
        client.log_batch(run_id, metrics=[Metric(UNREACHABLE_METRIC, seconds, op["at"], op["summary"])],
                         tags=[RunTag(UNREACHABLE_TAG, f"{seconds:.1f}")])
    elif "status" in op:
        client.set_terminated(run_id, status=op["status"])
    elif "reopen" in op:  # a resume that found the store away (runs.reopen_run): its reopening, as it would have been
        reopen(client, run_id, op["reopen"], op.get("key"))
    elif "register" in op:
        register_model_version(state["store"], run_id, op["register"])


def reopen(client, run_id: str, config_yaml: str, key: str | None = None) -> int:
    """Continue an existing run: mark it running, count the resume (tag probvlp.resumes) and keep the resumed config
    (`config_yaml`, secrets hidden already) next to the original. Returns the resume's number (1 for the first).
    `key`: the resume's own, recorded first (tag probvlp.resume.N): the same resume done again (a try cut short by an
    outage, then its queued copy delivered) keeps its number instead of counting twice."""
    tags = client.get_run(run_id).data.tags
    done = [int(k.rsplit(".", 1)[1]) for k, v in tags.items()
            if key and v == key and k.startswith(f"{RESUME_KEY_TAG}.") and k.rsplit(".", 1)[1].isdigit()]
    attempt = done[0] if done else int(tags.get(RESUMES_TAG, "0")) + 1
    if key:
        client.set_tag(run_id, f"{RESUME_KEY_TAG}.{attempt}", key)
    client.update_run(run_id, status="RUNNING")
    client.set_tag(run_id, RESUMES_TAG, str(attempt))
    client.log_text(run_id, config_yaml, f"config_resume_{attempt}.yaml")
    return attempt


def register_model_version(uri: str, run_id: str, name: str) -> str:
    """Register the run's MLflow model as a new version of `name`; returns the version. Idempotent: a version of this
    run's model that `name` holds already (a call whose answer timed out after the store made it, delivered again)
    is the one returned."""
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    source = client.get_run(run_id).info.artifact_uri.rstrip("/") + "/model"
    made = [v for v in client.search_model_versions(f"name='{name}' and run_id='{run_id}'") if v.source == source]
    if made:
        return str(min(int(v.version) for v in made))
    return str(client.create_model_version(name, source=source, run_id=run_id).version)


def _count(ops: Iterable[dict]) -> dict[str, int]:
    counts = {"metrics": 0, "tags": 0, "artifacts": 0, "other": 0}
    for _ in _counting(ops, counts):
        pass
    return counts


def _counting(ops: Iterable[dict], counts: dict[str, int]) -> Iterator[dict]:
    """`ops` as they pass, counted into `counts` by kind (metrics by the metric)."""
    for op in ops:
        key = "metrics" if "metrics" in op else "tags" if "tag" in op else "artifacts" if "file" in op else "other"
        counts[key] += len(op["metrics"]) if key == "metrics" else 1
        yield op


def _what(op: dict) -> str:
    """A call, in a few words."""
    if "metrics" in op:
        shown = ", ".join(f"metric {m[0]} at step {m[3]}" for m in op["metrics"][:3])
        return shown + (f" and {len(op['metrics']) - 3} more" if len(op["metrics"]) > 3 else "")
    if "tag" in op:
        return f"tag {op['tag'][0]}"
    if "file" in op:
        return f"artifact {op['file'].split('/', 1)[-1]}"
    return f"the run's {next(iter(op))}"


def files_folder(folder: Path) -> Path:
    """Where an outbox in `folder` keeps its copies of the artifacts it has not delivered."""
    return folder / "files"


@dataclasses.dataclass
class OutboxReport:
    unreachable_s: float
    outages: int
    undelivered: dict[str, int]  # what the store did not get: metrics, tags, artifacts, other (status, summary)
    kept_in: str | None  # where it is (`deliver_kept`), None when everything was delivered
    refused: int = 0  # calls the store refused, set aside in refused.jsonl (never tried again, not `pending`)

    @property
    def pending(self) -> int:
        return sum(self.undelivered.values())


class Outbox:
    """One run's MLflow calls, delivered in the order they were made by a background thread that retries while the
    store is unreachable (pausing at most RETRY_MAX_S, so a returning server is seen within seconds). Queuing never
    waits for the store: past MEMORY_METRICS queued metrics the queue goes on in a file in `folder` (this node's);
    artifact files are copied there when queued (the caller's temporary folders go away).

    `replay_from`: the step this attempt resumed from (its later steps may be replays); `carried`: an earlier attempt's
    undelivered calls (`load`), delivered first; `unreachable_s`: the seconds earlier attempts found the store away.
    A call the store refuses is set aside in `folder`'s refused.jsonl (`refused`), the queue goes on."""

    def __init__(self, client, run_id: str, uri: str, folder: Path, *, replay_from: int = -1,
                 carried: Iterable[dict] = (), unreachable_s: float = 0.0, store: str | None = None):
        """`uri`: the store's, credentials hidden (it is printed, and kept with what was not delivered); `store`:
        the store itself, for a model's registration (the driver's outbox only)."""
        self.client, self.run_id, self.uri = client, run_id, hide_credentials(uri)
        no_links_with_credentials(uri)
        self.replay_from = replay_from
        self.folder = folder
        self.files = files_folder(self.folder)
        self.spill = self.folder / "spill.jsonl"
        self.cv = threading.Condition()
        self.queue: deque[dict] = deque()
        self.in_memory = 0  # metrics in self.queue
        self.spilled = 0  # ops in the spill file not read back yet (queued after everything in self.queue)
        self.spill_offset = 0
        self.queued_total = 0  # every call queued so far: its number ("seq") marks what a persist has written
        self.persisted: tuple[str, int] | None = None  # the last `persist`: its folder, the last call it held
        self.state = {"horizon": None, "through": -1, "latest": {}, "store": store}
        self.down_since: float | None = None
        self.unreachable_s, self.outages = unreachable_s, 0
        self.refused: list[dict] = []  # the calls set aside: {"id", "answer", "op"}, as in refused.jsonl
        self.limit = BATCH  # metrics a call: halved for good by a proxy's 413
        self.probe: int | None = None  # metrics a call while the entries the store refuses are looked for
        self.stopped = False
        self.wake = threading.Event()
        fail_fast(uri)
        for op in carried:
            self._queue(op)
        self.thread = threading.Thread(target=self._run, name=f"probvlp-tracking-{run_id[:8]}", daemon=True)
        self.thread.start()

    # --- the caller's side (the training loop): never waits for the store
    def put(self, op: dict) -> None:
        with self.cv:
            if self.stopped:
                raise RuntimeError("the outbox is closed")
            self._queue(op)
            self.cv.notify_all()

    def _queue(self, op: dict) -> None:
        self.queued_total += 1
        op = {**op, "seq": self.queued_total}
        size = len(op.get("metrics", ()))
        if self.spilled or self.in_memory + size > MEMORY_METRICS:
            self.folder.mkdir(parents=True, exist_ok=True)
            with self.spill.open("a") as f:
                f.write(json.dumps(op) + "\n")
            self.spilled += 1
        else:
            self.queue.append(op)
            self.in_memory += size

    def put_metrics(self, metrics: list[Metric], event: bool = False) -> None:
        self.put(metrics_op(metrics, self.replay_from, event))

    def put_file(self, path: Path, artifact_path: str | None) -> None:
        name = f"{uuid.uuid4().hex[:12]}/{path.name}"  # unique across attempts: carried files keep their names
        target = self.files / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.copytree(path, target)
        else:
            shutil.copyfile(path, target)
        self.put({"file": name, "to": artifact_path})

    def reachable(self) -> bool:
        return self.down_since is None and self.state["horizon"] is not None

    def total_unreachable_s(self) -> float:
        return self.unreachable_s + (time.monotonic() - self.down_since if self.down_since is not None else 0.0)

    # --- the thread
    def _pending(self) -> bool:
        return bool(self.queue) or self.spilled > 0

    def _head(self) -> list[dict]:
        """The next call's ops (left queued until delivered): consecutive metrics up to `limit` (`probe`), the first
        op split where it holds more, else one op."""
        if not self.queue and self.spilled:
            with self.spill.open() as f:
                f.seek(self.spill_offset)
                for _ in range(min(self.spilled, BATCH)):
                    if self.in_memory >= BATCH * 10:
                        break
                    op = json.loads(f.readline())
                    self.queue.append(op)
                    self.in_memory += len(op.get("metrics", ()))
                    self.spilled -= 1
                self.spill_offset = f.tell()
            if not self.spilled:
                self.spill.unlink()
                self.spill_offset = 0
        cap = min(self.limit, self.probe or BATCH)
        first = self.queue[0]
        if len(first.get("metrics", ())) > cap:
            self.queue[0] = {**first, "metrics": first["metrics"][cap:]}
            self.queue.appendleft({**first, "metrics": first["metrics"][:cap]})
        batch = [self.queue[0]]
        if "metrics" in batch[0]:
            total = len(batch[0]["metrics"])
            for op in itertools.islice(self.queue, 1, None):
                if "metrics" not in op or total + len(op["metrics"]) > cap:
                    break
                batch.append(op)
                total += len(op["metrics"])
        return batch

    def _read_store(self) -> tuple[int, dict[str, int]]:
        """The run's highest step delivered (its tag) and each metric's latest step in the store."""
        data = self.client.get_run(self.run_id).data
        return int(data.tags.get(LOGGED_THROUGH_TAG, -1)), {m.key: m.step for m in data.to_proto().metrics}

    def _read_horizon(self) -> None:
        """What earlier attempts delivered: the highest step, and each key's latest step (the one read of the store).
        A run the store refuses to read (gone) has none: its calls are tried, and refused, one by one."""
        try:
            through, latest = self._read_store()
        except Exception as err:
            if answer_of(err, {}, self.files) != REFUSED:
                raise
            through, latest = -1, {}
        self.state.update(horizon=through, through=through, latest=latest)

    def _run(self) -> None:
        pause = 1.0
        while True:
            with self.cv:
                while not self.stopped and not self._pending() and self.state["horizon"] is not None:
                    self.cv.wait()
                if self.stopped:
                    return
                batch = self._head() if self._pending() else []
            try:
                if self.state["horizon"] is None:
                    self._read_horizon()
                if batch:
                    _deliver(self.client, self.run_id, batch, self.files, self.total_unreachable_s(), self.state)
                    if "metrics" in batch[0] and self.probe is not None:  # past the refused entries: back to size
                        self.probe = None if self.probe * 2 >= self.limit else self.probe * 2
                done = batch
            except Exception as err:  # noqa: BLE001 - every failure is an answer about the call or an outage
                if not batch or self.state["horizon"] is None or not self._answered(batch, err):
                    self._outage(err)
                    self.wake.wait(pause)
                    self.wake.clear()
                    pause = min(pause * 2, RETRY_MAX_S)
                    continue
                done = []  # `_answered` took the batch out, or changed what the next call is
            pause = 1.0
            with self.cv:
                if self.stopped:  # given up on meanwhile: what was kept is persisted already
                    return
                self._pop(done)
                if self.down_since is not None:
                    down = time.monotonic() - self.down_since
                    self.unreachable_s += down
                    self.down_since = None
                    print(f"[tracking] {self.uri} reachable again after {down:.0f} s; delivering what was logged "
                          f"meanwhile ({len(self.queue) + self.spilled} calls queued)", flush=True)
                self.cv.notify_all()

    def _pop(self, batch: list[dict]) -> None:
        """The head's `batch` done with (delivered or set aside): out of the queue, its artifact copies removed."""
        for op in batch:
            self.queue.popleft()
            self.in_memory -= len(op.get("metrics", ()))
            if "file" in op:
                shutil.rmtree(self.files / op["file"].split("/")[0], ignore_errors=True)

    def _outage(self, err: BaseException) -> None:
        with self.cv:
            if self.down_since is None:
                self.down_since, self.outages = time.monotonic(), self.outages + 1
                # a 401/403 says the store is there but the credentials are not taken (rotated, a token expired)
                why = (" (its credentials were not accepted: they may have been rotated; the calls wait for ones that "
                       "work)") if http_status(err) in (401, 403) else ""
                print(f"[tracking] {self.uri} unreachable ({one_line(err)}){why}; nothing waits for it: what is "
                      "logged is kept and delivered when the store answers again", flush=True)
            self.cv.notify_all()

    def _answered(self, batch: list[dict], err: BaseException) -> bool:
        """Act on the store's answer to `batch` (`answer_of`); False: no answer about the call (an outage). A
        refused batch of metrics the store holds already (a duplicate of a call that reached it late) is delivered;
        one that holds more than a metric is halved, until the refused ones are alone; a batch over a proxy's size
        limit is halved for good; what is left refused, or too large alone, is set aside (`_set_aside`)."""
        answer = answer_of(err, batch[0], self.files)
        if answer == OUTAGE:
            return False
        size = sum(len(op.get("metrics", ())) for op in batch)
        if answer == REFUSED and size:
            try:
                through, latest = self._read_store()
            except Exception as read:  # noqa: BLE001 - every failure is an answer about the run or an outage
                if answer_of(read, {}, self.files) != REFUSED:
                    return False  # the read is tried again with the batch
                self._set_aside(batch, err)  # the run itself is refused (gone): each of its metrics would be
                return True
            if not any(_kept({**op, "filtered": False, "event": False}, {"latest": latest}) for op in batch):
                self.state["through"] = max(self.state["through"], through)
                with self.cv:
                    self._pop(batch)
                return True
        if size > 1:
            if answer == TOO_LARGE:
                self.limit = size // 2
            else:
                self.probe = size // 2
            return True
        self._set_aside(batch, err)
        return True

    def _set_aside(self, batch: list[dict], err: BaseException) -> None:
        """`batch`, refused by the store, out of the queue into refused.jsonl (with the store's answer): never tried
        again, and nothing waits for it."""
        answer = one_line(err)
        entries = [{"id": uuid.uuid4().hex, "answer": answer, "op": op} for op in batch]
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / REFUSED_FILE).open("a") as f:
            f.writelines(json.dumps(entry) + "\n" for entry in entries)
        with self.cv:
            self._pop(batch)
            before = len(self.refused)
            self.refused += entries
        what = {"metrics": [m for op in batch for m in op["metrics"]]} if "metrics" in batch[0] else batch[0]
        if before < REFUSALS_SHOWN:
            print(f"[tracking] MLflow refused {_what(what)} of run {self.run_id}: {answer} (kept in "
                  f"{self.folder / REFUSED_FILE}; not retried)", flush=True)
        if before < REFUSALS_SHOWN <= len(self.refused):
            print(f"[tracking] further calls of run {self.run_id} that MLflow refuses go to "
                  f"{self.folder / REFUSED_FILE} without a line here", flush=True)

    # --- what is left, and the end
    def undelivered(self, since: int = 0) -> Iterator[dict]:
        """Every call not delivered yet (the one in flight too; `since`: of those queued after the since-th), in
        order, read as it is consumed: the queue in memory as it is now, then the spill file's lines one at a time (an
        open handle keeps them readable should the thread empty and remove the file meanwhile); metrics filtered by
        this attempt's horizon where it is known (a later attempt must not use its own for them). Memory: the queue's
        references, one spilled call."""
        return self._undelivered(since)[1]

    def _undelivered(self, since: int) -> tuple[int, Iterator[dict]]:
        """`undelivered`, and the number of the last call queued when it was taken (under the lock, now)."""
        with self.cv:
            queued, spilled, mark = list(self.queue), self.spilled, self.queued_total
            spill = self.spill.open() if spilled else None
            if spill:
                spill.seek(self.spill_offset)
        return mark, self._read(queued, spilled, spill, since)

    def _read(self, queued: list[dict], spilled: int, spill, since: int) -> Iterator[dict]:
        try:
            for op in itertools.chain(queued, (json.loads(spill.readline()) for _ in range(spilled))):
                if op.get("seq", 0) <= since:
                    continue
                if self.state["horizon"] is not None and "metrics" in op:
                    op = {**op, "metrics": _kept(op, self.state), "filtered": True}
                    if not op["metrics"]:
                        continue
                yield op
        finally:
            if spill:
                spill.close()

    def snapshot(self) -> list[dict]:
        """`undelivered`, as a list (tests, and small queues)."""
        return list(self.undelivered())

    def persist(self, target: str) -> int:
        """Write what is not delivered yet to the folder `target` (a local path or an fsspec URI: the run's storage)
        for the next attempt or the driver, replacing what an earlier call wrote there, streamed (bounded memory
        however long the outage); returns the calls written."""
        with self.cv:
            refused = list(self.refused)
        mark, ops = self._undelivered(0)
        written = write_pending(target, self.run_id, self.uri, ops, self.files, self.total_unreachable_s(), refused)
        self.persisted = (target, mark)
        return written

    def persist_more(self, target: str) -> int:
        """The calls queued since the last `persist` to `target`, added beside what it wrote there (`add_to_pending`):
        a save's own few records after the save, where a whole `persist` would write the queue again (a long
        outage's, to the run's storage, inside a notice's deadline). A whole `persist` where none was made there.
        Returns the calls added."""
        if self.persisted is None or self.persisted[0] != target:
            return self.persist(target)
        mark, ops = self._undelivered(self.persisted[1])
        added = add_to_pending(target, self.run_id, self.uri, ops, self.files)
        self.persisted = (target, mark)
        return added

    def wait(self, timeout_s: float, while_reachable: bool = False) -> bool:
        """Wait up to `timeout_s` for the queue to be delivered (`while_reachable`: only while the store answers);
        whether it was."""
        deadline = time.monotonic() + timeout_s
        self.wake.set()  # try now rather than after the current pause
        with self.cv:
            while (self._pending() or self.state["horizon"] is None) and time.monotonic() < deadline:
                if while_reachable and self.down_since is not None:
                    break
                self.cv.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            return not self._pending()

    def close(self, step: int, timeout_s: float, *, keep_to: str | None = None, while_reachable: bool = False,
              summary: bool = True) -> OutboxReport:
        """Queue the summary (metric tracking_unreachable_s at `step`), wait up to `timeout_s` for everything to be
        delivered (`while_reachable`: only while the store answers), stop the thread. What is left is written to
        `keep_to` (`persist`) or, without one, to this node's folder, and so are the calls the store refused (their
        refused.jsonl stays in this node's folder too, where their lines said)."""
        if summary:
            self.put({"summary": step, "at": int(time.time() * 1000)})
        self.wait(timeout_s, while_reachable)
        with self.cv:
            self.stopped = True
            self.cv.notify_all()
        self.wake.set()
        self.thread.join(timeout=5)
        counts = _count([])
        written = write_pending(keep_to or str(self.folder), self.run_id, self.uri,
                                _counting(self.undelivered(), counts), self.files, self.total_unreachable_s(),
                                self.refused)
        kept = (keep_to or str(self.folder)) if written else None
        if not written or keep_to:
            if not self.refused:
                shutil.rmtree(self.folder, ignore_errors=True)
            for path in self.folder.glob("*"):  # but refused.jsonl, where the refusals' lines said
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                elif path.name != REFUSED_FILE:
                    path.unlink()
        if self.refused:
            print(f"[tracking] {len(self.refused)} calls of run {self.run_id} refused by MLflow were set aside, not "
                  f"retried: listed in {keep_to or self.folder}/{REFUSED_FILE}", flush=True)
        return OutboxReport(self.total_unreachable_s(), self.outages, counts, kept, len(self.refused))


# --- an outbox at rest: a folder (local or object storage) holding pending.jsonl and the files it names
def write_pending(target: str, run_id: str, uri: str, ops: Iterable[dict], files: Path | None, unreachable_s: float,
                  refused: list[dict] = ()) -> int:
    """`ops` (the calls not delivered, consumed one at a time: an outage's queue need not fit in memory) to
    `target`'s pending.jsonl, replacing it whole or not at all, their files beside it, and the calls the store
    refused added to its refused.jsonl (`keep_refused`); returns the calls written."""
    keep_refused(target, refused)
    fs, root = fs_path(target)
    ops = iter(ops)
    first = next(ops, None)
    if first is None:
        clear_pending(target)
        return 0
    fs.makedirs(root, exist_ok=True)
    head = _head(run_id, uri, unreachable_s)
    with open_atomic(fs, f"{root}/{PENDING}") as out:
        out.write((json.dumps(head) + "\n").encode())
        written = _write_ops(fs, root, out, itertools.chain([first], ops), files)
    _remove_more(fs, root, but=head["id"])  # an earlier pending.jsonl's: what it added is in this one
    return written


def _head(run_id: str, uri: str, unreachable_s: float) -> dict:
    """A pending.jsonl's first line: the run, its store (credentials hidden), the seconds it was away, and the id
    that names the file of calls added to it later (MORE)."""
    return {"run_id": run_id, "uri": hide_credentials(uri), "unreachable_s": round(unreachable_s, 1),
            "id": uuid.uuid4().hex[:12]}


def _write_ops(fs, root: str, out, ops: Iterable[dict], files: Path | None) -> int:
    """`ops` as lines of `out`, each one's artifact (in `files`) copied to `root`/files first; returns how many."""
    written = 0
    for op in ops:
        if files is not None and "file" in op and (files / op["file"]).exists():
            remote = f"{root}/files/{op['file']}"
            if not fs.exists(remote):
                fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
                fs.put(str(files / op["file"]), remote, recursive=(files / op["file"]).is_dir())
        out.write((json.dumps(op) + "\n").encode())
        written += 1
    return written


def _remove_more(fs, root: str, but: str | None = None) -> None:
    """The files of calls added to an earlier pending.jsonl (none read any more), best effort."""
    for path in fs.glob(f"{root}/{MORE.format(id='*')}"):
        if but is None or not path.endswith(MORE.format(id=but)):
            try:
                fs.rm(path)
            except OSError:
                pass


def add_to_pending(target: str, run_id: str, uri: str, ops: Iterable[dict], files: Path | None = None) -> int:
    """`ops` after the calls kept in `target`, whose pending.jsonl stays as it is: in its MORE file, rewritten with
    the calls added before (a few: a save's own records, a driver's reopening of the run that found the store away)
    and these; their artifacts (in `files`) beside. Returns the calls added."""
    fs, root = fs_path(target)
    head = _read_head(fs, root)
    if head is None or "id" not in head:  # nothing kept there, or a file without an id: one pending.jsonl
        ops = list(ops)
        write_pending(target, run_id, uri, itertools.chain(_raw_ops(fs, root) if head else [], ops), files,
                      head.get("unreachable_s", 0.0) if head else 0.0)
        return len(ops)
    more = f"{root}/{MORE.format(id=head['id'])}"
    earlier = b""
    if fs.exists(more):
        with fs.open(more, "rb") as f:
            earlier = f.read()
    with open_atomic(fs, more) as out:
        out.write(earlier)
        return _write_ops(fs, root, out, ops, files)


def _raw_ops(fs, root: str) -> Iterator[dict]:
    """The calls of `root`'s pending.jsonl as written, a line at a time (their files stay where they are)."""
    with fs.open(f"{root}/{PENDING}", "rb") as f:
        f.readline()
        for line in f:
            if line.strip():
                yield json.loads(line)


def _read_head(fs, root: str) -> dict | None:
    if not fs.exists(f"{root}/{PENDING}"):
        return None
    with fs.open(f"{root}/{PENDING}", "rb") as f:
        return json.loads(f.readline())


def keep_refused(target: str, refused: list[dict]) -> None:
    """The refused calls `refused` in `target`'s refused.jsonl, after those there (every attempt's, each once: by
    its id). Nothing ever reads them back into a queue."""
    if not refused:
        return
    there = refused_in(target)
    ids = {entry["id"] for entry in there}
    new = [entry for entry in refused if entry["id"] not in ids]
    if new:
        fs, root = fs_path(target)
        fs.makedirs(root, exist_ok=True)
        text = "".join(json.dumps(entry) + "\n" for entry in [*there, *new])
        write_bytes_atomic(fs, f"{root}/{REFUSED_FILE}", text.encode())


def refused_in(target: str) -> list[dict]:
    """The calls set aside in `target`'s refused.jsonl (`keep_refused`)."""
    fs, root = fs_path(target)
    if not fs.exists(f"{root}/{REFUSED_FILE}"):
        return []
    with fs.open(f"{root}/{REFUSED_FILE}", "rb") as f:
        return [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]


def clear_pending(target: str) -> None:
    fs, root = fs_path(target)
    if fs.exists(f"{root}/{PENDING}"):
        fs.rm(f"{root}/{PENDING}")
        _remove_more(fs, root)
        if fs.exists(f"{root}/files"):
            fs.rm(f"{root}/files", recursive=True)


def load(target: str, files: Path, resumed_step: int | None = None,
         drop_ends: bool = False) -> tuple[dict, Iterable[dict]] | None:
    """The head and calls written to `target` (None: nothing there), the calls read a line at a time as they are
    iterated (each time anew), their files fetched into `files` then (never the calls the store refused: they stay
    in its refused.jsonl, `refused_in`). With `resumed_step` (a restart's): metrics of later steps are left out, the
    restart logs them again. `drop_ends`: an earlier job's end of the run (its status, its model's registration) is
    left out: this job ends it again."""
    fs, root = fs_path(target)
    head = _read_head(fs, root)
    return None if head is None else (head, _Kept(fs, root, head.get("id"), files, resumed_step, drop_ends))


@dataclasses.dataclass(frozen=True)
class _Kept:
    """The calls of a persisted outbox (`load`), streamed from its pending.jsonl at each iteration."""
    fs: Any
    root: str
    id: str | None  # the head's: names the MORE file of calls added later
    files: Path
    resumed_step: int | None
    drop_ends: bool

    def __iter__(self) -> Iterator[dict]:
        for line in self._lines():
            if line.strip():
                op = self._kept(json.loads(line))
                if op is not None:
                    yield op

    def _lines(self) -> Iterator[bytes]:
        with self.fs.open(f"{self.root}/{PENDING}", "rb") as f:
            f.readline()  # the head
            yield from f
        more = f"{self.root}/{MORE.format(id=self.id)}"
        if self.id and self.fs.exists(more):
            with self.fs.open(more, "rb") as f:
                yield from f

    def _kept(self, op: dict) -> dict | None:
        """`op` as the reader gets it (None: left out), its artifact fetched into `files`."""
        if self.drop_ends and ("status" in op or "register" in op):
            return None
        if "metrics" in op and self.resumed_step is not None:
            op = {**op, "metrics": [m for m in op["metrics"] if m[3] <= self.resumed_step]}
            if not op["metrics"]:
                return None
        if "file" in op:
            local, remote = self.files / op["file"], f"{self.root}/files/{op['file']}"
            if not local.exists() and self.fs.exists(remote):
                local.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get(remote, str(local), recursive=self.fs.isdir(remote))
        return op


def deliver_kept(target: str, uri: str | None = None, timeout_s: float = 600.0, extra: list[dict] = (), *,
                 run_id: str | None = None, shown_uri: str | None = None,
                 while_reachable: bool = False) -> OutboxReport:
    """Deliver the calls kept in `target` (and `extra` after them) to the run's store (`uri`, or the one they were
    meant for: the kept copy hides credentials) for up to `timeout_s` (`while_reachable`: only until a call finds the
    store away); what is still left stays in `target`. The report's `refused`: every call of the run set aside in
    `target`'s refused.jsonl (earlier attempts' included)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        head, kept = load(target, files_folder(folder)) or ({}, [])
        ops = iter(kept)
        first = next(ops, None)
        ops = itertools.chain([] if first is None else [first], ops)
        run_id, store = head.get("run_id", run_id), uri or head.get("uri")
        if first is None and not extra:
            return OutboxReport(0.0, 0, _count([]), None, len(refused_in(target)))
        if run_id is None or store is None:
            raise ValueError(f"{target}: no kept calls of a run (and no store named)")
        outbox = Outbox(MlflowClient(store), run_id, head.get("uri", shown_uri or store), folder,
                        carried=itertools.chain(ops, extra), unreachable_s=head.get("unreachable_s", 0.0), store=store)
        report = outbox.close(-1, timeout_s, keep_to=target, while_reachable=while_reachable, summary=False)
        return dataclasses.replace(report, refused=len(refused_in(target)))
