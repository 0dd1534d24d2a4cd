"""The sweep in MLflow: one parent run, each trial a nested child run with its stopping reason.

Parent (tag ``vitsweep.role=sweep``): the sweep's settings as params, the space and base config as
artifacts, and at the end the best trial, ``results.csv``, ``pruned.csv`` and ``plots/``.
Children (``mlflow.parentRunId`` = the parent, so the UI nests them): everything a training run
records, plus tags ``trial_id``, ``knobs`` (JSON of the searched and derived values) and
``stop_reason``: ``completed``, ``early_stopped: ...`` (by ASHA: status FINISHED, not a failure),
``diverged: ...`` / ``error: ...`` (FAILED) or ``interrupted`` (KILLED; ``--resume`` continues it).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from ray.tune import Callback

from pipeline.tracking import experiment_id

PARENT_TAG = "mlflow.parentRunId"
ROLE_TAG = "vitsweep.role"
SWEEP_TAG = "sweep"
TRIAL_TAG = "trial_id"
KNOBS_TAG = "knobs"
STOP_REASON_TAG = "stop_reason"

COMPLETED, EARLY_STOPPED, DIVERGED, ERROR, INTERRUPTED = "completed", "early_stopped", "diverged", "error", "interrupted"


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def open_parent_run(uri: str, experiment: str, sweep_name: str, run_id: str | None = None) -> str:
    """The sweep's parent run: a new one, or ``run_id`` continued (``--resume``)."""
    client = _client(uri)
    if run_id:
        client.update_run(run_id, status="RUNNING")
        return run_id
    tags = {ROLE_TAG: "sweep", SWEEP_TAG: sweep_name}
    return client.create_run(experiment_id(client, experiment), run_name=sweep_name, tags=tags).info.run_id


def log_sweep_setup(uri: str, run_id: str, params: dict[str, Any], files: dict[str, str]) -> None:
    from mlflow.entities import Param

    client = _client(uri)
    logged = client.get_run(run_id).data.params
    new = [Param(k, str(v)) for k, v in params.items() if k not in logged]
    client.log_batch(run_id, params=new)
    log_texts(uri, run_id, files)


def log_texts(uri: str, run_id: str, files: dict[str, str], artifact_path: str | None = None) -> None:
    client = _client(uri)
    with tempfile.TemporaryDirectory() as directory:
        for name, text in files.items():
            (Path(directory) / name).write_text(text)
            client.log_artifact(run_id, str(Path(directory) / name), artifact_path)


def find_child_run(uri: str, experiment: str, parent_run_id: str, trial_id: str):
    client = _client(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs(
        [found.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}' and tags.{TRIAL_TAG} = '{trial_id}'",
        max_results=2,
    )
    return runs[0] if runs else None


def open_child_run(uri: str, experiment: str, parent_run_id: str, sweep_name: str, trial_id: str, run_name: str,
                   knobs: dict[str, Any]) -> str:
    """The trial's child run, keyed by (parent, trial id): a restarted trial continues its run."""
    existing = find_child_run(uri, experiment, parent_run_id, trial_id)
    client = _client(uri)
    if existing is not None:
        client.update_run(existing.info.run_id, status="RUNNING")
        client.set_tag(existing.info.run_id, STOP_REASON_TAG, "running")
        return existing.info.run_id
    tags = {PARENT_TAG: parent_run_id, ROLE_TAG: "trial", SWEEP_TAG: sweep_name, TRIAL_TAG: trial_id,
            KNOBS_TAG: json.dumps(knobs), STOP_REASON_TAG: "running"}
    return client.create_run(experiment_id(client, experiment), run_name=run_name, tags=tags).info.run_id


def child_runs(uri: str, parent_run_id: str) -> list:
    client = _client(uri)
    parent = client.get_run(parent_run_id)
    return client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'", max_results=10000,
    )


def record_stop(uri: str, run_id: str, status: str | None, reason: str) -> None:
    client = _client(uri)
    client.set_tag(run_id, STOP_REASON_TAG, reason)
    if status:
        client.set_terminated(run_id, status=status)


def mark_unfinished(uri: str, parent_run_id: str, reason: str) -> None:
    """Children still RUNNING when the sweep stops (interrupted): KILLED, to be continued by --resume."""
    for run in child_runs(uri, parent_run_id):
        if run.info.status == "RUNNING":
            record_stop(uri, run.info.run_id, "KILLED", reason)


def _error_line(trial) -> str:
    try:
        error = trial.get_pickled_error() or trial.get_error()
    except Exception:  # noqa: BLE001  (the error file may not be readable from here)
        error = None
    lines = [line.strip() for line in str(error or "").splitlines() if line.strip()]
    return lines[-1][:500] if lines else f"see the trial's error file under {trial.local_path}"


class TrialRecorder(Callback):
    """Runs in the sweep's driver: gives every finished trial's child run its stopping reason.

    A trial stopped by ASHA is killed with its workers, so its run is still RUNNING here: it is
    recorded ``early_stopped`` (status FINISHED). One that trained every epoch finished its own run.
    """

    def __init__(self, uri: str, experiment: str, parent_run_id: str, epochs: int, scheduler: str):
        self.uri, self.experiment, self.parent_run_id = uri, experiment, parent_run_id
        self.epochs, self.scheduler = epochs, scheduler

    def _run(self, trial):
        return find_child_run(self.uri, self.experiment, self.parent_run_id, trial.trial_id)

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        run = self._run(trial)
        if run is None:  # pruned as it started (TPE sample): no run, recorded in the parent's pruned.csv
            return
        from pipeline.sweeps.trial import TIME_ATTR

        if run.info.status == "RUNNING":
            done = int(trial.last_result.get(TIME_ATTR, 0))
            record_stop(self.uri, run.info.run_id, "FINISHED",
                        f"{EARLY_STOPPED}: {self.scheduler.upper()} stopped it after epoch {done} of {self.epochs}")
        else:
            record_stop(self.uri, run.info.run_id, None, COMPLETED)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        from pipeline.tracking import DIVERGED_TAG

        run = self._run(trial)
        if run is None:
            return
        diverged = run.data.tags.get(DIVERGED_TAG)
        reason = f"{DIVERGED}: loss diverged at {diverged}" if diverged else f"{ERROR}: {_error_line(trial)}"
        record_stop(self.uri, run.info.run_id, "FAILED" if run.info.status == "RUNNING" else None, reason)
