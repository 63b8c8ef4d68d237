"""Evaluation tasks' data: CLIP_benchmark's metadata files, where a task's shards are, and the checks that run
before any work.

Layout of a task's data (CLIP_benchmark's webdataset layout; `jobs.download` output folders too):

    {data}/{split}/*.tar                          samples: an image (jpg/jpeg/png/webp), and
                                                  retrieval: txt (captions, one per line), or
                                                  zeroshot: cls (the class index as text)
    {data}/classnames.txt                         zeroshot: one class name per line
    {data}/zeroshot_classification_templates.txt  zeroshot: one template per line, "{c}" for the class

The shards are read by `pipelines.data.eval_reader`.
"""
from __future__ import annotations

import json

import fsspec

from pipelines.config import ConfigError, EvalTask
from pipelines.data.eval_reader import class_of, levels_of, parse_levels
from pipelines.data.reader import IMAGE_COLUMNS, shard_paths
from pipelines.data.stats import SkippedSample
from pipelines.data.tars import iter_tar_samples

CLASSNAMES, TEMPLATES = "classnames.txt", "zeroshot_classification_templates.txt"


# Text files a driver read for its workers (`driver_texts`, `use_texts`): a zero-shot task's class names and
# templates on the driver's disk, which a worker on another node of a cluster does not see.
_TEXTS: dict[str, str | None] = {}


def eval_dataset_name(task: EvalTask) -> str:
    """The Ray Train dataset that carries an eval task's data to the training workers (rank 0 reads it)."""
    return f"eval_{task.name}"


def driver_texts(tasks: list[EvalTask]) -> dict[str, str | None]:
    """The zero-shot tasks' class-name and template files as read here, for `use_texts` in the workers."""
    files = [f for t in tasks if t.kind == "zeroshot" for f in
             (f"{t.data}/{CLASSNAMES}", t.templates or f"{t.data}/{TEMPLATES}")]
    return {f: read_text(f) for f in files}


def use_texts(texts: dict[str, str | None]) -> None:
    _TEXTS.update(texts)


def read_text(uri: str) -> str | None:
    """A text file's content (local path or fsspec URI); None if it does not exist."""
    if uri in _TEXTS:
        return _TEXTS[uri]
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        return f.read()


def zeroshot_prompts(task: EvalTask) -> tuple[list[str], list[list[str]]]:
    """Class names and each class's prompts (templates filled in, or the per-class prompts of a JSON)."""
    where = f"eval task {task.name!r} (zeroshot)"
    text = read_text(f"{task.data}/{CLASSNAMES}")
    if text is None:
        raise ConfigError(f"{where}: no {CLASSNAMES} in {task.data}")
    classnames = [line.strip() for line in text.splitlines() if line.strip()]
    if not classnames:
        raise ConfigError(f"{where}: {CLASSNAMES} in {task.data} is empty")
    if task.templates:
        raw = read_text(task.templates)
        if raw is None:
            raise ConfigError(f"{where}: templates file {task.templates} not found")
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: templates file {task.templates} is not JSON ({err.msg})") from None
    else:
        raw = read_text(f"{task.data}/{TEMPLATES}")
        if raw is None:
            raise ConfigError(f"{where}: no {TEMPLATES} in {task.data} (or give the task a templates file)")
        spec = [line.strip() for line in raw.splitlines() if line.strip()]
    if isinstance(spec, dict):
        missing = [c for c in classnames if not spec.get(c)]
        if missing:
            raise ConfigError(f"{where}: templates file has no prompts for {', '.join(missing[:5])}")
        return classnames, [[str(p) for p in spec[c]] for c in classnames]
    if not isinstance(spec, list) or not spec or not all(isinstance(t, str) for t in spec):
        raise ConfigError(f"{where}: templates must be a non-empty list of strings or a class -> prompts mapping")
    return classnames, [[t.replace("{c}", c) for t in spec] for c in classnames]


# ------------------------------------------------------------------------------------ checks


def task_paths(task: EvalTask) -> list[str]:
    try:
        return shard_paths(task.data, task.split)
    except FileNotFoundError:
        raise ConfigError(f"eval task {task.name!r} ({task.kind}): no shards in {task.data}/{task.split}/*.tar "
                          f"(empty or missing split {task.split!r})") from None


def check_task(task: EvalTask) -> None:
    """Fail before any work, with one line naming the task and what its data lacks."""
    where = f"eval task {task.name!r} ({task.kind})"
    paths = task_paths(task)
    first = next(iter_tar_samples(paths, limit=1), None)
    if first is None:
        raise ConfigError(f"{where}: {task.data}/{task.split} holds no samples (empty split)")
    if not any(ext in first for ext in IMAGE_COLUMNS):
        raise ConfigError(f"{where}: samples have no image ({'/'.join(IMAGE_COLUMNS)}); first sample has "
                          f"{', '.join(sorted(k for k in first if k != '__key__'))}")
    if task.kind == "zeroshot":
        if "cls" not in first:
            raise ConfigError(f"{where}: samples have no 'cls' class index (first sample {first['__key__']!r})")
        classnames, _ = zeroshot_prompts(task)
        try:
            label = class_of(first["cls"])
        except SkippedSample:
            raise ConfigError(f"{where}: cls of the first sample ({first['__key__']!r}) is not a class index") from None
        if not 0 <= label < len(classnames):
            raise ConfigError(f"{where}: cls {label} is outside the {len(classnames)} classes of {CLASSNAMES}")
    elif "txt" not in first and "json" not in first:
        raise ConfigError(f"{where}: samples have no caption (txt) (first sample {first['__key__']!r})")


def read_caption_levels(task: EvalTask, keys: list[str]) -> list[dict[str, list[str]]] | None:
    """Per key, its captions by level, read from the task's shards (json only); None when the first sample
    has no levels (the shards are then not read further)."""
    paths = task_paths(task)
    first = next(iter_tar_samples(paths, limit=1), None)
    if first is None or not levels_of(_json(first)):
        return None
    found = {s["__key__"]: parse_levels(levels_of(_json(s))) for s in iter_tar_samples(paths)}
    return [found.get(k, {}) for k in keys]


def _json(sample: dict) -> dict:
    try:
        return json.loads(sample.get("json") or b"{}")
    except ValueError:
        return {}
