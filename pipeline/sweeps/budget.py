"""``tune.budget_hours``: a sweep that starts no further trial once its trials have spent the budget.

Tune's own early end (a ``Stopper``'s ``stop_all``) terminates every trial, the pending ones too, which a
resumed sweep would then never run. Here the sweep's scheduler starts nothing once the spend reaches
the budget (``budgeted_scheduler``), the running trials finish, and the sweep then ends as an
interrupted one does: by SIGUSR1, Tune's signal to end a run and save its state. Its pending trials stay
pending, and ``vitsweep tune --resume DIR --set tune.budget_hours=MORE`` runs them.

The spend is what the trials' MLflow runs recorded (``pipeline.training.cost``: each epoch's running
total, each attempt's whole spend when it ends), summed. Tune pickles its scheduler and callbacks
with the sweep's state and restores those on ``--resume``, so the budget is read from the sweep's
record when first needed, never held from when the sweep began.
"""
from __future__ import annotations

import json
import signal

from ray.tune import Callback
from ray.tune.experiment import Trial
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from pipeline import uris
from pipeline.sweeps.tracking import child_runs
from pipeline.tracking.store import STOP_REASON_TAG, MlflowRun
from pipeline.training.cost import ACCELERATOR_HOURS

BUDGET = "budget"  # the stop reason's first word, before ': ' (as the trials' states)


def recorded_budget(record_path: str) -> float | None:
    """``tune.budget_hours`` as the sweep's record holds it now (``--resume`` may have raised it)."""
    return json.loads(uris.read_bytes(record_path).decode())["base_config"]["tune"].get("budget_hours")


def trials_spend(parent: MlflowRun) -> float:
    """Accelerator-hours the sweep's trials have recorded so far."""
    return sum(run.data.metrics.get(ACCELERATOR_HOURS, 0.0) for run in child_runs(parent))


class SweepBudget(Callback):
    """In the sweep's driver: the spend after each trial's report and end; once it reaches the budget
    and no trial runs, it records why the sweep stops (the parent run's ``stop_reason``) and stops it."""

    def __init__(self, uri: str, parent_run_id: str, record_path: str, unit: str):
        self.uri, self.parent_run_id, self.record_path, self.unit = uri, parent_run_id, record_path, unit
        self._hours: float | None = None
        self._read = False
        self.spent = 0.0
        self.stopping = False

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_read": False}  # restored by --resume: the budget is read again

    @property
    def hours(self) -> float | None:
        if not self._read:  # first use: restored from a pickle or not, the record's value now
            self._hours, self._read = recorded_budget(self.record_path), True
            self.refresh()
        return self._hours

    @property
    def exhausted(self) -> bool:
        return self.hours is not None and self.spent >= self.hours

    def refresh(self) -> None:
        if self._hours is not None:
            self.spent = trials_spend(MlflowRun(self.uri, self.parent_run_id))

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info) -> None:
        self.refresh()

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        self.refresh()

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        self.refresh()

    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        if self.stopping or not self.exhausted or any(t.status == Trial.RUNNING for t in trials):
            return
        waiting = sum(t.status in (Trial.PENDING, Trial.PAUSED) for t in trials)
        if not waiting:
            return  # every trial has run: the sweep ends as it would have
        self.stopping = True
        MlflowRun(self.uri, self.parent_run_id).set_tags({STOP_REASON_TAG: self.reason(waiting)})
        signal.raise_signal(signal.SIGUSR1)  # Tune's own graceful end: its state saved, pending trials kept

    def reason(self, waiting: int) -> str:
        return (f"{BUDGET}: the trials spent {self.spent:.4g} {self.unit} of tune.budget_hours={self._hours:g}; "
                f"{waiting} trial{'s' if waiting != 1 else ''} not started")


class _Budgeted:
    """A scheduler that starts no trial once ``budget`` is exhausted."""

    def __init__(self, budget: SweepBudget, **settings):
        super().__init__(**settings)
        self.budget = budget

    def choose_trial_to_run(self, tune_controller) -> Trial | None:
        if self.budget.exhausted:
            return None
        return super().choose_trial_to_run(tune_controller)


class BudgetedFIFOScheduler(_Budgeted, FIFOScheduler):
    pass


class BudgetedASHAScheduler(_Budgeted, ASHAScheduler):
    pass
