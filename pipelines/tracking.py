"""MLflow: where runs go, the run's params/config/tags, and rank 0's buffered step metrics (delivered in the
background during training: `pipelines.tracking_outbox`)."""
from __future__ import annotations

import os
import re
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterator

from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts
from mlflow.entities import Metric, Param, RunTag

import models
from pipelines.config import PROJECT_ROOT, STATE_DIR
from pipelines.mlflow_store import prepare_sqlite_store
from pipelines.tracking_outbox import (BATCH, COMMAND, LOGGED_THROUGH_TAG, UNREACHABLE_METRIC, Outbox, OutboxReport,
                                       register_model_version)


# Whole words of the key (between ".", "_", "-"): hf_token and db.password are hidden, mixture_tokens is a knob.
_SECRET_KEY = re.compile(r"(?:^|[._-])(token|secret|password|passwd|api[_-]?key|credentials?)(?:$|[._-])", re.I)
_URI_CREDENTIALS = re.compile(r"(//)[^/@\s]+:[^/@\s]+@")


def tracking_uri(configured: str | None = None) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else a sqlite store in the project folder. A sqlite store that does
    not exist yet is created here, from a copy of an empty one (pipelines.mlflow_store)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{STATE_DIR / 'mlflow.db'}"
    prepare_sqlite_store(uri, sqlite_artifact_root(uri))
    return uri


def hide_credentials(text: str) -> str:
    """`text` with the user:password of any URI in it replaced by ***."""
    return _URI_CREDENTIALS.sub(r"\1***@", text)


def redact(params: dict[str, Any]) -> dict[str, Any]:
    """Hide values of secret-looking keys and credentials embedded in URIs."""
    out = {}
    for key, value in params.items():
        if _SECRET_KEY.search(key):
            out[key] = "***"
        elif isinstance(value, str):
            out[key] = hide_credentials(value)
        else:
            out[key] = value
    return out


def sqlite_artifact_root(uri: str) -> str | None:
    """`mlartifacts/` beside a sqlite store's file, as an absolute URI (None for other stores).

    MLflow's default for a database store is `./mlruns` of whichever process creates the experiment:
    Ray workers (other working directories) would scatter a run's artifacts, and a run from a
    checkout would write into it."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or uri[len(prefix):] in ("", ":memory:"):
        return None
    return (Path(uri[len(prefix):]).resolve().parent / "mlartifacts").as_uri()


def experiment_id(client, uri: str, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = sqlite_artifact_root(uri)
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # created concurrently by another process
        return client.get_experiment_by_name(name).experiment_id


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
    client.log_text(run.info.run_id, config_yaml, "config.yaml")
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
    client.log_text(run_id, config_yaml, f"config_resume_{attempt}.yaml")
    return attempt




def is_local_store(uri: str) -> bool:
    """A store on this node's disk (sqlite file, plain path), as opposed to a server or database every node reaches."""
    return uri.startswith(("sqlite:///", "file:")) or "://" not in uri


def worker_client(uri: str, run_id: str):
    """The client a Ray worker logs run `run_id` with: through the run's relay when `tracked_run` started one (a
    store on the driver's disk, a job that may span nodes), else straight to the store."""
    if is_local_store(uri):
        # deferred: Ray loads where runs are logged, not where a job only parses its config
        import ray

        from pipelines.tracking_relay import RelayClient

        if ray.is_initialized():
            try:
                return RelayClient(run_id)
            except ValueError:  # no relay: a run logged outside tracked_run, on its own node
                pass
    return MlflowClient(uri)


OUTBOX_DIR = STATE_DIR / "tracking_outbox"  # rank 0's outbox queue past its memory bound, and its artifact copies


class StepLogger:
    """Per-step metrics, tags and artifacts of a run.

    `background=True` (rank 0 of a training run): every call goes through an `Outbox` at once: a thread delivers it
    within seconds while the store answers, the loop never waits for the store, and what is not delivered yet travels
    with the run (`persist` at checkpoints, `carried` into the next attempt). A restart's replayed steps (after
    `resumed_from`) that an earlier attempt delivered are not delivered again; the store is never read on the way.

    Otherwise (the adapter's fit, tests) metrics are buffered and written in batches of `flush_every` (one MLflow call
    per flush), each flush recording the last step written (tag probvlp.logged_through); a restart from
    `resumed_from` reads it once and skips the steps up to it."""

    def __init__(self, uri: str, run_id: str, flush_every: int | None = 500, resumed_from: int = 0, *,
                 background: bool = False, flush_timeout_s: float = 600.0,
                 carried: tuple[dict, list[dict]] | None = None):
        self.client, self.run_id, self.flush_every = worker_client(uri, run_id), run_id, flush_every
        self.buffer: list = []
        self.logged_through, self.resumed_from = -1, resumed_from
        self.last_step = resumed_from
        self.flush_timeout_s = flush_timeout_s
        self.report: OutboxReport | None = None
        self.outbox = None
        if background:
            head, ops = carried or ({}, [])
            self.outbox = Outbox(self.client, run_id, hide_credentials(uri), OUTBOX_DIR / f"{run_id}-{os.getpid()}",
                                 replay_from=resumed_from, carried=ops, unreachable_s=head.get("unreachable_s", 0.0))
        elif resumed_from > 0:
            self.logged_through = int(self.client.get_run(run_id).data.tags.get(LOGGED_THROUGH_TAG, -1))

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.last_step = max(self.last_step, step)
        if self.outbox:
            self.outbox.put_metrics([Metric(k, float(v), now, step) for k, v in metrics.items()])
            return
        if self.resumed_from < step <= self.logged_through:
            return  # a replayed step that MLflow has from before the restart
        self.buffer += [Metric(k, float(v), now, step) for k, v in metrics.items()]
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


def _requirement(package: str) -> str:
    try:
        return f"{package}=={version(package).split('+')[0]}"
    except PackageNotFoundError:
        return package


SERVING_REQUIREMENTS = ("torch", "numpy", "pandas", "safetensors", "open_clip_torch", "opencv-python-headless")


def save_mlflow_model(model_file: Path, dst: Path, example_image: bytes, example_caption: str,
                      probabilistic: bool) -> Path:
    """An MLflow pyfunc model folder for a probvlp model file (models/serving.py), with its code, signature,
    input example and pip requirements; log it with `StepLogger.artifacts(dst, "model")`."""
    # deferred: mlflow.pyfunc and pandas load only where a model is saved (rank 0, once per run)
    import mlflow.pyfunc
    import pandas as pd
    from mlflow.models import ModelSignature
    from mlflow.types import DataType
    from mlflow.types.schema import AnyType, Array, ColSpec, Schema

    outputs = ["image_mu", "text_mu"] + (["image_sigma2", "text_sigma2"] if probabilistic else [])
    # image untyped: encoded bytes, or base64 text over REST. MLflow's scoring server decodes a `binary` column
    # itself and fails on a None row (a request mixing images and captions); models/serving.py decodes instead
    signature = ModelSignature(
        inputs=Schema([ColSpec(AnyType(), "image", required=False),
                       ColSpec(DataType.string, "caption", required=False)]),
        outputs=Schema([ColSpec(Array(DataType.float), name, required=False) for name in outputs]))
    mlflow.pyfunc.save_model(
        path=str(dst), loader_module="models.serving", data_path=str(model_file),
        code_paths=[str(Path(models.__file__).parent)], signature=signature,
        input_example=pd.DataFrame({"image": [example_image], "caption": [example_caption]}),
        pip_requirements=[_requirement(p) for p in SERVING_REQUIREMENTS])
    return dst


def model_file(folder: Path) -> Path:
    """The probvlp weights file inside a downloaded `model` artifact folder (the MLflow model's data)."""
    return folder / "data" / "model.safetensors"


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
    # The run's storage folder where rank 0 leaves what it could not deliver (pipelines.tracking_outbox): the driver
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
        from pipelines.tracking_outbox import deliver_kept

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
        if register:
            versions = MlflowClient(self.uri, registry_uri=self.uri).search_model_versions(
                f"name='{register}' and run_id='{self.run_id}'")
            self.registered_version = str(max(int(v.version) for v in versions)) if versions else None


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
    # (pipelines.tracking_relay). On one machine they write the store themselves: the relay's actor would add a
    # process and seconds to every run's start for nothing.
    import ray  # deferred: see worker_client

    from pipelines.cluster.check import spans_nodes
    from pipelines.tracking_relay import start_relay

    relay = None
    try:
        if is_local_store(uri) and ray.is_initialized() and spans_nodes():
            relay = start_relay(uri, run.run_id)
        yield run
    except BaseException:
        try:
            finish_run(uri, run.run_id, "FAILED")
        except Exception as err:  # noqa: BLE001 - the store away too: the job's own error is the one to show
            print(f"[tracking] could not mark run {run.run_id} FAILED ({type(err).__name__}); the job's error "
                  "follows", flush=True)
        raise
    finally:
        if relay is not None:
            ray.kill(relay)
    run.end()


def resolve_model(source: str, uri: str, dst: str | Path) -> dict[str, Any]:
    """A model to evaluate: a .safetensors file, `runs:/<run_id>/model`, or a run id.

    Returns {"model": path, "loss": path or None (loss.safetensors beside the model), "run_id": source run
    or None, "config": the source run's config.yaml text or None}."""
    path = Path(source)
    if path.is_file():
        # beside the weights, or, for the weights of a downloaded MLflow model (<model>/data/), in <model>/
        beside = [path.with_name("loss.safetensors")]
        if (path.parent.parent / "MLmodel").is_file():
            beside.append(path.parent.parent / "loss.safetensors")
        loss = next((p for p in beside if p.is_file()), None)
        return {"model": path, "loss": loss, "run_id": None, "config": None}
    run_id = source[len("runs:/"):].split("/")[0] if source.startswith("runs:/") else source
    if not re.fullmatch(r"[0-9a-f]{32}", run_id):
        raise ValueError(f"--model {source!r}: not a file, runs:/<run_id>/model, or an MLflow run id")
    try:
        folder = Path(download_artifacts(run_id=run_id, artifact_path="model", dst_path=str(dst), tracking_uri=uri))
        config = Path(download_artifacts(run_id=run_id, artifact_path="config.yaml", dst_path=str(dst),
                                         tracking_uri=uri)).read_text()
    except Exception as err:  # noqa: BLE001 - MLflow raises several kinds for a missing run or artifact
        raise ValueError(f"--model {source!r}: cannot read the run's model from {uri} ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if not model_file(folder).is_file():
        raise ValueError(f"--model {source!r}: the run has no model/data/model.safetensors (did it finish?)")
    loss = folder / "loss.safetensors"
    return {"model": model_file(folder), "loss": loss if loss.is_file() else None, "run_id": run_id,
            "config": config}


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
