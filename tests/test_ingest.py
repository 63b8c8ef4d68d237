"""Where data.augment_on resolves to. A run augmenting on the device: tests/test_user_data.py's ZeRO-3 run."""
from __future__ import annotations

from pipelines.config import Config
from pipelines.data.reader import train_options


def test_where_the_augmentation_runs():
    def where(**data) -> str:
        cfg = Config.from_dict({"data": data, "train": {"use_gpu": data.pop("gpu", False)}})
        return train_options(cfg)["augment_on"]

    assert where() == "reader" and where(gpu=True) == "device"  # auto: the GPU when there is one
    assert where(augment_on="device") == "device" and where(augment_on="reader", gpu=True) == "reader"
    assert train_options(Config())["uint8"]
