"""Driver side of pretraining: data, MLflow run, Ray Train TorchTrainer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.config import Config
from pipelines.tracking import finish_run, git_commit, start_run, tracking_uri


@dataclass
class FitResult:
    metrics: dict[str, Any]
    mlflow_uri: str
    mlflow_run_id: str
    experiment: str


def prepare_data(cfg: Config) -> None:
    if cfg.data.source == "digits":
        from pipelines.digits import write_digit_shards

        write_digit_shards(cfg.data.root, image_size=cfg.data.image_size, shard_size=cfg.data.shard_size,
                           seed=cfg.run.seed)


def build_datasets(cfg: Config, context_length: int) -> dict[str, Any]:
    from pipelines.reader import read_split

    common = dict(root=cfg.data.root, image_size=cfg.data.image_size, context_length=context_length)
    return {
        "train": read_split(split="train", mid_prob=cfg.data.mid_caption_prob,
                            general_prob=cfg.data.general_caption_prob, **common),
        "eval": read_split(split=cfg.eval.split, **common),
    }


def fit(cfg: Config) -> FitResult:
    import ray.train
    from ray.train.torch import TorchTrainer

    from models import create_model
    from pipelines.ray_env import init_ray, local_cpus
    from pipelines.train_loop import train_loop

    prepare_data(cfg)
    t = cfg.train
    init_ray(cfg.ray.address, cfg.ray.num_cpus or local_cpus(t.num_workers, t.cpus_per_worker))
    context_length = create_model(cfg.model.name, **cfg.model.overrides).context_length
    uri = tracking_uri(cfg.tracking.uri)
    tags = {"probvlp.model": cfg.model.name, "probvlp.loss": cfg.loss.name or "", "mlflow.source.git.commit": git_commit() or ""}
    run_id = start_run(uri, cfg.run.experiment, cfg.run.name, cfg.flat(), cfg.to_yaml(), tags)
    resources = {"CPU": t.cpus_per_worker} if not t.use_gpu else None
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"config": cfg.to_dict(), "mlflow_run_id": run_id, "mlflow_uri": uri},
        scaling_config=ray.train.ScalingConfig(num_workers=t.num_workers, use_gpu=t.use_gpu,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(name=cfg.run.name, storage_path=_storage(cfg.run.storage_path)),
        datasets=build_datasets(cfg, context_length),
        dataset_config=ray.train.DataConfig(datasets_to_split=["train"]),
    )
    try:
        result = trainer.fit()
    except BaseException:
        finish_run(uri, run_id, "FAILED")
        raise
    finish_run(uri, run_id)
    return FitResult(dict(result.metrics or {}), uri, run_id, cfg.run.experiment)


def _storage(path: str) -> str:
    return path if "://" in path else str(Path(path).expanduser().resolve())
