"""ProbVLM adapter (papers/004): formulas, the adapted model, bad input, and one real `jobs.adapt` run on the
session's trained CLIP (Ray Data embeddings, Ray Train fit, MLflow) checked for a frozen source, reloading,
calibration against the PFE-style baseline, corruption and out-of-distribution behaviour."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from scipy import stats

import jobs.adapt
from models import create_model
from models.distributions import ggd_variance, negative_mls
from models.losses import create_loss
from models.model_file import load_model, save_model
from models.probvlm import ProbVLMAdapter
from models.scoring.metrics import calibration
from pipelines.adapt.config import load_adapt_config
from pipelines.config import ConfigError, EvalTask
from pipelines.data.eval_reader import iter_local_batches
from pipelines.data.eval_tasks import task_paths
from pipelines.evaluate.in_process import embed_task_locally
from pipelines.evaluate.tasks import rank_retrieval, sigma2
from tests.helpers import BUCKET, registered_steps

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "probvlm_demo.yaml"


# ------------------------------------------------------------------------------------ formulas and model


def test_negative_mls_is_the_gaussian_density_of_the_difference():
    g = torch.Generator().manual_seed(0)
    mu1, mu2 = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)
    l1, l2 = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)
    ref = -stats.norm.logpdf((mu1 - mu2).numpy(), 0.0, np.sqrt(np.exp(l1.numpy()) + np.exp(l2.numpy())))
    np.testing.assert_allclose(negative_mls(mu1, l1, mu2, l2).numpy(), ref, rtol=1e-12)
    out = {"image_mu": mu1, "image_logvar": l1, "text_mu": mu2, "text_logvar": l2}
    assert create_loss("pfe_mls")(out)["loss"].item() == pytest.approx(ref.mean(), rel=1e-12)


def test_adapter_uncertainty_is_ggd_variance_plus_mc_dropout_variance():
    torch.manual_seed(0)
    adapter = ProbVLMAdapter(8, hidden=16, dropout=0.2, mc_samples=5, mc_seed=3)
    z = torch.nn.functional.normalize(torch.randn(6, 8), dim=-1)
    with torch.no_grad():
        u = adapter.uncertainty("image", z)
        mu_hat, alpha, beta = adapter.image.eval()(z)
        assert (alpha > 0).all() and (beta > 0).all()
        torch.testing.assert_close(u["aleatoric"], ggd_variance(alpha, beta))
        torch.testing.assert_close(u["mu_hat"], mu_hat)
        # epistemic: the (1/M) variance of mu_hat over M passes, each one sampled sub-network for all rows
        masks = adapter.image.mc_masks(5, 3 + 0, z.device)
        passes = [adapter.image(z, {k: [m[i : i + 1] for m in v] for k, v in masks.items()})[0][0] for i in range(5)]
        torch.testing.assert_close(u["epistemic"], torch.stack(passes).var(dim=0, unbiased=False))
        assert (u["epistemic"] > 0).all()
        # the same uncertainty for a row whatever batch it comes in, and the sum is the model's variance
        torch.testing.assert_close(adapter.uncertainty("image", z[2:4])["epistemic"], u["epistemic"][2:4])
        torch.testing.assert_close(adapter.variance("image", z), u["aleatoric"] + u["epistemic"])
        assert torch.equal(adapter.uncertainty("image", z, mc_samples=0)["epistemic"], torch.zeros_like(z))
    adapter.train()
    a, b = adapter.image(z)[0], adapter.image(z)[0]
    assert not torch.equal(a, b)  # dropout is on in training


def test_adapter_fit_resumes_from_its_saved_state_exactly(tmp_path):
    """The Ray Train loop's fit (adapter + baseline, AdamW, cosine lr, dropout): 2N steps straight equal N steps,
    the state through a safetensors file into a freshly built fit, then N more (what a same-name rerun does)."""
    from safetensors.torch import load_file, save_file

    from pipelines.adapt.loop import AdapterFit, build_adapter_set
    from pipelines.fit.loop import run_steps

    cfg = load_adapt_config(CONFIG, ["adapter.hidden=16", "loss.params.lambda_cross=0.01"])
    g = torch.Generator().manual_seed(0)
    batches = [torch.nn.functional.normalize(torch.randn(8, 2, 6, generator=g), dim=-1) for _ in range(8)]

    def new_fit(seed):
        torch.manual_seed(seed)
        return AdapterFit(build_adapter_set(cfg, 6), cfg.train.model_copy(update={"lr": 1e-2, "weight_decay": 0.01,
                                                                       "steps": len(batches)}), seed=3)

    straight = new_fit(0)
    lrs = []
    for b in batches:
        lrs.append(straight.lr())
        run_steps(straight, [b], len(batches))
    # the closed-form schedule is torch's CosineAnnealingLR (eta_min 0) over train.steps
    ref_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    ref = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=len(batches))
    expected = []
    for _ in batches:
        expected.append(ref_opt.param_groups[0]["lr"])
        ref_opt.step()
        ref.step()
    np.testing.assert_allclose(lrs, expected, rtol=1e-12)

    first = new_fit(0)
    run_steps(first, batches, 4)
    save_file(first.state(), str(tmp_path / "state.safetensors"))
    resumed = new_fit(1)  # other initial weights: everything must come from the file
    resumed.load(load_file(str(tmp_path / "state.safetensors")))
    assert (resumed.progress.step, resumed.progress.samples) == (4, 32)
    run_steps(resumed, batches[4:], len(batches))
    a, b = straight.net.state_dict(), resumed.net.state_dict()
    assert a.keys() == b.keys() and any(k.startswith("adapters.baseline.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight.state().keys() == resumed.state().keys()
    assert all(torch.equal(v, resumed.state()[k]) for k, v in straight.state().items())


def test_a_new_adapter_head_is_a_module_a_loss_and_one_register_call(tmp_path):
    """An adapter head added the way README says (its module and loss classes, one `register_adapter` call, nothing
    else edited) is a config value, trains in the adapt stage's fit beside the PFE baseline, and is a registry model
    that saves and reloads; unknown heads fail in one line naming the known ones."""
    import torch.nn as nn

    from models.losses import _LOSSES, register_loss
    from models.probvlm import ADAPTERS, AdapterKind, register_adapter
    from pipelines.adapt.loop import AdapterFit, build_adapter_set
    from pipelines.fit.loop import run_steps

    class Isotropic(nn.Module):  # one learned log variance per input, the mean the frozen embedding
        def __init__(self, dim: int, hidden: int = 8):
            super().__init__()
            self.image, self.text = nn.Linear(dim, 1), nn.Linear(dim, 1)

        def forward(self, image_z, text_z):
            return {"image_mu": image_z, "image_logvar": self.image(image_z).expand_as(image_z),
                    "text_mu": text_z, "text_logvar": self.text(text_z).expand_as(text_z)}

        def variance(self, side, z):
            return getattr(self, side)(z).exp().expand_as(z)

    class IsotropicMLS(nn.Module):
        def forward(self, out, world=None):
            return {"loss": negative_mls(out["image_mu"], out["image_logvar"], out["text_mu"], out["text_logvar"]).mean()}

    register_loss("isotropic_mls")(IsotropicMLS)
    register_adapter("isotropic", AdapterKind(Isotropic, "isotropic_mls", ("hidden",), method="isotropic_mls"))
    try:
        # the demo's loss params are ProbVLM's loss's: the new head's loss takes its own (none here)
        cfg = load_adapt_config(CONFIG, ["adapter.head=isotropic", "adapter.hidden=4", "adapter.baseline=pfe",
                                         "loss.params={}"])
        fit = AdapterFit(build_adapter_set(cfg, 6), cfg.train.model_copy(update={"lr": 1e-2, "steps": 4}))
        g = torch.Generator().manual_seed(0)
        before = {k: v.clone() for k, v in fit.net.adapters["adapter"].state_dict().items()}
        run_steps(fit, [torch.nn.functional.normalize(torch.randn(8, 2, 6, generator=g), dim=-1) for _ in range(4)], 4)
        assert any(not torch.equal(v, before[k]) for k, v in fit.net.adapters["adapter"].state_dict().items())
        model = create_model("isotropic_adapter", source="clip_tiny", hidden=4).eval()
        save_model(model.state_dict(), tmp_path / "m.safetensors", "isotropic_adapter", {"source": "clip_tiny", "hidden": 4})
        again = load_model(tmp_path / "m.safetensors")
        assert isinstance(again.adapter, Isotropic)
        assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
    finally:
        ADAPTERS.pop("isotropic"), _LOSSES.pop("isotropic_mls")
    with pytest.raises(ConfigError, match=r"adapter.head: .*unknown head 'isotropic'; known: probvlm, pfe"):
        load_adapt_config(CONFIG, ["adapter.head=isotropic"])


def test_adapted_model_saves_and_reloads_without_pickle(tmp_path):
    torch.manual_seed(0)
    model = create_model("probvlm_adapter", source="clip_tiny", hidden=32, mc_samples=4).eval()
    path = tmp_path / "adapted.safetensors"
    save_model(model.state_dict(), path, "probvlm_adapter", {"source": "clip_tiny", "hidden": 32, "mc_samples": 4})
    assert path.read_bytes()[:8] != b"\x80\x04\x95"[:8]  # a safetensors header, no pickle
    again = load_model(path)
    images, tokens = torch.randn(3, 3, 32, 32), torch.randint(1, 400, (3, 16))
    with torch.no_grad():
        for a, b in ((model.encode_image(images), again.encode_image(images)), (model.encode_text(tokens), again.encode_text(tokens))):
            assert torch.equal(a["mu"], b["mu"]) and torch.equal(a["logvar"], b["logvar"])
    assert again.probabilistic and not any(p.requires_grad for p in again.source.parameters())
    again.train()
    assert not again.source.training  # the source stays frozen in eval mode
    with pytest.raises(ValueError, match="probabilistic"):
        create_model("probvlm_adapter", source="prolip_tiny")


# ------------------------------------------------------------------------------------ configs and bad input


def test_configs_load_and_name_bad_keys(tmp_path):
    cfg = load_adapt_config(CONFIG, ["train.steps=7", "loss.params.lambda_cross=0.5"])
    assert cfg.train.steps == 7 and cfg.loss.params["lambda_cross"] == 0.5 and cfg.adapter.baseline == "pfe"
    assert load_adapt_config(ROOT / "configs" / "probvlm_openclip_b16.yaml").source.model == "open_clip:ViT-B-16"
    with pytest.raises(ConfigError, match="^adapter.hiddn: unknown key"):
        load_adapt_config(CONFIG, ["adapter.hiddn=3"])
    with pytest.raises(ConfigError, match="loss tasks need"):
        load_adapt_config(CONFIG, ["eval.tasks=[{name: l, kind: loss}]"])
    with pytest.raises(ConfigError, match="only for open_clip"):
        load_adapt_config(CONFIG, ["source.weights=x.safetensors"])


def write_embeddings(folder: Path, image: np.ndarray, text: np.ndarray, logvar: bool = False) -> None:
    """jobs.embed's layout: images/ (key, captions, cls, mu[, logvar]) and texts/ (index, text, mu)."""
    def fixed(arr):
        return pa.FixedSizeListArray.from_arrays(pa.array(arr.astype(np.float32).ravel()), arr.shape[1])

    n = len(image)
    (folder / "images").mkdir(parents=True)
    (folder / "texts").mkdir(parents=True)
    cols = {"key": [f"{i:06d}" for i in range(n)], "captions": [f"caption {i % len(text)}" for i in range(n)],
            "cls": np.zeros(n, np.int64), "mu": fixed(image)}
    if logvar:
        cols["logvar"] = fixed(np.zeros_like(image))
    pq.write_table(pa.table(cols), folder / "images" / "0.parquet")
    pq.write_table(pa.table({"index": np.arange(len(text)), "text": [f"caption {i}" for i in range(len(text))],
                             "mu": fixed(text)}), folder / "texts" / "0.parquet")


def tiny_openclip_file(path: Path) -> Path:
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg
    from safetensors.torch import save_file

    torch.manual_seed(1)
    model = CLIP(embed_dim=64, vision_cfg=CLIPVisionCfg(layers=2, width=64, head_width=32, patch_size=8, image_size=32),
                 text_cfg=CLIPTextCfg(context_length=16, vocab_size=49408, width=64, heads=2, layers=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


@pytest.fixture
def bad_input(tmp_path):
    """A deterministic source file and a runner of jobs.adapt that returns (exit code, stderr lines)."""
    torch.manual_seed(0)
    clip = tmp_path / "clip.safetensors"
    save_model(create_model("clip_tiny").state_dict(), clip, "clip_tiny", {})
    rng = np.random.default_rng(0)

    def run(capsys, *sets):
        rc = jobs.adapt.main(["--config", str(CONFIG), "--out", str(tmp_path / "out"),
                              "--set", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *sum([["--set", s] for s in sets], [])])
        return rc, capsys.readouterr().err.strip().splitlines()

    return tmp_path, clip, rng, run


def test_bad_sources_fail_in_one_line_before_any_work(bad_input, capsys):
    tmp, clip, _, run = bad_input
    junk = tmp / "junk.safetensors"
    junk.write_bytes(b"not a model at all")
    prolip = tmp / "prolip.safetensors"
    save_model(create_model("prolip_tiny").state_dict(), prolip, "prolip_tiny", {})
    pickled = tmp / "weights.pt"
    torch.save({"visual.conv1.weight": torch.zeros(1), "evil": object()}, pickled)  # needs unpickling code
    cases = [
        ([f"source.model={junk}"], "error: source.model: ", "neither a probvlp model file"),
        ([f"source.model={tmp / 'missing.safetensors'}"], "error: source.model: ", "not a file"),
        ([f"source.model={prolip}"], "error: source.model: prolip_tiny is probabilistic", "deterministic"),
        (["source.model=open_clip:ViT-B-16", f"source.weights={pickled}"], "error: source.weights: cannot read",
         "weights.pt"),
        (["source.model=open_clip:ViT-B-16", f"source.weights={junk}"], "error: source.weights: cannot read", "junk"),
        (["source.model=open_clip:RN50"], "error: source.model: no registry model known", "source.build"),
    ]
    for sets, start, contains in cases:
        rc, lines = run(capsys, *sets)
        assert rc == 2 and len(lines) == 1 and lines[0].startswith(start) and contains in lines[0], (sets, lines)
    assert not (tmp / "out" / "embeddings").exists()


@pytest.mark.parametrize("case,expected", [
    ("width", "image embeddings in .* are 32-d but the source model's \\(and so the adapter's\\) are 64-d"),
    ("nan", "3 of 20 image embeddings .* are not finite"),
    ("logvar", "carries logvar"),
])
def test_bad_embeddings_fail_in_one_line_before_training(bad_input, capsys, case, expected):
    import re

    tmp, clip, rng, run = bad_input
    image = rng.normal(size=(20, 32 if case == "width" else 64))
    text = rng.normal(size=(5, 64))
    if case == "nan":
        image[[1, 4, 9], 3] = np.nan
    write_embeddings(tmp / "emb", image, text, logvar=case == "logvar")
    rc, lines = run(capsys, f"source.model={clip}", f"data.embeddings={tmp / 'emb'}")
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: data.embeddings: "), lines
    assert re.search(expected, lines[0]), lines[0]


def test_open_clip_weights_file_becomes_a_source(tmp_path):
    from pipelines.adapt.config import SourceConfig
    from pipelines.adapt.source import resolve_source

    weights = tiny_openclip_file(tmp_path / "oc.safetensors")
    spec = SourceConfig(model="open_clip:tiny", weights=str(weights), build="clip_tiny",
                        overrides={"vision_pre_norm": True})
    source = resolve_source(spec, f"sqlite:///{tmp_path}/m.db", tmp_path / "src")
    assert source.name == "clip_tiny" and source.path.is_file() and len(source.sha256) == 64
    adapted = create_model("probvlm_adapter", source=source.name, source_overrides=source.overrides, hidden=16)
    adapted.source.load_state_dict(load_model(source.path).state_dict())
    out = adapted.encode_image(torch.randn(2, 3, 32, 32))
    assert out["mu"].shape == (2, 64) and torch.isfinite(out["logvar"]).all()


# ------------------------------------------------------------------------------------ the job on the trained CLIP

STEPS = 300  # the job end to end; the uncertainty behaviours need LONG_STEPS (`make test-long`)
LONG_STEPS = 1500
LOG_EVERY = 100


def adapt_clip(trained_clip, digits_root, tmp, name: str, steps: int, extra: tuple[str, ...] = ()):
    """jobs.adapt on the session's trained CLIP (its MLflow run as the source): pairs embedded by Ray Data,
    the adapter and the PFE-style baseline trained side by side by Ray Train (1 worker), held-out retrieval."""
    import time

    from pipelines.adapt.job import run_adapt

    cfg, result, _ = trained_clip
    adapt_cfg = load_adapt_config(CONFIG, [
        f"source.model=runs:/{result.mlflow_run_id}/model", f"data.root={digits_root}",
        f"tracking.uri={result.mlflow_uri}", f"run.storage_path={tmp}/ray", f"run.name={name}",
        f"train.steps={steps}", f"train.log_every={LOG_EVERY}",
        'eval.tasks=[{name: digits_retrieval, kind: retrieval, data: "{data.root}/eval/retrieval"}]', *extra])
    start = time.perf_counter()
    res = run_adapt(adapt_cfg, tmp / "out")
    print(f"jobs.adapt on the trained CLIP, {steps} steps: {time.perf_counter() - start:.1f} s {res.seconds}")
    return res, result, digits_root, tmp


ON_S3 = f"{BUCKET}/adapt"  # the module's jobs.adapt run reads and writes object storage (tests/multinode.py's s3)


@pytest.fixture(scope="module")
def adapted(trained_clip, digits_root, s3, tmp_path_factory):
    """The job with everything it reads and writes beside its --out folder on S3: its training pairs (the digits'
    pair shards) and eval set, the pairs' embeddings and the Ray Train checkpoints."""
    from pipelines.digits.shards import write_digit_pairs

    s3.put(str(write_digit_pairs(digits_root, "train") / "0.tar"), f"{ON_S3}/data/train/0.tar")
    s3.put(f"{digits_root}/eval/retrieval", f"{ON_S3}/data/eval/retrieval", recursive=True)
    return adapt_clip(trained_clip, digits_root, tmp_path_factory.mktemp("adapt"), "test_adapt", STEPS,
                     ("data.source=shards", f"data.root=s3://{ON_S3}/data", f"data.embeddings=s3://{ON_S3}/embeddings",
                      f"run.storage_path=s3://{ON_S3}/ray"))


SOURCE_STEPS = 600  # the in-process demo CLIP of the uncertainty behaviours (held-out zero-shot ~0.85)


def adapted_in_process(source_steps: int, steps: int, seed: int = 0):
    """A repeatable adapted CLIP, all in this process on one thread from fixed seeds (a Ray fit's data order is not
    fixed): the demo CLIP trained `source_steps` (pipelines/digits_fit.py), each training image paired with its
    two retrieval captions as jobs.adapt pairs them, the job's AdapterFit trained `steps` over seeded epochs; with
    the held-out digit images (test split). (adapted model, images)."""
    from pipelines.pretrain.config import load_train_config
    from pipelines.digits.dataset import iter_digits, retrieval_captions
    from pipelines.adapt.loop import AdapterFit, build_adapter_set
    from pipelines.fit.loop import run_steps
    from models.tokenizer import tokenize
    from pipelines.digits.arrays import digit_arrays
    from pipelines.digits_fit import fit_in_process

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = load_train_config(ROOT / "configs" / "demo.yaml", ["data.augment=false"])
        source = fit_in_process(cfg, source_steps, seed=seed)
        images, _, metas = digit_arrays("train")
        keys = [int(d.key) for d in iter_digits(32) if d.split == "train"]
        captions = [c for meta, key in zip(metas, keys) for c in retrieval_captions({**meta, "digit_index": key})]
        with torch.no_grad():
            z_image = torch.cat([source.encode_image(images[i : i + 256])["mu"] for i in range(0, len(images), 256)])
            z_text = source.encode_text(tokenize(captions, source.context_length))["mu"]
        pairs = torch.stack([z_image.repeat_interleave(2, dim=0), z_text], dim=1)
        acfg = load_adapt_config(CONFIG, ["adapter.baseline=none", f"train.steps={steps}", f"run.seed={seed}"])
        torch.manual_seed(acfg.run.seed)
        net = build_adapter_set(acfg, pairs.shape[-1])
        fit = AdapterFit(net, acfg.train, seed=acfg.run.seed)
        order, size = torch.Generator().manual_seed(acfg.run.seed), acfg.train.batch_size

        def epochs():
            while True:
                perm = torch.randperm(len(pairs), generator=order)
                yield from (pairs[perm[start : start + size]] for start in range(0, len(perm) - size + 1, size))

        run_steps(fit, epochs(), steps)
        a = acfg.adapter
        model = create_model("probvlm_adapter", source=cfg.model.name, source_overrides=cfg.model.overrides,
                             hidden=a.hidden, dropout=a.dropout, mc_samples=a.mc_samples, mc_seed=a.mc_seed)
        model.source.load_state_dict(source.state_dict())
        model.adapter.load_state_dict(net.adapters["adapter"].state_dict())
        return model.eval(), digit_arrays("test")[0]
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def held_out():
    """The adapted CLIP of the uncertainty behaviours: the source SOURCE_STEPS, the adapter LONG_STEPS."""
    return adapted_in_process(SOURCE_STEPS, LONG_STEPS)


def test_adapter_trains_without_changing_the_frozen_model(adapted, s3):
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts
    from safetensors.torch import load_file

    from pipelines.adapt.source import file_sha256
    from pipelines.tracking import model_file

    res, result, _, tmp = adapted
    # on S3: the pairs' embeddings (one image row per training image) and the adapter's checkpoints, nothing local
    s3.invalidate_cache()
    assert pq.read_table(f"{ON_S3}/embeddings/images", filesystem=s3).num_rows == 1258
    assert s3.glob(f"{ON_S3}/embeddings/texts/*.parquet") and s3.glob(f"{ON_S3}/ray/test_adapt/checkpoint_*/*")
    assert not (tmp / "ray").exists() and not (tmp / "out" / "embeddings").exists()
    # the source as the pretraining run stored it, fetched here independently of the job
    folder = download_artifacts(run_id=result.mlflow_run_id, artifact_path="model", dst_path=str(tmp / "dl"),
                                tracking_uri=result.mlflow_uri)
    original = load_file(str(model_file(Path(folder))))
    saved = load_file(str(res.model_file))
    source_part = {k.removeprefix("source."): v for k, v in saved.items() if k.startswith("source.")}
    assert source_part.keys() == original.keys()
    assert all(torch.equal(source_part[k], original[k]) for k in original)  # not a single weight changed
    assert file_sha256(res.source.path) == res.source.sha256
    assert any(k.startswith("adapter.") for k in saved)

    client = MlflowClient(res.mlflow_uri)
    run = client.get_run(res.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.tags["probvlp.source_unchanged"] == "true"
    assert run.data.tags["probvlp.source_run"] == result.mlflow_run_id and run.data.tags["probvlp.kind"] == "adapt"
    assert int(run.data.params["data.pairs"]) == 2 * 1258  # two captions per training image
    # it learned: the adapter's objective fell far below its first step's, the baseline's below its own
    history = {key: [m.value for m in sorted(client.get_metric_history(res.mlflow_run_id, key), key=lambda m: m.step)]
               for key in ("adapter/loss", "baseline/loss")}
    assert all(len(h) == STEPS // LOG_EVERY + 1 for h in history.values()), history
    assert history["adapter/loss"][-1] < history["adapter/loss"][0] - 5.0, history
    assert history["baseline/loss"][-1] < history["baseline/loss"][0], history
    assert res.train["step"] == STEPS and res.train["samples_per_s"] > 0
    artifacts = {a.path for a in client.list_artifacts(res.mlflow_run_id, "model")}
    assert {"model/MLmodel", "model/data"} <= artifacts
    assert {a.path for a in client.list_artifacts(res.mlflow_run_id, "plots")} >= {
        "plots/digits_retrieval_calibration_vs_baseline.png", "plots/digits_retrieval_uncertainty.png"}


def test_jobs_evaluate_scores_the_adapted_model_like_any_other(adapted, tmp_path):
    import jobs.evaluate

    res, result, root, _ = adapted
    out = tmp_path / "eval"
    rc = jobs.evaluate.main(["--model", str(res.model_file), "--config", str(ROOT / "configs" / "demo.yaml"),
                             "--set", f"data.root={root}", "--set", f"tracking.uri={result.mlflow_uri}",
                             "--set", 'eval.tasks=[{name: digits_retrieval, kind: retrieval, data: "{data.root}/eval/retrieval"}]',
                             "--out", str(out), "--actors", "1"])
    assert rc == 0
    got = {f"{r['task']}/{r['metric']}": r["value"] for r in json.loads((out / "results.json").read_text())}
    ours = {k: v for k, v in res.metrics.items() if not k.startswith("baseline/")}
    assert set(got) == set(ours)
    for key, value in ours.items():
        assert got[key] == pytest.approx(value, abs=1e-6, nan_ok=True), key
    # ProbVLM keeps the frozen model's ranking (Sec. 4.1): the means alone rank the same
    assert got["digits_retrieval/i2t_R1"] == got["digits_retrieval/cos_i2t_R1"]
    assert res.metrics["baseline/digits_retrieval/i2t_R1"] == got["digits_retrieval/i2t_R1"]


PYFUNC_SCRIPT = """
import json, sys
import mlflow, pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[1])
images = [bytes.fromhex(h) for h in json.loads(sys.argv[2])]
captions = json.loads(sys.argv[3])
out = model.predict(pd.DataFrame({"image": images + [None] * len(captions), "caption": [None] * len(images) + captions}))
import models
n = len(images)
print(json.dumps({"models_from": models.__file__, "columns": list(out.columns),
                  **{c: out[c][:n].tolist() for c in ("image_mu", "image_sigma2")},
                  **{c: out[c][n:].tolist() for c in ("text_mu", "text_sigma2")}}))
"""


def test_adapted_mlflow_model_loads_in_a_fresh_python(adapted, tmp_path):
    """`mlflow.pyfunc.load_model("runs:/<adapt run>/model")` in another process, from another directory, gives
    the mu and sigma^2 of the adapted model loaded here (frozen source + adapter, MC-dropout included)."""
    import subprocess
    import sys

    from models.preprocess import encoded_to_model_input
    from models.tokenizer import tokenize
    from pipelines.data.reader import shard_paths
    from pipelines.data.tars import iter_tar_samples

    res, _, root, _ = adapted
    samples = list(iter_tar_samples(shard_paths(f"{root}/eval/retrieval", "test"), limit=4))
    images = [next(s[k] for k in ("png", "jpg", "jpeg", "webp") if k in s) for s in samples]
    captions = ["the digit seven", "a bold wide seven, slanted right", "zero"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MLFLOW_TRACKING_URI": res.mlflow_uri}
    out = subprocess.run([sys.executable, "-c", PYFUNC_SCRIPT, f"runs:/{res.mlflow_run_id}/model",
                          json.dumps([b.hex() for b in images]), json.dumps(captions)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "/code/models/" in got["models_from"] and str(ROOT) not in got["models_from"]
    assert got["columns"] == ["image_mu", "text_mu", "image_sigma2", "text_sigma2"]
    model = load_model(res.model_file)
    with torch.no_grad():
        here = {"image": model.encode_image(torch.from_numpy(encoded_to_model_input(images, model.img_size))),
                "text": model.encode_text(tokenize(captions, model.context_length))}
    for side, out_here in here.items():
        torch.testing.assert_close(torch.tensor(got[f"{side}_mu"]), out_here["mu"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(got[f"{side}_sigma2"]), out_here["logvar"].exp(), atol=0, rtol=1e-5)
    assert len({round(float(v), 12) for v in torch.tensor(got["text_sigma2"]).mean(dim=1)}) == len(captions)


def held_out_calibration_inputs(model_file: Path, root: str):
    """Per query of the held-out digits retrieval, the model's sigma^2 and the rank of its first positive
    (i2t: images, t2i: captions), embedded and ranked in this process as the evaluation does."""
    model = load_model(model_file).eval()
    task = EvalTask(name="digits_retrieval", kind="retrieval", data=f"{root}/eval/retrieval", split="test")
    emb = embed_task_locally(model, task, iter_local_batches(task_paths(task), model.img_size))
    index = {c: j for j, c in enumerate(emb.texts)}
    i2t, t2i, queries = rank_retrieval(model, emb.image, emb.text, [[index[c] for c in caps] for caps in emb.captions])
    return {"i2t": (sigma2(emb.image)[queries.numpy()], i2t.first_hit.numpy()),
            "t2i": (sigma2(emb.text), t2i.first_hit.numpy())}


SHUFFLES = 1000  # seeded permutations of sigma^2 across the queries: the negative control's distribution
# Over the most extreme of the shuffles. Spearman rho(sigma^2, rank of the first positive) on the 231 held-out
# captions: baseline +0.72 / +0.74, adapter -0.54 / -0.66 (300- and 1200-step adapters), shuffles within +-0.21. The
# binned -S R^2 is not the property tested: with ~12 top-1 hits among the captions its shuffled spread alone moved
# from 0.19 to 0.37 between two seeds.
MARGIN = 0.1


@pytest.fixture(scope="module")
def calibration_inputs(adapted) -> dict[str, dict]:
    """Per model ("adapter", "baseline") and direction, the held-out queries' sigma^2 and first-hit ranks."""
    res, _, root, _ = adapted
    return {name: held_out_calibration_inputs(file, root)
            for name, file in (("adapter", res.model_file), ("baseline", res.baseline_file))}


def t2i_rho_and_control(s2: np.ndarray, first_hit: np.ndarray) -> tuple[float, np.ndarray]:
    """Spearman rho(sigma^2, rank of the first positive) and the same for SHUFFLES seeded shuffles of sigma^2."""
    rng = np.random.default_rng(0)
    s2_rank, hit_rank = stats.rankdata(s2), stats.rankdata(first_hit)
    rho = np.corrcoef(s2_rank, hit_rank)[0, 1]  # Spearman: Pearson of the ranks
    return rho, np.array([np.corrcoef(rng.permutation(s2_rank), hit_rank)[0, 1] for _ in range(SHUFFLES)])


def test_calibration_of_adapter_and_baseline_on_held_out_retrieval(adapted, calibration_inputs):
    """The logged calibration (PCME++ / ProbVLM: queries in 10 sigma^2 bins, Spearman S and R^2 between bin and R@1,
    -S R^2) is that of the per-query sigma^2 and R@1 recomputed here, and on the captions (t2i) the PFE-style
    baseline's sigma^2 is calibrated far beyond a negative control, the same sigma^2 shuffled across the queries
    (same values, no link to any query): the larger sigma^2, the lower its image ranks. The adapter's is
    test_adapter_caption_sigma2_is_calibrated's (an expected failure). The image side (i2t) is printed, not
    asserted: neither model's is reliably tied to retrieval on the digits."""
    res = adapted[0]
    m = res.metrics
    for name, prefix in (("adapter", ""), ("baseline", "baseline/")):
        for direction, (s2, first_hit) in calibration_inputs[name].items():
            real = calibration(s2, first_hit == 0)
            logged = [m[f"{prefix}digits_retrieval/{direction}_calib_{k}"] for k in ("rho", "r2", "score")]
            assert logged == pytest.approx([real.rho, real.r2, real.score], abs=1e-9), (name, direction)
            rho, control = t2i_rho_and_control(s2, first_hit)
            print(f"{name} {direction}: rho(sigma^2, rank of the first positive) {rho:+.3f}; shuffled "
                  f"{control.min():+.3f}..{control.max():+.3f}; binned -S R^2 {real.score:+.3f} (S {real.rho:+.2f}, "
                  f"R^2 {real.r2:.2f}), R@1 per bin {np.round(real.bin_metric, 2).tolist()}")
    rho, control = t2i_rho_and_control(*calibration_inputs["baseline"]["t2i"])
    assert rho > control.max() + MARGIN, (rho, control.max())
    assert (res.out / "plots" / "digits_retrieval_calibration_vs_baseline.png").stat().st_size > 10_000


# raises: only the assert below may fail; an error in the job or its reading (setup included) is a failure
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="the adapter's caption sigma^2 ranks the wrong way on the digits (rho -0.54 / "
                   "-0.66 against the shuffles' +-0.21): the class templates, the captions it retrieves best, are the "
                   "ambiguous ones it gives the larger sigma^2 (docs/RESULTS.md, 'Why caption-side (t2i) calibration "
                   "is not reproduced on this set')")
def test_adapter_caption_sigma2_is_calibrated(calibration_inputs):
    """ProbVLM's claim (Sec. 4.1, Fig. 4): the larger a caption's sigma^2, the lower its image ranks, beyond the
    shuffled control, as the baseline's does in the test above."""
    rho, control = t2i_rho_and_control(*calibration_inputs["adapter"]["t2i"])
    assert rho > control.max() + MARGIN, (rho, control.max())


def mask_patches(images: torch.Tensor, fraction: float, seed: int = 0, patch: int = 4) -> torch.Tensor:
    """`fraction` of each image's patch x patch squares set to black (-1 after the model's scaling)."""
    g = torch.Generator().manual_seed(seed)
    out = images.clone()
    side = images.shape[-1] // patch
    count = round(fraction * side * side)
    for i in range(len(out)):
        for j in torch.randperm(side * side, generator=g)[:count].tolist():
            r, c = divmod(j, side)
            out[i, :, r * patch : (r + 1) * patch, c * patch : (c + 1) * patch] = -1.0
    return out


def image_uncertainty(model, images: torch.Tensor, mc_samples: int | None = None) -> dict[str, float]:
    with torch.no_grad():
        u = model.adapter.uncertainty("image", model.source.encode_image(images)["mu"], mc_samples)
    return {"aleatoric": u["aleatoric"].mean().item(), "epistemic": u["epistemic"].mean().item(),
            "total": (u["aleatoric"] + u["epistemic"]).mean().item()}


# The masking study (docs/RESULTS.md "Masked and out-of-distribution inputs": three seeded in-process fits, two mask
# draws, 0-87.5% masked): epistemic sigma^2 (256 MC passes) at 25% masked was 1.046-1.20x the unmasked images', and
# it rose at each 12.5% step to there (by >= 1.5%); past ~40% it saturated in two fits of three (flat within 2%, or
# falling by up to 7% with 16 passes), so only the first quarter's rise is asserted step by step. At 25-75% it
# stayed >= 1.046x; the total (with the aleatoric part) at 25% >= 1.08x, while at 75% it was 1.01-1.67x.
MC_PASSES = 256
OVER_UNMASKED = 1.02


@pytest.mark.long
def test_uncertainty_rises_with_the_masked_fraction_of_the_image(held_out):
    model, images = held_out
    fractions = (0.0, 0.125, 0.25, 0.5, 0.75)
    levels = [image_uncertainty(model, mask_patches(images, f), MC_PASSES) for f in fractions]
    print("masked", fractions, [{k: f"{v:.3e}" for k, v in u.items()} for u in levels])
    epistemic = [u["epistemic"] for u in levels]
    # MC-dropout variance rises with the masked share (ProbVLM Fig. 6) over the first quarter, step by step
    assert epistemic[0] < epistemic[1] < epistemic[2], epistemic
    assert all(e > OVER_UNMASKED * epistemic[0] for e in epistemic[2:]), epistemic
    assert levels[2]["total"] > OVER_UNMASKED * levels[0]["total"], levels
    # the encoder path of the saved model gives the same total (with the model's own MC passes)
    with torch.no_grad():
        served = model.encode_image(images)["logvar"].exp().mean().item()
    assert served == pytest.approx(image_uncertainty(model, images)["total"], rel=1e-5)


def ood_images(n: int = 200, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs unlike the digits: uniform noise, and filled ellipses, rectangles and triangles."""
    from PIL import Image, ImageDraw

    from models.preprocess import to_model_input

    rng = np.random.default_rng(seed)
    shapes = []
    for i in range(n):
        img = Image.new("L", (32, 32), 0)
        draw = ImageDraw.Draw(img)
        x0, y0 = (int(v) for v in rng.integers(2, 12, 2))
        x1, y1 = min(30, x0 + int(rng.integers(10, 18))), min(30, y0 + int(rng.integers(10, 18)))
        if i % 3 == 2:
            draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) // 2, y0)], fill=255)
        else:
            (draw.ellipse if i % 3 == 0 else draw.rectangle)((x0, y0, x1, y1), fill=255)
        shapes.append(np.asarray(img.convert("RGB")))
    noise = rng.uniform(-1, 1, (n, 3, 32, 32)).astype(np.float32)
    return {"noise": torch.from_numpy(noise), "shapes": torch.from_numpy(to_model_input(np.stack(shapes)))}


@pytest.mark.long
def test_epistemic_uncertainty_is_higher_off_the_training_data(held_out):
    model, images = held_out
    digits = image_uncertainty(model, images)["epistemic"]
    others = {k: image_uncertainty(model, x)["epistemic"] for k, x in ood_images().items()}
    print(f"epistemic: held-out digits {digits:.3e}, " + ", ".join(f"{k} {v:.3e} ({v / digits:.2f}x)" for k, v in others.items()))
    # uniform noise: 1.08x / 1.28x / 1.29x the digits' in the three seeded fits of the masking study; the filled
    # shapes 1.42x / 1.07x / 0.97x, so they are printed, not asserted
    assert others["noise"] > 1.04 * digits, (digits, others)


# The short fit of `make test` (about 20 CPU-seconds): off the source's embeddings the adapter's MC-dropout variance
# is higher already, though not yet off its images (uniform noise 0.94-1.02x the digits' in three seeded fits). The
# digits' embeddings against isotropic directions at their norms: 1.21x / 1.54x / 1.34x at seeds 0 / 1 / 2, 1.01x
# after one adapter step (what training adds), 3.2-6.3x after LONG_STEPS.
SHORT_SOURCE_STEPS, SHORT_STEPS = 150, 300
OFF_EMBEDDINGS = 1.1


def test_short_fit_epistemic_uncertainty_is_higher_off_the_embeddings_it_learned():
    model, images = adapted_in_process(SHORT_SOURCE_STEPS, SHORT_STEPS)
    with torch.no_grad():
        z = model.source.encode_image(images)["mu"]
        g = torch.Generator().manual_seed(1)
        away = torch.nn.functional.normalize(torch.randn(z.shape, generator=g), dim=-1) * z.norm(dim=-1, keepdim=True)
        digits, others = (model.adapter.uncertainty("image", x)["epistemic"].mean().item() for x in (z, away))
    print(f"epistemic: held-out digits' embeddings {digits:.3e}, other directions {others:.3e} ({others / digits:.2f}x)")
    assert others > OFF_EMBEDDINGS * digits > 0, (digits, others)


@pytest.mark.long
def test_same_run_name_resumes_a_stopped_fit(trained_clip, digits_root, tmp_path):
    """Stopped at step 100 of 200 (train.stop_at_step), the same command resumes: one MLflow run, steps 101-200
    trained from the checkpoint, then saved and scored; the pair embeddings are not recomputed."""
    from mlflow import MlflowClient

    first, *_ = adapt_clip(trained_clip, digits_root, tmp_path, "test_resume", 200,
                          ("train.stop_at_step=100", "train.checkpoint_every=40"))
    assert first.model_file is None and first.metrics == {} and first.train["step"] == 100
    client = MlflowClient(first.mlflow_uri)
    assert client.get_run(first.mlflow_run_id).info.status == "KILLED"
    again, *_ = adapt_clip(trained_clip, digits_root, tmp_path, "test_resume", 200)
    assert again.mlflow_run_id == first.mlflow_run_id
    assert (again.train["step"], again.train["steps_this_run"]) == (200, 100)
    assert again.seconds["embed_pairs"] < first.seconds["embed_pairs"]
    run = client.get_run(again.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.tags["probvlp.resumes"] == "1"
    steps = [m.step for m in client.get_metric_history(again.mlflow_run_id, "adapter/loss")]
    assert sorted(steps) == sorted(set(steps)) and min(steps) == 1 and max(steps) == 200 and 101 in steps
    assert again.model_file.is_file() and "digits_retrieval/i2t_calib_score" in again.metrics


# A worker lost at step RESTART_FAIL_AT (train.fail_once_at_step), after the step-RESTART_CHECKPOINT checkpoint: with a
# log at every step, rank 0's outbox delivers within a second while the store answers, so the first attempt delivered
# most of the steps the restart trains again.
RESTART_STEPS, RESTART_CHECKPOINT, RESTART_FAIL_AT = 100, 45, 90
NOTICE_STEP = RESTART_CHECKPOINT + 1  # the restart's first step: the notice file is there before it
PER_STEP = ("loss", "adapter/loss", "baseline/loss", "lr", "samples_per_s")


# The fault tier (make test-cluster, run alone): a restart through an outage, with the other tier's time budget in mind
@pytest.mark.slow
@pytest.mark.cluster
def test_a_restarted_fit_logs_each_step_once(ray_local, digits_root, restartable_mlflow, tmp_path, monkeypatch):
    """jobs.adapt on the digits loses its worker at step 90 and Ray Train restarts it from the step-45 checkpoint
    (run.max_failures), and the tracking server (a real `mlflow server`) stops as the worker fails and starts again
    only once the fit has trained back to step 90 and checkpointed there: an outage with restarts in it, as users
    meet them. A notice of preemption (the hook's file, no time left) comes with the failure: the restart saves at its
    first step, 46, hands the notice to Ray Train and waits; the next restart resumes there (pipelines.fit.notices, the
    core's, composed by the adapter as by pretraining), and each restart says why in its line (the core's attempt). The restart never reads the store and its loop never waits for it (rank 0's outbox: its queue travels
    with the checkpoint, and what is left at the fit's end goes to the driver, which delivers it as the run ends). The
    job succeeds, the run ends FINISHED, and, read from MLflow after the job, each per-step metric's history holds
    every step 1-100 exactly once: the steps the first attempt had delivered (46-~89) are not written again by the
    replay, and none is lost. The driver's own steps after the fit (the model, the evaluation) log straight to the
    store: they wait for the server to be back (the test's hold), where the fit did not."""
    import threading
    import time

    from mlflow import MlflowClient

    from pipelines.adapt.job import run_adapt
    from pipelines.config import STATE_DIR
    from pipelines.fit.launch import Launch
    from pipelines.storage import run_folder
    from pipelines.tracking.outbox import UNREACHABLE_METRIC
    from pipelines.tracking.runs import RUN_RECORD
    from tests.helpers import wait_for
    from tests.pace import scaled

    server, name, storage = restartable_mlflow, "test_adapt_restart", tmp_path / "ray"
    notice = tmp_path / "notice"
    record = Path(run_folder(str(storage), name)) / RUN_RECORD
    seen: dict[str, float] = {}
    errors: list[BaseException] = []
    back = threading.Event()  # the server is up again (or never went)

    def outage() -> None:
        """The server away from the injected failure until the restart's checkpoint of step 90 is registered."""
        try:
            run_id = wait_for("the run recorded in its storage", lambda: record.exists() and
                              json.loads(record.read_text())["run_id"], 300, 0.1)
            marker = STATE_DIR / "injected_failures" / f"{run_id}.done"
            wait_for("the injected failure at step 90", marker.exists, 300, 0.05)
            # the restart's workers take seconds to start: the notice is there before their first step
            notice.write_text("0\n")
            server.stop()
            seen["down"] = time.monotonic()
            wait_for("the restart's checkpoint of step 90, trained with the tracking server away (a restart that "
                     "reads the store, or a loop that waits for it, never gets there)",
                     lambda: RESTART_FAIL_AT in registered_steps(storage / name), 60, 0.05)
            seen["checkpoint"] = time.monotonic()
        except BaseException as error:  # noqa: BLE001 - raised once the job has ended
            errors.append(error)
        finally:
            if "down" in seen:
                server.start()  # same port, same database
                seen["up"] = time.monotonic()
            back.set()

    fit = Launch.train

    def fit_then_wait(self, *args, **kwargs):
        """The fit, then (the driver's next calls to the store are synchronous) the server back."""
        try:
            return fit(self, *args, **kwargs)
        finally:
            seen["fit_ended"] = time.monotonic()
            back.wait(scaled(300))

    monkeypatch.setattr(Launch, "train", fit_then_wait)
    torch.manual_seed(0)
    clip = tmp_path / "clip.safetensors"  # an untrained source: the adapter learns on any embeddings
    save_model(create_model("clip_tiny").state_dict(), clip, "clip_tiny", {})
    cfg = load_adapt_config(CONFIG, [
        f"source.model={clip}", f"data.root={digits_root}", f"tracking.uri={server.uri}",
        f"run.storage_path={storage}", f"run.name={name}", "run.max_failures=1", f"run.notice_file={notice}",
        "run.keep_checkpoints=8",  # every registration stays listed
        f"train.steps={RESTART_STEPS}", f"train.checkpoint_every={RESTART_CHECKPOINT}",
        f"train.fail_once_at_step={RESTART_FAIL_AT}", "train.log_every=1", "train.batch_size=32",
        "adapter.hidden=32", "adapter.mc_samples=2",
        'eval.tasks=[{name: digits_retrieval, kind: retrieval, data: "{data.root}/eval/retrieval"}]'])
    thread = threading.Thread(target=outage, daemon=True)
    thread.start()
    try:
        res = run_adapt(cfg, tmp_path / "out")
    finally:
        thread.join(scaled(600))
    if errors:
        raise errors[0]

    marker = STATE_DIR / "injected_failures" / f"{res.mlflow_run_id}.done"
    assert marker.read_text() == str(RESTART_FAIL_AT)  # the worker failed there, once
    # the failure's restart from the step-45 checkpoint saved at its first step on the notice (the file taken), and
    # the attempt that finished began there
    assert registered_steps(storage / name) == [RESTART_CHECKPOINT, NOTICE_STEP, RESTART_FAIL_AT, RESTART_STEPS]
    assert not notice.exists() and (tmp_path / "notice.taken").exists()
    assert (res.train["step"], res.train["steps_this_run"]) == (RESTART_STEPS, RESTART_STEPS - NOTICE_STEP)
    client = MlflowClient(res.mlflow_uri)
    run = client.get_run(res.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert json.loads(run.data.tags[f"probvlp.preemption.step_{NOTICE_STEP}"])["sources"] == ["file"]
    assert [(m.step, m.value) for m in client.get_metric_history(res.mlflow_run_id, "preemptions")] == \
        [(NOTICE_STEP, 1)]
    assert res.model_file.is_file() and "digits_retrieval/i2t_calib_score" in res.metrics
    # the attempts as the core's journal keeps them (pipelines.fit.attempts), and each restart's line saying why
    journal = json.loads((Path(run_folder(str(storage), name)) / "attempts.json").read_text())
    assert [(a["from_step"], (a.get("notice") or {}).get("step")) for a in journal] == \
        [(0, None), (RESTART_CHECKPOINT, NOTICE_STEP), (NOTICE_STEP, None)], journal
    assert "injected failure at step" in json.loads(run.data.tags["probvlp.attempt.2"])["why"]
    assert json.loads(run.data.tags["probvlp.attempt.3"])["why"] == f"a notice of preemption (file) at step {NOTICE_STEP}"
    failed_at_ms = marker.stat().st_mtime * 1000
    for key in PER_STEP:
        history = client.get_metric_history(res.mlflow_run_id, key)
        steps = sorted(m.step for m in history)
        twice = sorted({s for s in steps if steps.count(s) > 1})
        assert not twice, f"{key}: steps logged more than once: {twice}"
        assert steps == list(range(1, RESTART_STEPS + 1)), f"{key}: steps missing: " \
            f"{sorted(set(range(1, RESTART_STEPS + 1)) - set(steps))}"
        # whether the first attempt had delivered steps past the checkpoint before it failed (the restart's replays
        # of them then dropped) depends on the machine's speed: said, not asserted. The replay rule is the outbox's,
        # held by pretraining's tests (tests/mutants.py: replay-dropped, replay-per-key).
        delivered = max(m.step for m in history if m.timestamp <= failed_at_ms)
        print(f"{key}: the first attempt delivered through step {delivered} before it failed at {RESTART_FAIL_AT}")
    # the outage as rank 0's outbox saw it, delivered with the rest
    [unreachable] = client.get_metric_history(res.mlflow_run_id, UNREACHABLE_METRIC)
    assert unreachable.value > 0, unreachable
    print(f"server away {seen['up'] - seen['down']:.1f} s from the failure at step {RESTART_FAIL_AT}; the restart's "
          f"checkpoint of step {RESTART_FAIL_AT} {seen['checkpoint'] - seen['down']:.1f} s into it; the fit ended "
          f"{seen['fit_ended'] - seen['down']:.1f} s into it; {UNREACHABLE_METRIC} {unreachable.value}")
