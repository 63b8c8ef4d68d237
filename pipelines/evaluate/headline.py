"""The lines a job prints about an evaluation's numbers: each eval task's main metrics (`jobs.evaluate`, and the end
of `jobs.pretrain` through `pipelines.pretrain.run_summary`)."""
from __future__ import annotations

import math

HEADLINE = ("top1", "top5", "i2t_R1", "t2i_R1", "rsum", "loss", "i2t_calib_score", "t2i_calib_score", "top1_calib_score")


def headline(metrics: dict) -> list[str]:
    """One line per eval task with its main numbers; a calibration score that is undefined (NaN: the metric is
    the same in every sigma^2 bin) reads n/a, with a line saying why."""
    tasks: dict[str, list[str]] = {}
    undefined = False
    for key, value in metrics.items():
        task, _, name = key.partition("/")
        if name in HEADLINE and isinstance(value, (int, float)):
            nan = math.isnan(value)
            undefined |= nan
            tasks.setdefault(task, []).append(f"{name} n/a" if nan else f"{name} {value:.4g}")
    lines = [f"  {task}: {', '.join(parts)}" for task, parts in tasks.items()]
    if undefined:
        lines.append("  (n/a: the metric is the same in every sigma^2 bin, e.g. no query right, so it cannot "
                     "track sigma^2)")
    return lines
