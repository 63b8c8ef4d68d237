"""DeepSpeed checkpoints through Ray Train, loaded without unpickling code.

DeepSpeed writes torch pickles and its own loader unpickles them with weights_only=False. We swap
in a checkpoint engine that loads with ``weights_only=True`` and allow-lists only the few plain
DeepSpeed data types those files hold (an enum, the loss-scaler
state and fragment addresses; found by loading stage 0-3 checkpoints, tests/test_scale.py).
"""
from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray.train
from fsspec.implementations.arrow import ArrowFSWrapper

from pipelines.compat.deepspeed_private import use_weights_only_checkpoint_loading
from pipelines.train import reshard

TAG = "state"


def use_weights_only_loading(engine) -> None:
    use_weights_only_checkpoint_loading(engine)


@dataclass
class Progress:
    """Where training stands; saved with every checkpoint. `batch_in_epoch` counts micro-batches."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    samples: int = 0
    skipped_batches: int = 0
    preemptions: int = 0  # notices of preemption the run saved on (pipelines.train.preemption)
    notice_streak: int = 0  # notices saved on in a row at the same step (no step trained between them)
    notice_file_mtime: float = 0.0  # the last notice file a save consumed (a file no newer is not a notice)
    evaluate_at: int = -1  # a notice's save at an evaluation step, before evaluating: a restart there evaluates first


def save(engine, progress: Progress, metrics: dict[str, Any]) -> None:
    """Every rank writes its DeepSpeed shard; Ray Train merges the ranks' files into one checkpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(tmp, tag=TAG, client_state={"progress": asdict(progress)})
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def restore(engine) -> tuple[Progress, dict | None] | None:
    """Load Ray Train's latest checkpoint (after a worker failure, a re-run with the same run name, or an elastic
    resize: a ZeRO-1/2/3 checkpoint of another world size loads resharded, pipelines.train.reshard). Returns the
    progress and the resharding's record (None where the checkpoint loaded as saved)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    # Ray's own filesystem for the checkpoint, as fsspec: an object store keeps the endpoint and credentials Ray has
    fs = ArrowFSWrapper(checkpoint.filesystem)
    with checkpoint.as_directory() as folder:
        path, client_state, resharded = reshard.load(engine, fs, checkpoint.path.rstrip("/"), Path(folder), TAG)
    if path is None:
        raise RuntimeError(f"checkpoint {checkpoint.path} holds no DeepSpeed state with tag {TAG!r}")
    return Progress(**client_state["progress"]), resharded
