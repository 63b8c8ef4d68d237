"""Where data.augment_on resolves to, and that either place gives the same training images from the same draws.
A Ray run augmenting on the device: tests/test_user_data.py's ZeRO-3 run."""
from __future__ import annotations

import json

import numpy as np
import torch

from models.preprocess import to_model_input
from pipelines.pretrain.config import TrainDocument
from pipelines.data.device_augment import augment
from pipelines.data.reader import Preprocess, train_options
from tests.test_device_augment import photos

SIZE = 48  # photos() are 56 px: the device path's decode size for 48 is 55, so both places crop nearly the same pixels


def where(**data) -> str:
    cfg = TrainDocument.from_dict({"data": data, "train": {"use_gpu": data.pop("gpu", False)}})
    return train_options(cfg)["augment_on"]


def test_where_the_augmentation_runs():
    assert where() == "reader" and where(gpu=True) == "device"  # auto: the GPU when there is one
    assert where(augment_on="device") == "device" and where(augment_on="reader", gpu=True) == "reader"
    assert train_options(TrainDocument())["uint8"]


def test_both_places_give_the_same_training_images():
    """The reader's batches under each resolved option (no Ray: the map function itself): on the CPU the images come
    augmented, on a GPU machine unaugmented at the decode size with the drawn parameters, which the worker applies;
    from the same seed both give the same images (up to uint8 rounding and the device's resampling)."""
    import cv2

    images = photos(32)
    raw = {"__key__": np.array([f"{i:06d}" for i in range(32)]),
           "png": [cv2.imencode(".png", cv2.cvtColor(im, cv2.COLOR_RGB2BGR))[1].tobytes() for im in images],
           "txt": [f"caption {i}".encode() for i in range(32)], "json": [json.dumps({"label": 1}).encode()] * 32}
    out = {}
    for gpu in (False, True):
        options = train_options(TrainDocument.from_dict({"train": {"use_gpu": gpu}}))
        out[options["augment_on"]] = Preprocess(SIZE, 16, seed=0, augment=True, **options)(dict(raw))
    reader, device = out["reader"], out["device"]
    assert reader["image"].shape == (32, SIZE, SIZE, 3) and "augment" not in reader
    assert device["image"].shape == (32, 55, 55, 3) and device["augment"].shape[0] == 32
    on_reader = to_model_input(reader["image"])
    on_device = augment(torch.from_numpy(device["image"]), torch.from_numpy(device["augment"]), SIZE).numpy()
    diff = np.abs(on_device - on_reader).mean(axis=(1, 2, 3))
    plain = np.abs(to_model_input(np.stack([cv2.resize(im, (SIZE, SIZE)) for im in images])) - on_reader).mean(axis=(1, 2, 3))
    print(f"device vs reader: mean |diff| {diff.mean():.4f} (max {diff.max():.4f}); unaugmented vs reader {plain.mean():.4f}")
    assert diff.max() < 0.02 and np.median(plain) > 0.05
