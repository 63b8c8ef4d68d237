"""The MLflow pyfunc of a model file (models/serving.py) against the PyTorch module it wraps, in process and as
`mlflow models serve` serves the session CLIP's logged model over HTTP on 127.0.0.1."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from models import create_model
from models.model_file import save_model
from models.preprocess import encode_png, encoded_to_model_input, to_model_input
from models.tokenizer import tokenize
from pipelines.tracking import save_mlflow_model

from tests.pace import scaled


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


# ------------------------------------------------------------------------------------------ served over HTTP
@pytest.fixture(scope="module")
def served(trained_clip, digits_root, tmp_path_factory):
    """`mlflow models serve` of the session CLIP's logged model on 127.0.0.1 (the model's own code, in its own
    process): (invocations URL, the module it serves loaded here, four held-out digit images as stored)."""
    import os
    import subprocess
    import sys

    import mlflow.artifacts

    from models.model_file import load_model
    from pipelines.data.reader import shard_paths
    from pipelines.data.tars import iter_tar_samples
    from pipelines.tracking import model_file
    from tests.helpers import free_port, wait_http

    _, result, _ = trained_clip
    tmp = tmp_path_factory.mktemp("served")
    uri = f"runs:/{result.mlflow_run_id}/model"
    folder = mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp / "here"), tracking_uri=result.mlflow_uri)
    model = load_model(model_file(Path(folder)))
    samples = list(iter_tar_samples(shard_paths(f"{digits_root}/eval/retrieval", "test"), limit=4))
    images = [next(s[k] for k in ("jpg", "png", "webp") if k in s) for s in samples]
    port = free_port()
    # the environment's bin/ first, as an activated environment has it: the server runs its `uvicorn`
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "MLFLOW_TRACKING_URI": result.mlflow_uri, "OMP_NUM_THREADS": "1"}
    with (tmp / "serve.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", uri, "--env-manager", "local",
                                 "-h", "127.0.0.1", "-p", str(port), "-w", "1"], cwd=tmp, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_http(f"http://127.0.0.1:{port}/ping", proc, timeout=180)
        except (RuntimeError, TimeoutError) as err:
            raise AssertionError(f"{err}: {(tmp / 'serve.log').read_text()[-3000:]}") from None
        yield f"http://127.0.0.1:{port}/invocations", model, images
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        proc.wait(timeout=scaled(60))


def _post(url: str, body: dict) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=scaled(120)) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def test_served_model_answers_mixed_image_only_and_caption_only_requests(served):
    """The README's predict example over REST (dataframe_split, images and captions row by row, None where a row
    has none), images alone and captions alone (dataframe_records): the module's mu for each row, None elsewhere."""
    url, model, images = served
    captions = ["a photo of the digit 7", "a handwritten three", "zero"]
    with torch.no_grad():
        image_mu = model.encode_image(torch.from_numpy(encoded_to_model_input(images, model.img_size)))["mu"]
        text_mu = model.encode_text(tokenize(captions, model.context_length))["mu"]
    mixed = [[_b64(images[0]), None], [None, captions[0]], [_b64(images[1]), None], [None, captions[1]]]
    status, got = _post(url, {"dataframe_split": {"columns": ["image", "caption"], "data": mixed}})
    assert status == 200, got
    rows = got["predictions"]
    assert len(rows) == 4 and all(set(r) == {"image_mu", "text_mu"} for r in rows)
    torch.testing.assert_close(torch.tensor([rows[0]["image_mu"], rows[2]["image_mu"]]), image_mu[:2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor([rows[1]["text_mu"], rows[3]["text_mu"]]), text_mu[:2], atol=1e-5, rtol=1e-5)
    assert [rows[i]["text_mu"] for i in (0, 2)] == [None, None] and [rows[i]["image_mu"] for i in (1, 3)] == [None, None]

    status, got = _post(url, {"dataframe_records": [{"image": _b64(b)} for b in images]})
    assert status == 200, got
    torch.testing.assert_close(torch.tensor([r["image_mu"] for r in got["predictions"]]), image_mu, atol=1e-5, rtol=1e-5)
    status, got = _post(url, {"dataframe_records": [{"caption": c} for c in captions]})
    assert status == 200, got
    torch.testing.assert_close(torch.tensor([r["text_mu"] for r in got["predictions"]]), text_mu, atol=1e-5, rtol=1e-5)


def test_served_model_names_the_bad_row_and_why(served):
    """A truncated JPEG in row 2, a non-base64 text in row 1: HTTP 400 naming the row and the reason."""
    url, _, images = served
    import cv2

    ok, jpeg = cv2.imencode(".jpg", cv2.imdecode(np.frombuffer(images[0], np.uint8), cv2.IMREAD_COLOR))
    assert ok
    truncated = jpeg.tobytes()[: len(jpeg) // 2]  # a JPEG cut short
    rows = [[_b64(images[0]), None], [None, "a one"], [_b64(truncated), None]]
    status, got = _post(url, {"dataframe_split": {"columns": ["image", "caption"], "data": rows}})
    assert status == 400 and got["error_code"] == "INVALID_PARAMETER_VALUE", got
    assert "row 2: image cannot be decoded (truncated JPEG" in got["message"], got["message"][-500:]
    status, got = _post(url, {"dataframe_records": [{"image": _b64(images[0])}, {"image": "not an image!"}]})
    assert status == 400 and "row 1: image is text but not base64" in got["message"], got["message"][-500:]
