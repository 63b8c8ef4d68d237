"""User-style shards without labels (jobs.download from a loopback server) trained on retrieval at ZeRO-3 with the
augmentation on the worker's device; their sweep: tests/test_tune.py (the same pytest worker: one download)."""
from __future__ import annotations

import json
import tarfile
from math import comb
from pathlib import Path

import numpy as np
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts

import jobs.pretrain
from models.model_file import load_model
from pipelines.tracking import model_file

ROOT = Path(__file__).resolve().parent.parent


def chance_rsum(tars: list[Path]) -> float:
    """Expected rsum (100 x the sum of i2t and t2i R@1, R@5, R@10) of a random ranking of these pairs: a query
    with p positives among a gallery of n finds one in its top k with probability 1 - C(n-p, k) / C(n, k)."""
    caps = []
    for tar in tars:
        with tarfile.open(tar) as t:
            caps += [set(t.extractfile(m).read().decode().splitlines()) for m in t.getmembers() if m.name.endswith(".txt")]
    texts = {c for cs in caps for c in cs}
    owners = [sum(c in cs for cs in caps) for c in texts]

    def hit(n: int, p: int, k: int) -> float:
        return 1 - comb(n - p, k) / comb(n, k)

    return 100 * sum(np.mean([hit(len(texts), len(cs), k) for cs in caps]) + np.mean([hit(len(caps), q, k) for q in owners])
                     for k in (1, 5, 10))


# The ZeRO-3 run must reach this multiple of a random ranking's held-out rsum (17.5 on these pairs). The 60-step run
# is not repeatable (the order of Ray Data's batches, and of the samples img2dataset's threads write): 11 runs on
# 2026-11-26/27 reached 52 to 128, median 98 (one at 52 in a full suite; 62, 77, 79, 98, 99, 108, 111, 113 in eight
# runs in a row), so 3x chance failed once in eleven; a run that does not learn stays near 1x.
RSUM_OVER_CHANCE = 2.0


def test_user_shards_train_with_retrieval_and_loss_and_no_zero_shot(user_shards, capsys):
    """jobs.pretrain on shards written by jobs.download (no labels), at ZeRO-3 (parameters partitioned: the
    evaluation and the saved model gather them), its augmentation applied on the worker's device (here its CPU)
    to uint8 images, with the wait for data logged."""
    root, tmp = user_shards
    with tarfile.open(sorted((root / "test").glob("*.tar"))[0]) as t:
        assert not any(json.loads(t.extractfile(m).read()).get("label") is not None
                       for m in t.getmembers() if m.name.endswith(".json"))
    uri = f"sqlite:///{tmp}/mlflow.db"
    rc = jobs.pretrain.main(["--config", str(ROOT / "configs" / "user_data.yaml"),
                             "--set", f"data.root={root}", "--set", "train.steps=60", "--set", "train.zero_stage=3",
                             "--set", f"tracking.uri={uri}", "--set", f"run.storage_path={tmp}/ray",
                             "--set", "run.experiment=user-data", "--set", "data.augment_on=device",
                             "--set", "data.decode_size=40", "--set", "data.prefetch_batches=2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "heldout: i2t_R1" in printed and "heldout_loss: loss" in printed
    client = MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("user-data").experiment_id])[0]
    metrics = run.data.metrics
    assert {"heldout/i2t_R1", "heldout/t2i_R10", "heldout/rsum", "heldout/i2t_mAP_R", "heldout_loss/loss"} <= set(metrics)
    assert not any("top1" in k or "zero" in k for k in metrics)
    # it learned: held-out rsum well above a random ranking's
    chance = chance_rsum(sorted((root / "test").glob("*.tar")))
    print(f"\nZeRO-3 user-data run: held-out rsum {metrics['heldout/rsum']:.1f}, chance {chance:.1f}")
    assert metrics["heldout/rsum"] > RSUM_OVER_CHANCE * chance
    assert run.data.params["train.zero_stage"] == "3" and run.data.params["train.num_workers"] == "2"
    assert run.data.params["data.augment_on"] == "device" and run.data.params["data.augment"] == "True"
    assert 0 <= metrics["data_wait_frac"] <= 1 and metrics["data_wait_ms"] >= 0
    assert 0 < metrics["data_wait_frac_mean"] < 1
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert steps == list(range(10, 61, 10))
    folder = Path(download_artifacts(run_id=run.info.run_id, artifact_path="model", dst_path=str(tmp / "dl_user"),
                                     tracking_uri=uri))
    load_model(model_file(folder))  # strict shapes: whole tensors were gathered, not ZeRO-3 partitions
