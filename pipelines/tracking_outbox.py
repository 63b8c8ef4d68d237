"""Rank 0's MLflow calls during training, queued in an `Outbox` and delivered in order by a background thread that
retries while the store is unreachable; what a store that never came back missed is kept for `replay_outbox`
(`python -m pipelines.tracking_outbox FOLDER [URI]`)."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, RunTag
from mlflow.exceptions import MlflowException


# Rank 0's MLflow calls during training go through an Outbox (StepLogger(background=True)): the training loop only
# queues them, a thread delivers them in order and retries while the store is unreachable.
LOGGED_THROUGH_TAG = "probvlp.logged_through"  # the last step a run's metrics are in MLflow for (StepLogger)
BATCH = 1000  # metrics per log_batch (MLflow's limit)
UNREACHABLE_METRIC = "tracking_unreachable_s"
UNREACHABLE_TAG = "probvlp.tracking_unreachable_s"
# MLflow's own defaults (7 retries, backoff factor 2, a 120-s timeout) hold one call for minutes, during which the
# thread cannot see the server come back; the outbox retries instead. The user's own settings win.
QUICK_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
RETRY_MAX_S = 5.0  # the longest pause between two tries: how late a returning server is seen at most
MEMORY_METRICS = 200_000  # ~40 MB of queued metrics, then the queue continues in a file


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


def _deliver(client, run_id: str, batch: list[dict], files: Path | None, unreachable_s: float) -> None:
    """One MLflow call for `batch`: queued ops (JSON: what the outbox keeps on disk), consecutive metrics together."""
    op = batch[0]
    if "metrics" in op:
        metrics = [Metric(k, v, ts, step) for o in batch for k, v, ts, step in o["metrics"]]
        through = [o["through"] for o in batch if o.get("through") is not None]
        client.log_batch(run_id, metrics=metrics,
                         tags=[RunTag(LOGGED_THROUGH_TAG, str(max(through)))] if through else [])
    elif "tag" in op:
        client.set_tag(run_id, *op["tag"])
    elif "file" in op:
        path = files / op["file"] if files is not None else Path(op["file"])
        (client.log_artifacts if path.is_dir() else client.log_artifact)(run_id, str(path), op["to"])
    elif "summary" in op:  # how long the store was unreachable, up to this call, which ends any outage
        seconds = op.get("seconds", unreachable_s)  # kept by a run that ended unreachable: its count
        client.log_batch(run_id, metrics=[Metric(UNREACHABLE_METRIC, round(seconds, 1), int(time.time() * 1000),
                                                 op["summary"])],
                         tags=[RunTag(UNREACHABLE_TAG, f"{seconds:.1f}")])


@dataclass
class OutboxReport:
    unreachable_s: float
    outages: int
    undelivered: dict[str, int]  # what the store never got: metrics, tags, artifacts
    kept_in: Path | None  # where it is (replay_outbox), None when everything was delivered


class Outbox:
    """One run's MLflow calls, delivered in the order they were made by a background thread that retries while the
    store is unreachable (pausing at most RETRY_MAX_S, so a returning server is seen within seconds). Queuing never
    waits for the store: past MEMORY_METRICS queued metrics the queue goes on in a file; artifact files are copied
    into the outbox's folder when queued (the caller's temporary folders go away)."""

    def __init__(self, client, run_id: str, uri: str, folder: Path):
        """`uri`: the store's, credentials hidden (it is printed, and kept with what was not delivered)."""
        self.client, self.run_id, self.uri = client, run_id, uri
        self.folder = folder
        self.files = self.folder / "files"
        self.spill = self.folder / "spill.jsonl"
        self.cv = threading.Condition()
        self.queue: deque[dict] = deque()
        self.in_memory = 0  # metrics in self.queue
        self.spilled = 0  # ops in the spill file not read back yet (queued after everything in self.queue)
        self.spill_offset = 0
        self.file_count = 0
        self.down_since: float | None = None
        self.unreachable_s, self.outages = 0.0, 0
        self.rejected: BaseException | None = None
        self.summary_s: float | None = None  # tracking_unreachable_s as delivered
        self.stopped = False
        self.wake = threading.Event()
        if uri.startswith(("http://", "https://")):
            for key, value in QUICK_HTTP.items():
                os.environ.setdefault(key, value)
        self.thread = threading.Thread(target=self._run, name=f"probvlp-tracking-{run_id[:8]}", daemon=True)
        self.thread.start()

    # --- the caller's side (the training loop): never waits for the store
    def put(self, op: dict) -> None:
        if self.rejected is not None:
            raise RuntimeError(f"MLflow refused a call of run {self.run_id}: {_one_line(self.rejected)}") \
                from self.rejected
        size = len(op.get("metrics", ()))
        with self.cv:
            if self.stopped:
                raise RuntimeError("the outbox is closed")
            if self.spilled or self.in_memory + size > MEMORY_METRICS:
                self.folder.mkdir(parents=True, exist_ok=True)
                with self.spill.open("a") as f:
                    f.write(json.dumps(op) + "\n")
                self.spilled += 1
            else:
                self.queue.append(op)
                self.in_memory += size
            self.cv.notify_all()

    def put_file(self, path: Path, artifact_path: str | None) -> None:
        self.file_count += 1
        name = f"{self.file_count:06d}/{path.name}"
        target = self.files / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.copytree(path, target)
        else:
            shutil.copyfile(path, target)
        self.put({"file": name, "to": artifact_path})

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

    def _run(self) -> None:
        pause = 1.0
        while True:
            with self.cv:
                while not self.stopped and not self._pending():
                    self.cv.wait()
                if self.stopped:
                    return
                batch = self._head()
            down = time.monotonic() - self.down_since if self.down_since is not None else 0.0
            try:
                _deliver(self.client, self.run_id, batch, self.files, self.unreachable_s + down)
                if "summary" in batch[0]:
                    self.summary_s = round(self.unreachable_s + down, 1)
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
                        print(f"[tracking] {self.uri} unreachable ({_one_line(err)}); training goes on, what it "
                              "logs is kept and delivered when the store answers again", flush=True)
                self.wake.wait(pause)
                self.wake.clear()
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            pause = 1.0
            with self.cv:
                if self.stopped:  # given up on meanwhile: what was kept is on disk already
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
                          f"meanwhile ({len(self.queue) + self.spilled + len(batch)} calls queued)", flush=True)
                self.cv.notify_all()

    # --- the end of the run
    def close(self, timeout_s: float, step: int) -> OutboxReport:
        """Queue the summary (metric tracking_unreachable_s at `step`), wait up to `timeout_s` for everything to be
        delivered, stop the thread. What is left is kept in the outbox's folder (outbox.jsonl, files/) for
        `replay_outbox`."""
        self.put({"summary": step})
        deadline = time.monotonic() + timeout_s
        self.wake.set()  # try now rather than after the current pause
        with self.cv:
            while self._pending() and self.rejected is None and time.monotonic() < deadline:
                self.cv.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            self.stopped = True
            self.cv.notify_all()
            down = time.monotonic() - self.down_since if self.down_since is not None else 0.0
            undelivered = {"metrics": 0, "tags": 0, "artifacts": 0}
            kept = None
            if self._pending():
                kept = self._keep(undelivered, self.unreachable_s + down)
            else:
                shutil.rmtree(self.folder, ignore_errors=True)
        self.wake.set()
        if self.rejected is not None:
            raise RuntimeError(f"MLflow refused a call of run {self.run_id}: {_one_line(self.rejected)}") \
                from self.rejected
        seconds = self.summary_s if self.summary_s is not None else self.unreachable_s + down
        return OutboxReport(seconds, self.outages, undelivered, kept)

    def _keep(self, counts: dict[str, int], unreachable_s: float) -> Path:
        """Everything not delivered, in order, to folder/outbox.jsonl (with the run and store it was meant for). A
        call in flight when the wait ran out may have been delivered too: a replay can repeat that one call."""
        ops = list(self.queue)
        if self.spilled:
            with self.spill.open() as f:
                f.seek(self.spill_offset)
                ops += [json.loads(line) for line in f]
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / "outbox.jsonl").open("w") as f:
            f.write(json.dumps({"run_id": self.run_id, "uri": self.uri}) + "\n")
            for op in ops:
                if "summary" in op:
                    op = {**op, "seconds": round(unreachable_s, 1)}
                f.write(json.dumps(op) + "\n")
                if "metrics" in op:
                    counts["metrics"] += len(op["metrics"])
                elif "tag" in op:
                    counts["tags"] += 1
                elif "file" in op:
                    counts["artifacts"] += 1
        self.spill.unlink(missing_ok=True)
        return self.folder


def replay_outbox(folder: str | Path, uri: str | None = None) -> int:
    """Deliver what a run's outbox kept (`python -m pipelines.tracking_outbox FOLDER [URI]`), in order; returns the
    number of calls made. The store is the one the run used unless `uri` is given (the kept copy hides credentials)."""
    folder = Path(folder)
    lines = (folder / "outbox.jsonl").read_text().splitlines()
    head = json.loads(lines[0])
    client = MlflowClient(uri or head["uri"])
    ops = [json.loads(line) for line in lines[1:]]
    for op in ops:
        _deliver(client, head["run_id"], [op], folder / "files", 0.0)
    (folder / "outbox.jsonl").rename(folder / "outbox.delivered.jsonl")
    return len(ops)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m pipelines.tracking_outbox OUTBOX_FOLDER [TRACKING_URI]")
    print(f"{replay_outbox(*sys.argv[1:])} calls delivered")
