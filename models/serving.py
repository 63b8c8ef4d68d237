"""A probvlp model file as an MLflow pyfunc: encoded images and/or captions in, mu and sigma^2 out.

MLflow imports this module from the model's own `code/` folder (`loader_module`), so a logged model
loads with `mlflow.pyfunc.load_model("runs:/<id>/model")` in any Python that has torch, opencv,
open_clip and safetensors, without this project installed. Nothing is unpickled: the weights are a
safetensors file and the model is rebuilt from the registry.

Input: a DataFrame with an `image` column (encoded JPEG / PNG / WebP: bytes, or their base64 text, which is
what a JSON request to `mlflow models serve` carries) and / or a `caption` column (str); a row may leave either
empty (None). Output: one row per input row with `image_mu`, `text_mu` (lists of floats, L2-normalised) and, for
probabilistic models, `image_sigma2` and `text_sigma2` (per-dimension variances); None where the row had no such
input. A row that cannot be read fails the request with its index and the reason.
"""
from __future__ import annotations

import base64
import binascii
from pathlib import Path

import numpy as np
import torch

from models.model_file import load_model
from models.preprocess import decode_image, resize, to_model_input
from models.tokenizer import tokenize

WEIGHTS = "model.safetensors"


def _present(values) -> list[int]:
    return [i for i, v in enumerate(values) if v is not None and not (isinstance(v, float) and np.isnan(v))]


class RowError(ValueError):
    """An input row the model cannot read: its index (the DataFrame's label) and why."""


def _image(value, size: int, row) -> np.ndarray:
    """One row's image, decoded and resized: bytes as they are, text as base64 (the scoring server passes a JSON
    request's strings through unchanged: the signature's image column is untyped so that None rows reach here)."""
    if isinstance(value, str):
        try:
            value = base64.b64decode(value, validate=False)
        except (binascii.Error, ValueError) as err:
            raise RowError(f"row {row}: image is text but not base64 ({err})") from None
    elif not isinstance(value, (bytes, bytearray, memoryview)):
        raise RowError(f"row {row}: image must be encoded bytes or base64 text, got {type(value).__name__}")
    try:
        return resize(decode_image(bytes(value)), size)
    except ValueError as err:
        raise RowError(f"row {row}: image cannot be decoded ({err})") from None


class EmbeddingModel:
    """What `mlflow.pyfunc.load_model` returns (wrapped in MLflow's PyFuncModel)."""

    def __init__(self, model: torch.nn.Module, batch_size: int = 64):
        self.model, self.batch_size = model.eval(), batch_size

    @property
    def columns(self) -> list[str]:
        names = ["image_mu", "text_mu"]
        return names + (["image_sigma2", "text_sigma2"] if self.model.probabilistic else [])

    @torch.no_grad()
    def _encode(self, encode, inputs: torch.Tensor) -> dict[str, np.ndarray]:
        parts = [encode(inputs[i : i + self.batch_size]) for i in range(0, len(inputs), self.batch_size)]
        out = {"mu": torch.cat([p["mu"] for p in parts]).float().numpy()}
        if self.model.probabilistic:
            out["sigma2"] = torch.cat([p["logvar"] for p in parts]).float().exp().numpy()
        return out

    def embed(self, images: list | None, captions: list | None, labels: list | None = None) -> dict[str, list]:
        """Column name -> one entry per row (a list of floats, or None). `labels` name the rows in errors
        (default: their positions)."""
        n = len(images if images is not None else captions)
        labels = list(range(n)) if labels is None else labels
        out: dict[str, list] = {c: [None] * n for c in self.columns}
        for column, values in (("image", images), ("text", captions)):
            rows = _present(values) if values is not None else []
            if not rows:
                continue
            if column == "image":
                decoded = [_image(values[i], self.model.img_size, labels[i]) for i in rows]
                inputs = torch.from_numpy(to_model_input(decoded))
                result = self._encode(self.model.encode_image, inputs)
            else:
                for i in rows:
                    if not isinstance(values[i], str):
                        raise RowError(f"row {labels[i]}: caption must be text, got {type(values[i]).__name__}")
                inputs = tokenize([values[i] for i in rows], self.model.context_length)
                result = self._encode(self.model.encode_text, inputs)
            for key, array in result.items():
                for row, vector in zip(rows, array):
                    out[f"{column}_{key}"][row] = vector.tolist()
        return out

    def predict(self, model_input, params=None):
        import pandas as pd  # deferred: MLflow's dependency, there where MLflow calls predict; the model needs none

        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        unknown = set(frame.columns) - {"image", "caption"}
        if unknown or frame.empty or not ({"image", "caption"} & set(frame.columns)):
            raise ValueError(f"expected a non-empty DataFrame with columns 'image' (encoded bytes) and / or "
                             f"'caption' (str); got columns {sorted(frame.columns)}")
        images = frame["image"].tolist() if "image" in frame else None
        captions = frame["caption"].tolist() if "caption" in frame else None
        try:
            return pd.DataFrame(self.embed(images, captions, frame.index.tolist()), index=frame.index)
        except RowError as err:
            # MLflow's scoring server answers its own exception with the message and HTTP 400 (any other error
            # becomes a generic "unexpected error"); mlflow is loaded wherever MLflow calls predict
            from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException

            raise MlflowException(str(err), error_code=INVALID_PARAMETER_VALUE) from err


def _load_pyfunc(data_path: str) -> EmbeddingModel:
    """MLflow's entry point for `loader_module` models: `data_path` is the model's weights file or folder."""
    path = Path(data_path)
    return EmbeddingModel(load_model(path / WEIGHTS if path.is_dir() else path))
