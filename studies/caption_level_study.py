"""Does a more general caption get a larger sigma^2 on the digits (ProLIP Sec. 4.3, Fig. 7), and under what recipe?
The study behind docs/RESULTS.md "sigma^2 by caption level": `make demo`'s model (configs/prolip_demo.yaml) trained
in this process (no Ray, one thread), one arm per recipe change, then measured as the demo's held-out task measures
it (pipelines.evaluate.uncertainty: mean sigma^2 of the test images' distinct captions per level, Spearman rho
between level and sigma^2 over those captions) and by its zero-shot top-1. Run it as a module:

    OMP_NUM_THREADS=1 .venv/bin/python -m studies.caption_level_study --arms demo alpha1_1 --seeds 0 1 2
    .venv/bin/python -m studies.caption_level_study --list        # the arms and what each changes

Levels, specific -> general: instance ("a bold wide seven, slanted right"), specific ("the digit seven"), mid ("an
odd digit"), general ("a handwritten digit"). Paper Fig. 7 plots HierarCaps text sigma^2 by level ("bird" ... the
full COCO caption) for a model trained on web alt-text, where none of the level captions are training captions.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from models.distributions import ppcl_logits
from models.losses import ProLIPLoss
from models.objective import Objective, build_objective
from models.tokenizer import tokenize
from pipelines.config import EvalTask, read_config_file
from pipelines.pretrain.config import load_train_config
from pipelines.digits.dataset import NAMES, specific_captions
from pipelines.digits.arrays import config_sampler, digit_arrays
from pipelines.evaluate.in_process import TaskEmbeddings, embed_texts
from pipelines.evaluate.tasks import score_task
from pipelines.digits_fit import InProcessFit
from pipelines.fit.loop import run_steps

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "configs" / "prolip_demo.yaml"
LEVELS = ("instance", "specific", "mid", "general")


def official_switches() -> list[str]:
    """configs/prolip_tiny_official.yaml's model overrides and loss params (docs/FIDELITY.md) as --set overrides."""
    data = read_config_file(ROOT / "configs" / "prolip_tiny_official.yaml")
    return ([f"model.overrides.{k}={json.dumps(v)}" for k, v in data["model"]["overrides"].items()]
            + [f"loss.params.{k}={json.dumps(v)}" for k, v in data["loss"]["params"].items()])


@dataclass(frozen=True)
class Arm:
    what: str
    overrides: tuple[str, ...] = ()  # --set overrides of configs/prolip_demo.yaml
    multi_positive: bool = False  # every image a caption fits is its positive in the batch (not only its own image)


def _mix(instance: float, mid: float, general: float) -> tuple[str, ...]:
    return (f"data.instance_caption_prob={instance}", f"data.mid_caption_prob={mid}",
            f"data.general_caption_prob={general}")


ARMS = {
    "demo": Arm("configs/prolip_demo.yaml as it is (700 steps; mix 0.7 specific, 0.1 each other level)"),
    "steps_300": Arm("300 steps", ("train.steps=300",)),
    "steps_1500": Arm("1,500 steps", ("train.steps=1500",)),
    "alpha1_0.1": Arm("inclusion inc(image in caption) weight alpha1 1e-3 -> 0.1", ("loss.params.alpha1=0.1",)),
    "alpha1_1": Arm("alpha1 1e-3 -> 1", ("loss.params.alpha1=1.0",)),
    "alpha1_1_eps0": Arm("alpha1 1 with the inclusion's eps -10 -> 0: the mean distance counts in H(image in caption) "
                         "(at eps -10 it is scaled by e^-10)", ("loss.params.alpha1=1.0", "loss.params.eps=0.0")),
    "alpha2_1": Arm("masked inclusion inc(x in masked x) weight alpha2 1e-2 -> 1", ("loss.params.alpha2=1.0",)),
    "mix_unseen": Arm("mid and general captions never trained on (0.8 specific, 0.2 instance): only seen at test, "
                      "as HierarCaps' levels", _mix(0.2, 0.0, 0.0)),
    "mix_tiny": Arm("prolip_tiny.yaml's mix (0.4 instance, 0.3 specific, 0.15 mid, 0.15 general)",
                    _mix(0.4, 0.15, 0.15)),
    "mix_general": Arm("more general captions (0.1 instance, 0.3 specific, 0.3 mid, 0.3 general)", _mix(0.1, 0.3, 0.3)),
    "multi_positive": Arm("every pair whose caption fits the image counts positive in PPCL", multi_positive=True),
    "multi_positive_alpha1_1": Arm("multi_positive and alpha1 1", ("loss.params.alpha1=1.0",), multi_positive=True),
    "official": Arm("configs/prolip_tiny_official.yaml's switches (model.overrides, loss.params)",
                    tuple(official_switches())),
}


def caption_sets(metas: list[dict]) -> list[set[str]]:
    """Per image, every caption that fits it (all levels)."""
    return [{c for caps in m["captions"].values() for c in caps} for m in metas]


def fit_labels(fits: list[set[str]], captions: list[str]) -> torch.Tensor:
    """(B, B) match labels of a batch: 1 where caption j fits image i; the diagonal (its own caption) always 1."""
    labels = torch.tensor([[c in f for c in captions] for f in fits], dtype=torch.float32)
    return labels.fill_diagonal_(1.0)


class MultiPositiveProLIP(ProLIPLoss):
    """ProLIPLoss whose PPCL counts every pair in `labels` (set before each step) as positive."""

    labels: torch.Tensor | None = None

    def pairwise(self, out, world):
        if world.size != 1:
            raise ValueError("the multi-positive study loss runs in one process")
        s, b = self.scale_bias(out["image_mu"])
        logits = ppcl_logits(out["image_mu"], out["image_logvar"], out["text_mu"], out["text_logvar"], s, b)
        y = 2.0 * self.labels - 1.0
        # ProLIP Eq. 2 with y_ij = +1 on every matching pair: sum_ij -log sigmoid(y_ij logit_ij) / B
        return F.softplus(-y * logits).sum() / logits.shape[0], s, b


def train(cfg, seed: int, multi_positive: bool):
    """cfg's model and loss, cfg.train.steps AdamW steps of the global batch (batch_size x num_workers) on the train
    split with cfg.data's caption mix, in this process; the model in eval mode. pipelines.digits_fit's loop,
    with the batch's match labels set before each step when `multi_positive`."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    images, _, metas = digit_arrays("train")
    fits = caption_sets(metas)
    t, sampler = cfg.train, config_sampler(cfg)
    objective = build_objective(cfg)
    if multi_positive:
        objective = Objective(objective.model, MultiPositiveProLIP(**cfg.loss.params))
    fit = InProcessFit(objective.train(), cfg)
    batch = t.batch_size * t.num_workers

    def batches():
        while True:
            rows = rng.choice(len(images), batch, replace=False)
            captions = [sampler.draw(metas[i], "", rng) for i in rows]
            if multi_positive:  # read by the loss of the step this batch goes to
                objective.loss.labels = fit_labels([fits[i] for i in rows], captions)
            yield images[rows], tokenize(captions, objective.model.context_length)

    run_steps(fit, batches(), t.steps)
    return objective.model.eval()


@torch.no_grad()
def measure(model) -> dict[str, float]:
    """The demo's held-out numbers: zero-shot top-1 with the class templates, and the level analyses of the test
    split as a retrieval task (its caption: the first class template, as the demo's held-out shards)."""
    images, labels, metas = digit_arrays("test")
    image = {k: v.float() for k, v in model.encode_image(images).items()}
    keys = [f"{i:04d}" for i in range(len(labels))]
    prompts = [specific_captions(c) for c in range(len(NAMES))]
    flat = [p for per_class in prompts for p in per_class]
    zeroshot = TaskEmbeddings(keys, image, [[] for _ in keys], labels, flat, embed_texts(model, flat),
                              [len(p) for p in prompts], NAMES)
    top1 = score_task(model, EvalTask(name="z", kind="zeroshot"), zeroshot).metrics["top1"]
    captions = [[specific_captions(int(c))[0]] for c in labels]
    texts = list(dict.fromkeys(c for caps in captions for c in caps))
    heldout = TaskEmbeddings(keys, image, captions, labels, texts, embed_texts(model, texts),
                             levels=[m["captions"] for m in metas])
    result = score_task(model, EvalTask(name="heldout", kind="retrieval", caption_levels=list(LEVELS)), heldout)
    m = result.analyses.metrics
    return {**{lv: m[f"unc_level_{lv}_sigma2"] for lv in LEVELS}, "rho": m["unc_level_rho"],
            "images": result.metrics["image_sigma2_mean"], "top1": top1}


def order_holds(row: dict[str, float]) -> bool:
    """Fig. 7's ordering across every level: sigma^2 rises from instance to general."""
    values = [row[lv] for lv in LEVELS]
    return all(a < b for a, b in zip(values, values[1:]))


def run_arm(name: str, seed: int) -> dict[str, float]:
    arm = ARMS[name]
    cfg = load_train_config(DEMO, [*arm.overrides, f"run.seed={seed}"])
    start = time.perf_counter()
    row = measure(train(cfg, seed, arm.multi_positive))
    return {**row, "seconds": time.perf_counter() - start}


def table_row(name: str, seed: int, row: dict[str, float]) -> str:
    cells = [f"{row[lv]:.5f}" for lv in LEVELS] + [f"{row['images']:.5f}", f"{row['rho']:+.2f}", f"{row['top1']:.3f}",
                                                   "yes" if order_holds(row) else "no", f"{row['seconds']:.0f}"]
    return f"| {name} | {seed} | " + " | ".join(cells) + " |"


HEADER = ("| arm | seed | " + " | ".join(LEVELS) + " | images | rho | top-1 | order | s |\n"
          "| --- | --- |" + " --- |" * (len(LEVELS) + 5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["demo"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--list", action="store_true", help="print the arms and exit")
    args = parser.parse_args()
    if args.list:
        for name, arm in ARMS.items():
            print(f"{name}: {arm.what}")
        return
    torch.set_num_threads(1)
    print(HEADER, flush=True)
    for seed in args.seeds:  # every arm once before the next seed: an interrupted run still compares the arms
        for name in args.arms:
            print(table_row(name, seed, run_arm(name, seed)), flush=True)


if __name__ == "__main__":
    main()
