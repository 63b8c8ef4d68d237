"""Every method trains on the bundled digits through `jobs.pretrain`'s fit (2 Ray Train workers, ZeRO-2)
and reaches held-out zero-shot top-1 >= 0.70, with the papers' choices and with the official code's
(configs/*_tiny_official.yaml, docs/FIDELITY.md); ProLIP's uncertainty behaves as the paper reports.

One fit per method (cached for the module); CLIP's own run is tests/test_pretrain.py. `make test` checks that every
method learns with short in-process fits (tests/test_learning.py).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.artifacts import download_artifacts

from models.distributions import inclusion_test
from models.model_file import load_model
from models.tokenizer import tokenize
from models.towers import random_keep
from pipelines.pretrain.config import load_train_config
from pipelines.digits.dataset import (
    GENERAL_CAPTIONS,
    NAMES,
    OFF_DOMAIN,
    iter_digits,
    specific_captions,
)
from pipelines.tracking import model_file
from pipelines.pretrain.job import run_pretrain
from pipelines.pretrain.run_summary import run_summary

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.long  # ~28 min on 2 cores for the paper configs, plus the official recipes: `make test-long`
METHODS = ["siglip", "pcmepp", "prolip", "llip", "prolip_llip"]
OFFICIAL = ["pcmepp", "prolip", "llip"]  # configs/{method}_tiny_official.yaml


def config_file(method: str) -> Path:
    """`prolip` -> configs/prolip_tiny.yaml, `prolip_official` -> configs/prolip_tiny_official.yaml."""
    base, official = method.removesuffix("_official"), method.endswith("_official")
    return ROOT / "configs" / f"{base}_tiny{'_official' if official else ''}.yaml"


@pytest.fixture(scope="module")
def fits(ray_local, digits_root, tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(method: str):
        if method not in cache:
            tmp = tmp_path_factory.mktemp(method)
            cfg = load_train_config(config_file(method), [
                f"data.root={digits_root}", f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"run.storage_path={tmp}/ray",
                f"run.name=test_{method}", f"run.experiment=test-{method}",
            ])
            t0 = time.perf_counter()
            result = run_pretrain(cfg)
            print(f"\n{method}: zero-shot top-1 {result.metrics.get('digits_zeroshot/top1')}, "
                  f"{cfg.train.steps} steps, fit {time.perf_counter() - t0:.0f} s")
            cache[method] = (cfg, result, tmp)
        return cache[method]

    return get


def trained_model(fits, method: str):
    cfg, result, tmp = fits(method)
    folder = Path(download_artifacts(run_id=result.mlflow_run_id, artifact_path="model",
                                     dst_path=str(tmp / "dl_model"), tracking_uri=result.mlflow_uri))
    return load_model(model_file(Path(folder))), cfg


@pytest.mark.parametrize("method", METHODS)
def test_method_learns_digits(fits, method):
    cfg, result, _ = fits(method)
    assert result.metrics["step"] == cfg.train.steps
    assert result.metrics["digits_zeroshot/top1"] >= 0.70


@pytest.mark.parametrize("method", OFFICIAL)
def test_official_recipe_learns_digits(fits, method):
    cfg, result, _ = fits(f"{method}_official")
    assert cfg.model.overrides or cfg.loss.params
    assert result.metrics["step"] == cfg.train.steps
    assert result.metrics["digits_zeroshot/top1"] >= 0.70


def held_out_images() -> torch.Tensor:
    """The test split's images, preprocessed as the reader does ((x / 255 - 0.5) / 0.5)."""
    arrays = [np.asarray(s.image, np.float32) for s in iter_digits(32) if s.split == "test"]
    x = (np.stack(arrays) / 255.0 - 0.5) / 0.5
    return torch.from_numpy(x.transpose(0, 3, 1, 2).copy())


@torch.no_grad()
def text_sigma2(model, texts: list[str]) -> float:
    return model.encode_text(tokenize(texts, model.context_length))["logvar"].exp().mean().item()


def held_out_instance_captions(label: int | None = None) -> list[str]:
    return [s.meta["captions"]["instance"][0] for s in iter_digits(8)
            if s.split == "test" and (label is None or s.label == label)]


def test_prolip_general_captions_are_more_uncertain(fits):
    # ProLIP Sec. 4.3 (Fig. 7, HierarCaps): a more general caption gets a larger sigma^2 than a more specific one.
    # On the digits the specific level is the instance caption (class + the image's ink, width, slant:
    # ~1 match in a batch) and the general one the class caption ("the digit seven": ~10% of a batch).
    model, cfg = trained_model(fits, "prolip")
    assert cfg.data.instance_caption_prob > 0
    class_level = [c for label in range(len(NAMES)) for c in specific_captions(label)]
    assert text_sigma2(model, class_level) > text_sigma2(model, held_out_instance_captions())
    # and class by class: the class's captions (its 5 templates) vs its held-out images' instance captions.
    # A trend, as in the paper's Fig. 7, not a law: 10 of 10 classes in the fits we ran, 8 asked for.
    per_class = [text_sigma2(model, specific_captions(c)) > text_sigma2(model, held_out_instance_captions(c))
                 for c in range(len(NAMES))]
    assert sum(per_class) >= 8, per_class


@pytest.mark.xfail(strict=True, reason=(
    "not reproduced on the digits: the caption that fits EVERY image gets the smallest sigma^2 (docs/RESULTS.md "
    "'ProLIP's uncertainty' has the runs and the reason). strict: a fit that reproduces it fails this marker."))
def test_prolip_universal_caption_is_more_uncertain_than_class_captions(fits):
    model, _ = trained_model(fits, "prolip")
    class_level = [c for label in range(len(NAMES)) for c in specific_captions(label)]
    assert text_sigma2(model, GENERAL_CAPTIONS) > text_sigma2(model, class_level)


def test_prolip_texts_more_uncertain_than_images(fits):
    # ProLIP Sec. 4.3: with the image-in-text inclusion loss, captions cover their images
    model, cfg = trained_model(fits, "prolip")
    assert cfg.loss.params.get("alpha1", 1e-7) > 0
    with torch.no_grad():
        image = model.encode_image(held_out_images())["logvar"].exp().mean().item()
    specific = [c for label in range(len(NAMES)) for c in specific_captions(label)]
    assert text_sigma2(model, specific + GENERAL_CAPTIONS) > image


def test_prolip_original_included_in_masked(fits):
    # ProLIP Sec. 4.3: H(x in x_masked) > 0, the masked input's distribution covers the original's
    model, cfg = trained_model(fits, "prolip")
    images = held_out_images()
    torch.manual_seed(0)
    keep = random_keep(len(images), model.visual.num_patches, model.mask_ratio)
    with torch.no_grad():
        full, masked = model.encode_image(images), model.encode_image(images, keep)
    eps, form = cfg.loss.params.get("eps", -10.0), cfg.loss.params.get("form", "paper")
    h = inclusion_test(full["mu"], full["logvar"], masked["mu"], masked["logvar"], eps=eps, form=form).mean(-1)
    assert (h > 0).float().mean().item() >= 0.70


def test_prolip_uncertainty_analyses_are_in_its_mlflow_run(fits):
    import json

    from mlflow import MlflowClient

    cfg, result, tmp = fits("prolip")
    client = MlflowClient(result.mlflow_uri)
    plots = {a.path for a in client.list_artifacts(result.mlflow_run_id, "plots")}
    assert {"plots/heldout_analyses.png", "plots/heldout_analyses.json", "plots/digits_retrieval_analyses.png",
            "plots/digits_retrieval_analyses.json"} <= plots
    folder = Path(download_artifacts(run_id=result.mlflow_run_id, artifact_path="plots", dst_path=str(tmp / "dl_plots"),
                                     tracking_uri=result.mlflow_uri))
    heldout = json.loads((folder / "heldout_analyses.json").read_text())
    assert heldout["skipped"] == {}  # the held-out shards carry the four caption levels
    logged = client.get_run(result.mlflow_run_id).data.metrics
    for level in ("instance", "specific", "mid", "general"):
        for what in ("sigma2", "image_in_caption"):
            assert logged[f"heldout/unc_level_{level}_{what}"] == pytest.approx(heldout["metrics"][f"unc_level_{level}_{what}"])
    # the retrieval set's samples have captions but no levels: that analysis is skipped with its reason
    pairs = json.loads((folder / "digits_retrieval_analyses.json").read_text())
    assert "no caption levels" in pairs["skipped"]["levels"]
    assert "digits_retrieval/unc_level_rho" not in logged and "digits_retrieval/unc_length_rho" in logged
    # jobs.pretrain's summary prints them (from the run's metrics) and where the plots are
    lines = run_summary(cfg, result)
    for level in ("instance", "specific", "mid", "general"):
        assert [level, f"{logged[f'heldout/unc_level_{level}_sigma2']:.4g}"] in [line.split()[:2] for line in lines]
    assert any(line.strip() == "heldout_analyses.png" for line in lines)
    # and a few held-out images with their predicted class and sigma^2, worked out by rank 0 (the driver loads no model)
    shown = lines.index("sample predictions: 4 held-out images of eval task 'digits_zeroshot' (zeroshot)")
    row = re.compile(r"  image \S+ \(true: '\w+'\) -> '\w+' \| sigma\^2 image ")
    assert len([x for x in lines[shown + 2 : shown + 6] if row.match(x)]) == 4
    print("\nProLIP analyses:", {k: round(v, 3) for k, v in heldout["metrics"].items()})
    # ProLIP Sec. 4.3 on the digits: captions wider than their images (the image-in-text inclusion loss)
    assert heldout["metrics"]["unc_caption_wider_frac"] > 0.5


def wrong_template_top1(fits, how: str, **options) -> dict[str, float]:
    """Held-out zero-shot top-1 of the ProLIP fit with deliberately wrong prompts added to every class's
    five templates: the plain ensemble and `how`."""
    from pipelines.config import EvalTask
    from pipelines.evaluate.in_process import TaskEmbeddings, embed_texts
    from pipelines.evaluate.tasks import score_task

    model, _ = trained_model(fits, "prolip")
    images = held_out_images()
    labels = torch.tensor([s.label for s in iter_digits(8) if s.split == "test"])
    with torch.no_grad():
        image = {k: v.float() for k, v in model.encode_image(images).items()}
    prompts = [specific_captions(c) + OFF_DOMAIN for c in range(len(NAMES))]
    flat = [p for per_class in prompts for p in per_class]
    emb = TaskEmbeddings([f"{i:04d}" for i in range(len(labels))], image, [[] for _ in labels], labels, flat,
                         embed_texts(model, flat), [len(p) for p in prompts], NAMES)
    top1 = {"mean": score_task(model, EvalTask(name="z", kind="zeroshot"), emb).metrics["top1"],
            how: score_task(model, EvalTask(name="z", kind="zeroshot", prompts=how, **options), emb).metrics["top1"]}
    print(f"\nzero-shot top-1 with {len(OFF_DOMAIN)} wrong templates per class: {top1}")
    return top1


def test_prolip_bprw_beats_the_plain_ensemble_with_wrong_templates(fits):
    # ProLIP A.5: re-weighting the prompts by the unlabeled test images beats the plain prompt ensemble.
    # eps: the paper's 0.02 is twice the tiny model's prompt sigma^2 (~0.01) and washes their differences
    # out (in-process 900-step fit of this config: 0.852 at 0.02, 0.872 at 0.001, plain ensemble 0.861).
    top1 = wrong_template_top1(fits, "bprw", bprw={"eps": 0.001})
    assert top1["bprw"] > top1["mean"]


@pytest.mark.xfail(strict=True, reason=(
    "not reproduced on the digits: the tiny ProLIP gives the off-domain prompts ('a photo of a car') a SMALLER "
    "sigma^2 than the digit templates (0.0025 vs 0.0097 in an in-process 900-step fit), as it does the universal "
    "caption (see test_prolip_universal_caption_is_more_uncertain_than_class_captions), so the filter keeps the "
    "wrong prompts (top-1 0.10 vs 0.86); PCME++ fits rank them the same way (docs/RESULTS.md 'Zero-shot prompt weighting'). strict: a fit "
    "that reproduces PCME++ C.6 fails this marker."))
def test_prolip_filter_beats_the_plain_ensemble_with_wrong_templates(fits):
    # PCME++ C.6 / ProLIP 3.4: keeping the 5 most certain prompts per class drops the wrong ones
    top1 = wrong_template_top1(fits, "filter", filter_keep=5)
    assert top1["filter"] > top1["mean"]
