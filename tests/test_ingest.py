"""The training data path end to end: a short run whose augmentation runs on the worker's device (here its CPU) from
uint8 images, with the wait for data logged; where data.augment_on resolves to."""
from __future__ import annotations

from mlflow import MlflowClient

from pipelines.config import Config
from pipelines.data.reader import train_options
from pipelines.train.driver import fit
from tests.small_runs import config


def test_where_the_augmentation_runs():
    def where(**data) -> str:
        cfg = Config.from_dict({"data": data, "train": {"use_gpu": data.pop("gpu", False)}})
        return train_options(cfg)["augment_on"]

    assert where() == "reader" and where(gpu=True) == "device"  # auto: the GPU when there is one
    assert where(augment_on="device") == "device" and where(augment_on="reader", gpu=True) == "reader"
    assert train_options(Config())["uint8"]


def test_a_run_augmenting_on_the_device_logs_its_data_wait(ray_local, digits_root, tmp_path):
    result = fit(config(tmp_path, digits_root, "device-augment", "train.steps=6", "train.log_every=2",
                        "data.augment=true", "data.augment_on=device", "data.decode_size=40", "data.prefetch_batches=2",
                        "data.flip_prob=0.5"))
    assert result.metrics["step"] == 6
    run = MlflowClient(result.mlflow_uri).get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.params["data.augment_on"] == "device"
    assert 0 <= run.data.metrics["data_wait_frac"] <= 1 and run.data.metrics["data_wait_ms"] >= 0
    assert 0 < result.metrics["data_wait_frac_mean"] < 1
    losses = MlflowClient(result.mlflow_uri).get_metric_history(result.mlflow_run_id, "loss")
    assert [m.step for m in losses] == [2, 4, 6] and all(m.value == m.value for m in losses)
