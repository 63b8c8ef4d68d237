"""Small datasets that Ray Train workers read themselves: the raw blocks in Ray's object store, decoded and batched
in each worker's own process.

A Ray Data pipeline costs its processes before the first batch (a split coordinator, read and map tasks, stats and
autoscaling actors: ~10 CPU-s and ~5 s of a 2-core machine's start-up, docs/BENCHMARKS.md "Start-up") and is worth them
for sets that stream. A set small enough to cache still encoded (the readers' cache_max_mb, 512 MB by default: the
bundled digits, a test set, a user's few shards) needs none of that: it is read once on the driver into the object
store, as the cached Ray Data path reads it, and handed to the workers as object references. Each worker takes its
rows (training: a contiguous share of the file order, the same count on every worker, the remainder dropped, as Ray
Data's equal split does, fetching only the blocks that hold them; evaluation: every row), shuffles them per epoch
with the epoch's seed, and runs the same map
function (the reader's `Preprocess`, the evaluator's `EvalDecode`) on a thread ahead of the step. What the workers
iterate has Ray Data's iterator methods (`iter_torch_batches`, `iter_batches`), so the training loop and the
evaluation read either the same way (`dataset_shard`). `data.reader: ray_data` keeps Ray Data for every set.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd
import ray


@dataclass
class WorkerShards:
    """A small dataset as the workers get it: the object references of its raw blocks (the readers' pandas blocks of
    still-encoded samples, file order),
    the map function that decodes a numpy batch of them (`fn(batch, **fn_kwargs)`, batches of `map_batch_size` rows),
    and whether the workers split its rows (training) or each reads all of them (evaluation)."""

    blocks: list
    fn: Callable[..., dict[str, np.ndarray]]
    fn_kwargs: dict[str, Any]
    map_batch_size: int
    split: bool
    lengths: list[int]  # rows per block (a training worker fetches only the blocks of its rows)

    def shard(self, rank: int, world: int) -> "LocalShard":
        return LocalShard(self, rank, world)


def worker_shards(blocks: list[pd.DataFrame], fn: Callable[..., dict[str, np.ndarray]], fn_kwargs: dict[str, Any],
                 map_batch_size: int, split: bool = True) -> WorkerShards:
    """The blocks put in Ray's object store (one object each), to be read by the workers."""
    blocks = [b for b in blocks if len(b)]
    return WorkerShards([ray.put(b) for b in blocks], fn, fn_kwargs, map_batch_size, split, [len(b) for b in blocks])


class LocalShard:
    """One worker's view of a `WorkerShards`: Ray Data's iterator methods over its rows."""

    def __init__(self, shards: WorkerShards, rank: int, world: int):
        self.shards, self.rank, self.world = shards, rank, world
        lengths = shards.lengths
        self.n = sum(lengths)
        self.span = (0, self.n)
        if shards.split:  # a contiguous equal share of the file order; the remainder dropped, as Ray Data's split
            share = self.n // world
            self.span = (rank * share, (rank + 1) * share)
        starts = np.cumsum([0, *lengths])
        self._blocks = [i for i in range(len(lengths)) if starts[i] < self.span[1] and starts[i + 1] > self.span[0]]
        self._offset = int(starts[self._blocks[0]]) if self._blocks else 0
        self._table: pd.DataFrame | None = None

    def table(self) -> pd.DataFrame:
        """The blocks that hold this worker's rows, joined (row i of the set is row i - offset here)."""
        if self._table is None:
            blocks = ray.get([self.shards.blocks[i] for i in self._blocks])
            self._table = pd.concat(blocks, ignore_index=True) if blocks else pd.DataFrame()
        return self._table

    def rows(self, seed: int | None) -> np.ndarray:
        """This worker's row indices in the set, in file order or (seed) shuffled."""
        idx = np.arange(*self.span)
        if seed is not None:
            np.random.default_rng(seed).shuffle(idx)
        return idx

    def mapped(self, seed: int | None) -> Iterator[dict[str, np.ndarray]]:
        """The map function's output on this worker's rows, `map_batch_size` rows at a time."""
        table, size = self.table(), self.shards.map_batch_size
        idx = self.rows(seed)
        for start in range(0, len(idx), size):
            part = table.iloc[idx[start:start + size] - self._offset]
            batch = {c: part[c].to_numpy() for c in part.columns}
            out = self.shards.fn(batch, **self.shards.fn_kwargs)
            if len(next(iter(out.values()), ())):
                yield out

    def iter_batches(self, batch_size: int = 256, batch_format: str = "numpy", drop_last: bool = False,
                     prefetch_batches: int = 1, local_shuffle_buffer_size: int | None = None,
                     local_shuffle_seed: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Batches of exactly `batch_size` rows (the last one shorter unless `drop_last`), made on a thread up to
        `prefetch_batches` ahead; shuffled by `local_shuffle_seed` where a shuffle buffer is asked for."""
        if batch_format != "numpy":
            raise ValueError(f"LocalShard.iter_batches: batch_format numpy only, not {batch_format!r}")
        seed = local_shuffle_seed if local_shuffle_buffer_size else None
        return _ahead(_rebatch(self.mapped(seed), batch_size, drop_last), max(1, prefetch_batches))

    def iter_torch_batches(self, batch_size: int = 256, drop_last: bool = False, device=None, pin_memory: bool = False,
                           prefetch_batches: int = 1, local_shuffle_buffer_size: int | None = None,
                           local_shuffle_seed: int | None = None) -> Iterator[dict[str, Any]]:
        import torch  # a worker that trains has it; the readers that import this module need not

        for batch in self.iter_batches(batch_size, "numpy", drop_last, prefetch_batches, local_shuffle_buffer_size,
                                       local_shuffle_seed):
            out = {}
            for k, v in batch.items():
                t = torch.as_tensor(v)
                if pin_memory:
                    t = t.pin_memory()
                out[k] = t.to(device, non_blocking=pin_memory) if device is not None else t
            yield out


def _rebatch(batches: Iterator[dict[str, np.ndarray]], size: int, drop_last: bool) -> Iterator[dict[str, np.ndarray]]:
    held: list[dict[str, np.ndarray]] = []
    count = 0
    for b in batches:
        held.append(b)
        count += len(next(iter(b.values())))
        while count >= size:
            joined = {k: np.concatenate([h[k] for h in held]) for k in held[0]}
            yield {k: v[:size] for k, v in joined.items()}
            rest = {k: v[size:] for k, v in joined.items()}
            count -= size
            held = [rest] if count else []
    if held and count and not drop_last:
        yield {k: np.concatenate([h[k] for h in held]) for k in held[0]}


def _ahead(items: Iterator[Any], depth: int) -> Iterator[Any]:
    """`items` produced on a daemon thread up to `depth` ahead of the consumer; its exception re-raised here. A
    consumer that stops early (the last step, mid-epoch) stops the thread at its next item."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in items:
                if not put(("item", item)):
                    return
            put(("end", done))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer
            put(("error", err))

    threading.Thread(target=produce, daemon=True, name="local-shard").start()
    try:
        while True:
            kind, item = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()


_DATASETS: dict[str, WorkerShards] = {}


def use_worker_datasets(datasets: dict[str, WorkerShards]) -> None:
    """The run's worker-read datasets, by name (a training worker sets them from its loop config)."""
    _DATASETS.clear()
    _DATASETS.update(datasets)


def dataset_shard(name: str):
    """This worker's shard of the run's dataset `name`: its own rows of a worker-read set, else Ray Data's shard."""
    if name in _DATASETS:
        ctx = ray.train.get_context()
        return _DATASETS[name].shard(ctx.get_world_rank(), ctx.get_world_size())
    return ray.train.get_dataset_shard(name)
