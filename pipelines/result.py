"""What every job's `run_*` returns: `JobResult` (its headline metrics and where MLflow holds its run), or a stage's
subclass of it with the stage's own fields. The jobs' CLIs and the tests read the shared fields the same way."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(kw_only=True)
class JobResult:
    metrics: dict[str, Any] = field(default_factory=dict)
    mlflow_uri: str | None = None
    mlflow_run_id: str | None = None  # None: a job run without tracking (a download with no tracking.uri)
    run_name: str | None = None  # the same command with this run.name resumes the job where it can
    out: Path | str | None = None  # the folder (or URI) of the job's files, where it writes any
