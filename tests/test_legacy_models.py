"""Models saved by an earlier tree still load: tests/data/legacy holds a model file inside its MLflow model
folder, written by `tests/make_legacy_models.py` at commit c85c55a (before the pipelines/ and models/ packages
were regrouped), with the embeddings it gave then."""
from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from models.model_file import load_model
from models.serving import EmbeddingModel
from pipelines.tracking import model_file
from tests.pace import scaled

LEGACY = Path(__file__).parent / "data" / "legacy"


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads((LEGACY / "expected.json").read_text())


def _close(got: dict, expected: dict) -> None:
    for key in ("image_mu", "text_mu", "image_sigma2", "text_sigma2"):
        np.testing.assert_allclose(np.asarray(got[key], dtype=np.float64), expected[key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)


def test_model_file_from_before_loads_and_embeds_as_it_did(expected):
    model = load_model(model_file(LEGACY / "mlflow_model"))
    assert model.probabilistic
    image = (LEGACY / "image.png").read_bytes()
    got = EmbeddingModel(model).embed([image], [expected["caption"]])
    _close({k: v[0] for k, v in got.items()}, expected)


PREDICT = """
import json, sys
import mlflow.pyfunc, pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[1])
frame = model.predict(pd.DataFrame({"image": [open(sys.argv[2], "rb").read()], "caption": [sys.argv[3]]}))
import models
print(json.dumps({"models_from": models.__file__, **frame.iloc[0].to_dict()}))
"""


def test_mlflow_model_from_before_loads_and_predicts_as_it_did(expected, tmp_path):
    """In a fresh Python outside the checkout, so that the model's archived code (its own `code/models/`) is what
    runs: in this process `models.serving` is already imported from the tree and MLflow would reuse it."""
    import subprocess
    import sys

    folder = tmp_path / "model"
    shutil.copytree(LEGACY / "mlflow_model", folder)
    with tarfile.open(LEGACY / "mlflow_model_code.tar.gz") as tar:
        tar.extractall(folder, filter="data")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PREDICT, str(folder), str(LEGACY / "image.png"), expected["caption"]],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got.pop("models_from") == str(folder / "code" / "models" / "__init__.py")
    _close(got, expected)
