"""What a job makes ready and checks on its driver before any Ray work: the bundled digits when the config reads
them, and every eval task's data. One home for the jobs that train or evaluate on an experiment's data (a
`DataDocument`: pretraining, evaluation, a sweep: once on its driver for all its trials)."""
from __future__ import annotations

from typing import Any

from pipelines.cluster.check import is_local_path
from pipelines.config import ConfigError, DataDocument, JobDocument
from pipelines.data.eval_tasks import check_task
from pipelines.digits.shards import prepare_digits


def prepare_inputs(cfg: DataDocument) -> None:
    """The digits written (when data.source is digits), then every eval task's data checked: a one-line
    ConfigError when it lacks what its kind needs. Needs a running Ray: the digits download runs as Ray tasks."""
    prepare_data(cfg)
    check_eval_tasks(cfg)


def prepare_data(cfg: DataDocument) -> None:
    if cfg.data.source == "digits":
        if not is_local_path(cfg.data.root):
            raise ConfigError(f"data.root: {cfg.data.root} is not a local folder; the bundled digits are written on "
                              "the driver's disk (a cluster's nodes get them through Ray): give a local folder, or "
                              "data.source=shards for shards already on object storage")
        prepare_digits(cfg.data.root, cfg.data.image_size, cfg.data.shard_size, cfg.data.split_seed)


def check_eval_tasks(cfg: JobDocument) -> None:
    """Every eval task's data has what its kind needs (one-line ConfigError otherwise), before any work."""
    for task in cfg.resolved_tasks():
        check_task(task)


def inputs_of(cfg: DataDocument) -> tuple[Any, ...]:
    """What `prepare_inputs` reads of `cfg`: two configs with the same value share one preparation (a sweep's
    trials differ from its base config only where this stays the same)."""
    data = cfg.data
    digits = (data.root, data.image_size, data.shard_size, data.split_seed) if data.source == "digits" else None
    return data.source, digits, tuple(task.model_dump_json() for task in cfg.resolved_tasks())
