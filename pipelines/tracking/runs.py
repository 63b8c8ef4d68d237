"""A job's MLflow run from its start to its end: created or reopened, its params, config and tags, the end of a
training run with what rank 0 left undelivered (`tracked_run`), the results of the jobs that do not train, the end of
a sweep's trials."""
from __future__ import annotations

import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from pipelines.config import PROJECT_ROOT
from pipelines.tracking.logger import StepLogger
from pipelines.tracking.outbox import COMMAND, UNREACHABLE_METRIC, OutboxReport, register_model_version
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


def reopen_run(uri: str, run_id: str, config_yaml: str) -> int:
    """Continue an existing run: mark it running, count the resume (tag probvlp.resumes) and keep the
    resumed config next to the original. Returns the resume's number (1 for the first)."""
    client = MlflowClient(uri)
    attempt = int(client.get_run(run_id).data.tags.get("probvlp.resumes", "0")) + 1
    client.update_run(run_id, status="RUNNING")
    client.set_tag(run_id, "probvlp.resumes", str(attempt))
    client.log_text(run_id, redact_yaml(config_yaml), f"config_resume_{attempt}.yaml")
    return attempt


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
                config_yaml: str, tags: dict[str, str], register_as: str | None = None) -> Iterator[TrackedRun]:
    """The MLflow run of a training job (pretraining, the adapter): a resumed job reopens the run it started
    before (its step history goes on), any other starts one. On exit the run ends with `end_status` (and its
    model is registered under `register_as` when FINISHED; `TrackedRun.end`); an exception ends it FAILED."""
    existing = find_run(uri, experiment, run_name) if resumed else None
    if existing:
        reopen_run(uri, existing, config_yaml)
    run = TrackedRun(uri, existing or start_run(uri, experiment, run_name, params, config_yaml, tags),
                     register_as=register_as)
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
