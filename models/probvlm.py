"""ProbVLM (Upadhyay et al., "ProbVLM: Probabilistic Adapter for Frozen Vision-Language Models", arXiv:2307.00398):
a post-hoc probabilistic adapter on a frozen deterministic model's embeddings.

Per modality a small MLP (Sec. 4: embedding -> 256 -> 256 -> embedding, dropout 0.1) maps a frozen
embedding z to a generalized Gaussian: mu_hat = z + a learned residual (the reconstructed embedding),
alpha > 0 and beta > 0 (Eq. 2). It trains on embeddings alone with `ProbVLMLoss` (Eq. 3, 7, 8).

Uncertainty (Sec. 3.2, Eq. 9): aleatoric alpha^2 Gamma(3/beta) / Gamma(1/beta) from the network
without dropout; epistemic the variance of mu_hat over M passes with dropout on; total their sum.
Each MC pass draws ONE dropout mask for all rows (a sampled sub-network, as MC dropout defines
it), from a seeded generator: an input gets the same uncertainty whatever batch it comes in.

`AdaptedModel` is the frozen source model plus the adapter: a probabilistic model like the others
(``encode_*`` -> mu, logvar; prompt ensemble of mu and sigma^2 for zero-shot). Its mu is the frozen
embedding itself and logvar the log of the total variance. ProbVLM keeps the deterministic model's
point estimates and its ranking: Sec. 4.1 compares uncertainty methods that "use the same
underlying embeddings and achieve the same performance", and calibration bins the queries of that
ranking by uncertainty. So the adapted model scores by the frozen cosine by default
(``scoring="cosine"``); ``scoring="csd"`` ranks by the closed-form sampled distance instead.

`PFEAdapter` is the baseline of ProbVLM's Table 1 ("PFE*"): the mean stays the frozen embedding and
only a per-dimension Gaussian variance is learned (loss ``pfe_mls``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


import torch
import torch.nn as nn
import torch.nn.functional as F

from models.distributions import ggd_variance
from models.prolip import negative_csd, prompt_ensemble

SIDES = ("image", "text")


class Hidden(nn.Module):
    """Linear + ReLU + dropout layers. Given `masks` (one (M, 1, H) tensor per layer, inputs (M, N, D)),
    those replace random dropout: M passes, each with one fixed sub-network for all rows."""

    def __init__(self, sizes: list[int], dropout: float):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:])])
        self.dropout = dropout

    def forward(self, x: torch.Tensor, masks: list[torch.Tensor] | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x))
            if masks is not None:
                x = x * masks[i]
            elif self.training and self.dropout > 0:
                x = F.dropout(x, self.dropout, training=True)
        return x

    def mc_masks(self, samples: int, g: torch.Generator, device) -> list[torch.Tensor]:
        keep = 1.0 - self.dropout
        return [(torch.rand(samples, 1, layer.out_features, generator=g) < keep).float().div(keep).to(device)
                for layer in self.layers]


class GGDHead(nn.Module):
    """One modality's ProbVLM MLP: z -> (mu_hat, alpha, beta), each (..., D).

    Three layers (D -> H -> H -> D) with a residual to the frozen embedding, then one small MLP per
    output, dropout after every hidden layer. mu_hat is reconstructed through its own MLP (no identity
    shortcut that would let alpha collapse to zero), and dropout during training teaches the network
    to be stable on the embeddings it knows, so MC-dropout spread is larger on those it does not."""

    PARTS = ("trunk", "mu", "alpha", "beta")

    def __init__(self, dim: int, hidden: int = 256, dropout: float = 0.1, alpha_min: float = 1e-4,
                 beta_min: float = 0.1):
        super().__init__()
        self.hidden = nn.ModuleDict({"trunk": Hidden([dim, hidden, hidden], dropout),
                                     **{k: Hidden([dim, hidden], dropout) for k in self.PARTS[1:]}})
        self.out = nn.ModuleDict({k: nn.Linear(hidden, dim) for k in self.PARTS})
        self.alpha_min, self.beta_min = alpha_min, beta_min

    def _part(self, name: str, x: torch.Tensor, masks: dict | None) -> torch.Tensor:
        return self.out[name](self.hidden[name](x, None if masks is None else masks[name]))

    def forward(self, z: torch.Tensor, masks: dict[str, list[torch.Tensor]] | None = None):
        x = z + self._part("trunk", z, masks)
        alpha = F.softplus(self._part("alpha", x, masks)) + self.alpha_min
        beta = F.softplus(self._part("beta", x, masks)) + self.beta_min
        return self._part("mu", x, masks), alpha, beta

    def mc_masks(self, samples: int, seed: int, device) -> dict[str, list[torch.Tensor]]:
        """The same masks for every call with this seed."""
        g = torch.Generator().manual_seed(seed)
        return {k: self.hidden[k].mc_masks(samples, g, device) for k in self.PARTS}


class ProbVLMAdapter(nn.Module):
    """Image and text GGD heads; ``forward`` gives `ProbVLMLoss` its inputs, ``variance`` the total uncertainty."""

    def __init__(self, dim: int, hidden: int = 256, dropout: float = 0.1, mc_samples: int = 16, mc_seed: int = 0):
        super().__init__()
        if not 0.0 <= dropout < 1.0 or mc_samples < 0 or (mc_samples > 0 and dropout == 0):
            raise ValueError("dropout must be in [0, 1), mc_samples >= 0, and MC passes need dropout > 0")
        self.image = GGDHead(dim, hidden, dropout)
        self.text = GGDHead(dim, hidden, dropout)
        self.mc_samples, self.mc_seed = mc_samples, mc_seed

    def forward(self, image_z: torch.Tensor, text_z: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for side, z in (("image", image_z), ("text", text_z)):
            hat, alpha, beta = getattr(self, side)(z)
            out.update({f"{side}_hat": hat, f"{side}_alpha": alpha, f"{side}_beta": beta, f"{side}_target": z})
        return out

    def uncertainty(self, side: str, z: torch.Tensor, mc_samples: int | None = None) -> dict[str, torch.Tensor]:
        """mu_hat, aleatoric and epistemic variance, (N, D) each, of frozen embeddings z (N, D)."""
        head: GGDHead = getattr(self, side)
        m = self.mc_samples if mc_samples is None else mc_samples
        was_training = head.training
        head.eval()
        try:
            mu_hat, alpha, beta = head(z)
            # ProbVLM Sec. 3.2: aleatoric sigma^2 = alpha^2 Gamma(3/beta) / Gamma(1/beta)
            aleatoric = ggd_variance(alpha, beta)
            if m > 0:
                masks = head.mc_masks(m, self.mc_seed + SIDES.index(side), z.device)
                passes = head(z.unsqueeze(0).expand(m, *z.shape), masks)[0]
                # ProbVLM Sec. 3.2: epistemic sigma^2 = 1/M sum_m (z_hat_m - mean_m z_hat_m)^2 over dropout passes
                epistemic = passes.var(dim=0, unbiased=False)
            else:
                epistemic = torch.zeros_like(aleatoric)
        finally:
            head.train(was_training)
        return {"mu_hat": mu_hat, "aleatoric": aleatoric, "epistemic": epistemic}

    def variance(self, side: str, z: torch.Tensor) -> torch.Tensor:
        u = self.uncertainty(side, z)
        # ProbVLM Eq. 9: sigma_total^2 = sigma_epistemic^2 + sigma_aleatoric^2
        return u["epistemic"] + u["aleatoric"]


class PFEAdapter(nn.Module):
    """Baseline: per modality an MLP z -> log sigma^2 (the same trunk, no dropout); the mean is z itself."""

    def __init__(self, dim: int, hidden: int = 256, logvar_init: float = -5.0):
        super().__init__()
        for side in SIDES:
            head = nn.Linear(hidden, dim)
            nn.init.normal_(head.weight, std=1e-3)
            nn.init.constant_(head.bias, logvar_init)
            self.add_module(side, nn.ModuleDict({"trunk": Hidden([dim, hidden, hidden], 0.0), "logvar": head}))

    def logvar(self, side: str, z: torch.Tensor) -> torch.Tensor:
        head = getattr(self, side)
        return head["logvar"](head["trunk"](z))

    def forward(self, image_z: torch.Tensor, text_z: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"image_mu": image_z, "image_logvar": self.logvar("image", image_z),
                "text_mu": text_z, "text_logvar": self.logvar("text", text_z)}

    def variance(self, side: str, z: torch.Tensor) -> torch.Tensor:
        return self.logvar(side, z).exp()


@dataclass(frozen=True)
class AdapterKind:
    """An adapter head as the adapt stage builds, trains, tags and saves it.

    module: built as ``module(dim, **options)`` (dim: the source's embedding width); loss: the registry loss it trains
    with (models.losses); options: the ``adapter`` config fields its constructor takes (a saved model records them);
    method: the MLflow tag. The adapt config's ``loss`` section (name and params) is the ``adapter`` head's."""

    module: type[nn.Module]
    loss: str
    options: tuple[str, ...] = ("hidden",)
    method: str = ""


ADAPTERS: dict[str, AdapterKind] = {}


def register_adapter(head: str, kind: AdapterKind) -> None:
    """A new adapter head: its module and loss classes plus this one call. It becomes ``adapter.head`` /
    ``adapter.baseline`` in the adapt config and the registry model ``{head}_adapter``."""
    if head in ADAPTERS:
        raise ValueError(f"adapter head {head!r} registered twice")
    ADAPTERS[head] = kind


register_adapter("probvlm", AdapterKind(ProbVLMAdapter, "probvlm", ("hidden", "dropout", "mc_samples", "mc_seed"),
                                        method="probvlm"))
register_adapter("pfe", AdapterKind(PFEAdapter, "pfe_mls", ("hidden",), method="pfe_mls"))


def adapter_kind(head: str) -> AdapterKind:
    if head not in ADAPTERS:
        raise ValueError(f"unknown adapter head {head!r}; known: {', '.join(ADAPTERS)}")
    return ADAPTERS[head]


def adapter_model_name(head: str) -> str:
    """The registry name of a source model with this adapter head (models.registry registers one per head)."""
    adapter_kind(head)
    return f"{head}_adapter"


def adapter_options(head: str, config: Any) -> dict[str, Any]:
    """The constructor options of `head` read from `config` (the adapt config's ``adapter`` section)."""
    return {k: getattr(config, k) for k in adapter_kind(head).options}


def build_adapter(head: str, dim: int, **options: Any) -> nn.Module:
    kind = adapter_kind(head)
    unknown = sorted(set(options) - set(kind.options))
    if unknown:
        raise ValueError(f"adapter head {head!r} takes {', '.join(kind.options)}; not {', '.join(unknown)}")
    return kind.module(dim, **options)


def source_problem(model: nn.Module, name: str) -> str | None:
    """Why `model` cannot be a ProbVLM source (None when it can): it must give one deterministic embedding."""
    if getattr(model, "probabilistic", False):
        return (f"{name} is probabilistic (it already outputs sigma^2); the ProbVLM adapter learns uncertainty "
                "for a deterministic model (clip_*, siglip_*)")
    if getattr(model, "mixture_tokens", None) is not None:
        return (f"{name} scores pairs by Llip's contextualised mixture tokens, not by one embedding per input; "
                "the adapter supports deterministic single-embedding models (clip_*, siglip_*)")
    if not isinstance(getattr(model, "image_proj", None), nn.Linear):
        return f"{name} has no image_proj: not a dual encoder with one embedding per input"
    return None


def embedding_width(model: nn.Module) -> int:
    return model.image_proj.out_features


class AdaptedModel(nn.Module):
    """Frozen source model + adapter: a probabilistic model (mu = frozen embedding, logvar = log total variance)."""

    probabilistic = True

    def __init__(self, source_model: nn.Module, *, source: str, source_overrides: dict | None = None,
                 head: str = "probvlm", scoring: str = "cosine", **adapter: Any):
        """`source_model`: the registry model `source` built with `source_overrides` (the registry builds it);
        `adapter`: the head's options (``AdapterKind.options``); the keywords are what a model file records to
        rebuild this model."""
        super().__init__()
        if scoring not in ("cosine", "csd"):
            raise ValueError(f"scoring must be 'cosine' or 'csd', got {scoring!r}")
        self.scoring = scoring
        self.source = source_model
        problem = source_problem(self.source, source)
        if problem:
            raise ValueError(problem)
        self.source.requires_grad_(False)
        self.source.eval()
        self.adapter = build_adapter(head, embedding_width(self.source), **adapter)
        self.context_length, self.img_size = self.source.context_length, self.source.img_size

    def train(self, mode: bool = True) -> "AdaptedModel":
        super().train(mode)
        self.source.eval()  # frozen: never in training mode
        return self

    def adapt(self, side: str, source_out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The source model's outputs for one modality -> this model's mu and logvar."""
        z = source_out["mu"].float()
        return {"mu": z, "logvar": self.adapter.variance(side, z).log()}

    def encode_image(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            out = self.source.encode_image(images)
        return self.adapt("image", out)

    def encode_text(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            out = self.source.encode_text(tokens)
        return self.adapt("text", out)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, world=None) -> dict[str, torch.Tensor]:
        """The adapter's training outputs on a batch of pairs (the source runs without gradient)."""
        with torch.no_grad():
            zi, zt = self.source.encode_image(images)["mu"].float(), self.source.encode_text(tokens)["mu"].float()
        return self.adapter(zi, zt)

    @staticmethod
    def class_embeddings(template_out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return prompt_ensemble(template_out)

    def class_scores(self, image_out: dict[str, torch.Tensor], class_out: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.scoring == "csd":
            return negative_csd(image_out, class_out)
        return image_out["mu"].float() @ class_out["mu"].float().T
