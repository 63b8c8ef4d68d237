"""The evaluation stage's configuration: what `jobs.evaluate` reads of a config file (`EvaluateDocument`,
`load_evaluate_config`). Its sections are all shared ones (`pipelines.config`); the model comes from the model file,
not from the config. Loads neither torch nor the model registry: a config error answers before either loads.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import Field

from pipelines.config import DataDocument, LossConfig, read_config_file, stage_document


class EvaluateDocument(DataDocument):
    """What `jobs.evaluate` reads of a config file: the eval section's tasks, the data section (its root stands for
    `{data.root}` in the tasks' paths; the bundled digits are written there when it names them), the loss section
    (the `loss` tasks' loss, when not the source run's), and the run (the MLflow experiment and run name), tracking
    and ray sections. An experiment file's other sections (the model, train, download) may stand beside them,
    unchecked (`pipelines.config.stage_document`)."""

    loss: LossConfig = Field(default_factory=LossConfig)


def load_evaluate_config(path: str | Path, overrides: list[str] | None = None) -> EvaluateDocument:
    return stage_document(EvaluateDocument, read_config_file(path, overrides))
