"""Feature-cache accumulation (models.accumulate, train.grad_accum) is exact: k micro-batches give the loss and every
parameter gradient of one pass over the k x batch rows with the same random draws (float64, within 1e-10), for every
method, on one process, on a 2-process gloo group and in 2 Ray Train workers; a DeepSpeed step with it at
ZeRO-0/1/2/3 (and bf16) equals the one-pass step. A Ray Train run with it stops, resumes and recovers a failed worker bit-exactly: tests/test_scale.py."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from models.accumulate import CachedBatch, SplitForward
from models.gather import World
from models.losses import create_loss
from models.objective import Objective
from models.registry import create_model
from models.tokenizer import tokenize
from tests.helpers import free_port, official_switches, spawn

f64 = torch.float64
MICRO, K = 3, 4
SMALL = {"vision_depth": 1, "text_depth": 1}
# The official recipes' switches, as configs/*_official.yaml set them.
PROLIP_OFFICIAL, PCMEPP_OFFICIAL, LLIP_OFFICIAL = (official_switches(recipe)
                                                   for recipe in ("prolip_tiny", "pcmepp_tiny", "llip_tiny"))
# (model, model overrides, loss, loss params): every loss term switched on, with weights that make it count
CASES = {
    "clip": ("clip_tiny", {}, "infonce", {}),
    "siglip": ("siglip_tiny", {}, "siglip", {"init_scale": 3.0, "init_bias": -1.0}),
    "prolip": ("prolip_tiny", {"mask_fraction": 0.25}, "prolip",
               {"alpha1": 0.3, "alpha2": 0.4, "beta": 0.5, "eps": -1.0, "c": 2.0}),
    "prolip_official": ("prolip_tiny", {**PROLIP_OFFICIAL[0], "mask_fraction": 0.5}, "prolip",
                        {**PROLIP_OFFICIAL[1], "alpha1": 0.3, "alpha2": 0.4, "beta": 0.5, "eps": -1.0, "c": 2.0,
                         "form": "exact"}),
    "pcmepp": ("pcmepp_tiny", {"msda_fraction": 0.5}, "pml", {"init_a": 2.0, "init_b": 1.0, "alpha": 0.5, "beta": 0.5}),
    "pcmepp_official": ("pcmepp_tiny", {**PCMEPP_OFFICIAL[0], "msda_fraction": 0.5}, "pml",
                        {**PCMEPP_OFFICIAL[1], "alpha": 0.5, "beta": 0.5, "label_smoothing": 0.01}),
    "llip": ("llip_tiny", {}, "llip", {"init_scale": 3.0, "init_bias": -1.0}),
    "llip_official": ("llip_tiny", LLIP_OFFICIAL[0], "llip",
                      {**LLIP_OFFICIAL[1], "init_scale": 3.0, "init_bias": -1.0}),
    "prob_llip": ("prolip_llip_tiny", {"mask_fraction": 0.25}, "prob_llip",
                  {"init_scale": 3.0, "init_bias": -1.0, "alpha1": 0.3, "alpha2": 0.4, "beta": 0.5, "eps": -1.0, "c": 2.0}),
}


def objective(case: str, seed: int = 0) -> Objective:
    name, overrides, loss, params = CASES[case]
    torch.manual_seed(seed)
    return Objective(create_model(name, **SMALL, **overrides), create_loss(loss, **params)).to(f64).train()


def inputs(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    words = ["zero", "one", "two", "three", "four", "a digit", "thin", "slanted", "wide ink"]
    captions = [" ".join(words[j] for j in torch.randint(0, len(words), (1 + i % 4,), generator=g)) for i in range(rows)]
    return torch.randn(rows, 3, 32, 32, generator=g, dtype=f64), tokenize(captions, 16)


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def one_pass(obj, images, tokens, seed, world=None):
    torch.manual_seed(seed)
    out = obj(images, tokens, world)
    out["loss"].backward()
    return out, torch.get_rng_state()


def cached(obj, images, tokens, seed, world=None, k=K):
    torch.manual_seed(seed)
    step = CachedBatch(obj, images, tokens, k, world)
    step.backward()
    return step.out, torch.get_rng_state()


def assert_same(ref_out, got_out, ref_grads, got_grads, tol=1e-10):
    assert set(ref_out) == set(got_out)
    for key in ref_out:
        assert torch.allclose(got_out[key], ref_out[key], rtol=0, atol=tol), (key, got_out[key], ref_out[key])
    assert set(got_grads) == set(ref_grads), set(got_grads) ^ set(ref_grads)
    for name, g in ref_grads.items():
        err = (got_grads[name] - g).abs().max().item()
        assert err <= tol, f"{name}: gradient differs by {err:.3g}"


@pytest.mark.parametrize("case", list(CASES))
def test_k_micro_batches_give_the_loss_and_gradients_of_one_batch(case):
    images, tokens = inputs(MICRO * K)
    ref = objective(case)
    got = copy.deepcopy(ref)
    ref_out, ref_rng = one_pass(ref, images, tokens, seed=5)
    got_out, got_rng = cached(got, images, tokens, seed=5)
    assert_same(ref_out, got_out, grads(ref), grads(got))
    assert torch.equal(ref_rng, got_rng)  # the random stream goes on as after one pass: the live passes replay it
    # every learnable scale / bias got its one gradient (k copies would be k times it)
    scalars = [n for n, p in ref.loss.named_parameters()]
    assert scalars and all(ref.loss.get_parameter(n).grad is not None for n in scalars)
    if "mask_fraction" in CASES[case][1]:
        assert ref_out["inclusion_masked"] > 0  # the masked copies took part


def nudged(features: dict[str, torch.Tensor], ulps: int, seed: int) -> dict[str, torch.Tensor]:
    """Each floating feature moved by up to `ulps` units in the last place, up or down at random: what other
    kernels, another device or another split of the batch do to a value that is the same in exact arithmetic."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, value in features.items():
        if not value.is_floating_point():
            out[key] = value
            continue
        value = value.detach()
        for _ in range(ulps):
            toward = torch.where(torch.rand(value.shape, generator=g) < 0.5, -torch.inf, torch.inf).to(value.dtype)
            value = torch.where(torch.rand(value.shape, generator=g) < 0.5, torch.nextafter(value, toward), value)
        out[key] = value
    return out


@pytest.mark.parametrize("dtype", [f64, torch.float32], ids=str)
@pytest.mark.parametrize("case", ["pcmepp", "pcmepp_official"])
def test_a_tie_between_logits_is_decided_alike_whatever_the_rounding(case, dtype):
    """The rows' captions repeat (12 rows, 10 captions): a repeated caption scores exactly its ground truth's logit in
    exact arithmetic, and PCME++'s pseudo-positives (logit >= the ground truth's) must decide that tie alike under
    any rounding. Features moved by a few ulps (as AVX-512 kernels, a GPU or a micro-batch's shorter padding move
    them; here by up to 16 ulps) give the loss and pseudo-positive count of the features as computed, within
    float64's 1e-10 (float32: 1e-5 relative)."""
    images, tokens = inputs(MICRO * K)
    assert len(set(map(tuple, tokens.tolist()))) < len(tokens)  # a caption twice: the ties this test is about
    obj, images = objective(case).to(dtype), images.to(dtype)
    torch.manual_seed(5)
    images, draws, batch_out = obj.model.draw(images, tokens)
    with torch.no_grad():
        features = obj.model.features(images, tokens, draws)
        ref = obj.loss(obj.model.pair_out({**features, **batch_out}, World.current()))
        assert ref["n_pseudo"] > 0
        tol = 1e-10 if dtype == f64 else 1e-5 * ref["loss"].abs().item()
        for seed in range(4):
            got = obj.loss(obj.model.pair_out({**nudged(features, 16, seed), **batch_out}, World.current()))
            assert got["n_pseudo"] == ref["n_pseudo"], (seed, got["n_pseudo"], ref["n_pseudo"])
            assert abs(got["loss"] - ref["loss"]).item() <= tol, (seed, got["loss"], ref["loss"])


# ATen's CPU kernel sets, lowest first (ATEN_CPU_CAPABILITY forces one for a process, up to what the CPU has)
CAPABILITIES = ("default", "avx2", "avx512")


def offered_capabilities() -> list[str]:
    """The kernel sets this CPU offers: those up to its native one (torch.backends.cpu.get_cpu_capability())."""
    native = torch.backends.cpu.get_cpu_capability().lower()
    return list(CAPABILITIES[: CAPABILITIES.index(native) + 1]) if native in CAPABILITIES else ["default", native]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("capability", [c for c in offered_capabilities()
                                        if c != torch.backends.cpu.get_cpu_capability().lower()])
def test_exact_under_every_cpu_kernel_set(capability):
    """The exactness tests above, in a process forced to each kernel set this CPU offers below its native one (the
    native one runs them in this process): a machine without AVX-512 still meets the kind of difference AVX-512
    kernels make, as the default kernels round otherwise than AVX2's. Every method's loss and gradients, and the
    pseudo-positives' ties."""
    import subprocess
    import sys

    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip().lower() == capability, probe.stdout  # the process really runs those kernels
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                          f"{__file__}::test_k_micro_batches_give_the_loss_and_gradients_of_one_batch",
                          f"{__file__}::test_a_tie_between_logits_is_decided_alike_whatever_the_rounding"],
                         env=env, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    passed = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and f"{len(CASES) + 4} passed" in passed, run.stdout[-3000:] + run.stderr[-2000:]


# On a GPU (`make test-gpu`): float64 as exact as on a CPU; float32 (TF32 off) within its rounding, relative to each
# tensor's largest value: cuBLAS / cuDNN pick their algorithms by shape, so a micro-batch's rows round otherwise than
# the whole batch's (bf16 is a precision choice, not an exactness claim).
GPU_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch: `make test-gpu`")
@pytest.mark.parametrize("dtype", list(GPU_TOLERANCE), ids=str)
def test_k_micro_batches_give_one_batch_on_the_gpu(dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    tol, worst = GPU_TOLERANCE[dtype], {}
    images, tokens = inputs(MICRO * K)
    images, tokens = images.cuda().to(dtype), tokens.cuda()
    for case in CASES:
        ref = objective(case).to("cuda", dtype)
        got = copy.deepcopy(ref)
        ref_out, _ = one_pass(ref, images, tokens, seed=5)
        got_out, _ = cached(got, images, tokens, seed=5)
        ref_g, got_g = grads(ref), grads(got)
        assert set(ref_g) == set(got_g), case
        errs = [((got_out[k] - ref_out[k]).abs().max() / ref_out[k].abs().max().clamp_min(1)).item() for k in ref_out
                if ref_out[k].is_floating_point()]
        scale = max(g.abs().max() for g in ref_g.values())  # the largest gradient: a near-zero one is not its own unit
        errs += [((got_g[n] - g).abs().max() / scale).item() for n, g in ref_g.items()]
        worst[case] = max(errs)
    print(f"\n{dtype} on {torch.cuda.get_device_name()}: largest relative difference per method {worst}")
    assert all(err <= tol for err in worst.values()), worst


def test_the_masked_rows_and_msda_partners_span_micro_batches():
    """The draws are made over the whole batch: with k micro-batches, masked rows fall in several of them (some in
    none) and MSDA partners cross micro-batch borders; the one-batch reference above saw the same draws."""
    images, tokens = inputs(MICRO * K)
    model = objective("prolip").model
    torch.manual_seed(5)
    _, draws, _ = model.draw(images, tokens)
    per_micro = draws["masked"].view(K, MICRO).sum(1)
    assert per_micro.sum() == round(0.25 * MICRO * K) and (per_micro == 0).any() and (per_micro > 0).sum() > 1
    model = objective("pcmepp").model
    torch.manual_seed(5)
    _, _, extra = model.draw(images, tokens)
    mixed = torch.nonzero(extra["mix_partner"] != torch.arange(MICRO * K)).flatten()
    assert (mixed // MICRO != extra["mix_partner"][mixed] // MICRO).any()


class DropoutModel(SplitForward, nn.Module):
    """A toy dual encoder with dropout in its features: the live pass must see the cached pass's masks."""

    def __init__(self):
        super().__init__()
        self.image, self.text = nn.Linear(12, 8), nn.Embedding(50000, 8)

    def features(self, images, tokens, draws):
        img = F.dropout(self.image(images.flatten(1)[:, :12]), 0.5, self.training)
        txt = F.dropout(self.text(tokens).mean(1), 0.5, self.training)
        return {"image_mu": F.normalize(img, dim=-1), "text_mu": F.normalize(txt, dim=-1)}


def test_dropout_is_replayed_in_the_gradient_pass():
    """Reference: the k micro-batches' features with their graphs kept (same dropout draws), one loss, one
    backward. Without restoring the random state the live passes would draw other masks."""
    images, tokens = inputs(MICRO * K)
    torch.manual_seed(0)
    ref = Objective(DropoutModel(), create_loss("siglip")).to(f64).train()
    got = copy.deepcopy(ref)
    torch.manual_seed(3)
    parts = [ref.model.features(images[i:i + MICRO], tokens[i:i + MICRO], {}) for i in range(0, MICRO * K, MICRO)]
    ref_out = ref({k: torch.cat([p[k] for p in parts]) for k in parts[0]}, World(), stage="loss")
    ref_out["loss"].backward()
    got_out, _ = cached(got, images, tokens, seed=3)
    assert_same(ref_out, got_out, grads(ref), grads(got))
    torch.manual_seed(3)
    one = copy.deepcopy(got)
    one.zero_grad()
    one_pass(one, images, tokens, seed=3)
    assert (grads(one)["model.image.weight"] - grads(got)["model.image.weight"]).abs().max() > 1e-3  # other masks


def _batch_dims(output) -> set[int]:
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else [output]
    return {t.shape[0] for t in values if isinstance(t, torch.Tensor) and t.dim()}


class _Saved:
    """A tensor autograd keeps for a backward; its graph drops it when that backward has run (or the graph dies)."""
    __slots__ = ("tensor", "__weakref__")


@pytest.mark.parametrize("case", ["clip", "llip"])
def test_a_gradient_pass_holds_one_micro_batchs_activations(case):
    """The memory claim: the encoders only ever see one micro-batch (every module's output has MICRO rows in the
    cached and the gradient passes), and the activations the gradient passes keep for backward, at their peak (so a
    graph left alive into the next pass counts), are a 1/K share of what one such pass over the whole batch keeps.
    Only the loss stage sees every row: features, not activations."""
    import weakref

    images, tokens = inputs(MICRO * K)
    obj = objective(case)
    params = {p.untyped_storage().data_ptr() for p in obj.parameters()}
    passes: list[tuple[str, set[int]]] = []  # (stage, rows of every module output)
    micro_grads: list[dict[str, torch.Tensor]] = []
    live, peak = [0], [0]  # bytes of gradient-pass activations alive now, and at most

    def pack(t):  # a parameter kept for backward costs nothing per row
        if t.untyped_storage().data_ptr() in params:
            return t
        saved, size = _Saved(), t.numel() * t.element_size()
        saved.tensor = t
        live[0] += size
        peak[0] = max(peak[0], live[0])
        weakref.finalize(saved, lambda: live.__setitem__(0, live[0] - size))
        return saved

    def forward(*args, stage, **kwargs):
        rows = set()
        hooks = [m.register_forward_hook(lambda _m, _a, out: rows.update(_batch_dims(out))) for m in obj.model.modules()]
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                    pack if stage == "surrogate" else lambda t: t, lambda s: s.tensor if isinstance(s, _Saved) else s):
                out = obj(*args, stage=stage, **kwargs)
        finally:
            for h in hooks:
                h.remove()
        passes.append((stage, rows))
        if stage == "surrogate":
            micro_grads.append(kwargs["grads"])
        return out

    torch.manual_seed(5)
    step = CachedBatch(obj, images, tokens, K, forward=forward)
    step.backward()
    # Llip's mixer (pair_out) contextualises the cached features against every caption in the loss stage
    for stage, rows in passes:
        assert rows == ({MICRO * K} if stage == "loss" and case == "llip" else set() if stage == "loss" else {MICRO}), \
            (stage, rows)
    # (Llip's image_mu branch, unused by the loss, never runs backward: its saved tensors, 1.5 kB a pass, stay counted)
    micro_peak, before = peak[0], live[0]
    peak[0] = before
    whole = {k: torch.cat([g[k] for g in micro_grads]) for k in micro_grads[0]}
    forward(images, tokens, stage="surrogate", draws=step.draws, grads=whole)
    assert passes.pop()[1] == {MICRO * K}
    # a micro-batch's captions may be shorter than the batch's longest; holding every row would keep K times this
    assert 0 < micro_peak <= 1.25 * (peak[0] - before) / K, (micro_peak, peak[0] - before)
    assert [p[0] for p in passes] == ["features"] * K + ["loss"] + ["surrogate"] * K


def test_micro_batches_must_split_the_batch_evenly():
    with pytest.raises(ValueError, match="do not split into 5 equal micro-batches"):
        CachedBatch(objective("clip"), *inputs(12), 5)


# ---------------------------------------------------------------------------------------------------------------
# two processes (gloo): every method in float64, then DeepSpeed steps (pipelines.zero.fit.cached_step)
# ---------------------------------------------------------------------------------------------------------------
WORLD = 2
DS_CASE = "prob_llip"  # masked draws, and the mixer's parameters in the whole-batch stage (gathered by ZeRO-3)
DS_RUNS = [(2, False), (3, False), (1, False), (0, False), (2, True)]  # (ZeRO stage, bf16)


def _mean_over_workers(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def _float64_methods(rank: int, world: World) -> dict:
    """Per method: the largest difference of the loss and of the workers' averaged gradients between one pass over
    each worker's 12 rows (against both workers' 24) and 4 cached micro-batches of 3 (same draws: seeded per rank)."""
    images, tokens = inputs(MICRO * K * WORLD)
    local = slice(rank * MICRO * K, (rank + 1) * MICRO * K)
    result = {}
    for case in CASES:
        ref = objective(case)
        got = copy.deepcopy(ref)
        ref_out, _ = one_pass(ref, images[local], tokens[local], 5 + rank, world)
        got_out, _ = cached(got, images[local], tokens[local], 5 + rank, world)
        loss_err = (_mean_over_workers(got_out["loss"]) - _mean_over_workers(ref_out["loss"])).abs().item()
        ref_g, got_g = grads(ref), grads(got)
        grad_err = max((_mean_over_workers(got_g[n]) - _mean_over_workers(g)).abs().max().item() for n, g in ref_g.items())
        result[case] = {"loss_err": loss_err, "grad_err": grad_err, "same_params": sorted(ref_g) == sorted(got_g),
                        "loss": _mean_over_workers(ref_out["loss"]).item()}
    return result


def _deepspeed_step(rank: int, world: World, stage: int, bf16: bool, accum: bool) -> dict[str, torch.Tensor]:
    """The weights after one SGD step of a DeepSpeed engine (the worker's config), one pass or cached."""
    import deepspeed

    from pipelines.pretrain.config import TrainDocument
    from pipelines.zero.fit import cached_step
    from pipelines.zero.engine import deepspeed_config, full_state_dict

    name, overrides, loss, params = CASES[DS_CASE]
    cfg = TrainDocument.from_dict({"model": {"name": name, "overrides": {**SMALL, **overrides}},
                            "loss": {"name": loss, "params": params},
                            "train": {"num_workers": WORLD, "batch_size": MICRO if accum else MICRO * K,
                                      "grad_accum": K if accum else 1, "zero_stage": stage, "grad_clip": 0.0}})
    torch.manual_seed(0)
    obj = Objective(create_model(name, **SMALL, **overrides), create_loss(loss, **params)).train()
    # SGD: the update is the gradient itself (Adam's first step would hide a gradient scaled by 1/k)
    engine, *_ = deepspeed.initialize(model=obj, optimizer=torch.optim.SGD(obj.parameters(), lr=0.5),
                                      config=deepspeed_config(cfg.train, bf16), dist_init_required=False)
    images, tokens = inputs(MICRO * K * WORLD, seed=1)
    local = slice(rank * MICRO * K, (rank + 1) * MICRO * K)
    images, tokens = images[local].float(), tokens[local]
    torch.manual_seed(5 + rank)
    if accum:
        out = cached_step(engine, images, tokens, K, world, finite=lambda loss: True)
    else:
        out = engine(images, tokens, world)
        engine.backward(out["loss"])
        engine.step()
    weights = full_state_dict(engine, engine.module)
    weights["@loss"] = out["loss"].detach().float().reshape(1)
    engine.destroy()
    return weights


def _two_workers(rank: int, port: int, out_dir: str) -> None:
    import json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        world = World.current()
        result = {"float64": _float64_methods(rank, world), "deepspeed": {}}
        from pipelines.zero.engine import skip_inference_comm_op

        skip_inference_comm_op()
        torch.manual_seed(0)
        initial = Objective(create_model(CASES[DS_CASE][0], **SMALL, **CASES[DS_CASE][1]),
                            create_loss(CASES[DS_CASE][2], **CASES[DS_CASE][3])).state_dict()
        for stage, bf16 in DS_RUNS:
            one = _deepspeed_step(rank, world, stage, bf16, accum=False)
            acc = _deepspeed_step(rank, world, stage, bf16, accum=True)
            loss_one, loss_acc = one.pop("@loss"), acc.pop("@loss")
            # per weight tensor: the largest update of the one-pass step, and how far the cached step's weights are
            per_tensor = [((one[k] - initial[k]).abs().max().item(), (acc[k] - one[k]).abs().max().item())
                          for k in one]
            moved = sum(int((acc[k] - initial[k]).abs().max() > 0) for k in acc)
            result["deepspeed"][f"zero{stage}{'_bf16' if bf16 else ''}"] = {
                "per_tensor": per_tensor, "moved": moved, "tensors": len(acc),
                "loss_err": (loss_acc - loss_one).abs().item()}
        if rank == 0:
            (__import__("pathlib").Path(out_dir) / "result.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    import json

    out = tmp_path_factory.mktemp("accum")
    spawn(_two_workers, (free_port(), str(out)), WORLD)
    return json.loads((out / "result.json").read_text())


@pytest.mark.timeout(600)
def test_two_workers_k_micro_batches_equal_one_batch_for_every_method(two_workers):
    for case, r in two_workers["float64"].items():
        assert r["same_params"], case
        assert r["loss_err"] <= 1e-10 and r["grad_err"] <= 1e-10, (case, r)


@pytest.mark.timeout(600)
def test_two_ray_train_workers_k_micro_batches_equal_one_batch(ray_local, tmp_path):
    """The same float64 check in 2 Ray Train workers (TorchTrainer, gloo): the process group and the gathers are the
    ones a training run's workers use."""
    import json

    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    def loop(config):
        torch.set_num_threads(1)
        rank = ray.train.get_context().get_world_rank()
        result = _float64_methods(rank, World.current())
        if rank == 0:
            with open(config["out"], "w") as f:
                json.dump(result, f)

    out = tmp_path / "result.json"
    TorchTrainer(loop, train_loop_config={"out": str(out)}, torch_config=TorchConfig(backend="gloo"),
                 scaling_config=ray.train.ScalingConfig(num_workers=WORLD, use_gpu=False),
                 run_config=ray.train.RunConfig(name="accum-float64", storage_path=str(tmp_path / "ray"))).fit()
    result = json.loads(out.read_text())
    assert set(result) == set(CASES)
    for case, r in result.items():
        assert r["same_params"], case
        assert r["loss_err"] <= 1e-10 and r["grad_err"] <= 1e-10, (case, r)


@pytest.mark.timeout(600)
def test_deepspeed_step_with_accumulation_equals_the_one_batch_step(two_workers):
    """ZeRO-2, ZeRO-3, ZeRO-1 and ZeRO-0, fp32: the first SGD step's weights agree to float32 rounding of the update (a
    gradient counted k times, divided by k, or reduced as one micro-batch's would be off by its size); bf16: the
    same step to bf16 rounding."""
    runs = two_workers["deepspeed"]
    assert set(runs) == {f"zero{s}{'_bf16' if b else ''}" for s, b in DS_RUNS}
    for name, r in runs.items():
        assert r["moved"] == r["tensors"], (name, r)  # every weight got its gradient (the loss's scale/bias too)
        rel, floor = (5e-2, 1e-3) if "bf16" in name else (1e-4, 1e-6)  # float32 weights near 1: ~1e-7 rounding
        bad = [(update, err) for update, err in r["per_tensor"] if err > rel * update + floor]
        assert not bad and r["loss_err"] <= rel, (name, bad, r["loss_err"])
        assert sum(update > 1e-3 for update, _ in r["per_tensor"]) > 0.9 * r["tensors"]  # the check has teeth


def test_config_states_the_contrastive_batch_and_refuses_per_sample_adapters():
    from pipelines.config import ConfigError
    from pipelines.pretrain.config import TrainDocument

    cfg = TrainDocument.from_dict({"train": {"batch_size": 16, "grad_accum": 4, "num_workers": 2}})
    assert cfg.flat()["train.contrastive_batch"] == 128  # an MLflow param of every run
    elastic = TrainDocument.from_dict({"train": {"batch_size": 16, "grad_accum": 4, "num_workers": [1, 3], "zero_stage": 0}})
    assert elastic.flat()["train.contrastive_batch"] == "64-192"
    with pytest.raises(ConfigError, match=r"^train.grad_accum: probvlm_adapter has no per-sample features"):
        TrainDocument.from_dict({"model": {"name": "probvlm_adapter", "overrides": {"source": "clip_tiny"}},
                          "train": {"grad_accum": 2}})
