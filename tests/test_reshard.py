"""A ZeRO-1 / ZeRO-2 / ZeRO-3 checkpoint saved by 2 gloo ranks loads at 1 rank (and a 1-rank one at 2) through its universal
form (pipelines.zero.reshard): parameters, fp32 master weights, Adam moments, LR schedule and step equal those the
saving engine held, gathered by DeepSpeed's own full-state accessors; training continues from there."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import free_port, spawn
from tests.small_runs import assert_identical

TAG = "state"
STEPS = 3
MICRO = 4
# ZeRO-1 shares ZeRO-2's optimizer and conversion code (DeepSpeed's stage_1_and_2): `make test-long` only
STAGES = (pytest.param(1, marks=pytest.mark.long), 2, 3)
pytestmark = pytest.mark.timeout(900)


def _config(world: int, stage: int):
    from pipelines.pretrain.config import TrainDocument

    return TrainDocument.from_dict({"model": {"name": "clip_tiny", "overrides": {"vision_depth": 1, "text_depth": 1}},
                             "loss": {"name": "infonce"},
                             "train": {"num_workers": world, "batch_size": MICRO, "zero_stage": stage, "steps": 20,
                                       "warmup_steps": 4, "lr": 1e-2, "grad_clip": 0.0}})


def _engine(world: int, stage: int):
    """The engine the training workers build (pipelines.zero.engine), on a tiny CLIP."""
    from pipelines.pretrain.objective import training_objective
    from pipelines.zero.engine import build_engine

    cfg = _config(world, stage)
    torch.manual_seed(0)
    return build_engine(cfg.train, training_objective(cfg))


def _train(engine, world: int, steps: int, seed: int) -> None:
    """`steps` optimizer steps, each rank on its slice of one global batch of MICRO x 2 rows."""
    from models.gather import World
    from models.tokenizer import tokenize

    rank, rows = dist.get_rank(), MICRO * 2 // world
    for s in range(steps):
        g = torch.Generator().manual_seed(seed + s)
        images = torch.randn(MICRO * 2, 3, 32, 32, generator=g)
        words = ["zero", "one", "two", "three", "a digit", "thin", "wide ink"]
        captions = [" ".join(words[j] for j in torch.randint(0, len(words), (1 + i % 3,), generator=g))
                    for i in range(MICRO * 2)]
        tokens = tokenize(captions, 16)
        part = slice(rank * rows, (rank + 1) * rows)
        out = engine(images[part], tokens[part], World.current())
        engine.backward(out["loss"])
        engine.step()


def _full_state(engine, scheduler) -> dict[str, torch.Tensor]:
    """Every parameter's weight, fp32 master copy and Adam moments, whole (collective under ZeRO-3), and the schedule."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer = engine.optimizer
    if getattr(optimizer, "_hp_optimizer_states_linked", False):
        # ZeRO-1/2 of DeepSpeed 0.19.8 links each parameter to its Adam state once, right after the first param
        # group's first step, when the other groups have no state yet: link again, every group's state now exists
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    out: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=engine.zero_optimization_stage() == 3):
            out[f"param/{name}"] = p.detach().float().clone()
        out[f"fp32/{name}"] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).clone()
    out["lr"] = torch.tensor(scheduler.get_last_lr())
    out["global_steps"] = torch.tensor(engine.global_steps)
    out["scheduler_epoch"] = torch.tensor(scheduler.last_epoch)
    return out


def _phase(rank: int, world: int, port: int, job: dict) -> None:
    """One world of `world` gloo ranks: load `job["load"]` (if any; through reshard), record the state, train, save."""
    from pipelines.storage import fs_path
    from pipelines.zero import checkpoint_files as state, reshard
    from pipelines.fit.progress import Progress
    from pipelines.zero.engine import skip_inference_comm_op

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        skip_inference_comm_op()
        engine, scheduler = _engine(world, job["stage"])
        record, progress = None, {"step": 0}
        if job.get("load"):
            fs, base = fs_path(job["load"])
            if world == 1:  # the checkpoint's storage an fsspec store apart from the local copy (as object storage)
                fs = __import__("fsspec").filesystem("memory")
            _, client_state, record = reshard.load(engine, fs, base, Path(job["load"]), TAG)
            if world == 1:
                record["stored"] = sorted(p.rsplit("/", 1)[-1] for p in fs.find(base))
            progress = client_state["progress"]
            loaded = _full_state(engine, scheduler)
            if rank == 0:
                torch.save(loaded, job["loaded"])
        _train(engine, world, STEPS, seed=progress["step"])
        progress = {"step": progress["step"] + STEPS}
        state.write_shard(engine, job["save"], Progress(**{**vars(Progress()), **progress}))  # the workers' save
        assert torch.serialization.get_crc32_options() is True  # the process's setting, back
        saved = _full_state(engine, scheduler)
        if rank == 0:
            torch.save(saved, job["saved"])
            Path(job["record"]).write_text(json.dumps(record))
        engine.destroy()
    finally:
        dist.destroy_process_group()


def _run(world: int, job: dict) -> None:
    spawn(_phase, (world, free_port(), job), world)


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module", params=STAGES, ids=lambda s: f"zero{s}")
def resized(request, tmp_path_factory):
    """ZeRO-`stage`: 2 ranks train and save; 1 rank loads it (resharded), trains and saves; 2 ranks load that."""
    stage, root = request.param, tmp_path_factory.mktemp(f"reshard{request.param}")
    jobs = [(2, {"save": root / "w2"}), (1, {"load": root / "w2", "save": root / "w1"}),
            (2, {"load": root / "w1", "save": root / "w2b"})]
    digests = []
    for i, (world, job) in enumerate(jobs):
        job.update(stage=stage, saved=root / f"saved{i}.pt", loaded=root / f"loaded{i}.pt", record=root / f"rec{i}")
        before = _digest(job["load"] / TAG) if job.get("load") else None
        _run(world, {k: str(v) if isinstance(v, Path) else v for k, v in job.items()})
        if before is not None:
            digests.append((before, _digest(job["load"] / TAG)))
    load = lambda p: torch.load(p, weights_only=True)  # noqa: E731
    return {"stage": stage, "root": root, "digests": digests,
            "saved": [load(j["saved"]) for _, j in jobs], "loaded": [None, *(load(j["loaded"]) for _, j in jobs[1:])],
            "records": [json.loads(Path(j["record"]).read_text()) for _, j in jobs]}


def test_resized_state_equals_the_saving_engines(resized):
    for i in (1, 2):
        saved, loaded = resized["saved"][i - 1], resized["loaded"][i]
        assert saved.keys() == loaded.keys()
        assert any(k.startswith("exp_avg_sq/") and v.abs().max() > 0 for k, v in saved.items())  # Adam has moved
        # exactly: resharding copies fp32 words and never computes on them, and Adam's second moments sit far below
        # any absolute tolerance that would spare the rest (most under 1e-6 here)
        for key, ref in saved.items():
            assert loaded[key].dtype == ref.dtype and torch.equal(loaded[key], ref), key
        assert int(loaded["global_steps"]) == int(loaded["scheduler_epoch"]) == i * STEPS


def test_resize_records_the_conversion_and_leaves_the_checkpoint_untouched(resized):
    from pipelines.zero import reshard

    recs = resized["records"]
    assert recs[0] is None
    assert (recs[1]["from_world_size"], recs[1]["to_world_size"]) == (2, 1)
    assert (recs[2]["from_world_size"], recs[2]["to_world_size"]) == (1, 2)
    assert all(recs[i]["bytes"] > 0 for i in (1, 2))
    for before, after in resized["digests"]:
        assert before == after
    # 2 -> 1 stored its conversion in the (in-memory) object store only: the marker and the parameters' files
    assert reshard.MARKER in recs[1]["stored"] and "exp_avg_sq.pt" in recs[1]["stored"]
    assert not (resized["root"] / "w2" / reshard.UNIVERSAL).exists()
    # 1 -> 2 beside the checkpoint on local disk, the marker holding the record
    marker = json.loads((resized["root"] / "w1" / reshard.MARKER).read_text())
    assert marker["bytes"] == recs[2]["bytes"] and (resized["root"] / "w1" / reshard.UNIVERSAL / TAG / "zero").is_dir()
    assert reshard.saved_world_size(resized["root"] / "w2" / TAG) == 2
    assert reshard.saved_world_size(resized["root"] / "w1" / TAG) == 1


def test_the_shards_are_written_without_checksums_and_the_option_is_left_as_it_was(resized):
    """pipelines.zero.checkpoint_files.write_shard: torch.save's zip records carry no CRC-32 (half the snapshot's time, which
    the loop waits for) and every file above loaded all the same; the process's own setting is restored after
    (`_phase`)."""
    import zipfile

    files = sorted((resized["root"] / "w2" / TAG).glob("*.pt"))
    assert len(files) >= 3  # the model states and each rank's optimizer partition
    for path in files:
        with zipfile.ZipFile(path) as z:
            assert {info.CRC for info in z.infolist()} == {0}, path


def test_training_continues_after_each_resize(resized):
    # the schedule goes on from the restored step: the LR is the warmup + cosine factor at 2 x STEPS and 3 x STEPS
    from pipelines.fit.optim import warmup_cosine

    t = _config(1, resized["stage"]).train
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=t.lr)
    schedule = warmup_cosine(reference, t.warmup_steps, t.steps)
    lrs = []
    for _ in range(3 * STEPS):
        reference.step()
        schedule.step()
        lrs.append(schedule.get_last_lr()[0])
    for i in range(3):
        saved = resized["saved"][i]
        assert int(saved["global_steps"]) == (i + 1) * STEPS
        assert saved["lr"].tolist() == pytest.approx([lrs[(i + 1) * STEPS - 1]] * len(saved["lr"]))
        # the weights moved on from what was loaded
        if i:
            moved = [k for k in saved if k.startswith("param/") and not torch.equal(saved[k], resized["loaded"][i][k])]
            assert moved


def test_a_failed_conversion_leaves_the_checkpoint_and_no_marker(resized, tmp_path):
    # a checkpoint whose rank-1 optimizer file never arrived: the conversion fails before anything reaches storage
    from pipelines.storage import fs_path
    from pipelines.zero import reshard

    checkpoint = tmp_path / "ck"
    shutil.copytree(resized["root"] / "w2", checkpoint, ignore=shutil.ignore_patterns(reshard.UNIVERSAL, reshard.MARKER))
    next((checkpoint / TAG).glob("*zero_pp_rank_1_*optim_states.pt")).unlink()
    before = _digest(checkpoint)
    fs, base = fs_path(str(checkpoint))
    # what DeepSpeed's ds_to_universal raises on the half it reads: ZeRO-3 checks the data-parallel degree the model
    # file names; ZeRO-1/2 do not, and fail reshaping rank 0's flat partition to a whole parameter
    missing = "dp_degree mismatch" if resized["stage"] == 3 else r"shape .* is invalid for input of size"
    with pytest.raises(RuntimeError, match=missing):
        reshard.ensure_universal(fs, base, checkpoint, TAG)
    assert _digest(checkpoint) == before
    assert not (checkpoint / reshard.MARKER).exists() and not (checkpoint / reshard.UNIVERSAL).exists()


def test_an_interrupted_conversion_is_redone(resized, tmp_path):
    # what a conversion stopped during its upload leaves: part of the folder, no marker
    from pipelines.storage import fs_path
    from pipelines.zero import reshard

    checkpoint = tmp_path / "ck"
    shutil.copytree(resized["root"] / "w1", checkpoint)
    (checkpoint / reshard.MARKER).unlink()
    complete = _digest(checkpoint / reshard.UNIVERSAL)
    for p in sorted((checkpoint / reshard.UNIVERSAL).rglob("exp_avg*.pt"))[::2]:
        p.unlink()
    fs, base = fs_path(str(checkpoint))
    record = reshard.ensure_universal(fs, base, checkpoint, TAG)
    assert record["from_world_size"] == 1 and (checkpoint / reshard.MARKER).exists()
    redone = _digest(checkpoint / reshard.UNIVERSAL)
    assert redone.keys() == complete.keys()
    # the tensors are those of the first conversion (compared loaded: torch.save's bytes hold the file's name)
    compared = 0
    for name in complete:
        if name.endswith(".pt"):
            compared += assert_identical(torch.load(checkpoint / reshard.UNIVERSAL / name, weights_only=False),
                                         torch.load(resized["root"] / "w1" / reshard.UNIVERSAL / name, weights_only=False),
                                         name)
    assert compared > len(complete) // 2


def test_the_partition_reader_gathers_what_the_engine_held(resized):
    # tests/zero_state.py reads a checkpoint's partitions without DeepSpeed (the end-to-end test's reference)
    from tests.zero_state import gathered_partitions, universal_state

    for i, name in ((0, "w2"), (1, "w1")):
        gathered, engine = gathered_partitions(resized["root"] / name / TAG), resized["saved"][i]
        assert gathered.keys() == {k for k in engine if k.split("/")[0] in ("fp32", "exp_avg", "exp_avg_sq")}
        for key, tensor in gathered.items():
            assert torch.equal(tensor, engine[key]), key
    # and the conversion of the 1-rank checkpoint holds those tensors
    converted = universal_state(resized["root"] / "w1" / "universal" / TAG)
    assert converted.keys() == gathered.keys()
    for key, tensor in gathered.items():
        assert torch.equal(converted[key], tensor.reshape(-1)), key


def test_the_two_rank_conversion_holds_its_partitions_bit_for_bit(resized, tmp_path):
    # 2 -> 1 stored its conversion in memory only (the fixture's object store): convert a copy of the 2-rank checkpoint
    # again, so that `make test` holds each joined tensor to its two halves, not only the engine that loaded them
    from pipelines.storage import fs_path
    from pipelines.zero import reshard
    from tests.zero_state import gathered_partitions, universal_state

    checkpoint = tmp_path / "w2"
    shutil.copytree(resized["root"] / "w2", checkpoint)
    fs, base = fs_path(str(checkpoint))
    assert reshard.ensure_universal(fs, base, checkpoint, TAG)["from_world_size"] == 2
    reference = gathered_partitions(checkpoint / TAG)
    converted = universal_state(checkpoint / reshard.UNIVERSAL / TAG)
    assert converted.keys() == reference.keys() and any(k.startswith("exp_avg_sq/") for k in reference)
    for key, tensor in reference.items():
        assert converted[key].dtype == tensor.dtype and torch.equal(converted[key], tensor.reshape(-1)), key
