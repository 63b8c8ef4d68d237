"""Evaluation inside a training run, on rank 0 (the evaluate stage's tasks over the trained weights): every
`train.eval_every` steps and once at the end, with its artifacts (metrics, summary, plots), the embedding probe
saved with the model and the sample predictions the job's summary prints. The collective part (gathering the
weights, sharing the metrics) is the worker's."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from models.objective import build_objective
from models.preprocess import to_device
from models.tokenizer import tokenize
from pipelines.config import EvalTask
from pipelines.pretrain.config import TrainDocument
from pipelines.evaluate import EvaluationError
from pipelines.evaluate.in_process import embed_task_locally, model_device
from pipelines.evaluate.names import metric_names
from pipelines.evaluate.samples import sample_predictions, showcase_task
from pipelines.data.worker_reader import dataset_shard
from pipelines.evaluate.tasks import TaskResult, held_out_loss, prefixed, score_task, write_plots
from pipelines.pretrain.model_card import summary_table
from pipelines.data.eval_tasks import eval_dataset_name


class EvaluationStopped(Exception):
    """The evaluation was stopped by its `stop` check (a notice of preemption came during it): its step's save is due
    now, and the evaluation comes again after it."""


def eval_batches(task: EvalTask, batch_size: int, stop: Callable[[], bool] | None = None):
    """The task's batches from its dataset shard; with `stop`, checked before each batch (EvaluationStopped)."""
    shard = dataset_shard(eval_dataset_name(task))
    if task.kind == "loss":
        batches = shard.iter_torch_batches(batch_size=batch_size, drop_last=False)
    else:
        batches = shard.iter_batches(batch_size=batch_size, batch_format="numpy")
    return batches if stop is None else _stoppable(batches, stop)


def _stoppable(batches: Iterable, stop: Callable[[], bool]) -> Iterator:
    for batch in batches:
        if stop():
            raise EvaluationStopped
        yield batch


@torch.no_grad()
def embedding_probe(model: torch.nn.Module, task: EvalTask, n: int = 8) -> dict[str, torch.Tensor]:
    """A few inputs and the float32 embeddings the trained model gives them on its device (no autocast), to check
    that saved models reload exactly."""
    batch = next(iter(eval_batches(task, n)))
    images = torch.as_tensor(batch["image"])[:n].contiguous()
    if task.kind == "loss":
        tokens = batch["text"][:n]
    else:
        captions = [c.split("\n")[0] or "a photo" for c in batch["captions"][:n]]
        tokens = tokenize(captions, model.context_length)
    tokens = tokens.contiguous()
    device = model_device(model)
    image_out, text_out = model.encode_image(to_device(images, device)), model.encode_text(to_device(tokens, device))
    return {"images": images, "tokens": tokens,
            **{f"image_{k}": v.float().cpu().contiguous() for k, v in image_out.items()},
            **{f"text_{k}": v.float().cpu().contiguous() for k, v in text_out.items()}}


class Evaluation:
    """Rank 0's evaluation of the weights it is handed, logged through rank 0's logger (a StepLogger)."""

    def __init__(self, cfg: TrainDocument, tasks: list[EvalTask], device: torch.device, use_bf16: bool, logger):
        self.cfg, self.tasks, self.device, self.use_bf16, self.logger = cfg, tasks, device, use_bf16, logger

    def objective(self, weights, loss_weights) -> torch.nn.Module:
        """A fresh objective (model + loss) built on this worker's device with these weights, in eval mode."""
        with torch.device(self.device):
            objective = build_objective(self.cfg)
        objective.model.load_state_dict(weights)
        objective.loss.load_state_dict(loss_weights)
        return objective.eval()

    def evaluate(self, objective: torch.nn.Module, step: int, stop: Callable[[], bool] | None = None
                 ) -> tuple[dict[str, float], dict[str, TaskResult]]:
        """The `{task}/{metric}` numbers (logged at `step`) and per-task results of the objective's model, on its
        device under the training autocast. EvaluationError names the task that failed; EvaluationStopped where
        `stop` (checked before each batch) said so (nothing logged)."""
        cfg, model = self.cfg, objective.model
        metrics: dict[str, float] = {}
        results: dict[str, TaskResult] = {}
        for task in self.tasks:
            try:
                batches = eval_batches(task, cfg.eval.batch_size, stop)
                if task.kind == "loss":
                    metrics[f"{task.name}/loss"] = held_out_loss(objective, batches, self.use_bf16)
                    continue
                embeddings = embed_task_locally(model, task, batches, cfg.eval.batch_size, self.use_bf16)
                results[task.name] = score_task(model, task, embeddings, cfg.eval.calibration_bins)
            except EvaluationStopped:
                raise
            except Exception as err:  # noqa: BLE001 - any failure of a task is reported by its name
                raise EvaluationError.of(task.name, err) from err
            metrics.update(prefixed(task, results[task.name]))
        self.logger.log(metrics, step)
        return metrics, results

    def validate(self, weights, loss_weights, step: int, stop: Callable[[], bool] | None = None
                 ) -> dict[str, float] | None:
        """Every eval task's metrics at `step`. A task that fails is reported (printed, MLflow tag
        `probvlp.eval_error`) and training goes on with every metric NaN in this report (a sweep's scheduler needs
        its metric in each report; NaN is never a score): the final evaluation decides the run's status. None where
        `stop` stopped it (a notice during it)."""
        try:
            return self.evaluate(self.objective(weights, loss_weights), step, stop)[0]
        except EvaluationStopped:
            print(f"[preemption] a notice during the evaluation of step {step}: stopped, for the notice's save; the "
                  "evaluation comes again after it", flush=True)
            return None
        except EvaluationError as err:
            print(f"[probvlp] step {step}: {err}", flush=True)
            self.logger.tag("probvlp.eval_error", f"step {step}: {err}")
            return {name: float("nan") for name in metric_names(self.cfg)}

    def probe(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The embedding probe on the first eval task's data; None (tagged `probvlp.probe_error`) where that data
        fails it: whatever the data holds, the model is saved."""
        try:
            return embedding_probe(model, self.tasks[0])
        except Exception as err:  # noqa: BLE001
            self.logger.tag("probvlp.probe_error", str(EvaluationError.of(self.tasks[0].name, err)))
            return None

    def final(self, objective: torch.nn.Module, step: int) -> tuple[dict[str, float], dict[str, TaskResult], str | None]:
        """The run's final metrics and per-task results, or ({}, {}, one line naming the task that failed: printed
        and tagged `probvlp.failure`, the run's status)."""
        try:
            return (*self.evaluate(objective, step), None)
        except EvaluationError as err:
            reason = str(err)
            print(f"[probvlp] {reason}; the trained model is saved: runs:/{self.logger.run_id}/model", flush=True)
            self.logger.tag("probvlp.failure", reason)
            return {}, {}, reason

    def samples(self, model: torch.nn.Module, n: int = 4) -> list[str]:
        """The summary's sample predictions (pipelines.evaluate.samples) on the first images of the showcase task's
        data; none where the tasks have nothing to show, one line saying why where its data fails them (the run is
        done and logged: a sample that cannot be shown must not turn it into a failure)."""
        task = showcase_task(self.tasks)
        if task is None:
            return []
        try:
            return sample_predictions(model, task, next(iter(eval_batches(task, n))), n)
        except Exception as err:  # noqa: BLE001
            return [f"(no sample predictions: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"]

    def save_results(self, metrics: dict[str, float], results: dict[str, TaskResult], folder: Path) -> None:
        """The final metrics (eval/metrics.json, eval/summary.md) and the tasks' plots (plots/) as run artifacts."""
        (folder / "metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True))
        (folder / "summary.md").write_text(summary_table(metrics))
        for name in ("metrics.json", "summary.md"):
            self.logger.artifact(folder / name, "eval")
        for png in write_plots(results, folder):
            self.logger.artifact(png, "plots")
