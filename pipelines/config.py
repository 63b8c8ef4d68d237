"""Typed configuration loaded from YAML: what several stages share.

One home per stage: a stage's own sections, document and loader live in `pipelines/<stage>/config.py`
(`download`, `evaluate`, `pretrain`, `tune`, `adapt`); this module holds what more than one stage reads (the run, data,
model, loss, eval, tracking and ray sections, the documents they form, an experiment file's list of sections:
`ExperimentDocument`) and the loading itself (unknown keys, YAML, `--set` overrides, local paths). Every section
rejects unknown keys, wrong types and out-of-range values with a one-line message naming the key (`ConfigError`).
Plain dicts appear only at the Ray boundary (`TrainDocument.to_dict()` / `TrainDocument.from_dict()`).
"""
from __future__ import annotations

import inspect
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# The project's local state: the default MLflow store, rank 0's tracking outboxes, injected-failure markers, a sweep's
# rungs and best config, evaluation and adapter outputs (a config's own paths, such as data.root, stay as written).
# $PROBVLP_HOME where set (the tests set a folder of their own; Ray's processes inherit it), else .probvlp in the
# project folder.
STATE_DIR = Path(os.path.abspath(os.path.expanduser(os.environ.get("PROBVLP_HOME") or PROJECT_ROOT / ".probvlp")))


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that 1e-4 is the number 1e-4 (YAML 1.2), not the string "1e-4" of YAML 1.1."""


_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                  list("-+0123456789."))


def read_yaml(text: str) -> Any:
    """Config YAML as users write it: every number form, including 1e-4, reads as a number."""
    return yaml.load(text, Loader=_YamlLoader)  # a SafeLoader: builds plain data only


class ConfigError(ValueError):
    """A configuration problem, phrased as one line naming the key."""


class InputError(ValueError):
    """Bad input that is not the config file's (a model, a data folder), phrased as one line naming it."""


class RunStopped(RuntimeError):
    """A run that the product stopped on purpose (notices that never clear), in one line; its checkpoint is kept."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    # Re-running with the same name resumes that run (its latest checkpoint and its MLflow run).
    # None: a new name from the experiment and the current time.
    name: str | None = None
    experiment: str = "probvlp"
    seed: int = 0
    # Ray Train storage (checkpoints, results): local folder, NFS or s3://.
    storage_path: str = ".probvlp/ray_results"
    # Worker-failure restarts from the last checkpoint (-1: unlimited).
    max_failures: int = Field(0, ge=-1)
    # Restarts after a node was preempted (a drain with reason PREEMPTION, a SIGTERM to a training worker), counted
    # apart from max_failures so that spot reclaims never use up the budget for real errors (-1: unlimited, Ray's
    # default).
    max_preemptions: int = Field(-1, ge=-1)
    # SIGTERM to a training worker's process is a notice of preemption this many seconds ahead (a Kubernetes pod's
    # terminationGracePeriodSeconds, `docker stop -t`, a SLURM KillWait): the run saves at the next step (and again
    # before the time is up: run.notice_train_on) and Ray Train restarts it once the time is up. None: SIGTERM ends the worker at once, as in Ray.
    sigterm_grace_s: float | None = Field(30.0, ge=0)
    # After a notice's save, train on and save once more just before the deadline (what the restart resumes from),
    # where the deadline leaves room for that save; false: every worker waits from the notice's save to the restart.
    notice_train_on: bool = True
    # A run stops with one line, instead of restarting for ever, after this many attempts in a row that a notice of
    # preemption ended before they trained a step (a notice source that never clears, a deadline shorter than the
    # start-up). A step trained is progress; an attempt lost to anything else is a failure (max_failures).
    max_notices_without_progress: int = Field(3, ge=1)
    # The hook for other sources of notices (a SLURM --signal trap, a cloud metadata poller): a file on each training
    # worker's node whose appearance is a notice (its content, if a number, the seconds left); the save it causes
    # takes it (renamed FILE.taken). None: $PROBVLP_PREEMPTION_NOTICE_FILE where set.
    notice_file: str | None = None
    keep_checkpoints: int = Field(2, ge=1)
    # A file on rank 0's node to which every attempt appends the optimizer steps it applies ("ATTEMPT STEP" a line):
    # what each attempt really ran, for an audit of restarts (tests count steps trained twice with it). None: off.
    audit_steps_to: str | None = None


class DataConfig(Section):
    source: Literal["digits", "shards"] = "digits"
    # Folder (or fsspec URI) holding {train,val,test}/*.tar webdataset shards.
    root: str = ".probvlp/data/digits"
    image_size: int = Field(32, ge=8, le=1024)
    # Train-split augmentation (RandomResizedCrop 0.8-1.0, colour jitter, grayscale); never on evaluation.
    augment: bool = True
    # Where it runs: "device" (the training worker's GPU, as batched tensor ops on the uint8 images), "reader"
    # (the reader's CPUs, OpenCV on uint8: Ray Data's tasks, or a small set's training workers, see data.reader),
    # "auto" (device with train.use_gpu, else reader).
    augment_on: Literal["auto", "device", "reader"] = "auto"
    # Horizontal flip probability (0: captions may say "left" or "right").
    flip_prob: float = Field(0.0, ge=0.0, le=1.0)
    # Side (px) images are decoded to (JPEG DCT scaling when stored larger) and, with augment_on device, shipped
    # at; None: 8/7 of image_size (256 for 224).
    decode_size: int | None = Field(None, ge=8, le=4096)
    # Batches each training worker's iterator prepares ahead of the step (Ray Data prefetch_batches).
    prefetch_batches: int = Field(4, ge=0, le=64)
    # Who reads a set small enough to keep still encoded (the readers' 512 MB: the digits, a test set, a few shards):
    # "auto", the training workers themselves from Ray's object store (pipelines.data.worker_reader: no Ray Data process,
    # seconds sooner to the first step); "ray_data", Ray Data as for larger sets.
    reader: Literal["auto", "ray_data"] = "auto"
    # Same sample order every run (Ray Data preserve_order + seeded shuffles): exact resume, less throughput.
    deterministic: bool = False
    # The largest share of the training samples read that may be skipped (undecodable, no caption, ...; see
    # pipelines.data.stats): past it the run stops with one line naming the share, main reason and an example.
    max_bad_frac: float = Field(0.05, ge=0.0, le=1.0)
    shard_size: int = Field(500, ge=1)
    # Digits only: which images are train / val / test. Not run.seed: runs, sweep trials and evaluations
    # with other seeds must hold out the same images (a rewritten split would score a model on its training data).
    split_seed: int = Field(0, ge=0)
    # Probability of drawing a mid-level / general / instance-level caption instead of the class-level
    # ("specific") one (digits only; see pipelines.digits.dataset for the levels).
    mid_caption_prob: float = Field(0.15, ge=0.0, le=1.0)
    general_caption_prob: float = Field(0.15, ge=0.0, le=1.0)
    instance_caption_prob: float = Field(0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _probs(self) -> "DataConfig":
        if self.mid_caption_prob + self.general_caption_prob + self.instance_caption_prob > 1.0:
            raise ValueError("data.mid_caption_prob + data.general_caption_prob + data.instance_caption_prob "
                             "must be <= 1")
        return self


class ModelConfig(Section):
    name: str = "clip_tiny"
    # Keyword overrides passed to the registry's constructor, e.g. {embed_dim: 128}.
    overrides: dict[str, Any] = Field(default_factory=dict)
    # Start the towers from open_clip CLIP weights (PCME++ Sec. 2.5 fine-tunes from CLIP):
    # "open_clip:ViT-B-16/laion2b_s34b_b88k" (open_clip downloads), or a .safetensors / torch state-dict file.
    init_from_openclip: str | None = None


class LossConfig(Section):
    # None: the model's default loss (its method).
    name: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)


def keyword_types(cls: type) -> dict[str, Any]:
    """The keyword parameters of `cls`'s constructor and their annotated types (Any where unannotated)."""
    sig = inspect.signature(cls.__init__)
    hints = typing.get_type_hints(cls.__init__)
    return {name: hints.get(name, Any) for name, p in sig.parameters.items()
            if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def check_kwargs(prefix: str, what: str, types: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Names and types of `kwargs` against `types` (name -> annotation), as one-line ConfigErrors."""
    for key, value in kwargs.items():
        if key not in types:
            raise ConfigError(f"{prefix}.{key}: unknown key for {what}; known: {', '.join(types)}")
        if types[key] is not Any:
            try:
                # Strict for everything but ints where a float is expected (YAML writes 10 for 10.0).
                TypeAdapter(types[key]).validate_python(value, strict=not isinstance(value, int) or isinstance(value, bool))
            except ValidationError as err:
                raise ConfigError(f"{prefix}.{key}: {err.errors()[0]['msg']} (got {value!r})") from None


class WorkerResources(Section):
    """What each Ray Train worker asks of Ray (the pretraining and the adapter's train sections)."""

    use_gpu: bool = False
    # CPUs per worker, GPU workers too: their data path runs on them
    cpus_per_worker: float = Field(1.0, gt=0)
    # GPUs per worker with use_gpu: a fraction (e.g. 0.25) packs tiny models or Tune trials onto one GPU
    gpus_per_worker: float = Field(1.0, gt=0)

    @field_validator("gpus_per_worker")
    @classmethod
    def _whole_or_fraction(cls, v: float) -> float:
        if v > 1 and v != int(v):
            raise ValueError(f"a fraction of one GPU or a whole number of GPUs (got {v})")  # as Ray schedules them
        return v

    @property
    def worker_resources(self) -> dict[str, float]:
        return {"CPU": self.cpus_per_worker, **({"GPU": self.gpus_per_worker} if self.use_gpu else {})}


TASK_NAME = r"^[A-Za-z0-9_.-]+$"


class BPRWConfig(Section):
    """Bayesian prompt re-weighting (ProLIP A.5, C.5): the EM's hyperparameters (defaults: the paper's zero-shot)."""

    # Dirichlet prior concentration: large -> near-uniform weights, small (< 1) -> one prompt dominates.
    alpha: float = Field(5.0, gt=0)
    # Added to every prompt's sigma^2 before the EM (the paper's stability term).
    eps: float = Field(0.02, ge=0)
    # Unlabeled test images nearest each class's prompt-ensemble embedding, and points sampled from each.
    images: int = Field(5, ge=1)
    samples: int = Field(10, ge=1)
    iters: int = Field(100, ge=1)
    tol: float = Field(1e-6, gt=0)
    seed: int = 0


class IndexConfig(Section):
    """`index: faiss` retrieval: an approximate index on the gallery's mu, candidates re-ranked by the model's score."""

    kind: Literal["hnsw", "ivf"] = "hnsw"
    # Candidates per query taken from the index and re-ranked (PCME++ C.5); R@K needs K <= candidates.
    candidates: int = Field(100, ge=10)
    hnsw_m: int = Field(32, ge=4)
    ef_search: int = Field(256, ge=1)
    ef_construction: int = Field(80, ge=1)
    # IVF lists (None: sqrt(gallery size)) and lists searched per query.
    nlist: int | None = Field(None, ge=1)
    nprobe: int = Field(64, ge=1)


ZEROSHOT_ONLY = ("prompts", "score", "filter_keep", "bprw")
RETRIEVAL_ONLY = ("index", "faiss", "analyses", "caption_levels")


class EvalTask(Section):
    """One evaluation: its metrics are logged as `{name}/{metric}` (see pipelines.evaluate.tasks)."""

    name: str = Field(pattern=TASK_NAME)
    # retrieval: image-text pairs (captions in txt, one per line); zeroshot: a classification set in
    # CLIP_benchmark's webdataset layout; loss: the training objective on held-out pairs.
    kind: Literal["retrieval", "zeroshot", "loss"]
    # Dataset folder or fsspec URI holding {split}/*.tar (and, for zeroshot, classnames.txt and
    # zeroshot_classification_templates.txt). "{data.root}" stands for the training data's root.
    # None: the training data ({data.root}), i.e. its held-out split.
    data: str | None = None
    # Subfolder of `data` with the shards; None: eval.split.
    split: str | None = None
    # zeroshot only: a JSON file with a list of templates ("{c}" for the class name) or a mapping
    # class name -> prompts (CLIP_benchmark's custom template file); None: the dataset's templates file.
    templates: str | None = None
    # zeroshot: how a class's prompts make its embedding. mean: the model's prompt ensemble; bprw: weights by
    # Bayesian prompt re-weighting on the unlabeled test images (ProLIP A.5); filter: the filter_keep prompts
    # of smallest sigma^2 per class (PCME++ C.6, ProLIP 3.4). bprw and filter need a probabilistic model.
    prompts: Literal["mean", "bprw", "filter"] = "mean"
    filter_keep: int = Field(5, ge=1)
    bprw: BPRWConfig = Field(default_factory=BPRWConfig)
    # zeroshot: model = the model's own similarity (CSD for probabilistic models); mean = cosine of the means.
    score: Literal["model", "mean"] = "model"
    # retrieval: exact = every query against the whole gallery; faiss = approximate index on mu + re-ranking.
    index: Literal["exact", "faiss"] = "exact"
    faiss: IndexConfig = Field(default_factory=IndexConfig)
    # retrieval, probabilistic models: uncertainty analyses (sigma^2 vs caption length and generality level,
    # images vs captions, image-in-caption inclusion per level; pipelines.evaluate.uncertainty).
    analyses: bool = True
    # Caption generality levels, most specific first: keys of the samples' json "captions" mapping
    # (level -> captions). The default names the bundled digits' levels.
    caption_levels: list[str] = Field(default_factory=lambda: ["instance", "specific", "mid", "general"], min_length=2)

    @model_validator(mode="after")
    def _options_match_kind(self) -> "EvalTask":
        if self.templates is not None and self.kind != "zeroshot":
            raise ValueError(f"templates: only zeroshot tasks take templates (task {self.name!r} is {self.kind})")
        for keys, kind in ((ZEROSHOT_ONLY, "zeroshot"), (RETRIEVAL_ONLY, "retrieval")):
            # non-default values, not fields_set: a dumped config (Ray boundary, saved runs) carries every field
            wrong = [k for k in keys if self.kind != kind
                     and getattr(self, k) != type(self).model_fields[k].get_default(call_default_factory=True)]
            if wrong:
                raise ValueError(f"{wrong[0]}: only {kind} tasks take {wrong[0]} (task {self.name!r} is {self.kind})")
        return self


class EvalConfig(Section):
    # Default shard subfolder of every task (the training data's held-out split).
    split: str = Field("test", pattern=TASK_NAME)
    batch_size: int = Field(256, ge=1)
    # None: retrieval and loss on the training data's held-out split (tasks "heldout", "heldout_loss").
    tasks: list[EvalTask] | None = None
    # Queries per uncertainty bin are equal; calibration uses this many bins (PCME++ / ProbVLM: 10).
    calibration_bins: int = Field(10, ge=2)

    @field_validator("tasks")
    @classmethod
    def _unique(cls, tasks: list[EvalTask] | None) -> list[EvalTask] | None:
        if tasks is not None:
            if not tasks:
                raise ValueError("give at least one task, or leave tasks out for the defaults")
            names = [t.name for t in tasks]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"task names must be unique; repeated: {', '.join(dup)}")
        return tasks

    def resolved_tasks(self, data_root: str, tasks: list[EvalTask]) -> list[EvalTask]:
        """`tasks` with data and split filled in ({data.root} replaced)."""
        out = []
        for t in tasks:
            data = (t.data or "{data.root}").replace("{data.root}", data_root.rstrip("/"))
            templates = t.templates.replace("{data.root}", data_root.rstrip("/")) if t.templates else None
            out.append(t.model_copy(update={"data": data, "split": t.split or self.split, "templates": templates}))
        return out

    def with_absolute_paths(self) -> "EvalConfig":
        """The tasks' data and template paths absolute (`absolute_path`)."""
        if self.tasks is None:
            return self
        return self.model_copy(update={"tasks": [
            t.model_copy(update={"data": absolute_path(t.data), "templates": absolute_path(t.templates)})
            for t in self.tasks]})


class TrackingConfig(Section):
    # None: $MLFLOW_TRACKING_URI, else a sqlite store in the project folder.
    uri: str | None = None
    # Register the final MLflow model under this name in the Model Registry (a new version per run).
    register_as: str | None = Field(None, min_length=1)
    # At the end of a run, how long the driver delivers what the store has not taken yet (an outage: rank 0 hands it
    # over in the run's storage and its workers are released); what is still left stays there, with the one command
    # that delivers it later (pipelines.tracking.outbox), and the job ends well.
    flush_timeout_s: float = Field(600.0, gt=0)

    def with_absolute_store(self) -> "TrackingConfig":
        """A relative sqlite store made absolute (sqlite:////abs/path); other URIs as they are."""
        uri, prefix = self.uri, "sqlite:///"
        if uri and uri.startswith(prefix) and uri[len(prefix):] not in ("", ":memory:"):
            return self.model_copy(update={"uri": prefix + absolute_path(uri[len(prefix):])})
        return self


class RayConfig(Section):
    # None: $RAY_ADDRESS if set (ray job submit), else a local Ray on 127.0.0.1.
    address: str | None = None
    # Logical CPUs of a local Ray; None: enough for the workers plus Ray Data tasks.
    num_cpus: int | None = Field(None, ge=1)
    # Folders every node of the cluster mounts at the same path (NFS, a shared volume). On a cluster of several
    # nodes any other local path is the driver node's alone: a run's storage must then be object storage or here.
    shared_paths: list[str] = Field(default_factory=list)


class Document(Section):
    """A whole config file (sections at the top level): YAML and MLflow-param views."""

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> scalar values, for MLflow params."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict) and value:
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = value

        walk("", self.to_dict())
        return out


class JobDocument(Document):
    """The sections every training job shares (pretraining and the adapter), and what they do with them."""

    run: RunConfig = Field(default_factory=RunConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    # eval tasks when eval.tasks is left out
    def default_tasks(self) -> list[EvalTask]:
        return [EvalTask(name="heldout", kind="retrieval"), EvalTask(name="heldout_loss", kind="loss")]

    def resolved_tasks(self) -> list[EvalTask]:
        """Eval tasks with data and split filled in ({data.root} replaced)."""
        return self.eval.resolved_tasks(self.data.root, self.eval.tasks or self.default_tasks())

    def _with_absolute(self, **updates: Any) -> Any:
        """A copy with the shared sections' local paths absolute, plus the job's own `updates`."""
        return self.model_copy(update={
            "run": self.run.model_copy(update={"storage_path": absolute_path(self.run.storage_path)}),
            "eval": self.eval.with_absolute_paths(),
            "tracking": self.tracking.with_absolute_store(),
            **updates,
        })


class DataDocument(JobDocument):
    """The sections of a job that reads an experiment's data: the data section beside the run, eval, tracking and
    ray sections (pretraining, evaluation, and the inputs they make ready)."""

    data: DataConfig = Field(default_factory=DataConfig)


class ExperimentDocument(DataDocument):
    """An experiment file: the sections every stage reading one shares (the data, the model, its loss, beside the run,
    eval, tracking and ray sections), and the sections of one stage each, held here as written. A stage's own
    document types and checks its sections and lets the file's others stand: `pipelines.pretrain.config.TrainDocument`
    the train section, `pipelines.download.config.DownloadDocument` the download section,
    `pipelines.evaluate.config.EvaluateDocument` what an evaluation reads (`stage_document`). So this class's fields
    are the list of an experiment file's sections, and a stage's loader takes it from here."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    # typed and checked by its stage: pipelines.pretrain.config.TrainConfig
    train: dict[str, Any] | None = None
    # typed and checked by its stage: pipelines.download.config.DownloadConfig
    download: dict[str, Any] | None = None

    def with_absolute_paths(self) -> "ExperimentDocument":
        """The same config with every local path absolute (URIs as they are): Ray workers and Tune trials run
        in other working directories than the command that was started."""
        return self._with_absolute(
            data=self.data.model_copy(update={"root": absolute_path(self.data.root)}),
            model=self.model.model_copy(update={"init_from_openclip": absolute_path(self.model.init_from_openclip)}))


def absolute_path(value: str | None) -> str | None:
    """A config value that may name a path on this machine, made absolute (Ray workers and Tune trials run in other
    working directories); None, URIs, `{data.root}...`, `open_clip:` and `runs:/` references as they are."""
    if value is None or "://" in value or value.startswith(("{data.root}", "open_clip:", "runs:/")):
        return value
    return os.path.abspath(os.path.expanduser(value))


def format_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    kind, msg = first["type"], first["msg"]
    if kind == "extra_forbidden":
        return f"{loc}: unknown key"
    if kind.startswith("value_error"):
        msg = msg.removeprefix("Value error, ")
        return msg if not loc else f"{loc}: {msg}"
    got = first.get("input")
    got_text = f" (got {got!r})" if not isinstance(got, dict) else ""
    return f"{loc}: {msg}{got_text}"


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    return key.strip(), read_yaml(raw)


def set_dotted(data: dict[str, Any], key: str, value: Any, where: str | None = None) -> dict[str, Any]:
    """data[a][b][c] = value for key "a.b.c", creating sections; `where` names the source in errors (default: key)."""
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{where or key}: {part} is not a section")
    node[parts[-1]] = value
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(data, key, value, where=f"--set {text!r}")
    return data


def read_config_file(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """A config file's sections as a dict, `--set` overrides applied; one-line ConfigError otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = read_yaml(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return apply_overrides(data, overrides or [])



D = TypeVar("D", bound=Document)


def stage_document(document: type[D], data: dict[str, Any]) -> D:
    """`document`'s sections of an experiment file's `data` (`read_config_file`), checked: a stage's document, the
    sections it reads. The file's other sections (`ExperimentDocument`'s fields: another stage's) stand unchecked;
    any other top-level key is refused. One-line ConfigError naming the key."""
    unknown = sorted(set(data) - set(ExperimentDocument.model_fields) - set(document.model_fields))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key")
    try:
        return document.model_validate({k: v for k, v in data.items() if k in document.model_fields})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
