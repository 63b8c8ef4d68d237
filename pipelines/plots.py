"""Uncertainty plots logged with a run: histograms of sigma^2 per modality."""
from __future__ import annotations

from pathlib import Path

import torch

from models.zeroshot import encode_texts


@torch.no_grad()
def sigma2_histograms(model: torch.nn.Module, ds, prompts: list[list[str]], folder: Path,
                      max_images: int = 1024) -> list[Path]:
    """Mean sigma^2 per image (eval split) and per prompt; nothing for deterministic models."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    image_var = []
    for batch in ds.iter_torch_batches(batch_size=256):
        out = model.encode_image(batch["image"])
        if "logvar" not in out:
            return []
        image_var.append(out["logvar"].exp().mean(dim=-1))
        if sum(len(v) for v in image_var) >= max_images:
            break
    text_var = encode_texts(model, [p for per_class in prompts for p in per_class])["logvar"].exp().mean(dim=-1)
    path = folder / "sigma2_hist.png"
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in (("images", torch.cat(image_var)), ("prompts", text_var)):
        ax.hist(values.float().numpy(), bins=40, alpha=0.6, label=f"{name} (mean {values.mean():.2e})")
    ax.set_xlabel("mean sigma^2 over dimensions")
    ax.set_ylabel("count")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
