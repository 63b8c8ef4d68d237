"""Small sets read by the training workers themselves (pipelines.data.worker_reader): each worker's rows, their order and
batches, the same decoded samples as Ray Data's read gives, and which datasets a run hands Ray Data."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import ray.data

from pipelines.config import ConfigError
from pipelines.data.worker_reader import WorkerShards
from pipelines.data.reader import read_split
from pipelines.inputs import prepare_data
from pipelines.pretrain.config import load_train_config
from pipelines.pretrain.job import build_datasets
ROOT = Path(__file__).resolve().parent.parent

SIZE, CONTEXT = 32, 16


def ids(batches) -> list[int]:
    return [int(i) for b in batches for i in np.asarray(b["sample_id"])]


def test_workers_split_the_rows_equally_and_reshuffle_them_by_epoch(ray_local, digits_root):
    local = read_split(digits_root, "train", SIZE, CONTEXT, seed=0, stats_name="local-split", worker_read=True)
    assert isinstance(local, WorkerShards)
    shards = [local.shard(rank, 2) for rank in range(2)]
    n = shards[0].n
    rows = [s.rows(None) for s in shards]
    assert len(rows[0]) == len(rows[1]) == n // 2 and not set(rows[0]) & set(rows[1])
    epoch0 = [s.rows(100) for s in shards]
    assert all(sorted(a) == sorted(b) for a, b in zip(epoch0, rows))  # the same rows, shuffled
    assert all(np.array_equal(a, s.rows(100)) for a, s in zip(epoch0, shards))  # seeded: the same every time
    assert not np.array_equal(epoch0[0], shards[0].rows(101))  # another epoch, another order
    batches = list(shards[0].iter_torch_batches(batch_size=64, drop_last=True, local_shuffle_buffer_size=256,
                                                local_shuffle_seed=100))
    assert [len(b["text"]) for b in batches] == [64] * (n // 2 // 64)
    assert tuple(batches[0]["image"].shape) == (64, 3, SIZE, SIZE) and batches[0]["text"].shape[1] == CONTEXT
    # every row once over the two workers (eval: each reads all of them)
    whole = dataclasses.replace(local, split=False).shard(0, 2)
    assert len(whole.rows(None)) == n == len(whole.table())
    assert len(shards[0].table()) < n  # a training worker fetches the blocks of its own rows only
    left = ids(shards[0].iter_batches(batch_size=100)) + ids(shards[1].iter_batches(batch_size=100))
    assert len(left) == len(set(left)) == 2 * (n // 2)
    assert set(left) <= set(ids(whole.iter_batches(batch_size=100)))


def test_the_same_samples_as_ray_datas_read(ray_local, digits_root):
    """Unaugmented, in file order: the decoded images, tokens and labels equal Ray Data's, sample by sample."""
    kw = dict(seed=0, augment=False, shuffle=False, stats_name="local-same")
    ours = dataclasses.replace(read_split(digits_root, "val", SIZE, CONTEXT, worker_read=True, **kw), split=False)
    theirs = read_split(digits_root, "val", SIZE, CONTEXT, **kw).take_all()
    got = {}
    for b in ours.shard(0, 1).iter_batches(batch_size=128):
        for i, sid in enumerate(b["sample_id"]):
            got[int(sid)] = (b["image"][i], b["text"][i], b["label"][i])
    assert len(got) == len(theirs)
    for row in theirs:
        image, text, label = got[int(row["sample_id"])]
        assert np.array_equal(image, row["image"]) and np.array_equal(text, row["text"]) and label == row["label"]


def test_a_run_hands_ray_data_only_what_the_workers_do_not_read(ray_local, digits_root, tmp_path):
    base = [f"data.root={digits_root}", f"tracking.uri=sqlite:///{tmp_path}/m.db", f"run.storage_path={tmp_path}/r"]
    cfg = load_train_config(ROOT / "configs" / "demo.yaml", base)
    prepare_data(cfg)  # the eval sets
    datasets = build_datasets(cfg, CONTEXT)
    assert datasets and all(isinstance(d, WorkerShards) for d in datasets.values())
    assert datasets["train"].split and not any(d.split for k, d in datasets.items() if k != "train")
    cfg = load_train_config(ROOT / "configs" / "demo.yaml", [*base, "data.reader=ray_data"])
    assert all(isinstance(d, ray.data.Dataset) for d in build_datasets(cfg, CONTEXT).values())
    with pytest.raises(ConfigError, match="data.reader"):
        load_train_config(ROOT / "configs" / "demo.yaml", [*base, "data.reader=workers"])
