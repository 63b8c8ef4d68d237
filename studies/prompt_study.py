"""Zero-shot prompt weighting with deliberately wrong prompts, on models trained in this process (no Ray):
the study behind docs/RESULTS.md "Zero-shot prompt weighting with wrong prompts" (it reuses the tests' in-process
digit fits, pipelines/digits_fit.py). Run it as a module:

    .venv/bin/python -m studies.prompt_study --source prolip --seed 0      # configs/prolip_tiny.yaml, 900 steps
    .venv/bin/python -m studies.prompt_study --source pcmepp --seed 1      # configs/pcmepp_tiny.yaml, 600 steps
    .venv/bin/python -m studies.prompt_study --source clip_adapter --seed 0
      # configs/demo.yaml's CLIP (600 steps), then configs/probvlm_demo.yaml's ProbVLM adapter and PFE-style
      # baseline (1,500 steps) on its embeddings of the digits' training pairs
    .venv/bin/python -m studies.prompt_study --source prolip --unrelated 0.2
      # 20% of the training captions replaced by unrelated alt-text ("my new guitar"), as web data has: does
      # the model learn a larger sigma^2 for captions that match no image? (its words are not the test's)

For each model: held-out (test split) top-1 of the plain prompt ensemble, `filter` (the 5 most certain of
each class's prompts) and `bprw`, with each class's five templates plus five off-domain prompts ("a photo of
a car") or five in-domain class-free ones ("a handwritten digit", "an odd digit"); and the mean sigma^2 of the
class templates against the added prompts (for the adapter also its epistemic and aleatoric parts).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from models.registry import create_model
from pipelines.config import EvalTask
from pipelines.pretrain.config import load_train_config
from pipelines.digits.dataset import GENERAL_CAPTIONS, NAMES, OFF_DOMAIN, mid_captions, specific_captions
from pipelines.digits.arrays import config_sampler, digit_arrays
from pipelines.digits_fit import fit_in_process
from pipelines.evaluate.in_process import TaskEmbeddings, embed_texts
from pipelines.evaluate.tasks import score_task

ROOT = Path(__file__).resolve().parent.parent
IN_DOMAIN = GENERAL_CAPTIONS + mid_captions(1)  # fits every digit, or half of them: names no class
STEPS = {"prolip": 900, "pcmepp": 600, "clip": 600}
ADAPTER_STEPS = 1500
# Web-style alt-text that says nothing about the image; none of OFF_DOMAIN's content words
UNRELATED = [t.format(o) for t in ("a photo of a {}", "my new {}", "a {} for sale", "a picture of the {} we saw",
                                   "a close-up of a {}", "the best {} in town", "an old {} near the road", "{}")
             for o in ("dog", "tree", "house", "chair", "boat", "flower", "guitar", "pizza", "lamp", "horse", "beach",
                       "bridge", "shoe", "clock", "river", "train", "garden", "kitchen", "window", "coffee")]


class WithUnrelated:
    """A caption sampler that draws one of UNRELATED instead, with probability `share`."""

    def __init__(self, base, share: float):
        self.base, self.share = base, share

    def draw(self, meta: dict, fallback: str, rng: np.random.Generator) -> str:
        if rng.random() < self.share:
            return UNRELATED[rng.integers(len(UNRELATED))]
        return self.base.draw(meta, fallback, rng)


def fit_adapters(clip, steps: int = ADAPTER_STEPS, seed: int = 0) -> dict[str, torch.nn.Module]:
    """configs/probvlm_demo.yaml's adapter and PFE-style baseline trained side by side on the CLIP's embeddings of
    the digits' training pairs (a class template and the instance caption per image), as `jobs.adapt` trains
    them; returns the two adapted models (frozen CLIP + adapter)."""
    from pipelines.adapt.config import load_adapt_config
    from pipelines.adapt.loop import AdapterFit, build_adapter_set
    from pipelines.fit.loop import run_steps

    images, _, metas = digit_arrays("train")
    captions = [c for i, m in enumerate(metas) for c in (m["captions"]["specific"][i % 5], m["captions"]["instance"][0])]
    with torch.no_grad():
        zi = torch.cat([clip.encode_image(images[i : i + 512])["mu"].float() for i in range(0, len(images), 512)])
        zt = embed_texts(clip, captions)["mu"]
    pairs = torch.stack([zi.repeat_interleave(2, dim=0), zt], dim=1)
    cfg = load_adapt_config(ROOT / "configs" / "probvlm_demo.yaml")
    net = build_adapter_set(cfg, zi.shape[1])
    fit = AdapterFit(net, cfg.train.model_copy(update={"steps": steps}), seed=seed)
    rng = np.random.default_rng(seed)
    run_steps(fit, (pairs[torch.from_numpy(rng.choice(len(pairs), cfg.train.batch_size, replace=False))]
                    for _ in range(steps)), steps)
    models = {}
    for name, registry in (("adapter", "probvlm_adapter"), ("baseline", "pfe_adapter")):
        model = create_model(registry, source="clip_tiny", hidden=cfg.adapter.hidden)
        model.source.load_state_dict(clip.state_dict())
        model.adapter.load_state_dict(net.adapters[name].state_dict())
        models[f"clip+{'probvlm' if name == 'adapter' else 'pfe'}"] = model.eval()
    return models


def prompt_weighting(model, images: torch.Tensor, labels: torch.Tensor, added: list[str]) -> dict[str, float]:
    """Top-1 of `mean`, `filter` (keep 5) and `bprw` (eps 0.02 and 0.001) with `added` appended to every class's five templates, and
    the mean sigma^2 per dimension of the templates and of the added prompts."""
    prompts = [specific_captions(c) + added for c in range(len(NAMES))]
    flat = [p for per_class in prompts for p in per_class]
    with torch.no_grad():
        image = {k: v.float() for k, v in model.encode_image(images).items()}
        text = embed_texts(model, flat)
    emb = TaskEmbeddings([f"{i:04d}" for i in range(len(labels))], image, [[] for _ in labels], labels, flat, text,
                         [len(p) for p in prompts], NAMES)
    options = {"mean": {}, "filter": {"prompts": "filter"}, "bprw": {"prompts": "bprw"},
               # the paper's eps (0.02) is above these models' prompt sigma^2: also a smaller one
               "bprw_eps_0.001": {"prompts": "bprw", "bprw": {"eps": 0.001}}}
    out = {how: score_task(model, EvalTask(name="z", kind="zeroshot", **o), emb).metrics["top1"] for how, o in options.items()}
    sigma2 = text["logvar"].exp().mean(-1).view(len(NAMES), -1)
    out.update(templates_sigma2=sigma2[:, :5].mean().item(), added_sigma2=sigma2[:, 5:].mean().item(),
               classes_added_below=int((sigma2[:, 5:].min(1).values < sigma2[:, :5].max(1).values).sum()),
               unrelated_sigma2=embed_texts(model, UNRELATED)["logvar"].exp().mean().item())
    if hasattr(model, "adapter") and hasattr(model.adapter, "uncertainty"):
        from models.tokenizer import tokenize

        with torch.no_grad():
            z = model.source.encode_text(tokenize(flat, model.context_length))["mu"].float()
            u = model.adapter.uncertainty("text", z)
        for part in ("epistemic", "aleatoric"):
            per = u[part].mean(-1).view(len(NAMES), -1)
            out.update({f"templates_{part}": per[:, :5].mean().item(), f"added_{part}": per[:, 5:].mean().item()})
    return out


def study(source: str, seed: int, unrelated: float = 0.0) -> dict[str, dict]:
    start = time.perf_counter()
    config = {"prolip": "prolip_tiny.yaml", "pcmepp": "pcmepp_tiny.yaml", "clip_adapter": "demo.yaml"}[source]
    cfg = load_train_config(ROOT / "configs" / config)
    # None: cfg.data's own mix, drawn exactly as without --unrelated
    sampler = WithUnrelated(config_sampler(cfg), unrelated) if unrelated else None
    trained = fit_in_process(cfg, STEPS[source.removesuffix("_adapter")], seed=seed, sampler=sampler)
    models = fit_adapters(trained, seed=seed) if source == "clip_adapter" else {source: trained}
    images, labels, _ = digit_arrays("test")
    results = {name: {kind: prompt_weighting(model, images, labels, added)
                      for kind, added in (("off_domain", OFF_DOMAIN), ("in_domain", IN_DOMAIN))}
               for name, model in models.items()}
    print(f"{source}, seed {seed}: {time.perf_counter() - start:.0f} s")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=["prolip", "pcmepp", "clip_adapter"], required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unrelated", type=float, default=0.0, help="share of training captions replaced by UNRELATED")
    args = parser.parse_args()
    for name, kinds in study(args.source, args.seed, args.unrelated).items():
        for kind, r in kinds.items():
            print(f"{name} {kind}: " + json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in r.items()}))


if __name__ == "__main__":
    main()
