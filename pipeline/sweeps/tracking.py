"""The sweep in MLflow: one parent run, each trial a nested child run with its stopping reason.

Runs are written through ``pipeline.tracking.store.MlflowRun``; this module only keys them.
Parent (tag ``vitsweep.role=sweep``): the sweep's settings as params, the space and base config as
artifacts, and at the end the best trial, ``results.csv``, ``pruned.csv`` and ``plots/``.
Children (``mlflow.parentRunId`` = the parent, so the UI nests them): everything a training run
records, plus tags ``trial_id``, ``knobs`` (JSON of the searched and derived values) and
``stop_reason``: ``completed``, ``early_stopped: ...`` (by ASHA: status FINISHED, not a failure),
``diverged: ...`` / ``error: ...`` (FAILED), ``interrupted`` (KILLED; ``--resume`` continues it) or
``pruned: oom: ...`` (FINISHED: it does not fit in memory even at micro-batch 1, ``pipeline.training.oom``).
"""
from __future__ import annotations

import json
import os
from typing import Any

from mlflow.entities import Run
from ray.tune import Callback

from pipeline.tracking.store import DIVERGED_TAG, STOP_REASON_TAG, SWEEP_TAG, TRIAL_TAG, MlflowRun, MlflowStore

PARENT_TAG = "mlflow.parentRunId"
ROLE_TAG = "vitsweep.role"
KNOBS_TAG = "knobs"
EPOCHS_DONE = "epochs_done"  # what a trial reports to Tune each epoch (1-based); ASHA's time attribute

COMPLETED, EARLY_STOPPED, DIVERGED, ERROR, INTERRUPTED, PRUNED = (
    "completed", "early_stopped", "diverged", "error", "interrupted", "pruned")
TRIAL_STATES = (COMPLETED, EARLY_STOPPED, DIVERGED, ERROR, INTERRUPTED, PRUNED)


def open_parent_run(uri: str, experiment: str, sweep_name: str, run_id: str | None = None) -> MlflowRun:
    """The sweep's parent run: a new one, or ``run_id`` continued (``--resume``); its ``stop_reason``
    says ``running`` until the sweep ends (``runner.finish_sweep``)."""
    if run_id:
        parent = MlflowRun(uri, run_id)
        parent.set_running()
        parent.set_tags({STOP_REASON_TAG: "running"})  # why it stopped before is history now
        return parent
    return MlflowStore(uri).create_run(experiment, sweep_name,
                                       tags={ROLE_TAG: "sweep", SWEEP_TAG: sweep_name, STOP_REASON_TAG: "running"})


def find_child_run(uri: str, experiment: str, parent_run_id: str, trial_id: str) -> Run | None:
    store = MlflowStore(uri)
    found = store.find_experiment(experiment)
    if found is None:
        return None
    runs = store.search(found.experiment_id, max_results=2,
                        filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}' and tags.{TRIAL_TAG} = '{trial_id}'")
    return runs[0] if runs else None


def open_child_run(uri: str, experiment: str, parent_run_id: str, sweep_name: str, trial_id: str, run_name: str,
                   knobs: dict[str, Any]) -> MlflowRun:
    """The trial's child run, keyed by (parent, trial id): a restarted trial continues its run."""
    existing = find_child_run(uri, experiment, parent_run_id, trial_id)
    if existing is not None:
        child = MlflowRun(uri, existing.info.run_id)
        child.set_running()
        child.set_tags({STOP_REASON_TAG: "running"})
        return child
    tags = {PARENT_TAG: parent_run_id, ROLE_TAG: "trial", SWEEP_TAG: sweep_name, TRIAL_TAG: trial_id,
            KNOBS_TAG: json.dumps(knobs), STOP_REASON_TAG: "running"}
    return MlflowStore(uri).create_run(experiment, run_name, tags)


def child_runs(parent: MlflowRun) -> list[Run]:
    return MlflowStore(parent.uri).search(parent.get().info.experiment_id, f"tags.`{PARENT_TAG}` = '{parent.run_id}'")


def record_stop(run: MlflowRun, status: str | None, reason: str) -> None:
    if status:
        run.end(status, reason)
    else:
        run.set_tags({STOP_REASON_TAG: reason})


def mark_unfinished(parent: MlflowRun, reason: str) -> None:
    """Children still RUNNING when the sweep stops (interrupted): KILLED, to be continued by --resume."""
    for child in child_runs(parent):
        if child.info.status == "RUNNING":
            record_stop(MlflowRun(parent.uri, child.info.run_id), "KILLED", reason)


def trial_error_text(trial) -> str:
    """The error Tune recorded for a failed trial, as its callbacks see it: Tune writes the error into
    the trial's local directory just before calling them, and copies it to the run's storage (where
    ``Trial.get_error`` reads) only at its next sync."""
    if trial.error_file and os.path.isfile(trial.error_file):
        with open(trial.error_file) as written:
            return written.read()
    try:
        return str(trial.get_pickled_error() or trial.get_error() or "")
    except Exception:  # noqa: BLE001  (the error file may not be readable from here)
        return ""


def _error_line(trial) -> str:
    lines = [line.strip() for line in trial_error_text(trial).splitlines() if line.strip()]
    return lines[-1][:500] if lines else f"see the trial's error file under {trial.local_path}"


class TrialRecorder(Callback):
    """Runs in the sweep's driver: gives every finished trial's child run its stopping reason.

    A trial stopped by ASHA is killed with its workers, so its run is still RUNNING here: it is
    recorded ``early_stopped`` (status FINISHED). One that trained every epoch finished its own run.
    """

    def __init__(self, uri: str, experiment: str, parent_run_id: str, epochs: int, scheduler: str):
        self.uri, self.experiment, self.parent_run_id = uri, experiment, parent_run_id
        self.epochs, self.scheduler = epochs, scheduler

    def _run(self, trial) -> tuple[MlflowRun, Run] | None:
        found = find_child_run(self.uri, self.experiment, self.parent_run_id, trial.trial_id)
        return None if found is None else (MlflowRun(self.uri, found.info.run_id), found)

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        child = self._run(trial)
        if child is None:  # pruned as it started (TPE sample): no run, recorded in the parent's pruned.csv
            return
        run, found = child
        if found.info.status == "RUNNING":
            done = int(trial.last_result.get(EPOCHS_DONE, 0))
            record_stop(run, "FINISHED",
                        f"{EARLY_STOPPED}: {self.scheduler.upper()} stopped it after epoch {done} of {self.epochs}")
        elif not found.data.tags.get(STOP_REASON_TAG, "").startswith(f"{PRUNED}: "):  # pruned by its own end (oom)
            record_stop(run, None, COMPLETED)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        child = self._run(trial)
        if child is None:
            return
        run, found = child
        diverged = found.data.tags.get(DIVERGED_TAG)
        reason = f"{DIVERGED}: loss diverged at {diverged}" if diverged else f"{ERROR}: {_error_line(trial)}"
        record_stop(run, "FAILED" if found.info.status == "RUNNING" else None, reason)
