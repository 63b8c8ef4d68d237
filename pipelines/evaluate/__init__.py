"""Evaluation: tasks on any data (tasks), in-process and Ray Data embeddings (embed, inference), the uncertainty
analyses (uncertainty) and `jobs.evaluate` (job); the tasks' data is read by `pipelines.data.eval_reader` and
`pipelines.data.eval_tasks`. Only the error type lives here: the jobs' error handling imports it without the
evaluation's dependencies."""
from __future__ import annotations


class EvaluationError(RuntimeError):
    """An eval task that could not be computed; the message is one line naming the task."""

    @classmethod
    def of(cls, task: str, err: BaseException) -> "EvaluationError":
        first = (str(err).strip().splitlines() or [""])[0]
        return cls(f"evaluation task {task!r} failed: {type(err).__name__}: {first}"[:500])
