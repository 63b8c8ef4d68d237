"""A job's MLflow run from its start to its end: created or reopened, its params, config and tags, the end of a
training run with what rank 0 left undelivered (`tracked_run`), the results of the jobs that do not train, the end of
a sweep's trials."""
from __future__ import annotations

import json
import subprocess
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from pipelines.config import PROJECT_ROOT
from pipelines.tracking.logger import StepLogger
from pipelines.storage import fs_path, read_json, write_bytes_atomic
from pipelines.tracking.outbox import (COMMAND, REFUSED, STORE_REFUSALS, UNREACHABLE_METRIC, OutboxReport,
                                       add_to_pending, answer_of, fail_fast, one_line, register_model_version,
                                       reopen)
from pipelines.tracking.store import experiment_id, hide_credentials, is_local_store, redact, redact_yaml


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def start_run(uri: str, experiment: str, run_name: str, params: dict[str, Any], config_yaml: str,
              tags: dict[str, str]) -> str:
    """Create the run (driver side); returns its id, which Ray workers use to log into it."""
    client = MlflowClient(uri)
    run = client.create_run(experiment_id(client, uri, experiment), run_name=run_name,
                            tags={k: v for k, v in tags.items() if v})
    items = [Param(k, str(v)[:6000]) for k, v in redact(params).items()]
    for i in range(0, len(items), 100):
        client.log_batch(run.info.run_id, params=items[i : i + 100])
    client.log_text(run.info.run_id, redact_yaml(config_yaml), "config.yaml")
    return run.info.run_id


def find_run(uri: str, experiment: str, run_name: str) -> str | None:
    """The latest MLflow run created for `run_name` (tag probvlp.run_name), if any."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`probvlp.run_name` = '{run_name}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def reopen_run(uri: str, run_id: str, config_yaml: str, key: str | None = None) -> int:
    """Continue an existing run: mark it running, count the resume (tag probvlp.resumes) and keep the
    resumed config next to the original. Returns the resume's number (1 for the first). `key`: outbox.reopen's."""
    return reopen(MlflowClient(uri), run_id, redact_yaml(config_yaml), key)


# In a training run's storage folder (run.storage_path/NAME/probvlp/): its MLflow run, so that a resume finds it
# without asking the store.
RUN_RECORD = "mlflow_run.json"


def _recorded_run(record_in: str | None) -> str | None:
    if record_in is None:
        return None
    fs, path = fs_path(f"{record_in}/{RUN_RECORD}")
    return (read_json(fs, path) or {}).get("run_id")


def _record_run(record_in: str | None, run_id: str) -> None:
    if record_in is not None:
        fs, path = fs_path(f"{record_in}/{RUN_RECORD}")
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        write_bytes_atomic(fs, path, json.dumps({"run_id": run_id}).encode())


def _resume(uri: str, experiment: str, run_name: str, config_yaml: str, record_in: str | None,
            pending_in: str | None) -> str | None:
    """The MLflow run a resumed job continues, reopened: the one its storage records (no store asked to find it),
    else the latest of `run_name` in the store (runs that predate the record). With the store away, a recorded run
    resumes without it: its reopening is handed to the run's next rank 0 in `pending_in` (delivered first, with what
    the run logs, once the store answers), in one line. None: no run to resume (a new one is started)."""
    recorded = _recorded_run(record_in)
    if recorded is None:
        existing = find_run(uri, experiment, run_name)
        if existing:
            reopen_run(uri, existing, config_yaml)
        return existing
    fail_fast(uri)  # one try a call, bounded: the resume does not wait on the store
    key = uuid.uuid4().hex[:12]  # the try below and its queued copy are one resume, counted once
    try:
        reopen_run(uri, recorded, config_yaml, key)
    except Exception as err:  # noqa: BLE001 - the store's answer, or its absence
        # the run is not in the store (deleted, or another store on the same storage): a new one
        if answer_of(err, {}, Path()) == REFUSED or getattr(err, "error_code", None) in STORE_REFUSALS:
            print(f"[tracking] run {recorded} of the run's storage is refused by {hide_credentials(uri)} "
                  f"({one_line(err)}): a new MLflow run is started", flush=True)
            return None
        if pending_in is None or is_local_store(uri):  # nowhere to hand it over, or no outage: a file on this node
            raise
        add_to_pending(pending_in, recorded, uri, [{"reopen": redact_yaml(config_yaml), "key": key}])
        print(f"[tracking] {hide_credentials(uri)} is away as the run resumes ({one_line(err)}): run {recorded} "
              "goes on without it; its reopening and what the run logs are delivered when it answers", flush=True)
    return recorded


def finish_run(uri: str, run_id: str, status: str = "FINISHED") -> None:
    MlflowClient(uri).set_terminated(run_id, status=status)


@dataclass
class TrackedRun:
    """A training job's MLflow run while `tracked_run` holds it: the store, the run, and how it is to end."""

    uri: str
    run_id: str
    end_status: str = "FINISHED"  # KILLED: stopped before its last step (resumable)
    register_as: str | None = None  # a Model Registry name: the run's model becomes a new version on FINISHED
    registered_version: str | None = None
    # The run's storage folder where rank 0 leaves what it could not deliver (pipelines.tracking.outbox): the driver
    # delivers it, then the run's end, for up to `flush_timeout_s`; what the store still did not take stays there.
    pending_in: str | None = None
    flush_timeout_s: float = 600.0
    kept: OutboxReport | None = None

    def logger(self, flush_every: int | None = None) -> StepLogger:
        return StepLogger(self.uri, self.run_id, flush_every)

    def end(self) -> None:
        """The run's end (status, then the model's registration) after what rank 0 left, off the workers: delivered
        for up to `flush_timeout_s`, or kept in `pending_in` with one line saying how to deliver it later."""
        register = self.register_as if self.end_status == "FINISHED" else None
        if self.pending_in is None:
            finish_run(self.uri, self.run_id, self.end_status)
            if register:
                self.registered_version = register_model_version(self.uri, self.run_id, register)
            return
        from pipelines.tracking.outbox import deliver_kept

        final = [{"status": self.end_status}, *([{"register": register}] if register else [])]
        self.kept = report = deliver_kept(self.pending_in, self.uri, self.flush_timeout_s, extra=final,
                                          run_id=self.run_id, shown_uri=hide_credentials(self.uri))
        if report.kept_in is not None:
            what = ", ".join(f"{n} {kind}" for kind, n in report.undelivered.items() if n)
            print(f"[tracking] {hide_credentials(self.uri)} did not answer within tracking.flush_timeout_s "
                  f"({self.flush_timeout_s:g} s) after training: {report.pending} calls of run {self.run_id} are "
                  "pending "
                  f"({what}; the run's status {self.end_status} last) in {report.kept_in}; deliver them with: "
                  f"{COMMAND} {report.kept_in}", flush=True)
            return
        if report.unreachable_s > 0:
            print(f"[tracking] {hide_credentials(self.uri)} was unreachable for {report.unreachable_s:.1f} s over the "
                  f"run; everything logged meanwhile was delivered (MLflow metric {UNREACHABLE_METRIC})", flush=True)
        if report.refused:  # every attempt's, set aside in the run's storage: never retried, never blocking the end
            print(f"[tracking] {report.refused} calls of run {self.run_id} were refused by MLflow and set aside (not "
                  f"retried): listed in {self.pending_in or 'the outbox folder'}/refused.jsonl", flush=True)
        if register:
            versions = MlflowClient(self.uri, registry_uri=self.uri).search_model_versions(
                f"name='{register}' and run_id='{self.run_id}'")
            self.registered_version = str(max(int(v.version) for v in versions)) if versions else None


    def fail(self) -> None:
        """The run ends FAILED without waiting on a store that is away: the status queued after what rank 0 left
        (`pending_in`, else this node's outbox folder) and delivered while the store answers, each call bounded by
        the outbox's client timeout; at the first call that finds it away, all of it is kept with one line naming
        the command that delivers it. The job's own error follows at once either way."""
        from pipelines.tracking.logger import OUTBOX_DIR
        from pipelines.tracking.outbox import deliver_kept

        target = self.pending_in or str(OUTBOX_DIR / f"{self.run_id}-failed")
        shown = hide_credentials(self.uri)
        self.kept = report = deliver_kept(target, self.uri, self.flush_timeout_s, extra=[{"status": "FAILED"}],
                                          run_id=self.run_id, shown_uri=shown, while_reachable=True)
        if report.kept_in is not None:
            print(f"[tracking] {shown} is away as the job fails: run {self.run_id}'s FAILED status and "
                  f"{report.pending - 1} calls before it are kept in {report.kept_in}; deliver them with: {COMMAND} "
                  f"{report.kept_in}", flush=True)


@contextmanager
def tracked_run(uri: str, experiment: str, run_name: str, *, resumed: bool, params: dict[str, Any],
                config_yaml: str, tags: dict[str, str], register_as: str | None = None,
                record_in: str | None = None, pending_in: str | None = None) -> Iterator[TrackedRun]:
    """The MLflow run of a training job (pretraining, the adapter): a resumed job reopens the run it started
    before (its step history goes on; `_resume`: the run recorded in `record_in`, the run's storage folder, needs no
    store), any other starts one (and records it there). On exit the run ends with `end_status` (and its
    model is registered under `register_as` when FINISHED; `TrackedRun.end`); an exception ends it FAILED.
    `pending_in`: where rank 0 leaves what it did not deliver (`TrackedRun.pending_in`)."""
    existing = _resume(uri, experiment, run_name, config_yaml, record_in, pending_in) if resumed else None
    if existing is None:
        existing = start_run(uri, experiment, run_name, params, config_yaml, tags)
        _record_run(record_in, existing)
    run = TrackedRun(uri, existing, register_as=register_as, pending_in=pending_in)
    # a store on this node's disk, and workers that may run on other nodes: they log through this node
    # (pipelines.tracking.relay). On one machine they write the store themselves: the relay's actor would add a
    # process and seconds to every run's start for nothing.
    import ray  # deferred: see worker_client

    from pipelines.cluster.check import spans_nodes
    from pipelines.tracking.relay import start_relay

    relay = None
    try:
        if is_local_store(uri) and ray.is_initialized() and spans_nodes():
            relay = start_relay(uri, run.run_id)
        yield run
    except BaseException:
        try:
            run.fail()
        except Exception as err:  # noqa: BLE001 - the job's own error is the one to show
            print(f"[tracking] could not end run {run.run_id} FAILED ({type(err).__name__}); the job's error "
                  "follows", flush=True)
        raise
    finally:
        if relay is not None:
            ray.kill(relay)
    run.end()


def finish_with_results(uri: str, run_id: str, metrics: dict[str, float], files: list[tuple[Path, str | None]] = (),
                        texts: dict[str, str] | None = None) -> None:
    """A run's results, then end it: metrics (step 0), files (local path, artifact folder or None for the
    root) and texts (artifact file name -> text). Evaluations, downloads and sweeps' parent runs."""
    client = MlflowClient(uri)
    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
    for i in range(0, len(items), 1000):
        client.log_batch(run_id, metrics=items[i : i + 1000])
    for path, folder in files:
        client.log_artifact(run_id, str(path), folder)
    for name, text in (texts or {}).items():
        client.log_text(run_id, text, name)
    client.set_terminated(run_id, "FINISHED")


def end_trial_runs(uri: str, experiment: str, trial_id: str, trial_status: str, run_status: str) -> None:
    """Tag a sweep trial's MLflow run (tag probvlp.trial_id) with how the trial ended, and end it if still
    running (Tune stopped the trial before its fit() returned) with `run_status`. Earlier runs of the trial
    (an interrupted sweep's) are tagged "interrupted" and end as KILLED."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`probvlp.trial_id` = '{trial_id}'")
    runs.sort(key=lambda r: r.info.start_time)
    # Earlier runs were left by a sweep interrupted during this trial, which then ran again.
    ends = [(r, "interrupted", "KILLED") for r in runs[:-1]] + [(r, trial_status, run_status) for r in runs[-1:]]
    for child, how, final in ends:
        client.set_tag(child.info.run_id, "probvlp.trial_status", how)
        if child.info.status == "RUNNING":
            client.set_terminated(child.info.run_id, final)
