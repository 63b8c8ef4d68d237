"""Rank 0's step metrics, tags and artifacts (`StepLogger`): through the outbox during training, in batches otherwise."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterable

from mlflow.entities import Metric, RunTag

from pipelines.config import STATE_DIR
from pipelines.tracking.outbox import (BATCH, COMMAND, LOGGED_THROUGH_TAG, UNREACHABLE_METRIC, Outbox,
                                       OutboxReport, replayed)
from pipelines.tracking.store import hide_credentials, worker_client


OUTBOX_DIR = STATE_DIR / "tracking_outbox"  # rank 0's outbox queue past its memory bound, and its artifact copies


def process_outbox(run_id: str) -> Path:
    """This process's outbox folder for the run (under OUTBOX_DIR): its queue past the memory bound and its artifact
    copies (pipelines.tracking.outbox.files_folder)."""
    return OUTBOX_DIR / f"{run_id}-{os.getpid()}"


class StepLogger:
    """Per-step metrics, tags and artifacts of a run.

    `background=True` (rank 0 of a training run): every call goes through an `Outbox` at once: a thread delivers it
    within seconds while the store answers, the loop never waits for the store, and what is not delivered yet travels
    with the run (`persist` at checkpoints, `carried` into the next attempt). A restart's replayed steps (after
    `resumed_from`) that an earlier attempt delivered are not delivered again; the store is never read on the way.

    Otherwise (tests, small tools) metrics are buffered and written in batches of `flush_every` (one MLflow call
    per flush), each flush recording the last step written (tag probvlp.logged_through); a restart from
    `resumed_from` reads the run once and skips of each key the replayed steps MLflow has."""

    def __init__(self, uri: str, run_id: str, flush_every: int | None = 500, resumed_from: int = 0, *,
                 background: bool = False, flush_timeout_s: float = 600.0,
                 carried: tuple[dict, Iterable[dict]] | None = None):
        self.client, self.run_id, self.flush_every = worker_client(uri, run_id), run_id, flush_every
        self.buffer: list = []
        self.logged_through, self.resumed_from = -1, resumed_from
        self.delivered: dict[str, int] = {}
        self.last_step = resumed_from
        self.flush_timeout_s = flush_timeout_s
        self.report: OutboxReport | None = None
        self.outbox = None
        if background:
            head, ops = carried or ({}, [])
            self.outbox = Outbox(self.client, run_id, hide_credentials(uri), process_outbox(run_id),
                                 replay_from=resumed_from, carried=ops, unreachable_s=head.get("unreachable_s", 0.0))
        elif resumed_from > 0:
            data = self.client.get_run(run_id).data
            self.logged_through = int(data.tags.get(LOGGED_THROUGH_TAG, -1))
            self.delivered = {m.key: m.step for m in data.to_proto().metrics}  # each key's latest step in MLflow

    def log(self, metrics: dict[str, float], step: int, event: bool = False) -> None:
        """`event`: metrics of what this attempt did (a save, a notice, its start), kept even where a restart replays
        their step; the others are the step's own records, logged once whichever attempt made them."""
        now = int(time.time() * 1000)
        self.last_step = max(self.last_step, step)
        if self.outbox:
            self.outbox.put_metrics([Metric(k, float(v), now, step) for k, v in metrics.items()], event)
            return
        # a replayed step's metrics that MLflow has from before the restart are left out (per key: the attempt that
        # logged the step's loss may have died before its evaluation)
        self.buffer += [Metric(k, float(v), now, step) for k, v in metrics.items()
                        if event or not replayed(k, step, self.resumed_from, self.delivered)]
        if self.flush_every is not None and len(self.buffer) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Write the buffered metrics (a background logger buffers nothing)."""
        if not self.buffer:
            return
        self.logged_through = max(self.logged_through, max(m.step for m in self.buffer))
        for i in range(0, len(self.buffer), BATCH):
            last = i + BATCH >= len(self.buffer)  # the tag goes with the last batch: one call, no extra request
            self.client.log_batch(self.run_id, metrics=self.buffer[i : i + BATCH],
                                  tags=[RunTag(LOGGED_THROUGH_TAG, str(self.logged_through))] if last else [])
        self.buffer = []

    def tag(self, key: str, value: str) -> None:
        if self.outbox:
            self.outbox.put({"tag": [key, value]})
        else:
            self.client.set_tag(self.run_id, key, value)

    def artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.outbox:
            self.outbox.put_file(Path(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def artifacts(self, folder: str | Path, artifact_path: str | None = None) -> None:
        if self.outbox:
            self.outbox.put_file(Path(folder), artifact_path)
        else:
            self.client.log_artifacts(self.run_id, str(folder), artifact_path)

    def persist(self, target: str) -> int:
        """What is not delivered yet, written to `target` (the run's storage) for the next attempt or the driver."""
        return self.outbox.persist(target) if self.outbox else 0

    def persist_more(self, target: str) -> int:
        """What was logged since the last `persist` to `target`, added beside it (a save's own records)."""
        return self.outbox.persist_more(target) if self.outbox else 0

    def close(self, keep_to: str | None = None) -> OutboxReport | None:
        """The end of the run's logging (again: nothing). With an outbox: wait for delivery while the store answers
        (up to `flush_timeout_s`), then what is left goes to `keep_to` (the run's storage, where the driver delivers
        it) or, without one, waits the whole `flush_timeout_s` and is kept in this node's folder."""
        self.flush()
        if self.outbox is None or self.report is not None:
            return self.report
        start = time.monotonic()
        self.report = report = self.outbox.close(self.last_step, self.flush_timeout_s, keep_to=keep_to,
                                                 while_reachable=keep_to is not None)
        uri = self.outbox.uri
        if report.kept_in is not None and keep_to is not None:
            print(f"[tracking] {uri} is not answering at the end of training: {report.pending} calls handed over "
                  f"in {report.kept_in}", flush=True)
        elif report.kept_in is not None:
            what = ", ".join(f"{n} {kind}" for kind, n in report.undelivered.items() if n)
            print(f"[tracking] {uri} did not answer for the last {report.unreachable_s:.0f} s of the run (waited "
                  f"{time.monotonic() - start:.0f} s, tracking.flush_timeout_s): NOT delivered to run {self.run_id}: "
                  f"{what}. Kept in {report.kept_in}; deliver them with: {COMMAND} {report.kept_in}", flush=True)
        elif report.unreachable_s > 0:
            print(f"[tracking] {uri} was unreachable for {report.unreachable_s:.1f} s over the run; everything logged "
                  f"meanwhile was delivered (MLflow metric {UNREACHABLE_METRIC})", flush=True)
        return report
