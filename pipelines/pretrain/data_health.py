"""Rank 0's view of what the readers skipped during a training run (`pipelines.data.stats`): the train set's share
polled at each log step (the progress line, MLflow, the data.max_bad_frac stop), every dataset's report at the end."""
from __future__ import annotations

import json
from pathlib import Path

from pipelines.data.stats import bad_share_error, reader_stats, report_metrics, skipped_share
from pipelines.console import share_field

# Samples met before the share of skipped ones may stop a run in its first epoch: a few bad samples early
# do not decide (the end of the first epoch always does).
MIN_MET = 1000


def run_stats_name(run_id: str, dataset: str) -> str:
    """The stats name of one of a training run's Ray datasets ("train", "eval_<task>"): its own counts, whatever
    other runs share the cluster."""
    return f"{run_id}/{dataset}"


class DataHealth:
    def __init__(self, run_id: str, datasets: list[str], max_bad_frac: float):
        self.names = {d: run_stats_name(run_id, d) for d in datasets}
        self.max_bad_frac = max_bad_frac
        self.train = reader_stats(self.names["train"])

    def poll(self, epoch_done: bool) -> str | None:
        """Fresh train-set counts; the one line that stops the run when its share is past data.max_bad_frac."""
        self.train = reader_stats(self.names["train"])
        return bad_share_error("training", self.train, self.max_bad_frac, 0 if epoch_done else MIN_MET)

    def fields(self) -> dict[str, str]:
        return share_field("skipped", skipped_share(self.train))

    def metrics(self) -> dict[str, float]:
        return report_metrics("train", self.train)

    def reports(self) -> dict[str, dict]:
        """Every dataset's stats, as they are now."""
        return {d: reader_stats(name) for d, name in self.names.items()}

    @staticmethod
    def write(reports: dict[str, dict], folder: Path) -> Path:
        """The reports (counts, example samples and files by reason) as JSON, for the run's artifacts."""
        path = folder / "skipped.json"
        path.write_text(json.dumps(reports, indent=1, sort_keys=True))
        return path
