"""A model as MLflow keeps it: the pyfunc folder rank 0 saves (served by models/serving.py), the weights file in it, and
the model an evaluation or the adapter reads (a file, a run's model)."""
from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from mlflow.artifacts import download_artifacts

import models
from pipelines.tracking.store import hide_credentials


def _requirement(package: str) -> str:
    try:
        return f"{package}=={version(package).split('+')[0]}"
    except PackageNotFoundError:
        return package


SERVING_REQUIREMENTS = ("torch", "numpy", "pandas", "safetensors", "open_clip_torch", "opencv-python-headless")


def save_mlflow_model(model_file: Path, dst: Path, example_image: bytes, example_caption: str,
                      probabilistic: bool) -> Path:
    """An MLflow pyfunc model folder for a probvlp model file (models/serving.py), with its code, signature,
    input example and pip requirements; log it with `StepLogger.artifacts(dst, "model")`."""
    # deferred: mlflow.pyfunc and pandas load only where a model is saved (rank 0, once per run)
    import mlflow.pyfunc
    import pandas as pd
    from mlflow.models import ModelSignature
    from mlflow.types import DataType
    from mlflow.types.schema import AnyType, Array, ColSpec, Schema

    outputs = ["image_mu", "text_mu"] + (["image_sigma2", "text_sigma2"] if probabilistic else [])
    # image untyped: encoded bytes, or base64 text over REST. MLflow's scoring server decodes a `binary` column
    # itself and fails on a None row (a request mixing images and captions); models/serving.py decodes instead
    signature = ModelSignature(
        inputs=Schema([ColSpec(AnyType(), "image", required=False),
                       ColSpec(DataType.string, "caption", required=False)]),
        outputs=Schema([ColSpec(Array(DataType.float), name, required=False) for name in outputs]))
    mlflow.pyfunc.save_model(
        path=str(dst), loader_module="models.serving", data_path=str(model_file),
        code_paths=[str(Path(models.__file__).parent)], signature=signature,
        input_example=pd.DataFrame({"image": [example_image], "caption": [example_caption]}),
        pip_requirements=[_requirement(p) for p in SERVING_REQUIREMENTS])
    return dst


def model_file(folder: Path) -> Path:
    """The probvlp weights file inside a downloaded `model` artifact folder (the MLflow model's data)."""
    return folder / "data" / "model.safetensors"


def resolve_model(source: str, uri: str, dst: str | Path) -> dict[str, Any]:
    """A model to evaluate: a .safetensors file, `runs:/<run_id>/model`, or a run id.

    Returns {"model": path, "loss": path or None (loss.safetensors beside the model), "run_id": source run
    or None, "config": the source run's config.yaml text or None}."""
    path = Path(source)
    if path.is_file():
        # beside the weights, or, for the weights of a downloaded MLflow model (<model>/data/), in <model>/
        beside = [path.with_name("loss.safetensors")]
        if (path.parent.parent / "MLmodel").is_file():
            beside.append(path.parent.parent / "loss.safetensors")
        loss = next((p for p in beside if p.is_file()), None)
        return {"model": path, "loss": loss, "run_id": None, "config": None}
    run_id = source[len("runs:/"):].split("/")[0] if source.startswith("runs:/") else source
    if not re.fullmatch(r"[0-9a-f]{32}", run_id):
        raise ValueError(f"--model {source!r}: not a file, runs:/<run_id>/model, or an MLflow run id")
    try:
        folder = Path(download_artifacts(run_id=run_id, artifact_path="model", dst_path=str(dst), tracking_uri=uri))
        config = Path(download_artifacts(run_id=run_id, artifact_path="config.yaml", dst_path=str(dst),
                                         tracking_uri=uri)).read_text()
    except Exception as err:  # noqa: BLE001 - MLflow raises several kinds for a missing run or artifact
        raise ValueError(hide_credentials(f"--model {source!r}: cannot read the run's model from {uri} "
                                          f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
                         ) from None
    if not model_file(folder).is_file():
        raise ValueError(f"--model {source!r}: the run has no model/data/model.safetensors (did it finish?)")
    loss = folder / "loss.safetensors"
    return {"model": model_file(folder), "loss": loss if loss.is_file() else None, "run_id": run_id,
            "config": config}
