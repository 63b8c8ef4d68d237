"""User-style shards without labels (jobs.download from a loopback server) trained on retrieval at ZeRO-3 with the
augmentation on the worker's device; their sweep: tests/test_tune.py (the same pytest worker: one download). And
ZeRO-3 against ZeRO-2, step for step, for CLIP, ProLIP and Llip: two DeepSpeed ranks on gloo, no Ray."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from math import comb
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts

import jobs.pretrain
from models.model_file import load_model
from pipelines.tracking import model_file
from tests.pace import scaled

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


# The ZeRO-3 run must reach this multiple of a random ranking's held-out rsum (17.5 on these pairs): a smoke check of
# the whole product path. The 60-step run is not repeatable (the order of Ray Data's batches, and of the samples
# img2dataset's threads write): 11 runs on 2026-11-26/27 reached 52 to 128, median 98 (one at 52 in a full suite;
# 62, 77, 79, 98, 99, 108, 111, 113 in eight runs in a row), so 3x chance failed once in eleven; a run that does not
# learn stays near 1x. The repeatable ZeRO-3 check is test_zero3_trains_step_for_step_as_zero2.
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


ZERO_STEPS, ZERO_BATCH = 5, 32  # steps, rows per rank: a lost or misapplied update shows from the next step on
ZERO_RECIPES = ("demo.yaml", "prolip_tiny.yaml", "llip_tiny.yaml")
# The losses of the two stages, both seeded and fed the same batches: 2.4e-7 (Llip) to 2.0e-6 (ProLIP) apart at
# most over 20 steps (2026-11-27): the reduce-scatter sums in another order than the all-reduce. A lost or
# misapplied update, or a parameter read while partitioned, moves the next losses by far more.
ZERO_RTOL = 1e-4

ZERO_FIT = """
import json, os, sys
import numpy as np, torch, deepspeed
from models.tokenizer import tokenize
from pipelines.pretrain.config import load_train_config
from pipelines.digits.arrays import config_sampler, digit_arrays
from pipelines.pretrain.objective import training_objective
from pipelines.zero.engine import deepspeed_config, skip_inference_comm_op
rank, steps, per_rank = int(os.environ["RANK"]), int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
skip_inference_comm_op()
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
images, _, metas = digit_arrays("train")
out = {}
for recipe in sys.argv[3:]:
    for stage in (2, 3):
        cfg = load_train_config(f"configs/{recipe}", [f"train.zero_stage={stage}", f"train.batch_size={per_rank}"])
        torch.manual_seed(0)  # the same initial weights at both stages
        objective = training_objective(cfg)
        t = cfg.train
        opt = torch.optim.AdamW(objective.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                weight_decay=t.weight_decay)
        ds = deepspeed_config(cfg.train, False)
        if stage == 3:  # partitioned as a full-size model's parameters are: by default a parameter under 1e5 elements
            # stays whole on every rank (nearly all of a tiny model's), and gathered ones stay until memory runs short
            ds["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0,
                                           stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
        engine, *_ = deepspeed.initialize(model=objective, optimizer=opt, config=ds)
        torch.manual_seed(1 + rank)  # each rank's own draws (ProLIP's masks), the same at both stages
        rng, sampler, context = np.random.default_rng(0), config_sampler(cfg), objective.model.context_length
        losses = []
        for _ in range(steps):  # one seeded global batch per step, each rank its half
            rows = rng.choice(len(images), 2 * per_rank, replace=False)
            tokens = tokenize([sampler.draw(metas[i], "", rng) for i in rows], context)
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            loss = engine(images[rows][mine], tokens[mine])["loss"]
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[f"{recipe}:{stage}"] = losses
if rank == 0:
    print(json.dumps(out))
"""


@pytest.mark.slow  # ~40 s of DeepSpeed on two processes: not for `make test-fast`
def test_zero3_trains_step_for_step_as_zero2():
    """CLIP, ProLIP (its second encoder pass over the masked copies) and Llip (its mixer's custom autograd) trained
    by DeepSpeed on two gloo ranks, once at ZeRO-2 and once at ZeRO-3 (every parameter partitioned between the
    ranks, as a full-size model's are), from the same weights on the same seeded batches: the ZeRO-3 losses are the ZeRO-2 ones, step for step (the
    ZeRO-2 recipes learn: tests/test_methods.py). Repeatable: nothing in it depends on timing."""
    from tests.helpers import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", ZERO_FIT, str(ZERO_STEPS), str(ZERO_BATCH), *ZERO_RECIPES]
    ranks = [subprocess.Popen(args, cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (1, 0)]
    done = [p.communicate(timeout=scaled(600)) for p in ranks]
    for p, (_, err) in zip(ranks, done):
        assert p.returncode == 0, err[-3000:]
    losses = json.loads(done[1][0].strip().splitlines()[-1])
    for recipe in ZERO_RECIPES:
        two, three = losses[f"{recipe}:2"], losses[f"{recipe}:3"]
        print(f"{recipe} ZeRO-3 losses {three}, largest relative gap to ZeRO-2 "
              f"{max(abs(a - b) / abs(b) for a, b in zip(three, two)):.1e}")
        assert len(three) == ZERO_STEPS and all(np.isfinite(three)), (recipe, three)
        np.testing.assert_allclose(three, two, rtol=ZERO_RTOL, err_msg=recipe)
        assert min(three[-3:]) < three[0], (recipe, three)  # the steps move the model
