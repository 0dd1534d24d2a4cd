"""A sweep's progress on the console: one compact table of its trials (Tune callback, in the driver).

Columns: the trial, each knob by its short name, epochs done, the optimised metric, the status
(running, completed, stopped early, diverged, failed). On a terminal the table is redrawn in
place; otherwise each change is one plain line, and the finished sweep prints the whole table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ray.tune import Callback

from pipeline.console import active_console
from pipeline.sweeps.report import EPOCHS_KEY, knobs_text
from pipeline.sweeps.spaces import short_keys
from pipeline.sweeps.tracking import EPOCHS_DONE, trial_error_text

RUNNING, COMPLETED, STOPPED_EARLY, DIVERGED, FAILED = "running", "completed", "stopped early", "diverged", "failed"


@dataclass
class TrialLine:
    trial_id: str
    knobs: dict[str, Any]
    epochs: int = 0
    value: float = math.nan
    status: str = RUNNING


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_cell(v) for v in value) + "]"
    return str(value)


class SweepTable(Callback):
    """Tune pickles its callbacks with the sweep's state (``--resume``): the console is looked up, not held."""

    def __init__(self, metric: str, epochs: int):
        self.metric, self.epochs = metric, epochs
        self.trials: dict[str, TrialLine] = {}
        self._drawn = 0  # lines of the table on screen (terminal)

    def render(self) -> list[str]:
        keys = list(dict.fromkeys(key for line in self.trials.values() for key in line.knobs))
        header = ["trial", *short_keys(keys).values(), "epochs", self.metric, "status"]
        rows = [[line.trial_id, *[_cell(line.knobs.get(key, "")) for key in keys], f"{line.epochs}/{self._epochs(line)}",
                 _cell(line.value), line.status] for line in self.trials.values()]
        widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
        return ["  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip() for cells in [header, *rows]]

    def _epochs(self, line: TrialLine) -> int:
        """The trial's own epochs: the sweep's, or its knob where the space searches them (fifo only)."""
        return int(line.knobs.get(EPOCHS_KEY, self.epochs))

    def _show(self, line: TrialLine, event: str) -> None:
        console = active_console()
        if console.terminal:
            table = self.render()
            up = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
            console.redraw(up + "\n".join(table) + "\n")
            self._drawn = len(table)
        else:
            console.line(f"trial {line.trial_id} ({knobs_text(line.knobs)}): {event}")

    def _line(self, trial) -> TrialLine:
        if trial.trial_id not in self.trials:
            self.trials[trial.trial_id] = TrialLine(trial.trial_id, dict(trial.config.get("knobs", {})))
        return self.trials[trial.trial_id]

    def on_trial_start(self, iteration: int, trials: list, trial, **info) -> None:
        self._show(self._line(trial), "started")

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info) -> None:
        line = self._line(trial)
        line.epochs = int(result.get(EPOCHS_DONE, line.epochs))
        line.value = float(result.get(self.metric, line.value))
        self._show(line, f"epoch {line.epochs}/{self._epochs(line)}  {self.metric} {_cell(line.value)}")

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        line = self._line(trial)
        if line.epochs == 0 and not trial.last_result.get(EPOCHS_DONE):  # a TPE sample pruned as it started
            line.status = "pruned"
        else:
            line.status = COMPLETED if line.epochs >= self._epochs(line) else STOPPED_EARLY
        self._show(line, line.status + (f" after epoch {line.epochs}" if line.status == STOPPED_EARLY else ""))

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        line = self._line(trial)
        line.status = DIVERGED if "loss diverged" in trial_error_text(trial) else FAILED
        self._show(line, line.status)
