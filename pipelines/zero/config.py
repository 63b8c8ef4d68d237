"""What a DeepSpeed stage's train section gives pipelines.zero (`ZeroConfig`): the training core's knobs (LoopConfig)
and the engine's: the per-worker batch, the ZeRO stage, feature-cache accumulation, and when and where checkpoints are
written. A stage's train section subclasses it and adds its own (pretraining's: the workers, precision, evaluation)."""
from __future__ import annotations

from pydantic import Field

from pipelines.fit.config import LoopConfig


class ZeroConfig(LoopConfig):
    batch_size: int = Field(64, ge=1, description="per worker")
    zero_stage: int = Field(2, ge=0, le=3)
    # Micro-batches per optimizer step, by feature-cache accumulation (models.accumulate): the loss of each step is
    # that of one batch of grad_accum x batch_size x workers samples (every one a negative of every other), with the
    # activations of one micro-batch; ~1/3 more tower compute. docs/SCALING.md "Batch".
    grad_accum: int = Field(1, ge=1)
    # Checkpoint every N optimizer steps, or every this many seconds of the attempt's training since its last
    # checkpoint, whichever comes first (0: never that way; the final checkpoint always). Uploaded to run.storage_path
    # behind training (pipelines.zero.checkpoint_files); docs/SCALING.md "Checkpoints" says how to choose them.
    checkpoint_every: int = Field(0, ge=0)
    checkpoint_every_s: float = Field(600.0, ge=0)
    # Where each rank writes its shard before the upload: "auto" (the node's memory, /dev/shm, where it has room for a
    # whole checkpoint twice over, else $TMPDIR), or a folder (a local SSD).
    checkpoint_snapshot_dir: str = "auto"
    # The longest a rank waits for Ray Train to register a checkpoint (every rank's part uploaded): before the next
    # save behind training, and in a save at once. Past it the attempt fails in one line and Ray Train restarts it
    # from the last registered checkpoint (run.max_failures): an upload stuck on one rank costs this long, not the run
    # (held at that save for ever). 1800 s: over 20x the 80 s a 2.4-GB checkpoint took to a slow S3 server
    # (docs/BENCHMARKS.md "Checkpoints"), room for checkpoints or storage that much larger or slower.
    upload_timeout_s: float = Field(1800.0, gt=0)
