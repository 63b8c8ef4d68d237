"""What every training job's train section gives the training core (`LoopConfig`): the loop's steps and its
non-finite policy, AdamW and its schedule, clipping. Each stage's train section adds its own (the workers, the batch,
checkpoints) and may change a default; every fit obeys these the same way (pipelines.fit.optim, pipelines.fit.step)."""
from __future__ import annotations

from pydantic import Field

from pipelines.config import WorkerResources


class LoopConfig(WorkerResources):
    steps: int
    lr: float = Field(1e-3, gt=0)
    # AdamW: decoupled weight decay (none on gains, biases and other vectors: pipelines.fit.optim.param_groups), its
    # moments' decay rates and epsilon.
    weight_decay: float = Field(0.2, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-6, gt=0)
    # Linear warm-up over this many steps, then cosine annealing to 0 at `steps`.
    warmup_steps: int = Field(50, ge=0)
    # The gradient's global norm is clipped to this before each step; 0: no clipping.
    grad_clip: float = Field(1.0, ge=0)
    # Batches with a NaN/inf loss on any rank are skipped on every rank and counted; this many in a row stop the fit.
    max_bad_batches: int = Field(20, ge=1)
    # Stop (checkpointed, not evaluated) after this step; the same run.name again continues to train.steps.
    stop_at_step: int | None = Field(None, ge=1)

    @property
    def last_step(self) -> int:
        """The step this attempt trains to."""
        return min(self.steps, self.stop_at_step or self.steps)
