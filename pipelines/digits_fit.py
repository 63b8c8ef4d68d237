"""A tiny model trained in this process on the bundled digits (no Ray, no DeepSpeed): the same model, loss,
optimizer, schedule and step as a Ray Train fit of the config (pipelines.fit), on the same loop
(pipelines.fit.loop.run_steps), single process, for tests and studies that need trained embeddings fast."""
from __future__ import annotations

import numpy as np
import torch

from models.accumulate import CachedBatch
from models.gather import World
from models.objective import build_objective
from models.tokenizer import tokenize
from pipelines.digits.arrays import config_sampler, digit_arrays
from pipelines.fit.loop import run_steps
from pipelines.fit.optim import optimizer_for
from pipelines.fit.progress import Progress
from pipelines.fit.step import plain_step


def fit_in_process(cfg, steps: int, batch: int = 128, seed: int = 0, sampler=None, loss_sign: float = 1.0,
                   accum: int = 1, dtype: torch.dtype = torch.float32):
    """cfg's model and loss trained `steps` steps (InProcessFit: the pretraining worker's AdamW and its warm-up +
    cosine schedule over cfg.train.steps, of which a shorter fit runs the first `steps`) on the train split with
    cfg.data's caption mix (or `sampler`'s: anything with CaptionSampler's draw); returns the model in eval mode.
    loss_sign -1 climbs the objective instead: the broken loss that tests/test_learning.py's targets must reject. The
    model comes back in float32. accum > 1: each step's `batch` rows run as `accum` micro-batches by feature-cache
    accumulation (models.accumulate, as train.grad_accum), the same samples and draws. dtype: of the weights and
    images (float64: two fits that differ by rounding only stay together much longer)."""
    if accum > 1 and loss_sign != 1.0:
        raise ValueError("loss_sign applies to one-pass fits only")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    images, _, metas = digit_arrays("train")
    sampler = sampler or config_sampler(cfg)
    fit = InProcessFit(build_objective(cfg).to(dtype).train(), cfg, accum, loss_sign)
    images = images.to(dtype)
    context = fit.objective.model.context_length

    def batches():
        while True:
            rows = rng.choice(len(images), batch, replace=False)
            yield images[rows], tokenize([sampler.draw(metas[i], "", rng) for i in rows], context)

    run_steps(fit, batches(), steps, max_bad_batches=cfg.train.max_bad_batches)
    return fit.objective.model.float().eval()


class InProcessFit:
    """cfg's objective under the training core's optimizer and step (pipelines.fit: AdamW, no weight decay on gains,
    biases and vectors; linear warm-up, then cosine to 0 at cfg.train.steps: the config's run, of which a shorter fit
    takes the first steps; clipping; a non-finite step skipped), one `step` per batch for
    `pipelines.fit.loop.run_steps` (`loss_sign` -1: the loss climbed)."""

    def __init__(self, objective, cfg, accum: int = 1, loss_sign: float = 1.0):
        self.objective, self.cfg, self.accum, self.loss_sign = objective, cfg.train, accum, loss_sign
        self.optimizer = optimizer_for(objective, cfg.train)
        self.parameters, self.world = list(objective.parameters()), World()  # what the step clips; one process
        self.progress = Progress()

    def step(self, batch) -> dict[str, torch.Tensor] | None:
        images, tokens = batch
        if self.accum > 1:
            cached = CachedBatch(self.objective, images, tokens, self.accum)
            out, backward = cached.out, cached.backward
        else:
            out = self.objective(images, tokens)

            def backward() -> None:
                (self.loss_sign * out["loss"]).backward()

        return plain_step(out, backward, self.optimizer, self.parameters, self.cfg, self.progress.step, self.world)

    def rows(self, batch) -> int:
        return len(batch[0])
