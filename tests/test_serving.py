"""The MLflow pyfunc of a model file (models/serving.py) against the PyTorch module it wraps; no Ray."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from models import create_model
from models.model_file import save_model
from models.preprocess import encode_png, encoded_to_model_input, to_model_input
from models.tokenizer import tokenize
from pipelines.tracking import save_mlflow_model


def test_png_round_trip_gives_the_same_model_input():
    rng = np.random.default_rng(0)
    x = to_model_input([(rng.random((32, 32, 3)) * 255).astype(np.uint8) for _ in range(3)])
    back = encoded_to_model_input([encode_png(img) for img in x], 32)
    assert back.dtype == np.float32 and np.array_equal(back, x)


@pytest.mark.parametrize("name", ["prolip_tiny", "clip_tiny"])
def test_pyfunc_gives_the_module_s_mu_and_sigma2(tmp_path, name):
    import mlflow.pyfunc

    torch.manual_seed(0)
    model = create_model(name).eval()
    save_model(model.state_dict(), tmp_path / "model.safetensors", name, {})
    rng = np.random.default_rng(1)
    inputs = to_model_input([(rng.random((32, 32, 3)) * 255).astype(np.uint8) for _ in range(2)])
    pngs = [encode_png(img) for img in inputs]
    folder = save_mlflow_model(tmp_path / "model.safetensors", tmp_path / "served", pngs[0], "a photo of a dog",
                               model.probabilistic)
    served = mlflow.pyfunc.load_model(str(folder))
    captions = ["the digit seven", "a handwritten digit"]
    out = served.predict(pd.DataFrame({"image": pngs + [None, None], "caption": [None, None] + captions}))

    with torch.no_grad():
        image = model.encode_image(torch.from_numpy(inputs))
        text = model.encode_text(tokenize(captions, model.context_length))
    assert torch.allclose(torch.tensor(out["image_mu"][:2].tolist()), image["mu"], atol=1e-5)
    assert torch.allclose(torch.tensor(out["text_mu"][2:].tolist()), text["mu"], atol=1e-5)
    assert out["image_mu"][2] is None and out["text_mu"][0] is None
    if model.probabilistic:
        assert torch.allclose(torch.tensor(out["image_sigma2"][:2].tolist()), image["logvar"].exp(), rtol=1e-5)
        assert torch.allclose(torch.tensor(out["text_sigma2"][2:].tolist()), text["logvar"].exp(), rtol=1e-5)
    else:
        assert "image_sigma2" not in out.columns

    only_captions = served.predict(pd.DataFrame({"caption": captions}))
    assert torch.allclose(torch.tensor(only_captions["text_mu"].tolist()), text["mu"], atol=1e-5)
    with pytest.raises(Exception, match="caption"):
        served.predict(pd.DataFrame({"text": ["a column the model does not take"]}))
