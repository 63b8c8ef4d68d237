"""ASHA for sweeps that are stopped and resumed.

Tune saves the search algorithm with the experiment but not the scheduler: a resumed sweep rebuilds ASHA from the
pickle written when the sweep started (ray-project/ray#30838), so its rungs start empty and the trials after a
resume are compared with nothing and never cut. Tune also counts `training_iteration` from 1 again for a trial
resumed from its checkpoint, so its rungs would come late. Here the rungs are kept in a JSON file beside the
experiment, rewritten after every result that lands on one, and read back when the resumed sweep adds its trials;
and time is the training step, which a resumed trial continues.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ray.tune.schedulers import ASHAScheduler


class ResumableASHA(ASHAScheduler):
    """ASHAScheduler (time_attr "step") whose rung records survive a stop and resume of the sweep."""

    def __init__(self, *, state_file: str, **kwargs):
        super().__init__(time_attr="step", **kwargs)
        self._state_file = state_file
        self._state_read = False
        self._written = ""

    def _rungs(self) -> list[list[tuple[float, dict]]]:
        return [bracket._rungs for bracket in self._brackets]

    def _read_state(self) -> None:
        if self._state_read:
            return
        self._state_read = True
        path = Path(self._state_file)
        if not path.is_file():
            return
        saved = json.loads(path.read_text())
        for rungs, saved_rungs in zip(self._rungs(), saved):
            for (milestone, recorded), (saved_milestone, saved_recorded) in zip(rungs, saved_rungs):
                if milestone == saved_milestone:  # the same sweep settings: the same milestones
                    recorded.update(saved_recorded)

    def _write_state(self) -> None:
        text = json.dumps(self._rungs())
        if text == self._written:  # most results land on no rung
            return
        self._written = text
        path = Path(self._state_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # a Ctrl-C mid-write leaves the last whole file

    def on_trial_add(self, tune_controller, trial):
        self._read_state()  # every trial is added before its first result, the restored ones too
        super().on_trial_add(tune_controller, trial)

    def on_trial_result(self, tune_controller, trial, result):
        action = super().on_trial_result(tune_controller, trial, result)
        self._write_state()
        return action

    def on_trial_complete(self, tune_controller, trial, result):
        super().on_trial_complete(tune_controller, trial, result)
        self._write_state()
