"""The training loop a job's workers run, and what a job plugs into it.

`run_steps` does what every fit needs done the same way: optimizer steps until the last step, a step whose loss
was not finite on some rank skipped (nothing applied) and counted, `max_bad_batches` of them in a row stopping the fit,
the samples and the rate, and when to log, evaluate, checkpoint or save on a notice. `epoch_batches` keeps the place in
the data: epochs, and the batches an epoch has already given (a resumed fit skips them), in the `Progress` every
checkpoint saves. A job plugs in its `Fit` (the objective and the optimizer: one `step` of a batch, or None where
nothing was applied) and its `Hooks` (what logging, evaluating, checkpointing and a notice's save do); the optimizer,
the schedule and the step's rules are `pipelines.fit.optim`'s and `pipelines.fit.step`'s. The pretraining workers (`pipelines.pretrain.worker`:
DeepSpeed's engine), the adapter's (`pipelines.adapt.loop.AdapterFit`) and the in-process fit
(`pipelines.fit.in_process`) are the fits.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from pipelines.fit.progress import Progress


class EmptyEpoch(RuntimeError):
    """An epoch of the training data gave no batch: every file or sample was skipped, or the data is smaller than one
    batch per worker."""


class Fit(Protocol):
    """What a job trains: its objective and optimizer behind one `step`, and where it stands."""

    progress: Progress

    def step(self, batch: Any) -> dict[str, torch.Tensor] | None:
        """One optimizer step on `batch`: the loss and its parts, or None where the loss was not finite on some rank
        (nothing applied)."""

    def rows(self, batch: Any) -> int:
        """The samples one step on `batch` trains on, over all workers."""


def epoch_batches(stream: Callable[[int], Iterable[Any]], progress: Progress) -> Iterator[Any]:
    """The batches from `progress`'s place on, without end: `stream(epoch)` gives one epoch's batches (shuffled by
    the epoch), the ones this epoch already gave are skipped, and `progress` counts each batch as it is handed out.
    EmptyEpoch where an epoch gives none (it would repeat forever)."""
    while True:
        got = False
        for i, batch in enumerate(stream(progress.epoch)):
            got = True
            if i >= progress.batch_in_epoch:
                progress.batch_in_epoch = i + 1
                yield batch
        if not got:
            raise EmptyEpoch("training data: an epoch gave no batch (every file or sample was skipped)")
        progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0


class Hooks:
    """What a job does around `run_steps`'s steps, the same way for every stage (the defaults do nothing; a stage
    overrides what it has). After each applied step, in this order: `on_step`; `log` at a log step (True stops the
    fit); then, before the last step, at the points `eval_every` and `checkpoint_every` (steps) or `checkpoint_due`
    (a clock) set: on a notice of preemption (`noticed`), `save_on_notice` alone (the checkpoint first: the
    evaluation due, `evaluate=True`, may take the whole deadline); otherwise `evaluate` where due (a notice during it
    stops it: `save_on_notice` then), then `checkpoint` with its metrics where due, or `report` of the evaluation's
    metrics alone. A step whose loss was not finite on
    some rank applies nothing, and with a notice saves the state of the step before."""

    eval_every: int = 0
    checkpoint_every: int = 0

    def on_step(self, step: int) -> None:
        pass

    def log(self, out: dict[str, torch.Tensor], samples_per_s: float) -> bool:
        return False

    def noticed(self) -> bool:
        return False

    def save_on_notice(self, step: int, evaluate: bool) -> None:
        pass

    def checkpoint_due(self) -> bool:
        return False

    def evaluate(self, step: int) -> dict[str, float] | None:
        """The evaluation's metrics; None where a notice came during it (stopped: `save_on_notice` follows)."""
        return {}

    def checkpoint(self, metrics: dict[str, Any]) -> None:
        pass

    def report(self, metrics: dict[str, Any]) -> None:
        pass


def run_steps(fit: Fit, batches: Iterable[Any], last_step: int, hooks: Hooks | None = None, *,
              max_bad_batches: int = 1, micro_batches: int = 1, log_every: int = 1, log_first: bool = True) -> None:
    """`fit` stepped on `batches` until `fit.progress.step` reaches `last_step`, `hooks` around each step (`Hooks`):
    a log at the first step of this call (`log_first`), every `log_every` and the last. A skipped step counts
    `micro_batches` in `progress.skipped_batches`; FloatingPointError after `max_bad_batches` in a row."""
    p, hooks = fit.progress, hooks or Hooks()
    if p.step >= last_step:
        return
    first, start, samples0 = p.step, time.perf_counter(), p.samples
    bad_in_a_row = 0
    for batch in batches:
        out = fit.step(batch)
        if out is None:
            bad_in_a_row += 1
            p.skipped_batches += micro_batches
            if hooks.noticed():  # nothing applied at this step: the state of the step before is saved
                hooks.save_on_notice(p.step, evaluate=False)
            if bad_in_a_row >= max_bad_batches:
                raise FloatingPointError(f"loss was not finite for {bad_in_a_row} batches in a row at step {p.step} "
                                         "(train.max_bad_batches); lower train.lr or check the data")
            continue
        bad_in_a_row = 0
        p.samples += fit.rows(batch)
        p.step += 1
        hooks.on_step(p.step)
        if (log_first and p.step == first + 1) or p.step % log_every == 0 or p.step == last_step:
            if hooks.log(out, (p.samples - samples0) / (time.perf_counter() - start)):
                return
        if p.step >= last_step:
            return
        due_eval = bool(hooks.eval_every) and p.step % hooks.eval_every == 0
        due_checkpoint = (bool(hooks.checkpoint_every) and p.step % hooks.checkpoint_every == 0) or hooks.checkpoint_due()
        if hooks.noticed():
            hooks.save_on_notice(p.step, evaluate=due_eval)
            continue
        evaluated = hooks.evaluate(p.step) if due_eval else {}
        if evaluated is None:  # a notice came during the evaluation: its save now, the evaluation after it
            hooks.save_on_notice(p.step, evaluate=True)
            continue
        metrics = {"step": p.step, **evaluated}
        if due_checkpoint:
            hooks.checkpoint(metrics)
        elif due_eval:
            hooks.report(metrics)
