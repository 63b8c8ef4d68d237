"""Llip (Lavoie et al. 2024, arXiv:2405.00740): K visual mixture tokens mixed per caption by a text-conditioned cross-attention.

The image tower carries K learnable mixture tokens instead of [CLS]; their outputs, projected to
the embedding width, are the keys and values of ``models.llip_mixer.LlipMixer`` (8 heads, temperature
tau, output projection), whose queries are the captions' embeddings (Eq. 1-2). The forward computes
the contextualised cosines of the local images against the captions of ALL workers
(``world.gather``, with gradient) inside the module's forward (``pair_out``), as ZeRO-3 requires, for the
sigmoid loss (Eq. 3). Zero-shot contextualises every image with each class's template-averaged query.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.accumulate import SplitForward
from models.gather import World
from models.llip_mixer import LlipMixer
from models.towers import TowerConfig


class Llip(SplitForward, nn.Module):
    """Options (paper defaults first; official Llip's second, docs/FIDELITY.md):
    kv_proj "shared" (one K and one V projection of the projected mixture tokens) | "per_token" (a K and
    a V projection per mixture token, from the image tower's outputs); query_from "embedding" (the
    normalised caption embedding) | "hidden" (the text tower's pooled hidden state, before text_proj);
    zeroshot_query "mean_embedding" (the query of the class's renormalised mean template embedding) |
    "mean_query" (the mean of the templates' queries; the only choice with query_from "hidden").
    """

    # encode_* return mu (and the mixture tokens); scored by the contextualised cosine
    probabilistic = False

    def __init__(self, towers: TowerConfig = TowerConfig(), *, mixture_tokens: int = 64, mixer_heads: int = 8,
                 tau: float = 5.0, kv_proj: Literal["shared", "per_token"] = "shared",
                 query_from: Literal["embedding", "hidden"] = "embedding",
                 zeroshot_query: Literal["mean_embedding", "mean_query"] = "mean_embedding"):
        super().__init__()
        if mixture_tokens < 1:
            raise ValueError("mixture_tokens must be >= 1")
        if kv_proj not in ("shared", "per_token") or query_from not in ("embedding", "hidden") \
                or zeroshot_query not in ("mean_embedding", "mean_query"):
            raise ValueError("kv_proj: shared | per_token, query_from: embedding | hidden, "
                             "zeroshot_query: mean_embedding | mean_query")
        if query_from == "hidden" and zeroshot_query != "mean_query":
            raise ValueError("query_from 'hidden' needs zeroshot_query 'mean_query' (a hidden state is no embedding)")
        self.visual = towers.image_tower(extra_tokens=mixture_tokens, class_token=False)
        self.text = towers.text_tower()
        self.image_proj, self.text_proj = towers.projections()
        per_token = kv_proj == "per_token"
        self.mixer = LlipMixer(towers.embed_dim, heads=mixer_heads, tau=tau,
                               query_dim=towers.text_width if query_from == "hidden" else None,
                               kv_tokens=mixture_tokens if per_token else 0,
                               kv_dim=towers.vision_width if per_token else None)
        self.context_length, self.img_size, self.mixture_tokens = towers.context_length, towers.img_size, mixture_tokens
        self.kv_proj, self.query_from, self.zeroshot_query = kv_proj, query_from, zeroshot_query

    def encode_image(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """"mix": (B, K, width) the mixer's input (projected mixture tokens, or the tower's outputs for
        per-token K/V); "mu": the normalised mean of the projected tokens (uncontextualised summary)."""
        tokens = self.visual(images)[:, : self.mixture_tokens]
        projected = self.image_proj(tokens)
        mix = projected if self.kv_proj == "shared" else tokens
        return {"mu": F.normalize(projected.mean(dim=1), dim=-1), "mix": mix}

    def encode_text(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """"mu": the normalised caption embedding; with query_from "hidden" also "query": the pooled hidden state."""
        x = self.text(tokens)
        pooled = x[torch.arange(x.shape[0], device=x.device), self.text.eot_index(tokens)]
        out = {"mu": F.normalize(self.text_proj(pooled), dim=-1)}
        if self.query_from == "hidden":
            out["query"] = pooled
        return out

    def query(self, text_out: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mixer's query input for these text outputs (captions or classes)."""
        if self.query_from == "hidden" and "query" not in text_out:
            raise KeyError("Llip with query_from 'hidden' needs the text outputs' 'query' (encode_text's hidden state)")
        return text_out.get("query", text_out["mu"])

    def pair_cos(self, mix: torch.Tensor, text_out: dict[str, torch.Tensor], world: World) -> torch.Tensor:
        """(B_local, N_global) contextualised cosines; the captions are gathered from every worker."""
        text_all = world.gather(text_out["mu"])
        query_all = world.gather(text_out["query"]) if self.query_from == "hidden" else text_all
        return self.mixer(mix, query_all, text_all)

    def features(self, images: torch.Tensor, tokens: torch.Tensor, draws: dict) -> dict[str, torch.Tensor]:
        """Per sample: image_mu, image_mix (the mixer's input), text_mu (and text_query with query_from "hidden")."""
        txt = self.encode_text(tokens)  # first: its padding trim reads the batch's length on the host
        img = self.encode_image(images)  # (on a GPU, before the image tower's work is queued)
        return {"image_mu": img["mu"], "image_mix": img["mix"], **{f"text_{k}": v for k, v in txt.items()}}

    def pair_out(self, features: dict[str, torch.Tensor], world: World) -> dict[str, torch.Tensor]:
        """The contextualised cosines of the local images against every worker's captions, with the mixer."""
        text = {"mu": features["text_mu"], **({"query": features["text_query"]} if "text_query" in features else {})}
        return {**features, "pair_cos": self.pair_cos(features["image_mix"], text, world)}

    def class_embeddings(self, template_out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per class: "mu", the renormalised mean template embedding (the contextualisation's target), and
        with zeroshot_query "mean_query" a "query": the templates' mean query input (W_Q is linear, so the
        mean of the queries is W_Q of the mean)."""
        # Llip Sec. 5 (zero-shot): class prompts averaged; official code averages the template queries
        at_least_f32 = lambda t: t if t.dtype == torch.float64 else t.float()  # noqa: E731
        out = {"mu": F.normalize(at_least_f32(template_out["mu"]).mean(dim=1), dim=-1)}
        if self.zeroshot_query == "mean_query":
            out["query"] = at_least_f32(template_out["query" if self.query_from == "hidden" else "mu"]).mean(dim=1)
        return out

    def class_scores(self, image_out: dict[str, torch.Tensor], class_out: dict[str, torch.Tensor]) -> torch.Tensor:
        """(N, C) cosines of each image contextualised by each class's query (Llip Sec. 5, zero-shot)."""
        return self.mixer(image_out["mix"], self.query(class_out), class_out["mu"])
