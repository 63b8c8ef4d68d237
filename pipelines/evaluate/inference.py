"""Ray Data batch inference: a saved model's embeddings of images and captions, written as parquet.

Images: decoded shards (pipelines.data.eval_reader) -> `map_batches(ImageEmbedder)` on an actor pool (one model
per actor, loaded once; `num_gpus` per actor on a GPU cluster) -> ``{out}/images/*.parquet`` with
columns key, captions (one per line), cls, and the model's outputs (mu, logvar for probabilistic
models, mix for Llip's mixture tokens, flattened) as fixed-size float32 lists, readable by pandas,
pyarrow or faiss without this project. Texts: the same for a list of strings ->
``{out}/texts/*.parquet`` (index, text, mu[, logvar]); a list that fits one batch (a zero-shot task's prompts) is
embedded by the caller's copy of the model instead, which a pool would spend a process start and a model load on.
An evaluation of several tasks (`embed_tasks`) reads them all through one image pool and one text pool, each row
labelled with its task, and writes each task's rows under ``{out}/{task}/``: every actor loads the model once for all
the tasks, not once per task.
"""
from __future__ import annotations

import functools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray.data
import torch

from models.model_file import load_model
from models.preprocess import to_device, to_model_input
from models.tokenizer import tokenize
from pipelines.cluster.check import is_local_path, only_here
from pipelines.data.eval_reader import REQUIRES, read_eval_shards
from pipelines.data.eval_tasks import task_paths
from pipelines.storage import fs_path, uri
from pipelines.evaluate.in_process import TaskEmbeddings, embed_texts, split_captions, task_texts

OUTPUT_KEYS = ("mu", "logvar", "mix", "query")  # query: Llip's hidden-state query (query_from: hidden)
TASK = "task"  # the column that names each row's task in a pass over several tasks (dropped from what is written)


@dataclass
class InferenceOptions:
    concurrency: int = 2  # the most actors (model copies): a pool starts with one and adds them while batches queue
    batch_size: int = 256
    num_gpus: float = 0.0  # per actor
    threads: int = 1  # torch threads per actor on CPU


def _device(num_gpus: float) -> torch.device:
    return torch.device("cuda") if num_gpus > 0 and torch.cuda.is_available() else torch.device("cpu")


def fixed_lists(out: dict[str, torch.Tensor]) -> dict:
    cols = {}
    for k in OUTPUT_KEYS:
        if k in out:
            arr = out[k].float().cpu().numpy().reshape(out[k].shape[0], -1)
            cols[k] = pa.FixedSizeListArray.from_arrays(pa.array(arr.ravel(), pa.float32()), arr.shape[1])
    return cols


class _Embedder:
    def __init__(self, model_file: str | bytes, num_gpus: float = 0.0, threads: int = 1):
        if num_gpus <= 0:
            torch.set_num_threads(max(1, threads))
        self.device = _device(num_gpus)
        if self.device.type == "cuda":
            # float32 embeddings, as on a CPU: no TF32 in cuDNN's convolutions (its default) or cuBLAS's matmuls,
            # so GPU and CPU actors give the same metrics (this actor's process does nothing else)
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        if isinstance(model_file, bytes):  # the driver's file, sent along (`_pool`)
            with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
                f.write(model_file)
                f.flush()
                self.model = load_model(f.name).to(self.device).eval()
        else:
            self.model = load_model(model_file).to(self.device).eval()


class ImageEmbedder(_Embedder):
    """Decoded batch -> pyarrow table of key, captions, cls and the image outputs."""

    @torch.no_grad()
    def __call__(self, batch: dict[str, np.ndarray]):
        out = self.model.encode_image(to_device(torch.from_numpy(to_model_input(batch["image"])), self.device))
        return _with_task(batch, pa.table({"key": pa.array([str(k) for k in batch["key"]], pa.string()),
                                           "captions": pa.array([str(c) for c in batch["captions"]], pa.string()),
                                           "cls": pa.array(np.asarray(batch["cls"], np.int64)), **fixed_lists(out)}))


class TextEmbedder(_Embedder):
    """Batch of (index, text) -> pyarrow table of index, text and the text outputs."""

    @torch.no_grad()
    def __call__(self, batch: dict[str, np.ndarray]):
        texts = [str(t) for t in batch["text"]]
        out = self.model.encode_text(to_device(tokenize(texts, self.model.context_length), self.device))
        return _with_task(batch, text_table(batch["index"], texts, out))


def _with_task(batch: dict[str, np.ndarray], table: pa.Table) -> pa.Table:
    """`table` with the batch's task column, when the batch has one (a pass over several tasks)."""
    return table.append_column(TASK, pa.array([str(t) for t in batch[TASK]], pa.string())) if TASK in batch else table


def _labelled(batch: dict[str, np.ndarray], task: str) -> dict[str, np.ndarray]:
    batch[TASK] = np.full(len(batch["key"]), task, dtype=object)
    return batch


def text_table(index, texts: list[str], out: dict[str, torch.Tensor]) -> pa.Table:
    """The texts/ parquet's rows: index, text and the text outputs."""
    return pa.table({"index": pa.array(np.asarray(index, np.int64)), "text": pa.array(texts, pa.string()),
                     **fixed_lists(out)})


@functools.lru_cache(maxsize=1)
def _model_arg(model_file: str) -> str | bytes:
    """The model file as the actors get it: its path, or (on this node's disk alone, the cluster spanning nodes) its
    bytes, read once for every pool of the job."""
    return Path(model_file).read_bytes() if only_here([model_file], size_limit=False) else model_file


def _pool(cls, model_file: str, opts: InferenceOptions) -> dict:
    # Autoscaling from one actor: each actor loads the model (seconds), and an eval task's captions or a small set
    # of images is a batch or two that one actor embeds before a second would have loaded.
    return dict(fn=cls, fn_constructor_kwargs={"model_file": _model_arg(str(model_file)), "num_gpus": opts.num_gpus,
                                               "threads": opts.threads},
                concurrency=(1, max(1, opts.concurrency)), batch_size=opts.batch_size, num_gpus=opts.num_gpus or None,
                num_cpus=None if opts.num_gpus else opts.threads)


def _under(out: str | Path, name: str) -> str | Path:
    """`{out}/{name}`: a local Path, or a URI on object storage."""
    return Path(out) / name if is_local_path(str(out)) else f"{str(out).rstrip('/')}/{name}"


def _fresh(out: str | Path, name: str) -> str | Path:
    """`{out}/{name}` emptied (a local Path, or a URI on object storage): Ray Data adds its files beside any already
    there, so a rerun would double the rows."""
    folder = _under(out, name)
    if isinstance(folder, Path):
        shutil.rmtree(folder, ignore_errors=True)
        return folder
    fs, path = fs_path(folder)
    if fs.exists(path):
        fs.rm(path, recursive=True)
    return uri(fs, path)


def write_image_embeddings(model_file: str, paths: list[str], image_size: int, out: str | Path, opts: InferenceOptions,
                 stats_name: str | None = None, require: str | None = None) -> str | Path:
    """Shards -> {out}/images/*.parquet through an actor pool; returns the folder. What the reader skipped is
    counted under `stats_name`; require: see `EvalDecode` (None: every sample with a readable image)."""
    folder = _fresh(out, "images")
    _write(_eval_images(paths, image_size, opts, stats_name, require).map_batches(**_pool(ImageEmbedder, model_file,
                                                                                           opts)), folder)
    return folder


def _eval_images(paths: list[str], image_size: int, opts: InferenceOptions, stats_name: str | None,
                 require: str | None):
    """The shards' samples for an image pool: streamed (one pass), images moved as uint8 and scaled in the actor."""
    return read_eval_shards(paths, image_size, stats_name=stats_name, batch_size=opts.batch_size, cache_max_mb=0,
                            uint8=True, require=require)


def embedded_here(texts: list[str], opts: InferenceOptions, model: torch.nn.Module | None) -> bool:
    """Strings embedded by the caller's model rather than a pool: those that fit one batch, the model at hand."""
    return model is not None and len(texts) <= opts.batch_size


def _texts_here(model: torch.nn.Module, texts: list[str], opts: InferenceOptions) -> pa.Table:
    """The texts/ rows of `texts`, embedded by the caller's model in this process."""
    return text_table(range(len(texts)), texts, embed_texts(model, texts, opts.batch_size))


def write_text_embeddings(model_file: str, texts: list[str], out: str | Path, opts: InferenceOptions,
                          model: torch.nn.Module | None = None) -> str | Path:
    """Strings -> {out}/texts/*.parquet through an actor pool; returns the folder. Given `model` (the file's, loaded
    by the caller), strings that fit one batch are embedded by it here: a pool's actor would start a process and load
    the model for that one batch (seconds on a CPU, a CUDA context on a GPU), and the columns are the same."""
    folder = _fresh(out, "texts")
    if embedded_here(texts, opts, model):
        _write_here([_texts_here(model, texts, opts)], folder)
        return folder
    items = [{"index": i, "text": t} for i, t in enumerate(texts)]
    _write(ray.data.from_items(items).map_batches(**_pool(TextEmbedder, model_file, opts)), folder)
    return folder


def _write(ds, folder: str | Path) -> None:
    """The embeddings as parquet files in `folder`: by Ray Data's writers where every node reaches it, else (a folder
    on this node's disk, the cluster spanning nodes) by this process, the tables sent to it through the object store."""
    if not only_here([str(folder)], size_limit=False):
        ds.write_parquet(str(folder))
        return
    _write_here(_tables(ds), folder)


def _tables(ds):
    """The dataset's blocks as pyarrow tables in this process, sent through the object store one at a time."""
    return (ray.get(ref) for ref in ds.to_arrow_refs())


def _write_here(tables, folder: str | Path) -> None:
    """Tables as parquet files in `folder` (a local folder or a URI on object storage), written by this process."""
    fs, path = fs_path(str(folder))
    fs.makedirs(path, exist_ok=True)
    for i, table in enumerate(tables):
        with fs.open(f"{path}/{i:06d}.parquet", "wb") as f:
            pq.write_table(table, f)


def read_embeddings(folder: str | Path, order_by: str, mixture_tokens: int | None = None):
    """Parquet written above -> (table columns as numpy / lists, outputs as tensors), rows sorted by `order_by`."""
    return embeddings_of(pq.read_table(str(folder)), order_by, mixture_tokens, folder)


def embeddings_of(table: pa.Table, order_by: str, mixture_tokens: int | None, folder: str | Path):
    """read_embeddings of a table in hand (written to `folder`)."""
    if table.num_rows == 0:
        raise ValueError(f"{folder}: no embeddings")
    table = table.sort_by(order_by)
    outputs = {}
    for k in OUTPUT_KEYS:
        if k in table.column_names:
            col = table.column(k).combine_chunks()
            arr = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), -1)
            if k == "mix":
                arr = arr.reshape(len(col), mixture_tokens, -1)
            outputs[k] = torch.from_numpy(arr.copy())
    columns = {c: table.column(c).to_pylist() for c in table.column_names if c not in OUTPUT_KEYS}
    return columns, outputs


def _pooled(ds, cls, model_file: str, opts: InferenceOptions) -> pa.Table | None:
    """Every batch of `ds` through one actor pool of `cls`, as one table in this process (None: no rows)."""
    tables = [t for t in _tables(ds.map_batches(**_pool(cls, model_file, opts))) if t.num_rows]
    return pa.concat_tables(tables) if tables else None


def _rows_of(table: pa.Table | None, task: str) -> pa.Table:
    """`task`'s rows of a pass over several tasks, without the task column."""
    if table is None:
        return pa.table({})
    return table.filter(pc.equal(table[TASK], task)).drop_columns([TASK])


def embed_tasks(model_file: str, model: torch.nn.Module, tasks: list, out: str | Path, opts: InferenceOptions,
                stats_names: dict[str, str] | None = None) -> dict[str, TaskEmbeddings]:
    """Eval tasks' embeddings by batch inference: every task's images through one actor pool, then the texts of every
    task past a batch through one more (a task's texts within a batch, a zero-shot task's prompts, by `model`, the
    caller's copy of the file's model), each actor loading the model once for all of them; each task's rows written
    under {out}/{task}/images|texts and read back (pipelines.evaluate.tasks.TaskEmbeddings, in the same canonical order
    as the in-process path). What a task cannot use is skipped and counted under its `stats_names` entry."""
    if not tasks:
        return {}
    stats_names = stats_names or {}
    mixture_tokens = getattr(model, "mixture_tokens", None)
    parts = [_eval_images(task_paths(t), model.img_size, opts, stats_names.get(t.name), REQUIRES[t.kind])
             .map_batches(_labelled, fn_kwargs={"task": t.name}, batch_format="numpy") for t in tasks]
    images = _pooled(parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0], ImageEmbedder, model_file, opts)
    found, pooled_texts = {}, []
    for task in tasks:
        folder = _fresh(_under(out, task.name), "images")
        rows = _rows_of(images, task.name)
        _write_here([rows] if rows.num_rows else [], folder)
        cols, image = embeddings_of(rows, "key", mixture_tokens, folder)
        captions = split_captions(cols["captions"])
        texts, counts, classnames = task_texts(task, captions)
        here = embedded_here(texts, opts, model)
        found[task.name] = (cols, image, captions, texts, counts, classnames, here)
        if not here:
            pooled_texts += [{TASK: task.name, "index": i, "text": t} for i, t in enumerate(texts)]
    text_rows = _pooled(ray.data.from_items(pooled_texts), TextEmbedder, model_file, opts) if pooled_texts else None
    embedded = {}
    for task in tasks:
        cols, image, captions, texts, counts, classnames, here = found[task.name]
        folder = _fresh(_under(out, task.name), "texts")
        rows = _texts_here(model, texts, opts) if here else _rows_of(text_rows, task.name)
        _write_here([rows] if rows.num_rows else [], folder)
        _, text = embeddings_of(rows, "index", None, folder)
        embedded[task.name] = TaskEmbeddings(cols["key"], image, captions, torch.tensor(cols["cls"], dtype=torch.long),
                                             texts, text, counts, classnames)
    return embedded
