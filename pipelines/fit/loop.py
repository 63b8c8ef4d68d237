"""The training loop a job's workers run, and what a job plugs into it.

`run_steps` does what every fit needs done the same way: optimizer steps until the last step, a step whose loss
was not finite on some rank skipped (nothing applied) and counted, `max_bad_batches` of them in a row stopping the fit,
the samples and the rate, and the order of what follows a step. `epoch_batches` keeps the place in the data: epochs,
and the batches an epoch has already given (a resumed fit skips them), in the `Progress` every checkpoint saves. A
job plugs in its `Fit` (the objective and the optimizer: one `step` of a batch, or None where nothing was applied)
and the components that act between steps, each of which says when it is due: the step's log (`StepLog`), the
evaluation (`Evaluator`), the checkpoints (`Saver`), the notices of preemption (`NoticeSaver`:
pipelines.fit.notices.Notices); the optimizer, the schedule and the step's rules are `pipelines.fit.optim`'s and
`pipelines.fit.step`'s. The pretraining workers (`pipelines.pretrain.worker`:
DeepSpeed's engine), the adapter's (`pipelines.adapt.loop.AdapterFit`) and the in-process fit
(`pipelines.digits_fit`) are the fits.
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


class Points:
    """The steps at which a component acts: every `every` steps (0: none), and `first` and `last` (None: no such
    point)."""

    def __init__(self, every: int = 0, *, first: int | None = None, last: int | None = None):
        self.every, self.first, self.last = every, first, last

    def __call__(self, step: int) -> bool:
        return (bool(self.every) and step % self.every == 0) or step in (self.first, self.last)


class StepLog(Protocol):
    """What a step logs. `log` at the steps it is `due` (every rank): True stops the fit."""

    def due(self, step: int) -> bool: ...

    def log(self, out: dict[str, torch.Tensor], samples_per_s: float) -> bool: ...


class Evaluator(Protocol):
    """An evaluation between steps. `evaluate` at the steps it is `due`: its metrics, or None where a notice came
    during it (stopped: the notice's save follows, told that the evaluation is due); `report` of those metrics where
    no checkpoint is due at the same step (a checkpoint carries them)."""

    def due(self, step: int) -> bool: ...

    def evaluate(self, step: int) -> dict[str, float] | None: ...

    def report(self, metrics: dict[str, Any]) -> None: ...


class Saver(Protocol):
    """The checkpoints between steps: `save` (with the step's metrics) where `due`."""

    def due(self, step: int) -> bool: ...

    def save(self, metrics: dict[str, Any]) -> None: ...


class NoticeSaver(Protocol):
    """A notice of preemption: `noticed` (what the ranks agreed at the last step), then `save_now` (the checkpoint at
    once; `evaluate`: an evaluation was due at the step, which comes after the save)."""

    def noticed(self) -> bool: ...

    def save_now(self, step: int, evaluate: bool) -> None: ...


def run_steps(fit: Fit, batches: Iterable[Any], last_step: int, *, on_step: Iterable[Callable[[int], None]] = (),
              log: StepLog | None = None, evaluation: Evaluator | None = None, checkpoints: Saver | None = None,
              notices: NoticeSaver | None = None, max_bad_batches: int = 1, micro_batches: int = 1) -> None:
    """`fit` stepped on `batches` until `fit.progress.step` reaches `last_step`. After each applied step, in this
    order: each of `on_step`; `log` where due (True stops the fit); then, before the last step (the job's own end
    evaluates and saves there): on a notice, its save alone (the checkpoint first: the evaluation due may take the
    whole deadline); otherwise the evaluation where due (a notice during it: its save then), then the checkpoint with
    its metrics where due, or the evaluation's report alone. A step whose loss was not finite on some rank applies
    nothing (counted `micro_batches` in `progress.skipped_batches`; FloatingPointError after `max_bad_batches` in a
    row), and with a notice saves the state of the step before."""
    p = fit.progress
    if p.step >= last_step:
        return
    start, samples0 = time.perf_counter(), p.samples
    on_step = list(on_step)
    noticed = notices.noticed if notices is not None else (lambda: False)
    bad_in_a_row = 0
    for batch in batches:
        out = fit.step(batch)
        if out is None:
            bad_in_a_row += 1
            p.skipped_batches += micro_batches
            if noticed():  # nothing applied at this step: the state of the step before is saved
                notices.save_now(p.step, evaluate=False)
            if bad_in_a_row >= max_bad_batches:
                raise FloatingPointError(f"loss was not finite for {bad_in_a_row} batches in a row at step {p.step} "
                                         "(train.max_bad_batches); lower train.lr or check the data")
            continue
        bad_in_a_row = 0
        p.samples += fit.rows(batch)
        p.step += 1
        for call in on_step:
            call(p.step)
        if log is not None and log.due(p.step):
            if log.log(out, (p.samples - samples0) / (time.perf_counter() - start)):
                return
        if p.step >= last_step:
            return
        due_eval = evaluation is not None and evaluation.due(p.step)
        due_checkpoint = checkpoints is not None and checkpoints.due(p.step)
        if noticed():
            notices.save_now(p.step, evaluate=due_eval)
            continue
        evaluated = evaluation.evaluate(p.step) if due_eval else {}
        if evaluated is None:  # a notice came during the evaluation: its save now, the evaluation after it
            notices.save_now(p.step, evaluate=True)
            continue
        metrics = {"step": p.step, **evaluated}
        if due_checkpoint:
            checkpoints.save(metrics)
        elif due_eval:
            evaluation.report(metrics)
