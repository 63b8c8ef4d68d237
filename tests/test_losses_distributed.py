"""Every loss on a real 2-process gloo group equals the single-process full-batch loss.

Each worker holds half the batch, gathers the other workers' features with gradient and computes
its local rows x global columns. Checked: the mean of the two workers' losses (and logged parts)
equals the full-batch value, and the workers' averaged parameter gradients (as DDP / DeepSpeed
average them) equal the full-batch gradients, in float64.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from models.gather import World
from models.llip_mixer import LlipMixer
from models.losses import create_loss
from tests.helpers import free_port, official_switches, spawn

f64 = torch.float64
WORLD, B_LOCAL, DIN, D, K = 2, 4, 6, 8, 3

CASES = [
    ("infonce", {}),
    ("siglip", {"init_scale": 3.0, "init_bias": -1.0}),
    ("ppcl", {"init_scale": 3.0, "init_bias": -1.0}),
    ("inclusion", {"eps": -1.0, "c": 3.0}),
    ("vib", {"beta": 0.5}),
    ("prolip", {"init_scale": 3.0, "init_bias": -1.0, "alpha1": 0.3, "alpha2": 0.4, "beta": 0.5, "eps": -1.0, "c": 2.0}),
    ("prolip", {"alpha1": 0.3, "alpha2": 0.4, "beta": 0.5, "eps": 0.0, "c": 2.0, "form": "exact"}),
    ("pml", {"init_a": 2.0, "init_b": 1.0, "alpha": 0.5, "beta": 0.5}),
    ("llip", {"init_scale": 3.0, "init_bias": -1.0}),
    ("prob_llip", {"init_scale": 3.0, "init_bias": -1.0, "alpha1": 0.3, "alpha2": 0.4, "beta": 0.5, "eps": -1.0, "c": 2.0}),
    ("probvlm", {"lambda_cross": 0.5, "l1": 0.3}),
    # the official recipes' switches (configs/*_official.yaml, docs/FIDELITY.md): caption-row pseudo-positives
    # gather the MSDA labels
    ("pml", {**official_switches("pcmepp_tiny")[1], "init_a": 2.0, "init_b": 1.0, "alpha": 0.5, "beta": 0.5,
             "label_smoothing": 0.01}),
    ("prolip", {**official_switches("prolip_tiny")[1], "alpha1": 0.3, "alpha2": 0.4, "beta": 0.5, "eps": -1.0,
                "c": 2.0}),
    ("probvlm", {**official_switches("probvlm_demo")[1], "lambda_cross": 0.5, "l1": 0.3}),
]


class TinyModel(nn.Module):
    """Produces every key the losses read from raw per-sample inputs (shared weights on all workers)."""

    def __init__(self):
        super().__init__()
        lin = lambda o: nn.Linear(DIN, o, bias=False)  # noqa: E731
        self.img_mu, self.img_lv, self.txt_mu, self.txt_lv = lin(D), lin(D), lin(D), lin(D)
        self.tokens = lin(K * D)
        self.mixer = LlipMixer(D, heads=2, tau=0.5, chunk_size=3)
        self.hat, self.alpha, self.beta = lin(D), lin(D), lin(D)

    def forward(self, batch: dict[str, torch.Tensor], world: World) -> dict[str, torch.Tensor]:
        xi, xt = batch["x_img"], batch["x_txt"]
        out = {
            "image_mu": F.normalize(self.img_mu(xi), dim=-1),
            "image_logvar": self.img_lv(xi) - 1.0,
            "text_mu": F.normalize(self.txt_mu(xt), dim=-1),
            "text_logvar": self.txt_lv(xt) - 1.0,
            "masked_rows": batch["masked_rows"],
            "image_masked_mu": F.normalize(self.img_mu(batch["x_img_masked"]), dim=-1),
            "image_masked_logvar": self.img_lv(batch["x_img_masked"]),
            "text_masked_mu": F.normalize(self.txt_mu(batch["x_txt_masked"]), dim=-1),
            "text_masked_logvar": self.txt_lv(batch["x_txt_masked"]),
            "mix_lambda": batch["mix_lambda"],
            "mix_partner": batch["mix_partner"],
        }
        tokens = self.tokens(xi).reshape(xi.shape[0], K, D)
        txt_all = world.gather(out["text_mu"])
        out["pair_cos"] = self.mixer(tokens, txt_all, txt_all)
        for m, x, other in (("image", xi, xt), ("text", xt, xi)):
            out[f"{m}_hat"] = self.hat(x)
            out[f"{m}_alpha"] = F.softplus(self.alpha(x)) + 0.1
            out[f"{m}_beta"] = F.softplus(self.beta(x)) + 0.3
            out[f"{m}_target"] = x[:, :D] if DIN >= D else F.pad(x, (0, D - DIN))
        return out


def full_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    n = WORLD * B_LOCAL
    local_rows = torch.tensor([1, 3])
    local_partner = torch.tensor([0, 2, 2, 3])
    local_lambda = torch.tensor([1.0, 0.7, 1.0, 1.0], dtype=f64)
    return {
        "x_img": torch.randn(n, DIN, generator=g, dtype=f64),
        "x_txt": torch.randn(n, DIN, generator=g, dtype=f64),
        "x_img_masked": torch.randn(WORLD * 2, DIN, generator=g, dtype=f64),
        "x_txt_masked": torch.randn(WORLD * 2, DIN, generator=g, dtype=f64),
        # per-worker local indices, shifted to global indices for the full batch
        "masked_rows": torch.cat([local_rows + w * B_LOCAL for w in range(WORLD)]),
        "mix_partner": torch.cat([local_partner + w * B_LOCAL for w in range(WORLD)]),
        "mix_lambda": local_lambda.repeat(WORLD),
    }


def local_batch(full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    masked = slice(rank * 2, (rank + 1) * 2)
    return {
        "x_img": full["x_img"][rows],
        "x_txt": full["x_txt"][rows],
        "x_img_masked": full["x_img_masked"][masked],
        "x_txt_masked": full["x_txt_masked"][masked],
        "masked_rows": full["masked_rows"][masked] - rank * B_LOCAL,
        "mix_partner": full["mix_partner"][rows] - rank * B_LOCAL,
        "mix_lambda": full["mix_lambda"][rows],
    }


def _mean_over_workers(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        failures = []
        full = full_batch()
        for name, params in CASES:
            torch.manual_seed(0)
            model, loss = TinyModel().double(), create_loss(name, **params).double()
            ref_model, ref_loss = copy.deepcopy(model), copy.deepcopy(loss)

            single = World(0, 1)
            ref = ref_loss(ref_model(full, single), single)
            ref["loss"].backward()

            world = World.current()
            assert world.size == WORLD and world.rank == rank
            got = loss(model(local_batch(full, rank), world), world)
            got["loss"].backward()

            for key, value in ref.items():
                mean = _mean_over_workers(got[key])
                if not torch.allclose(mean, value.detach(), rtol=1e-9, atol=1e-10):
                    failures.append(f"{name} {params}: part {key}: workers {mean.tolist()} vs single {value.tolist()}")
            named = list(model.named_parameters()) + list(loss.named_parameters())
            ref_named = list(ref_model.named_parameters()) + list(ref_loss.named_parameters())
            for (pname, p), (_, q) in zip(named, ref_named):
                if q.grad is None:
                    has = torch.tensor(float(p.grad is not None and p.grad.abs().max() > 0), dtype=f64)
                    dist.all_reduce(has)
                    if has.item() > 0:
                        failures.append(f"{name}: {pname} has a gradient only in the distributed run")
                    continue
                grad = _mean_over_workers(p.grad if p.grad is not None else torch.zeros_like(p))
                err = (grad - q.grad).abs().max().item()
                if err > 1e-10 * (1 + q.grad.abs().max().item()):
                    failures.append(f"{name} {params}: grad {pname} differs by {err:.3g}")
        if failures:
            raise AssertionError("\n".join(failures))
    finally:
        dist.destroy_process_group()


def test_local_batches_reassemble_full_batch():
    full = full_batch()
    parts = [local_batch(full, r) for r in range(WORLD)]
    for key in ("x_img", "x_txt", "mix_lambda"):
        torch.testing.assert_close(torch.cat([p[key] for p in parts]), full[key])
    assert all(p["mix_partner"].max() < B_LOCAL and p["masked_rows"].max() < B_LOCAL for p in parts)


@pytest.mark.timeout(300)
def test_two_process_gloo_matches_single_process_full_batch():
    spawn(_worker, (free_port(),), WORLD)
