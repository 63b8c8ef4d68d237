"""The training loop every fit runs (pipelines.fit.loop): the place in the data across epochs and resumes, skipped
non-finite steps, logging and checkpoint points; the adapter's fit on it."""
from __future__ import annotations

import math

import pytest
import torch

from pipelines.fit.loop import EmptyEpoch, Points, epoch_batches, run_steps
from pipelines.fit.progress import Progress


def test_epoch_batches_resume_within_an_epoch_and_stop_on_an_empty_one():
    epochs = {0: [0, 1, 2], 1: [10, 11, 12], 2: [20, 21, 22]}
    p = Progress()
    it = epoch_batches(lambda e: epochs[e], p)
    assert [next(it) for _ in range(4)] == [0, 1, 2, 10] and (p.epoch, p.batch_in_epoch) == (1, 1)
    # a restart from this progress skips what epoch 1 already gave
    resumed = Progress(epoch=1, batch_in_epoch=1)
    assert [b for _, b in zip(range(3), epoch_batches(lambda e: epochs[e], resumed))] == [11, 12, 20]
    with pytest.raises(EmptyEpoch, match="an epoch gave no batch"):
        list(epoch_batches(lambda e: [], Progress()))


class Counting:
    """A fit whose batches are their losses: NaN is not finite (nothing applied)."""

    def __init__(self):
        self.progress, self.applied = Progress(), []

    def step(self, loss):
        if not math.isfinite(loss):
            return None
        self.applied.append(loss)
        return {"loss": torch.tensor(loss)}

    def rows(self, loss):
        return 4


class Recording:
    """Every component the loop asks, writing down when it was asked to act (one list for all of them): the step's
    log (`stop_at_log`: the log step that stops the fit), the evaluation, the checkpoints, the notices
    (`notice_at`: the steps at which the ranks agreed on one)."""

    def __init__(self, fit, log_every=1, first=None, last=None, eval_every=0, checkpoint_every=0, stop_at_log=None,
                 notice_at=()):
        self.fit, self.calls = fit, []
        self.log_due = Points(log_every, first=first, last=last)
        self.eval_due, self.checkpoint_due = Points(eval_every), Points(checkpoint_every)
        self.stop_at_log, self.notice_at = stop_at_log, set(notice_at)

    def run(self, batches, last_step, **kwargs):
        run_steps(self.fit, batches, last_step, on_step=[lambda step: self.calls.append(("step", step))],
                  log=Part(self.log_due, log=self.log), evaluation=Part(self.eval_due, evaluate=self.evaluate,
                                                                         report=self.report),
                  checkpoints=Part(self.checkpoint_due, save=self.checkpoint),
                  notices=Part(None, noticed=lambda: self.fit.progress.step in self.notice_at,
                               save_now=self.save_now), **kwargs)

    def log(self, out, samples_per_s):
        self.calls.append(("log", self.fit.progress.step, out["loss"].item()))
        return self.fit.progress.step == self.stop_at_log

    def save_now(self, step, evaluate):
        self.calls.append(("notice", step, evaluate))

    def evaluate(self, step):
        self.calls.append(("evaluate", step))
        return {"top1": 0.5}

    def checkpoint(self, metrics):
        self.calls.append(("checkpoint", metrics))

    def report(self, metrics):
        self.calls.append(("report", metrics))


class Part:
    """One component: its `due` and what it does."""

    def __init__(self, due, **acts):
        self.due = due
        self.__dict__.update(acts)


def test_run_steps_skips_and_counts_non_finite_steps_logs_and_stops():
    fit = Counting()
    hooks = Recording(fit, log_every=2, first=1, last=5)
    batches = [1.0, math.nan, 2.0, 3.0, math.nan, math.nan, 4.0, 5.0, 6.0, 7.0]
    hooks.run(iter(batches), 5, max_bad_batches=3, micro_batches=2)
    assert fit.applied == [1.0, 2.0, 3.0, 4.0, 5.0]  # the last step reached, nothing drawn after it
    assert (fit.progress.step, fit.progress.samples, fit.progress.skipped_batches) == (5, 20, 6)
    logged = [(c[1], c[2]) for c in hooks.calls if c[0] == "log"]
    assert logged == [(1, 1.0), (2, 2.0), (4, 4.0), (5, 5.0)]  # the points the log said: the first, every 2, the last
    assert [c[1] for c in hooks.calls if c[0] == "step"] == [1, 2, 3, 4, 5]  # every step applied
    run_steps(fit, iter([8.0]), 5)  # at the last step already: nothing more
    assert fit.applied[-1] == 5.0
    stopped = Counting()
    hooks = Recording(stopped, log_every=2, last=10, stop_at_log=4)
    hooks.run(iter([4.0, 5.0, 6.0, 7.0]), 10)
    # every 2, and the log that stops the fit
    assert stopped.progress.step == 4 and [c[1] for c in hooks.calls if c[0] == "log"] == [2, 4]


def test_the_loop_evaluates_checkpoints_and_saves_on_a_notice_at_its_points():
    """Every fit's order after a step, each component saying when it is due: the evaluation (reported alone, or with
    the checkpoint due at the same step), the checkpoint, neither at the last step (the job's own end does them); on
    a notice the save alone, told whether an evaluation was due (it comes after the save); a notice at a step that
    applied nothing saves the step before."""
    fit = Counting()
    hooks = Recording(fit, log_every=100, eval_every=2, checkpoint_every=3, notice_at={4})
    hooks.run(iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]), 7)
    points = [c for c in hooks.calls if c[0] not in ("step", "log")]
    assert points == [("evaluate", 2), ("report", {"step": 2, "top1": 0.5}), ("checkpoint", {"step": 3}),
                      ("notice", 4, True), ("evaluate", 6), ("checkpoint", {"step": 6, "top1": 0.5})]
    skipped = Counting()
    hooks = Recording(skipped, notice_at={1})
    hooks.run(iter([1.0, math.nan, 2.0]), 3, max_bad_batches=2)
    assert [c for c in hooks.calls if c[0] == "notice"] == [("notice", 1, False), ("notice", 1, False)]


    with pytest.raises(FloatingPointError, match="not finite for 3 batches in a row at step 1"):
        run_steps(Counting(), iter([1.0, math.nan, math.nan, math.nan]), 5, max_bad_batches=3)


def test_the_adapter_skips_a_non_finite_step():
    """The adapter's fit on the loop: a batch whose loss is NaN changes nothing and is counted; the next trains."""
    from pipelines.adapt.config import AdaptDocument
    from pipelines.adapt.loop import AdapterFit, build_adapter_set

    cfg = AdaptDocument.model_validate({"source": {"model": "m.safetensors"}, "adapter": {"hidden": 8}})
    torch.manual_seed(0)
    fit = AdapterFit(build_adapter_set(cfg, 6), cfg.train.model_copy(update={"lr": 1e-2, "steps": 4}))
    good = torch.nn.functional.normalize(torch.randn(8, 2, 6), dim=-1)
    before = {k: v.clone() for k, v in fit.net.state_dict().items()}
    run_steps(fit, iter([torch.full_like(good, math.nan)]), 4, max_bad_batches=2)
    assert fit.progress.skipped_batches == 1 and fit.progress.step == 0
    assert all(torch.equal(v, fit.net.state_dict()[k]) for k, v in before.items())
    run_steps(fit, iter([good]), 1)
    after = fit.net.state_dict()
    assert fit.progress.step == 1 and not all(torch.equal(v, after[k]) for k, v in before.items())


def test_every_fit_takes_the_learning_rate_clipping_and_adamw_of_its_loop_config():
    """One LoopConfig, the same rules: a plain fit's step (the adapter's, the in-process fit's: pipelines.fit.step)
    sets the learning rate DeepSpeed's scheduler gives the engine at each step (schedule_for), clips the gradient to
    grad_clip (0: not at all), and its AdamW has the config's betas, epsilon and weight decay; a step whose loss is
    not finite applies nothing."""
    from models.gather import World
    from pipelines.fit.config import LoopConfig
    from pipelines.fit.optim import optimizer_for, schedule_for
    from pipelines.fit.step import plain_step

    cfg = LoopConfig(steps=9, lr=0.1, warmup_steps=3, beta1=0.8, beta2=0.9, eps=1e-5, weight_decay=0.3, grad_clip=0.5)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    optimizer = optimizer_for(net, cfg)
    assert [(g["betas"], g["eps"], g["weight_decay"]) for g in optimizer.param_groups] == \
        [((0.8, 0.9), 1e-5, 0.3), ((0.8, 0.9), 1e-5, 0.0)]  # the bias takes no weight decay
    reference = schedule_for(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr), cfg)
    for step in range(cfg.steps):
        out = {"loss": (net(torch.randn(8, 4)) * 100).pow(2).mean()}
        assert plain_step(out, out["loss"].backward, optimizer, list(net.parameters()), cfg, step, World()) is out
        assert optimizer.param_groups[0]["lr"] == reference.get_last_lr()[0]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in net.parameters()]))
        assert norm <= cfg.grad_clip * (1 + 1e-5)
        reference.optimizer.step()
        reference.step()
    before = [p.detach().clone() for p in net.parameters()]
    bad = {"loss": torch.tensor(float("nan"))}
    assert plain_step(bad, lambda: None, optimizer, list(net.parameters()), cfg, cfg.steps, World()) is None
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    unclipped = cfg.model_copy(update={"grad_clip": 0.0})
    out = {"loss": (net(torch.randn(8, 4)) * 100).pow(2).mean()}
    plain_step(out, out["loss"].backward, optimizer, list(net.parameters()), unclipped, 0, World())
    assert torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in net.parameters()])) > 1
