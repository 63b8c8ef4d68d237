"""The pretraining stage's configuration: the train section, and the experiment document `jobs.pretrain` reads
(`TrainDocument`, `load_train_config`). The sections it shares with the other stages, and the YAML loading, are
`pipelines.config`'s.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from pipelines.config import (ConfigError, ExperimentDocument, check_kwargs, format_validation_error, keyword_types,
                              read_config_file)
from pipelines.zero.config import ZeroConfig


class TrainConfig(ZeroConfig):
    """The pretraining stage's train section: the training core's knobs (LoopConfig: steps, AdamW, schedule, clipping,
    non-finite policy), DeepSpeed's (ZeroConfig: batch, ZeRO stage, accumulation, checkpoints) and pretraining's own:
    the workers, precision, logging, evaluation, the towers' activation checkpointing and compilation."""

    # An int, or [min, max] for elastic training: Ray Train runs as many workers as the cluster holds, at least
    # min, at most max, and restarts at another size from the last checkpoint when nodes come or go (any ZeRO stage:
    # a ZeRO-1/2/3 checkpoint is resharded, pipelines.zero.reshard; per-worker batch and learning rate kept:
    # docs/SCALING.md "Elastic training").
    num_workers: int | tuple[int, int] = 2
    # Elastic runs: how often Ray Train checks, while the workers run, whether more of them would fit now.
    elastic_resize_interval_s: float = Field(60.0, gt=0)
    steps: int = Field(1000, ge=1)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    log_every: int = Field(10, ge=1)
    # Run the eval tasks every N steps, reported to Ray (Tune schedulers use it); 0: only at the end.
    eval_every: int = Field(0, ge=0)
    # Fault injection for testing recovery: one worker raises when this step completes, once per MLflow run.
    fail_once_at_step: int | None = Field(None, ge=1)
    # Activation checkpointing of the towers' transformer blocks (non-reentrant torch.utils.checkpoint): only each
    # block's input is kept and the block is recomputed in the backward, so twice the per-GPU batch fits for ~1/3
    # more tower compute (docs/BENCHMARKS.md, "Memory").
    grad_checkpointing: bool = False
    # torch.compile of every transformer block (models.towers.compile_blocks); off: docs/BENCHMARKS.md measures it.
    compile: bool = False

    @field_validator("num_workers")
    @classmethod
    def _worker_range(cls, v: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (v, v) if isinstance(v, int) else v
        if low < 1:
            raise ValueError(f"needs at least 1 worker (got {list(v) if isinstance(v, tuple) else v})")
        if low > high:
            raise ValueError(f"[min, max] with min > max (got {list(v)})")
        return v

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple)

    @property
    def contrastive_batch(self) -> int | str:
        """Samples one loss sees per step (batch_size x grad_accum x workers); elastic runs: "min-max"."""
        low, high = (self.num_workers, self.num_workers) if isinstance(self.num_workers, int) else self.num_workers
        per_worker = self.batch_size * self.grad_accum
        return per_worker * low if low == high else f"{per_worker * low}-{per_worker * high}"

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers


class TrainDocument(ExperimentDocument):
    """An experiment file as `jobs.pretrain` (and a sweep's base, each trial) reads it: the experiment's sections
    with the train section typed, checked against the model registry and the loss and model constructors. The
    download section stands as written (`jobs.download` checks it)."""

    train: TrainConfig = Field(default_factory=TrainConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> "TrainDocument":
        from models.registry import list_models  # deferred: the registry imports torch and every model class

        if self.model.name not in list_models():
            raise ValueError(f"model.name: unknown model {self.model.name!r}; known: {', '.join(list_models())}")
        if self.train.grad_accum > 1:
            from models.registry import model_arch

            if not hasattr(model_arch(self.model.name), "features"):
                raise ValueError(f"train.grad_accum: {self.model.name} has no per-sample features to cache (an adapter's "
                                 "loss is per sample: raise train.batch_size instead)")
        return self

    def flat(self) -> dict[str, Any]:
        """MLflow params, with the contrastive batch the config implies (batch_size x grad_accum x workers)."""
        return {**super().flat(), "train.contrastive_batch": self.train.contrastive_batch}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainDocument":
        return _validate(data)


def _validate(data: dict[str, Any]) -> TrainDocument:
    try:
        cfg = TrainDocument.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    _check_loss(cfg)
    return cfg


def _check_loss(cfg: TrainDocument) -> None:
    """Validate loss params and model overrides against what their constructors take."""
    from models.losses import list_losses, loss_class  # deferred, as in TrainDocument._cross_checks
    from models.objective import loss_name
    from models.registry import check_overrides, override_types

    name = loss_name(cfg)
    if name not in list_losses():
        raise ConfigError(f"loss.name: unknown loss {name!r}; known: {', '.join(list_losses())}")
    check_kwargs("loss.params", f"loss {name!r}", keyword_types(loss_class(name)), cfg.loss.params)
    check_kwargs("model.overrides", f"model {cfg.model.name!r}", override_types(cfg.model.name), cfg.model.overrides)
    try:
        check_overrides(cfg.model.name, **cfg.model.overrides)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model.overrides: {cfg.model.name}: {err}") from None
    _check_openclip_init(cfg)


def _check_openclip_init(cfg: TrainDocument) -> None:
    source = cfg.model.init_from_openclip
    if source is None:
        return
    if not source.startswith("open_clip:") and not Path(source).is_file():
        raise ConfigError(f"model.init_from_openclip: no such file {source!r} (or use open_clip:<arch>/<tag>)")
    import torch  # deferred, as in TrainDocument._cross_checks: only configs that start from open_clip weights
    from models.objective import build_objective

    with torch.device("meta"):
        objective = build_objective(cfg)
    if "visual.vit.norm_pre.weight" not in objective.model.state_dict():
        raise ConfigError("model.init_from_openclip: CLIP weights need CLIP's ln_pre; "
                          "set model.overrides.vision_pre_norm: true")


def load_train_config(path: str | Path, overrides: list[str] | None = None) -> TrainDocument:
    return _validate(read_config_file(path, overrides))
