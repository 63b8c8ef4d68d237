"""Hyperparameter sweeps (`jobs.tune`): one TorchTrainer run per trial of a sweep file (`pipelines.tune.config`).

One trial is a Ray Tune function trainable that runs `pipelines.pretrain.job.run_pretrain` (Ray Train V2 + Tune:
the Train run forwards its `ray.train.report`s to Tune through `TuneReportCallback`). Trials log to
MLflow child runs of the sweep's parent run; the sweep resumes from its Tune experiment folder. The driver prepares
and checks the data once for every trial (`pipelines.inputs`; a space that would change it is refused first).
"""
from __future__ import annotations

import copy
import math
import os
import signal
import tempfile
import threading
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import pandas as pd
from ray import tune
from ray.tune import Callback
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import FIFOScheduler
from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

from pipelines.cluster.check import spans_nodes
from pipelines.cluster.runtime import local_cpus
from pipelines.config import STATE_DIR, ConfigError, absolute_path, set_dotted
from pipelines.pretrain.config import TrainDocument
from pipelines.plotting import pyplot
from pipelines.console import ProgressLine
from pipelines.tracking import (end_trial_runs, find_run, finish_with_results, is_local_store, redact_yaml,
                                start_run, tracking_uri)
from pipelines.inputs import inputs_of, prepare_inputs
from pipelines.fit.launch import check_reachable, start_ray
from pipelines.result import JobResult
from pipelines.pretrain.job import run_pretrain
from pipelines.tune.asha import ResumableASHA
from pipelines.tune.config import SweepDocument, trial_config


class MetricReports(TuneReportCallback):
    """The Train run's reports that carry the sweep's metric, forwarded to Tune: the final checkpoint, saved before
    the final evaluation, carries none (the final report after the evaluation does), and Tune requires the metric in
    every result it is given."""

    def __init__(self, metric: str):
        super().__init__()
        self.metric = metric

    def after_report(self, run_context, metrics, checkpoint):
        if self.metric in metrics[0]:
            super().after_report(run_context, metrics, checkpoint)


def run_trial(params: dict[str, Any], *, base: dict[str, Any], sweep_name: str, storage_path: str,
              parent_run_id: str, joined: bool, metric: str) -> None:
    """One Tune trial: the sampled values applied to the base config, trained by one TorchTrainer. `joined`: the
    sweep's driver joined a cluster (a trial runs in a Ray worker, where the environment does not say so)."""
    trial_id = tune.get_context().get_trial_id()
    data = copy.deepcopy(base)
    set_dotted(data, "run.name", f"{sweep_name}-{trial_id}")
    set_dotted(data, "run.storage_path", storage_path)
    cfg = trial_config(data, params)
    run_pretrain(cfg, callbacks=[MetricReports(metric)], joined=joined, inputs_ready=True,
                 extra_tags={"mlflow.parentRunId": parent_run_id, "probvlp.trial_id": trial_id,
                             "probvlp.sweep": sweep_name})


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def check_trials_share_inputs(sweep: SweepDocument, base: TrainDocument) -> None:
    """A one-line ConfigError for a space value or point that changes what `prepare_inputs` reads of the base config
    (the digits, the eval tasks' data): the driver prepares and checks them once, and the trials skip it."""
    prepared, base_dict = inputs_of(base), base.to_dict()
    changes = [(f"space.{key}", {key: value}) for key, domain in sweep.space.items() for value in domain.probes()]
    changes += [(f"tune.points_to_evaluate[{i}]", dict(point)) for i, point in enumerate(sweep.tune.points_to_evaluate)]
    for where, params in changes:
        if inputs_of(trial_config(base_dict, params)) != prepared:
            raise ConfigError(f"{where}: {params} changes the data the trials share (the digits or the eval tasks' "
                              "data, prepared once for the sweep): set it in the base config")


def check_sweep_reaches_its_nodes(base: TrainDocument, storage: str) -> None:
    """One-line ConfigErrors, before any trial starts, on a cluster whose nodes share no disk: each trial drives its
    training from a node of its own, so the sweep's storage and the MLflow store must be reachable from every node."""
    check_reachable(base, "tune.storage_path", storage, "Tune and every trial's Ray Train write there: set it to "
                    "object storage, e.g. --set tune.storage_path=s3://BUCKET/tune")
    check_reachable(base, "data.root", base.data.root, "each trial reads its data from its own node: put the "
                    "shards on object storage, e.g. --set data.root=s3://BUCKET/data with data.source=shards")
    uri = tracking_uri(base.tracking.uri)
    if is_local_store(uri) and spans_nodes():
        raise ConfigError(f"tracking: {uri.split('?')[0]} is a store on this node's disk, and a sweep's trials run "
                          "on other nodes: set MLFLOW_TRACKING_URI (or tracking.uri) to an mlflow server every node "
                          "reaches")


@dataclass(kw_only=True)
class TuneResult(JobResult):
    """`mlflow_run_id`: the sweep's parent run; `out`: the best config's file (None when interrupted)."""

    grid: Any  # Tune's ResultGrid
    summary: dict[str, Any] | None  # summarize_sweep's table, best params and metric; None: interrupted (Ctrl-C)


def run_tune(sweep: SweepDocument, base: TrainDocument, sweep_file_text: str,
             best_config_out: str | Path | None = None) -> TuneResult:
    """`jobs.tune`: run (or resume) the sweep, the best config written to `best_config_out` (default
    .probvlp/tune/<name>_best.yaml; summary["best_config_file"]). The summary is None when the sweep was interrupted
    (Ctrl-C): Tune saved its state, and running the same command again resumes it."""
    s = sweep.tune
    base = base.with_absolute_paths()  # trials run in Ray workers, in other directories
    t = base.train
    joined = start_ray(base, local_cpus(t.max_workers * s.max_concurrent, t.cpus_per_worker))
    check_sweep_reaches_its_nodes(base, absolute_path(s.storage_path))
    check_trials_share_inputs(sweep, base)
    prepare_inputs(base)  # once for every trial, before concurrent trials could race on it
    uri = tracking_uri(base.tracking.uri)
    root = absolute_path(s.storage_path).rstrip("/")
    exp_path = f"{root}/{s.name}"
    # The driver runs the scheduler, so its rungs are a local file: beside the experiment, or in the project's
    # .probvlp/tune when the experiment is in cloud storage.
    rungs_file = str(STATE_DIR / "tune" / s.name if "://" in root else exp_path) + "_asha_rungs.json"

    parent = find_run(uri, s.experiment, f"sweep:{s.name}")
    if parent is None:
        params = {"sweep.base": sweep.base, **{f"tune.{k}": v for k, v in s.model_dump().items() if k != "points_to_evaluate"},
                  **{f"space.{k}": f"{d.kind}{getattr(d, d.kind)}" for k, d in sweep.space.items()}}
        parent = start_run(uri, s.experiment, s.name, params, sweep_file_text,
                           {"probvlp.run_name": f"sweep:{s.name}", "probvlp.sweep": s.name})

    trainable = tune.with_parameters(run_trial, base=base.to_dict(), sweep_name=s.name,
                                     storage_path=f"{root}/{s.name}_train", parent_run_id=parent, joined=joined,
                                     metric=s.metric)
    # The trial function only drives its TorchTrainer (the workers request their own CPUs); Tune
    # needs a non-empty bundle for it, so a sliver of a CPU.
    trainable = tune.with_resources(trainable, {"CPU": 0.1})
    if tune.Tuner.can_restore(exp_path):
        tuner = tune.Tuner.restore(exp_path, trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        Path(rungs_file).unlink(missing_ok=True)  # a new sweep of an old name: not that sweep's rungs
        tuner = tune.Tuner(trainable, param_space={k: d.to_tune() for k, d in sweep.space.items()},
                           tune_config=tune.TuneConfig(metric=s.metric, mode=s.mode, num_samples=s.num_samples,
                                                       search_alg=_searcher(sweep),
                                                       scheduler=_scheduler(sweep, rungs_file)),
                           run_config=tune.RunConfig(name=s.name, storage_path=root,
                                                     callbacks=[trial_progress(s.num_samples, s.metric)]))
    grid, interrupted = fit_noting_ctrl_c(tuner)
    result = TuneResult(mlflow_uri=uri, mlflow_run_id=parent, run_name=s.name, grid=grid, summary=None)
    if interrupted:  # Tune saved the experiment with trials still to run: nothing to summarise yet
        return result
    summary = summarize_sweep(grid, sweep, base, uri, parent)
    out = Path(best_config_out or STATE_DIR / "tune" / f"{s.name}_best.yaml")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(summary["best_config"].to_yaml())
    summary["best_config_file"] = out
    result.summary, result.out, result.metrics = summary, out, {s.metric: summary["best_metric"]}
    return result


def fit_noting_ctrl_c(tuner):
    """tuner.fit(), and whether a Ctrl-C stopped it. Tune catches the first SIGINT (it saves the experiment and
    returns) and puts back the handler it found there, so that a second one ends the process: this function's
    handler back in place after the fit is the sign. Tune catches no signal outside the main thread or with
    TUNE_DISABLE_SIGINT_HANDLER=1 (a Ctrl-C then ends the process at once)."""
    if threading.current_thread() is not threading.main_thread() or os.environ.get("TUNE_DISABLE_SIGINT_HANDLER") == "1":
        return tuner.fit(), False

    def second_ctrl_c(signum, frame):
        signal.default_int_handler(signum, frame)

    previous = signal.signal(signal.SIGINT, second_ctrl_c)
    try:
        grid = tuner.fit()
        return grid, signal.getsignal(signal.SIGINT) is second_ctrl_c
    finally:
        signal.signal(signal.SIGINT, previous)


def trial_progress(total: int, metric: str):
    """A Tune callback printing `[sweep] trial 3/8 (38%) | <id> completed | <metric> ... | elapsed | ETA`."""
    class TrialProgress(Callback):
        def __init__(self):
            self.line, self.done = ProgressLine("sweep", total, unit="trial"), 0

        def setup(self, **info):
            self.line.update(0)

        def _ended(self, trials, trial, how: str) -> None:
            # Counted from Tune's trial list, so a resumed sweep goes on from the trials ended before it.
            ended = {t.trial_id for t in trials if t.status in ("TERMINATED", "ERROR")} | {trial.trial_id}
            self.done = max(self.done + 1, len(ended))
            value = (trial.last_result or {}).get(metric)
            shown = f"{value:.4g}" if isinstance(value, (int, float)) else "not reported"
            self.line.update(self.done, trial=f"{trial.trial_id} {how}", **{metric: shown})

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._ended(trials, trial, "ended")

        def on_trial_error(self, iteration, trials, trial, **info):
            self._ended(trials, trial, "failed")

    return TrialProgress()


def _searcher(sweep: SweepDocument):
    s = sweep.tune
    points = [dict(p) for p in s.points_to_evaluate]
    if s.search_alg == "optuna":
        from ray.tune.search.optuna import OptunaSearch  # deferred: optuna is needed only by this search

        searcher = OptunaSearch(metric=s.metric, mode=s.mode, seed=s.seed, points_to_evaluate=points or None)
        return ConcurrencyLimiter(searcher, max_concurrent=s.max_concurrent)
    return BasicVariantGenerator(points_to_evaluate=points or None, max_concurrent=s.max_concurrent,
                                 random_state=s.seed)


def _scheduler(sweep: SweepDocument, rungs_file: str):
    s = sweep.tune
    if s.scheduler == "fifo":
        return FIFOScheduler()
    # In steps (reports come every eval_every steps). One report past the last: a trial that runs to the end
    # finishes by itself (final checkpoint, model artifacts, MLflow status) instead of being stopped by ASHA.
    max_reports = sweep.reports_per_trial + 1
    return ResumableASHA(state_file=rungs_file, max_t=max_reports * sweep.eval_every,
                         grace_period=min(s.grace_period, max_reports - 1) * sweep.eval_every,
                         reduction_factor=s.reduction_factor)


def summarize_sweep(grid, sweep: SweepDocument, base: TrainDocument, uri: str, parent: str) -> dict[str, Any]:
    """Child-run statuses, results table and plot, best config YAML; all logged to the parent run."""
    s = sweep.tune
    rows = [trial_row(result, sweep, base) for result in grid]
    for row in rows:
        final = {"completed": "FINISHED", "stopped early": "KILLED"}.get(row["status"], "FAILED")
        end_trial_runs(uri, base.run.experiment, row["trial_id"], row["status"], final)
    table = pd.DataFrame(rows)
    scored = table[table[s.metric].map(finite)]
    if scored.empty:
        raise RuntimeError(f"no trial reported {s.metric}")
    best = scored.sort_values(s.metric, ascending=(s.mode == "min")).iloc[0]
    best_params = {k: _plain(best[k]) for k in sweep.space}
    best_cfg = trial_config(base.to_dict(), best_params)
    best_cfg.run.name = None
    log_sweep_results(uri, parent, table, sweep, best_cfg, {f"best_{s.metric}": float(best[s.metric])})
    return {"table": table, "best_params": best_params, "best_config": best_cfg, "best_metric": float(best[s.metric])}


def trial_row(result, sweep: SweepDocument, base: TrainDocument) -> dict[str, Any]:
    """One Tune result -> trial id, its sampled knobs, the metric, the last step and how it ended."""
    metrics = result.metrics or {}
    trial_id = metrics.get("trial_id", result.path.rstrip("/").split("/")[-1] if result.path else "")
    step = metrics.get("step", 0)
    status = "error" if result.error else ("completed" if step >= base.train.steps else "stopped early")
    return {"trial_id": trial_id, **{k: result.config.get(k) for k in sweep.space},
            sweep.tune.metric: metrics.get(sweep.tune.metric), "step": step, "status": status}


def log_sweep_results(uri: str, parent: str, table, sweep: SweepDocument, best_cfg: TrainDocument,
                      metrics: dict[str, float]) -> None:
    """The parent run's results table, knob plot, best config and `metrics`; then the parent run ends."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        table.to_csv(tmp / "results.csv", index=False)
        (tmp / "results.md").write_text(markdown_table(table))
        (tmp / "best_config.yaml").write_text(redact_yaml(best_cfg.to_yaml()))
        plot_knobs(table, list(sweep.space), sweep.tune.metric, tmp / "metric_vs_knobs.png")
        names = ("results.csv", "results.md", "best_config.yaml", "metric_vs_knobs.png")
        finish_with_results(uri, parent, metrics, [(tmp / name, None) for name in names])


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def markdown_table(table) -> str:
    cols = list(table.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |"
              for row in table.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def plot_knobs(table, knobs: list[str], metric: str, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(knobs), figsize=(3.2 * len(knobs), 3), squeeze=False)
    for ax, knob in zip(axes[0], knobs):
        for status, marker in (("completed", "o"), ("stopped early", "x"), ("error", "s")):
            part = table[table["status"] == status]
            ax.scatter(part[knob].astype(float) if part[knob].map(lambda v: isinstance(v, (int, float))).all() else part[knob].astype(str),
                       part[metric], marker=marker, label=status)
        ax.set_xlabel(knob.split(".")[-1])
        ax.set_title(knob, fontsize=7)
    axes[0][0].set_ylabel(metric)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
