"""The download stage's configuration: what `jobs.download` reads of a config file (`DownloadDocument`,
`load_download_config`). Its download section is `pipelines.config.DownloadConfig` (an experiment file's section,
checked with the rest by every job that reads the file). Loads neither torch nor the model registry: start-up counts
in a download's wall time.
"""
from __future__ import annotations

from pathlib import Path
from pydantic import Field, ValidationError

from pipelines.config import (ConfigError, Document, DownloadConfig, ExperimentDocument, RayConfig, RunConfig,
                              TrackingConfig, format_validation_error, read_config_file)


# The top-level sections of an experiment file: pipelines.train.config.TrainDocument's (a stage above this one;
# tests/test_config.py keeps the two equal).
EXPERIMENT_SECTIONS = (*ExperimentDocument.model_fields, "train", "download")


class DownloadDocument(Document):
    """What `jobs.download` reads of a config file: its download, run, tracking and ray sections. The other
    sections of an experiment file may stand beside them (unchecked here: the model registry, and with it torch,
    is not imported for a download)."""

    run: RunConfig = Field(default_factory=RunConfig)
    download: DownloadConfig
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)


def load_download_config(path: str | Path, overrides: list[str] | None = None) -> DownloadDocument:
    data = read_config_file(path, overrides)
    unknown = sorted(set(data) - set(EXPERIMENT_SECTIONS))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key")
    if data.get("download") is None:
        raise ConfigError(f"{path}: no `download:` section")
    try:
        return DownloadDocument.model_validate({k: v for k, v in data.items() if k in DownloadDocument.model_fields})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
