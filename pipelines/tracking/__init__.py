"""MLflow, in one room: where runs go (`store`, a new sqlite store from `sqlite_template`), a job's run from start to
end (`runs`), rank 0's step metrics (`logger`) through the `outbox` that delivers them in the background and travels
with the run, the `relay` that writes a store on the driver's disk from other nodes, `deliver` (the command for what a
run left undelivered), and the model as MLflow keeps it (`mlflow_model`). The names other stages use are here."""
from pipelines.tracking.logger import OUTBOX_DIR, StepLogger
from pipelines.tracking.mlflow_model import model_file, resolve_model, save_mlflow_model
from pipelines.tracking.runs import (TrackedRun, end_trial_runs, find_run, finish_run, finish_with_results, git_commit,
                                     reopen_run, start_run, tracked_run)
from pipelines.tracking.store import (hide_credentials, is_local_store, redact, redact_yaml, sqlite_artifact_root,
                                      tracking_uri, worker_client)

__all__ = ["OUTBOX_DIR", "StepLogger", "TrackedRun", "end_trial_runs", "find_run", "finish_run", "finish_with_results",
           "git_commit", "hide_credentials", "is_local_store", "model_file", "redact", "redact_yaml", "reopen_run",
           "resolve_model", "save_mlflow_model", "sqlite_artifact_root", "start_run", "tracked_run", "tracking_uri",
           "worker_client"]
