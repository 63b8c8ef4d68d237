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
while the call was in flight may go twice."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, RunTag
from mlflow.exceptions import MlflowException

from pipelines.storage import fs_path, write_bytes_atomic

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
COMMAND = "python -m pipelines.tracking.deliver"  # pipelines/tracking/deliver.py


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def _rejected(err: BaseException) -> bool:
    """The store answered and refused the call (a bad value, a missing run): retrying cannot help. Anything else (no
    connection, a timeout, a 5xx, a 429, a relay being restarted) is an outage."""
    status = None
    if isinstance(err, MlflowException):
        status = err.get_http_status_code()
    elif getattr(err, "response", None) is not None:  # requests.HTTPError of an artifact upload
        status = getattr(err.response, "status_code", None)
    return status is not None and 400 <= status < 500 and status not in (408, 429)


def metrics_op(metrics: list[Metric], replay_from: int) -> dict:
    return {"metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics], "from": replay_from}


def _kept(op: dict, state: dict) -> list[list]:
    """A metrics op's entries that are not replays of what an earlier attempt delivered: of the steps from the op's
    `from` on, those whose key the store holds at that step or later. Per key, not up to the run's horizon: an attempt
    that delivered the last step's loss and died before the final evaluation did not deliver the evaluation's metrics
    at that step (delivery is in order, so a key's latest step bounds what was delivered of it). An op filtered by the
    attempt that knew the store's steps keeps its entries."""
    if op.get("filtered"):
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
    elif "register" in op:
        register_model_version(state["store"], run_id, op["register"])


def register_model_version(uri: str, run_id: str, name: str) -> str:
    """Register the run's MLflow model as a new version of `name`; returns the version."""
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    source = client.get_run(run_id).info.artifact_uri.rstrip("/") + "/model"
    return str(client.create_model_version(name, source=source, run_id=run_id).version)


def _count(ops: list[dict]) -> dict[str, int]:
    counts = {"metrics": 0, "tags": 0, "artifacts": 0, "other": 0}
    for op in ops:
        key = "metrics" if "metrics" in op else "tags" if "tag" in op else "artifacts" if "file" in op else "other"
        counts[key] += len(op["metrics"]) if key == "metrics" else 1
    return counts


@dataclass
class OutboxReport:
    unreachable_s: float
    outages: int
    undelivered: dict[str, int]  # what the store did not get: metrics, tags, artifacts, other (status, summary)
    kept_in: str | None  # where it is (`deliver_kept`), None when everything was delivered

    @property
    def pending(self) -> int:
        return sum(self.undelivered.values())


class Outbox:
    """One run's MLflow calls, delivered in the order they were made by a background thread that retries while the
    store is unreachable (pausing at most RETRY_MAX_S, so a returning server is seen within seconds). Queuing never
    waits for the store: past MEMORY_METRICS queued metrics the queue goes on in a file in `folder` (this node's);
    artifact files are copied there when queued (the caller's temporary folders go away).

    `replay_from`: the step this attempt resumed from (its later steps may be replays); `carried`: an earlier attempt's
    undelivered calls (`load`), delivered first; `unreachable_s`: the seconds earlier attempts found the store away."""

    def __init__(self, client, run_id: str, uri: str, folder: Path, *, replay_from: int = -1,
                 carried: list[dict] = (), unreachable_s: float = 0.0, store: str | None = None):
        """`uri`: the store's, credentials hidden (it is printed, and kept with what was not delivered); `store`:
        the store itself, for a model's registration (the driver's outbox only)."""
        self.client, self.run_id, self.uri = client, run_id, uri
        self.replay_from = replay_from
        self.folder = folder
        self.files = self.folder / "files"
        self.spill = self.folder / "spill.jsonl"
        self.cv = threading.Condition()
        self.queue: deque[dict] = deque()
        self.in_memory = 0  # metrics in self.queue
        self.spilled = 0  # ops in the spill file not read back yet (queued after everything in self.queue)
        self.spill_offset = 0
        self.state = {"horizon": None, "through": -1, "latest": {}, "store": store}
        self.down_since: float | None = None
        self.unreachable_s, self.outages = unreachable_s, 0
        self.rejected: BaseException | None = None
        self.stopped = False
        self.wake = threading.Event()
        if uri.startswith(("http://", "https://")):
            for key, value in QUICK_HTTP.items():
                os.environ.setdefault(key, value)
        for op in carried:
            self._queue(op)
        self.thread = threading.Thread(target=self._run, name=f"probvlp-tracking-{run_id[:8]}", daemon=True)
        self.thread.start()

    # --- the caller's side (the training loop): never waits for the store
    def put(self, op: dict) -> None:
        if self.rejected is not None:
            raise RuntimeError(f"MLflow refused a call of run {self.run_id}: {_one_line(self.rejected)}") \
                from self.rejected
        with self.cv:
            if self.stopped:
                raise RuntimeError("the outbox is closed")
            self._queue(op)
            self.cv.notify_all()

    def _queue(self, op: dict) -> None:
        size = len(op.get("metrics", ()))
        if self.spilled or self.in_memory + size > MEMORY_METRICS:
            self.folder.mkdir(parents=True, exist_ok=True)
            with self.spill.open("a") as f:
                f.write(json.dumps(op) + "\n")
            self.spilled += 1
        else:
            self.queue.append(op)
            self.in_memory += size

    def put_metrics(self, metrics: list[Metric]) -> None:
        self.put(metrics_op(metrics, self.replay_from))

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
        """The next call's ops (left queued until delivered): consecutive metrics up to BATCH, else one op."""
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
        batch = [self.queue[0]]
        if "metrics" in batch[0]:
            total = len(batch[0]["metrics"])
            for op in itertools.islice(self.queue, 1, None):
                if "metrics" not in op or total + len(op["metrics"]) > BATCH:
                    break
                batch.append(op)
                total += len(op["metrics"])
        return batch

    def _read_horizon(self) -> None:
        """What earlier attempts delivered: the highest step, and each key's latest step (the one read of the store)."""
        data = self.client.get_run(self.run_id).data
        through = int(data.tags.get(LOGGED_THROUGH_TAG, -1))
        latest = {m.key: m.step for m in data.to_proto().metrics}
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
            except Exception as err:  # noqa: BLE001 - every failure is either a refusal or an outage
                with self.cv:
                    if _rejected(err):
                        self.rejected = err
                        print(f"[tracking] MLflow refused a call of run {self.run_id}: {_one_line(err)}", flush=True)
                        self.stopped = True
                        self.cv.notify_all()
                        return
                    if self.down_since is None:
                        self.down_since, self.outages = time.monotonic(), self.outages + 1
                        print(f"[tracking] {self.uri} unreachable ({_one_line(err)}); nothing waits for it: what is "
                              "logged is kept and delivered when the store answers again", flush=True)
                    self.cv.notify_all()
                self.wake.wait(pause)
                self.wake.clear()
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            pause = 1.0
            with self.cv:
                if self.stopped:  # given up on meanwhile: what was kept is persisted already
                    return
                for op in batch:
                    self.queue.popleft()
                    self.in_memory -= len(op.get("metrics", ()))
                    if "file" in op:
                        shutil.rmtree(self.files / op["file"].split("/")[0], ignore_errors=True)
                if self.down_since is not None:
                    down = time.monotonic() - self.down_since
                    self.unreachable_s += down
                    self.down_since = None
                    print(f"[tracking] {self.uri} reachable again after {down:.0f} s; delivering what was logged "
                          f"meanwhile ({len(self.queue) + self.spilled} calls queued)", flush=True)
                self.cv.notify_all()

    # --- what is left, and the end
    def snapshot(self) -> list[dict]:
        """Every call not delivered yet (the one in flight too), in order; metrics filtered by this attempt's horizon
        where it is known (a later attempt must not use its own for them)."""
        with self.cv:
            ops = list(self.queue)
            if self.spilled:
                with self.spill.open() as f:
                    f.seek(self.spill_offset)
                    ops += [json.loads(line) for line in f]
        if self.state["horizon"] is None:
            return ops
        filtered = [{**op, "metrics": _kept(op, self.state), "filtered": True} if "metrics" in op else op for op in ops]
        return [op for op in filtered if op.get("metrics", True)]

    def persist(self, target: str) -> int:
        """Write what is not delivered yet to the folder `target` (a local path or an fsspec URI: the run's storage)
        for the next attempt or the driver, replacing what an earlier call wrote there; returns the calls written."""
        ops = self.snapshot()
        return write_pending(target, self.run_id, self.uri, ops, self.files, self.total_unreachable_s())

    def wait(self, timeout_s: float, while_reachable: bool = False) -> bool:
        """Wait up to `timeout_s` for the queue to be delivered (`while_reachable`: only while the store answers);
        whether it was."""
        deadline = time.monotonic() + timeout_s
        self.wake.set()  # try now rather than after the current pause
        with self.cv:
            while (self._pending() or self.state["horizon"] is None) and self.rejected is None \
                    and time.monotonic() < deadline:
                if while_reachable and self.down_since is not None:
                    break
                self.cv.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            return not self._pending() and self.rejected is None

    def close(self, step: int, timeout_s: float, *, keep_to: str | None = None, while_reachable: bool = False,
              summary: bool = True) -> OutboxReport:
        """Queue the summary (metric tracking_unreachable_s at `step`), wait up to `timeout_s` for everything to be
        delivered (`while_reachable`: only while the store answers), stop the thread. What is left is written to
        `keep_to` (`persist`) or, without one, to this node's folder."""
        if summary:
            self.put({"summary": step, "at": int(time.time() * 1000)})
        self.wait(timeout_s, while_reachable)
        with self.cv:
            self.stopped = True
            self.cv.notify_all()
        self.wake.set()
        self.thread.join(timeout=5)
        if self.rejected is not None:
            raise RuntimeError(f"MLflow refused a call of run {self.run_id}: {_one_line(self.rejected)}") \
                from self.rejected
        ops = self.snapshot()
        kept = None
        if ops:
            kept = keep_to or str(self.folder)
            write_pending(kept, self.run_id, self.uri, ops, self.files, self.total_unreachable_s())
        elif keep_to:
            clear_pending(keep_to)
        if not ops or keep_to:
            shutil.rmtree(self.folder, ignore_errors=True)
        return OutboxReport(self.total_unreachable_s(), self.outages, _count(ops), kept)


# --- an outbox at rest: a folder (local or object storage) holding pending.jsonl and the files it names
def write_pending(target: str, run_id: str, uri: str, ops: list[dict], files: Path, unreachable_s: float) -> int:
    fs, root = fs_path(target)
    if not ops:
        clear_pending(target)
        return 0
    for op in ops:
        if "file" in op and (files / op["file"]).exists():
            remote = f"{root}/files/{op['file']}"
            if not fs.exists(remote):
                fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
                fs.put(str(files / op["file"]), remote, recursive=(files / op["file"]).is_dir())
    head = {"run_id": run_id, "uri": uri, "unreachable_s": round(unreachable_s, 1)}
    text = "".join(json.dumps(line) + "\n" for line in [head, *ops])
    fs.makedirs(root, exist_ok=True)
    write_bytes_atomic(fs, f"{root}/{PENDING}", text.encode())
    return len(ops)


def clear_pending(target: str) -> None:
    fs, root = fs_path(target)
    if fs.exists(f"{root}/{PENDING}"):
        fs.rm(f"{root}/{PENDING}")
        if fs.exists(f"{root}/files"):
            fs.rm(f"{root}/files", recursive=True)


def load(target: str, files: Path, resumed_step: int | None = None,
         drop_ends: bool = False) -> tuple[dict, list[dict]] | None:
    """The head and calls written to `target` (None: nothing there), their files fetched into `files`. With
    `resumed_step` (a restart's): metrics of later steps are left out, the restart logs them again. `drop_ends`: an
    earlier job's end of the run (its status, its model's registration) is left out: this job ends it again."""
    fs, root = fs_path(target)
    if not fs.exists(f"{root}/{PENDING}"):
        return None
    with fs.open(f"{root}/{PENDING}", "rb") as f:
        lines = f.read().decode().splitlines()
    head, ops = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    kept = []
    for op in ops:
        if drop_ends and ("status" in op or "register" in op):
            continue
        if "metrics" in op and resumed_step is not None:
            op = {**op, "metrics": [m for m in op["metrics"] if m[3] <= resumed_step]}
            if not op["metrics"]:
                continue
        if "file" in op:
            local = files / op["file"]
            if not local.exists() and fs.exists(f"{root}/files/{op['file']}"):
                local.parent.mkdir(parents=True, exist_ok=True)
                fs.get(f"{root}/files/{op['file']}", str(local), recursive=fs.isdir(f"{root}/files/{op['file']}"))
        kept.append(op)
    return head, kept


def deliver_kept(target: str, uri: str | None = None, timeout_s: float = 600.0, extra: list[dict] = (), *,
                 run_id: str | None = None, shown_uri: str | None = None) -> OutboxReport:
    """Deliver the calls kept in `target` (and `extra` after them) to the run's store (`uri`, or the one they were
    meant for: the kept copy hides credentials) for up to `timeout_s`; what is still left stays in `target`."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        head, ops = load(target, folder / "files") or ({}, [])
        run_id, store = head.get("run_id", run_id), uri or head.get("uri")
        if not ops and not extra:
            return OutboxReport(0.0, 0, _count([]), None)
        if run_id is None or store is None:
            raise ValueError(f"{target}: no kept calls of a run (and no store named)")
        outbox = Outbox(MlflowClient(store), run_id, head.get("uri", shown_uri or store), folder,
                        carried=[*ops, *extra], unreachable_s=head.get("unreachable_s", 0.0), store=store)
        return outbox.close(-1, timeout_s, keep_to=target, summary=False)
