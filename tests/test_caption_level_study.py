"""The caption-level study's own pieces (studies/caption_level_study.py; no training, no Ray): the batch's match
labels, the multi-positive PPCL against a direct transcription of ProLIP Eq. 2, and the official arm read from
configs/prolip_tiny_official.yaml."""
from __future__ import annotations

import math

import torch

from models.gather import World
from models.losses import ProLIPLoss
from pipelines.config import read_config_file
from pipelines.pretrain.config import load_train_config
from pipelines.digits.dataset import GENERAL_CAPTIONS, captions_for, mid_captions, specific_captions
from studies.caption_level_study import ARMS, DEMO, MultiPositiveProLIP, caption_sets, fit_labels, order_holds


def test_match_labels_follow_which_images_a_caption_fits():
    # images: a seven, a three, another seven; captions drawn: general, the seven's class, the three's parity
    fits = caption_sets([{"captions": captions_for(7)}, {"captions": captions_for(3)}, {"captions": captions_for(7)}])
    captions = [GENERAL_CAPTIONS[0], specific_captions(7)[1], mid_captions(3)[0]]  # "an odd digit" fits all three
    labels = fit_labels(fits, captions)
    assert labels.tolist() == [[1, 1, 1], [1, 1, 1], [1, 1, 1]]
    captions = [specific_captions(7)[0], specific_captions(3)[0], mid_captions(7)[1]]  # "a digit greater than four"
    assert fit_labels(fits, captions).tolist() == [[1, 0, 1], [0, 1, 0], [1, 0, 1]]
    # a caption that fits no image in the batch (user data without levels) still matches its own image
    assert fit_labels([set(), set()], ["x", "y"]).tolist() == [[1, 0], [0, 1]]


def _outputs(n: int, d: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    unit = lambda: torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)  # noqa: E731
    return {"image_mu": unit(), "text_mu": unit(), "image_logvar": torch.randn(n, d, generator=g, dtype=torch.float64) - 3,
            "text_logvar": torch.randn(n, d, generator=g, dtype=torch.float64) - 3}


def test_multi_positive_ppcl_against_eq2_and_the_one_positive_loss():
    out, n = _outputs(4), 4
    params = dict(alpha1=1e-3, alpha2=1e-2, beta=1e-2)
    loss = MultiPositiveProLIP(**params).double()
    loss.labels = torch.eye(n, dtype=torch.float64)
    one = ProLIPLoss(**params).double()
    assert torch.allclose(loss(out, World())["loss"], one(out, World())["loss"], rtol=0, atol=1e-12)
    labels = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.float64)
    loss.labels = labels
    got = loss(out, World())
    s, b = got["scale"].item(), got["bias"].item()  # ~10, -10: the initial values as the parameters store them
    total = 0.0
    for i in range(n):
        for j in range(n):
            mv, mt = out["image_mu"][i].tolist(), out["text_mu"][j].tolist()
            tr = sum(math.exp(x) for x in out["image_logvar"][i].tolist() + out["text_logvar"][j].tolist())
            logit = s * (sum(a * c for a, c in zip(mv, mt)) - tr / 2) + b
            y = 1.0 if labels[i, j] else -1.0
            total += math.log1p(math.exp(-y * logit))  # -log sigmoid(y logit)
    assert abs(got["ppcl"].item() - total / n) < 1e-9


def test_official_arm_sets_every_switch_of_the_official_recipe():
    official = read_config_file(DEMO.parent / "prolip_tiny_official.yaml")
    cfg = load_train_config(DEMO, list(ARMS["official"].overrides))
    assert cfg.model.overrides == official["model"]["overrides"]
    assert cfg.loss.params == official["loss"]["params"]
    assert cfg.train.steps == load_train_config(DEMO).train.steps  # the demo's recipe otherwise


def test_order_holds_only_when_sigma2_rises_at_every_level():
    row = {"instance": 1.0, "specific": 2.0, "mid": 3.0, "general": 4.0}
    assert order_holds(row)
    assert not order_holds({**row, "general": 2.5}) and not order_holds({**row, "instance": 2.0})
