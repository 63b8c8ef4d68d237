"""A sweep file: a YAML search space over dotted config keys on a base training config, checked whole
(space, points, metric) by `load_tune_config` before any trial starts. Loads no Ray, so that a mistake answers at once.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from pipelines.config import ConfigError, Section, apply_overrides, format_validation_error, read_yaml, set_dotted
from pipelines.pretrain.config import TrainDocument, load_train_config
from pipelines.evaluate.names import metric_names


class Domain(Section):
    """Exactly one of: uniform [low, high], loguniform [low, high], randint [low, high), choice [values]."""

    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None
    randint: tuple[int, int] | None = None
    choice: list[Any] | None = None

    @model_validator(mode="after")
    def _one(self) -> "Domain":
        set_ = [k for k in ("uniform", "loguniform", "randint", "choice") if getattr(self, k) is not None]
        if len(set_) != 1:
            raise ValueError("give exactly one of uniform, loguniform, randint, choice")
        if self.kind in ("uniform", "loguniform", "randint"):
            low, high = getattr(self, self.kind)
            if not low < high:
                raise ValueError(f"{self.kind}: low must be < high (got [{low}, {high}])")
            if self.kind == "loguniform" and low <= 0:
                raise ValueError(f"loguniform: low must be > 0 (got {low})")
        elif not self.choice:
            raise ValueError("choice: needs at least one value")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("uniform", "loguniform", "randint", "choice") if getattr(self, k) is not None)

    def probes(self) -> list[Any]:
        """Values whose validity stands for the whole domain."""
        if self.kind == "choice":
            return list(self.choice)
        low, high = getattr(self, self.kind)
        return [low, high - 1] if self.kind == "randint" else [low, high]

    def to_tune(self):
        from ray import tune  # deferred: this module loads no Ray

        if self.kind == "choice":
            return tune.choice(self.choice)
        low, high = getattr(self, self.kind)
        return {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}[self.kind](low, high)


class TuneSettings(Section):
    name: str = "sweep"
    # Any `{task}/{metric}` the trial config reports (pipelines.evaluate.tasks.metric_names).
    metric: str = "heldout/rsum"
    mode: Literal["max", "min"] = "max"
    num_samples: int = Field(4, ge=1)
    max_concurrent: int = Field(1, ge=1)
    search_alg: Literal["optuna", "random"] = "optuna"
    seed: int = 0
    scheduler: Literal["asha", "fifo"] = "asha"
    # In reports (one per train.eval_every steps, plus the final one): ASHA's first rung comes after
    # grace_period * eval_every training steps.
    grace_period: int = Field(1, ge=1)
    reduction_factor: int = Field(2, ge=2)
    # First trials to run, as {dotted.key: value}; the search algorithm suggests the rest.
    points_to_evaluate: list[dict[str, Any]] = Field(default_factory=list)
    storage_path: str = ".probvlp/tune"
    experiment: str = "probvlp-sweeps"


class SweepDocument(Section):
    base: str
    overrides: list[str] = Field(default_factory=list)
    space: dict[str, Domain]
    tune: TuneSettings = Field(default_factory=TuneSettings)
    # Set by load_tune_config from the base config: results one full trial reports to Tune, steps between them.
    reports_per_trial: int = 0
    eval_every: int = 0


def trial_config(base: dict[str, Any], params: dict[str, Any]) -> TrainDocument:
    data = copy.deepcopy(base)
    for key, value in params.items():
        set_dotted(data, key, value)
    return TrainDocument.from_dict(data)


def load_tune_config(path: str | Path, overrides: list[str] | None = None) -> tuple[SweepDocument, TrainDocument]:
    """Parse and validate the whole sweep before any trial starts; errors are one line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file not found: {path}")
    try:
        data = apply_overrides(read_yaml(path.read_text()) or {}, overrides or [])
        sweep = SweepDocument.model_validate(data)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    base_path = Path(sweep.base)
    if not base_path.is_absolute() and not base_path.exists():
        base_path = path.parent / base_path
    base = load_train_config(base_path, sweep.overrides)
    base_dict = base.to_dict()
    for key, domain in sweep.space.items():
        for value in domain.probes():
            try:
                trial_config(base_dict, {key: value})
            except ConfigError as err:
                if "unknown key" in str(err):
                    raise ConfigError(f"space.{key}: not a config key: {err}") from None
                numeric = "" if domain.kind == "choice" else f" ({domain.kind} needs a numeric field)"
                raise ConfigError(f"space.{key}: {value!r} is not valid here{numeric}: {err}") from None
    for i, point in enumerate(sweep.tune.points_to_evaluate):
        unknown = set(point) - set(sweep.space)
        if unknown:
            raise ConfigError(f"tune.points_to_evaluate[{i}]: keys not in space: {', '.join(sorted(unknown))}")
        trial_config(base_dict, point)

    reported = metric_names(base)
    if sweep.tune.metric not in reported:
        task = sweep.tune.metric.split("/")[0]
        same = [m.split("/", 1)[1] for m in reported if m.startswith(f"{task}/")]
        hint = (f"task {task!r} reports {', '.join(same)}" if same else
                f"no eval task is named {task!r}; tasks: {', '.join(dict.fromkeys(m.split('/')[0] for m in reported))}")
        raise ConfigError(f"tune.metric: {sweep.tune.metric!r} is not reported ({hint})")
    t = base.train
    if not t.eval_every:
        raise ConfigError("train.eval_every: must be > 0 in the base config so schedulers see intermediate results")
    if t.checkpoint_every % t.eval_every:
        raise ConfigError("train.checkpoint_every: must be a multiple of train.eval_every in a sweep "
                          "(every report to Tune must carry the metric)")
    # Validation reports at eval_every, 2*eval_every, ... before the last step, then the final report.
    sweep.reports_per_trial = (t.steps - 1) // t.eval_every + 1
    sweep.eval_every = t.eval_every
    return sweep, base
