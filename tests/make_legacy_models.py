"""Writes tests/data/legacy/: a tiny ProLIP model file and its MLflow model, saved by the code of the day.

Run once per on-disk format (`python -m tests.make_legacy_models`); tests/test_legacy_models.py checks that
what an earlier tree saved still loads and gives the embeddings it gave then. The weights are random (seeded):
loading is what is tested, not accuracy.
"""
from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import torch

from models import create_model
from models.model_file import save_model
from models.preprocess import encode_png, to_model_input
from models.serving import EmbeddingModel
from pipelines.tracking import save_mlflow_model

FOLDER = Path(__file__).parent / "data" / "legacy"
CAPTION = "a photo of the digit 7"
# narrow towers and bf16 weights keep the files small (the token table is most of a tiny model)
OVERRIDES = {"vision_width": 16, "text_width": 16, "embed_dim": 16}


def example_image() -> bytes:
    rng = np.random.default_rng(0)
    return encode_png(to_model_input([rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)])[0])


def main() -> None:
    torch.manual_seed(0)
    model = create_model("prolip_tiny", **OVERRIDES)
    shutil.rmtree(FOLDER, ignore_errors=True)
    FOLDER.mkdir(parents=True)
    weights = FOLDER / "model.safetensors"
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    save_model(state, weights, "prolip_tiny", OVERRIDES)
    model.load_state_dict(state)
    image = example_image()
    save_mlflow_model(weights, FOLDER / "mlflow_model", image, CAPTION, probabilistic=True)
    weights.unlink()  # the MLflow model's data/model.safetensors is the same file: the model file test reads that
    # the model's own copy of models/ kept as an archive: as source it would read as a second copy of the package
    code = FOLDER / "mlflow_model" / "code"
    with tarfile.open(FOLDER / "mlflow_model_code.tar.gz", "w:gz") as tar:
        tar.add(code, arcname="code", filter=lambda info: None if "__pycache__" in info.name else info)
    shutil.rmtree(code)
    expected = EmbeddingModel(model).embed([image], [CAPTION])
    (FOLDER / "image.png").write_bytes(image)
    (FOLDER / "expected.json").write_text(json.dumps({"caption": CAPTION, **{k: v[0] for k, v in expected.items()}}))


if __name__ == "__main__":
    main()
