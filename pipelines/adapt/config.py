"""Typed configuration of `jobs.adapt` (the ProbVLM adapter), loaded from YAML like `pipelines.config`.

Unknown keys, wrong types and out-of-range values fail with one line naming the key (`ConfigError`);
`--set a.b=value` overrides. The run, eval, tracking and ray sections are the pretraining config's own.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from pipelines.config import (ConfigError, EvalTask, JobDocument, LossConfig, RunConfig, Section, absolute_path,
                              check_kwargs, format_validation_error, keyword_types, read_config_file)
from pipelines.fit.config import LoopConfig


class SourceConfig(Section):
    # The frozen deterministic model: a probvlp model file (.safetensors), runs:/<run_id>/model, an MLflow
    # run id, or open_clip:<arch> (open_clip CLIP weights, loaded into our CLIP towers).
    model: str
    # open_clip sources: a local weights file (.safetensors, or a torch state dict read with weights_only);
    # None: open_clip downloads `open_clip:<arch>/<pretrained tag>` itself.
    weights: str | None = None
    # open_clip sources: the registry model the weights load into and its overrides (None: from the
    # known-architecture table, pipelines.adapt.source.OPENCLIP_ARCHS).
    build: str | None = None
    overrides: dict[str, Any] = Field(default_factory=dict)


class AdaptDataConfig(Section):
    # digits: the bundled digits (written under `root` if missing), trained on image-caption pairs of their
    # train split (a class template and the instance caption per image, as the digits retrieval task);
    # shards: {root}/{split}/*.tar image-caption pairs (txt, one caption per line; jobs.download output).
    source: Literal["digits", "shards"] = "digits"
    root: str = ".probvlp/data/digits"
    split: str = "train"
    # Embeddings of the training pairs (jobs.embed's layout: images/ and texts/ parquet). Used when the folder
    # holds them; otherwise the source model writes them there first (Ray Data batch inference).
    # None: {run folder}/embeddings.
    embeddings: str | None = None


class AdapterConfig(Section):
    # A registered adapter head (models.probvlm.register_adapter): probvlm, the GGD adapter; pfe, the PFE-style
    # baseline (frozen mean, learned Gaussian variance).
    head: str = "probvlm"
    hidden: int = Field(256, ge=1)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    # MC-dropout passes for the epistemic variance (0: aleatoric only).
    mc_samples: int = Field(16, ge=0)
    mc_seed: int = 0
    # Also train a baseline head (say pfe) on the same batches and report its calibration beside the adapter's.
    baseline: str = "none"

    @field_validator("head", "baseline")
    @classmethod
    def _registered(cls, value: str, info) -> str:
        from models.probvlm import ADAPTERS  # the model code only where a config names a head

        if value not in ADAPTERS and not (info.field_name == "baseline" and value == "none"):
            known = ", ".join([*ADAPTERS, *(["none"] if info.field_name == "baseline" else [])])
            raise ValueError(f"unknown head {value!r}; known: {known}")
        return value

    @model_validator(mode="after")
    def _mc_needs_dropout(self) -> "AdapterConfig":
        if self.head == "probvlm" and self.mc_samples > 0 and self.dropout == 0:
            raise ValueError("adapter.mc_samples: MC-dropout passes need adapter.dropout > 0")
        return self


class AdaptLossConfig(LossConfig):
    """The adapter head's loss as pretraining's: `name` (a registry loss, models.losses; None: the head's own, ProbVLM's
    for `probvlm`) and `params`, its constructor's keywords, checked against its signature (ProbVLM's: lambda_cross,
    Eq. 8's 1e-4; l1; ggd; approx, Eq. 16; and the official code's approx_form, stabilise, l1_cross: docs/FIDELITY.md).
    The baseline trains with its own loss's defaults."""

    @model_validator(mode="before")
    @classmethod
    def _params_under_params(cls, data: Any) -> Any:
        flat = sorted(set(data) - {"name", "params"}) if isinstance(data, dict) else []
        if flat:
            raise ValueError(f"the loss's parameters go under loss.params (loss: {{params: {{{flat[0]}: ...}}}}); "
                             f"found {', '.join(flat)}")
        return data


class AdaptTrainConfig(LoopConfig):
    num_workers: int = Field(1, ge=1)
    batch_size: int = Field(128, ge=2, description="per worker")
    steps: int = Field(500, ge=1)
    # The training core's knobs (pipelines.fit.config.LoopConfig), with the adapter's defaults: no warm-up, no weight
    # decay, torch's own AdamW moments and epsilon, no clipping (a small head on frozen embeddings).
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    beta2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(0.0, ge=0)
    log_every: int = Field(50, ge=1)
    # A Ray Train checkpoint (adapters, optimizer, step) every this many steps and at the end; the same
    # run.name again resumes from the latest.
    checkpoint_every: int = Field(500, ge=1)
    # Fault injection for testing recovery (pretraining's key, pipelines.fit.faults): one worker raises when this step
    # is applied, once per MLflow run; Ray Train restarts the group from the last checkpoint (run.max_failures).
    fail_once_at_step: int | None = Field(None, ge=1)


class EmbedConfig(Section):
    """Ray Data batch inference of the source model (training pairs and eval tasks)."""

    actors: int = Field(1, ge=1)
    batch_size: int = Field(256, ge=1)
    gpus_per_actor: float = Field(0.0, ge=0)


class AdaptDocument(JobDocument):
    run: RunConfig = Field(default_factory=lambda: RunConfig(experiment="probvlp-adapt"))
    source: SourceConfig
    data: AdaptDataConfig = Field(default_factory=AdaptDataConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    loss: AdaptLossConfig = Field(default_factory=AdaptLossConfig)
    train: AdaptTrainConfig = Field(default_factory=AdaptTrainConfig)
    embed: EmbedConfig = Field(default_factory=EmbedConfig)
    # eval: tasks scored at the end (retrieval / zeroshot; calibration of the adapter and the baseline).

    @model_validator(mode="after")
    def _checks(self) -> "AdaptDocument":
        self._check_loss()
        spec = self.source
        if not spec.model.startswith("open_clip:") and (spec.weights is not None or spec.build is not None or spec.overrides):
            raise ValueError("source.weights / build / overrides: only for open_clip:<arch> sources")
        for task in self.eval.tasks or []:
            if task.kind == "loss":
                raise ValueError(f"eval.tasks: {task.name!r}: loss tasks need the source's training loss; "
                                 "the adapter is scored on retrieval and zeroshot tasks")
        return self

    def loss_name(self) -> str:
        """The adapter head's loss: loss.name, else the head's own (models.probvlm.AdapterKind.loss)."""
        from models.probvlm import adapter_kind  # deferred: torch, for a config's validation only

        return self.loss.name or adapter_kind(self.adapter.head).loss

    def _check_loss(self) -> None:
        from models.losses import list_losses, loss_class  # deferred, as loss_name

        name = self.loss_name()
        if name not in list_losses():
            raise ValueError(f"loss.name: unknown loss {name!r}; known: {', '.join(list_losses())}")
        try:
            check_kwargs("loss.params", f"loss {name!r}", keyword_types(loss_class(name)), self.loss.params)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        try:  # the values too (a small module: its constructor checks them)
            loss_class(name)(**self.loss.params)
        except (TypeError, ValueError) as err:
            raise ValueError(f"loss.params: loss {name!r}: {err}") from None

    def default_tasks(self) -> list[EvalTask]:
        return [EvalTask(name="heldout", kind="retrieval")]  # no loss task: the adapter has no training loss

    def with_absolute_paths(self) -> "AdaptDocument":
        """Local paths absolute (Ray workers run in other directories); URIs and open_clip: as they are."""
        model = self.source.model
        return self._with_absolute(
            source=self.source.model_copy(update={"model": absolute_path(model) if Path(model).exists() else model,
                                                  "weights": absolute_path(self.source.weights)}),
            data=self.data.model_copy(update={"root": absolute_path(self.data.root),
                                              "embeddings": absolute_path(self.data.embeddings)}))


def load_adapt_config(path: str | Path, overrides: list[str] | None = None) -> AdaptDocument:
    return adapt_config_from_dict(read_config_file(path, overrides))


def adapt_config_from_dict(data: dict[str, Any]) -> AdaptDocument:
    try:
        return AdaptDocument.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
