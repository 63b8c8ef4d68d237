"""The trained model as rank 0 saves it to the run: the model file inside an MLflow model, the loss weights, the
embedding probe and the model card."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from models.model_file import save_model
from models.preprocess import encode_png
from pipelines.pretrain.config import TrainDocument
from pipelines.pretrain.model_card import model_card

EXAMPLE_CAPTION = "a photo of a dog"


def save_trained_model(logger, cfg: TrainDocument, model: torch.nn.Module, weights: dict[str, torch.Tensor],
                       loss_weights: dict[str, torch.Tensor], probe: dict[str, torch.Tensor] | None,
                       folder: Path) -> None:
    """The MLflow model (MLmodel, code/, data/model.safetensors) as the run's `model` folder, the loss weights and
    the probe (where there is one) beside it; its input example is the probe's first image, else a grey one."""
    host = {k: v.cpu() for k, v in weights.items()}
    save_model(host, folder / "model.safetensors", cfg.model.name, cfg.model.overrides)
    if probe is not None:
        example = probe["images"][0].numpy()
    else:
        example = np.zeros((3, model.img_size, model.img_size), np.float32)
    from pipelines.tracking import save_mlflow_model  # deferred: MLflow in rank 0's process only

    save_mlflow_model(folder / "model.safetensors", folder / "mlflow_model", encode_png(example), EXAMPLE_CAPTION,
                      model.probabilistic)
    logger.artifacts(folder / "mlflow_model", "model")
    save_file({k: v.cpu().contiguous() for k, v in loss_weights.items()}, str(folder / "loss.safetensors"))
    logger.artifact(folder / "loss.safetensors", "model")
    if probe is not None:
        save_file(probe, str(folder / "probe.safetensors"))
        logger.artifact(folder / "probe.safetensors", "model")


def save_model_card(logger, cfg: TrainDocument, metrics: dict[str, Any], step: int, folder: Path) -> None:
    """model/README.md: the card, with the final metrics (none where the final evaluation failed)."""
    (folder / "README.md").write_text(model_card(cfg, metrics, step))
    logger.artifact(folder / "README.md", "model")
