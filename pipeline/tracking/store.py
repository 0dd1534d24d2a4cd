"""MLflow runs: the one object every run is written through, and the store they are read from.

``MlflowRun`` (a store URI, a run id, one client) is the only writer of runs: the driver opens or
continues a training run's, Ray Train's controller logs each epoch into it
(``pipeline.training.epoch_logger``), and sweeps key their parent and child runs on top of it
(``pipeline.sweeps.tracking``). Reports read through ``MlflowStore``. A run directory records which
MLflow run it belongs to (``RUN_RECORD``), so that a restarted run continues its own.
"""
from __future__ import annotations

import getpass
import json
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag, LoggedModelInput, Metric, Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from pipeline.atomic import write_text_atomically
from pipeline.config.schema import ExperimentConfig
from pipeline.report_keys import DIVERGED_KEY, INITIAL_PREFIX
from pipeline.tracking.connection import local_artifact_root, open_client

# What vitsweep named every run's logged model before naming each after its run (``logged_model_name``); in
# ``runs:/<run_id>/model`` it still names the run's own model to vitsweep's commands (``run_model_id``).
FORMER_MODEL_NAME = "model"
MODEL_ID_TAG = "vitsweep.model_id"  # the run's own logged model (its name follows the run's, which the UI can change)
# What MLflow 3.17 refuses in a logged model's name (/ : . % " '), and what would cut it short in a runs:/ URI (# ?).
MODEL_NAME_FORBIDDEN = re.compile(r"[/:.%\"'#?]")
SWEEP_TAG, TRIAL_TAG = "sweep", "trial_id"  # a sweep trial's run: its sweep's name and Tune's trial id
LOGGED_MODEL_FILES = "extra_files"  # where mlflow.pytorch keeps a logged model's extra files (its weights)
RUN_RECORD = "mlflow_run.json"  # beside Ray's files in the run directory: a restarted run continues its MLflow run
DIVERGED_TAG = DIVERGED_KEY  # the MLflow tag saying where the loss diverged
# Why a run ended, one line: completed, diverged: ..., error: ..., interrupted: SIGINT; sweeps add
# early_stopped: ... for trials their scheduler stopped.
STOP_REASON_TAG = "stop_reason"
# How a store's database says an insert met a row another process had just added (SQLite, PostgreSQL, MySQL).
UNIQUE_KEY_VIOLATIONS = ("IntegrityError", "UniqueViolation", "duplicate key", "Duplicate entry")
SAVED_VIEW_TAG = "mlflow.sharedViewState."  # MLflow 3.17 UI: an experiment tag per saved runs-table view


def command_line() -> str:
    """The command this process runs, as the UI's Source shows it."""
    return " ".join(["vitsweep", *sys.argv[1:]]) if Path(sys.argv[0]).name in ("vitsweep", "__main__.py") else "vitsweep"


def run_origin(description: str, source: str) -> dict[str, str]:
    """Tags the UI shows as the run's Description, Created by and Source (its model's "Logged from").

    The source is a JOB, which MLflow 3.17's UI shows as written: a LOCAL source it shows as a file path's
    last part, so a command with a path in it would read from its last "/" (``x.yaml --set ...`` for
    ``vitsweep train --config configs/x.yaml --set ...``)."""
    return {"mlflow.note.content": description, "mlflow.user": getpass.getuser(), "mlflow.source.name": source,
            "mlflow.source.type": "JOB"}


def read_run_record(run_dir: Path) -> dict[str, str] | None:
    """Which MLflow run a run directory belongs to: ``tracking_uri``, ``run_id``, ``experiment`` (its
    name) and ``experiment_id`` (written when its MLflow run was created; a sweep trial's when its
    model is logged), and ``model_id``, the MLflow logged model of its final weights (once logged)."""
    record = run_dir / RUN_RECORD
    return json.loads(record.read_text()) if record.is_file() else None


def update_run_record(run_dir: Path, **entries: str) -> None:
    """Add ``entries`` to the run directory's record of its MLflow run (written whole, atomically)."""
    record = {**(read_run_record(run_dir) or {}), **entries}
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(run_dir / RUN_RECORD, json.dumps(record) + "\n")


def logged_model_name(run: Run) -> str:
    """The name the run's logged model goes by in the Models tab (and in ``runs:/<run_id>/<name>``): the
    run's name, a sweep trial's id and sweep (``afe7d_00005 of smoke_lr_wd-20261207-154841``: its run name
    holds the knobs' values, whose decimal points MLflow refuses in a model's name), each character of
    ``MODEL_NAME_FORBIDDEN`` made ``_``."""
    tags = run.data.tags
    name = (f"{tags[TRIAL_TAG]} of {tags[SWEEP_TAG]}" if TRIAL_TAG in tags and SWEEP_TAG in tags
            else run.info.run_name or run.info.run_id)
    return MODEL_NAME_FORBIDDEN.sub("_", name)


def run_model_id(client: MlflowClient, run: Run) -> str | None:
    """The id of the model ``run`` logged as its own (``MODEL_ID_TAG``; from an older vitsweep, its model
    named ``FORMER_MODEL_NAME``), or None: a run that has not finished logged none."""
    if MODEL_ID_TAG in run.data.tags:
        return run.data.tags[MODEL_ID_TAG]
    outputs = run.outputs.model_outputs if run.outputs else []
    return next((output.model_id for output in outputs
                 if client.get_logged_model(output.model_id).name == FORMER_MODEL_NAME), None)


def dataset_reference(location: str, sha256: str) -> tuple[str, str]:
    """How a dataset input is named in MLflow: (file name, digest). MLflow caps a digest at 36
    characters: it is the SHA-256's prefix (``log_datasets`` adds the whole hash as a tag)."""
    return Path(location).name, sha256[:32]


class MlflowStore:
    """One MLflow store: its experiments and the runs in them (reading; runs are written by ``MlflowRun``)."""

    def __init__(self, uri: str):
        self.uri = uri
        self.client = open_client(uri)

    def experiment_id(self, experiment: str) -> str:
        """The id of the named experiment, created (artifacts beside a local store) if it is new."""
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(experiment, artifact_location=local_artifact_root(self.uri))
        except MlflowException as error:
            # Another command created it since we looked (two started at once into a new experiment).
            found = self.find_experiment(experiment) if error.error_code == "RESOURCE_ALREADY_EXISTS" else None
            if found is None:
                raise
            return found.experiment_id

    def find_experiment(self, experiment: str):
        return self.client.get_experiment_by_name(experiment)

    def experiment_names(self) -> list[str]:
        return [e.name for e in self.client.search_experiments()]

    def search(self, experiment_id: str, filter_string: str, order_by: list[str] | None = None,
               max_results: int = 10000) -> list[Run]:
        return self.client.search_runs([experiment_id], filter_string=filter_string, order_by=order_by,
                                       max_results=max_results)

    def create_run(self, experiment: str, run_name: str, tags: dict[str, str] | None = None) -> MlflowRun:
        run_id = self.client.create_run(self.experiment_id(experiment), run_name=run_name, tags=tags or {}).info.run_id
        return MlflowRun(self.uri, run_id, self.client)

    def run(self, run_id: str) -> MlflowRun:
        return MlflowRun(self.uri, run_id, self.client)

    def save_view(self, experiment_id: str, key: str, name: str, state: dict[str, Any]) -> None:
        """A saved view of the experiment's runs page, opened by ``ui_link(..., view=key)``: the UI's
        search facets and UI state (table columns, order, filter, chart cards), as JSON."""
        now = int(time.time() * 1000)
        self.client.set_experiment_tag(experiment_id, SAVED_VIEW_TAG + key, json.dumps(
            {"name": name, "createdAt": now, "updatedAt": now, "state": json.dumps(state)}))


class MlflowRun:
    """One MLflow run: every write to it, and what is read back from it."""

    def __init__(self, uri: str, run_id: str, client: MlflowClient | None = None):
        self.uri, self.run_id = uri, run_id
        self.client = client or open_client(uri)

    @classmethod
    def open_or_continue(cls, uri: str, experiment: str, run_dir: Path, run_name: str,
                         tags: dict[str, str] | None = None) -> MlflowRun:
        """The MLflow run of this training run: the recorded one when the run restarts, else a new run."""
        saved = read_run_record(run_dir)
        if saved is not None and saved["tracking_uri"] == uri:
            run = cls(uri, saved["run_id"])
            run.set_running()
            return run
        run = MlflowStore(uri).create_run(experiment, run_name, tags)
        update_run_record(run_dir, tracking_uri=uri, run_id=run.run_id, experiment=experiment,
                          experiment_id=run.get().info.experiment_id)
        return run

    # -- reading --------------------------------------------------------------------------------

    def get(self) -> Run:
        return self.client.get_run(self.run_id)

    @property
    def tags(self) -> dict[str, str]:
        return self.get().data.tags

    def model_id(self) -> str | None:
        """Its own logged model's id (``models:/<model_id>``), once it finished; else None."""
        return run_model_id(self.client, self.get())

    def metric_history(self, key: str) -> list[Metric]:
        return self.client.get_metric_history(self.run_id, key)

    def artifact_names(self) -> list[str]:
        return [artifact.path for artifact in self.client.list_artifacts(self.run_id)]

    def read_artifact(self, name: str) -> str:
        with tempfile.TemporaryDirectory() as directory:
            return Path(self.client.download_artifacts(self.run_id, name, directory)).read_text()

    # -- writing --------------------------------------------------------------------------------

    def set_running(self) -> None:
        self.client.update_run(self.run_id, status="RUNNING")

    def log_params(self, params: dict[str, Any]) -> None:
        """Params not logged yet (MLflow params are immutable: a restart re-logs nothing)."""
        logged = self.get().data.params
        new = [Param(key, str(value)) for key, value in params.items() if key not in logged]
        self.client.log_batch(self.run_id, params=new)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(key, str(value)) for key, value in tags.items()])

    def log_metrics(self, metrics: dict[str, float], step: int = 0, model_id: str | None = None,
                    dataset: tuple[str, str] | None = None) -> None:
        """``model_id``: also the metrics of that MLflow logged model (its page lists them), measured on
        ``dataset`` (``dataset_reference``: a dataset input of this run)."""
        now = int(time.time() * 1000)
        name, digest = dataset or (None, None)
        self.client.log_batch(self.run_id, metrics=[
            Metric(key, float(value), now, step, model_id=model_id, dataset_name=name, dataset_digest=digest)
            for key, value in metrics.items()])

    def log_texts(self, files: dict[str, str], artifact_path: str | None = None) -> None:
        with tempfile.TemporaryDirectory() as directory:
            for name, text in files.items():
                (Path(directory) / name).write_text(text)
                self.log_artifact(Path(directory) / name, artifact_path)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_setup(self, cfg: ExperimentConfig, files: dict[str, str], facts: dict[str, Any],
                  tags: dict[str, str]) -> None:
        """Params (every resolved config value under its dotted key), model facts, tags, setup artifacts."""
        params = {**cfg.flat(), **{f"model_facts.{key}": value for key, value in facts.items()}}
        self.log_params(params)
        self.set_tags(tags)
        self.log_texts(files)

    def log_epoch(self, reported: dict[str, Any]) -> None:
        """A worker's epoch report, one MLflow step per epoch (epochs count from 1 everywhere); the
        evaluation of the weights a run started from, before any step (``initial_*``), at step 0."""
        epoch = int(reported["epoch"])
        metrics = {key: value for key, value in reported.items() if key != "epoch" and isinstance(value, (int, float))}
        initial = {key: metrics.pop(key) for key in list(metrics) if key.startswith(INITIAL_PREFIX)}
        if initial:
            self.log_metrics(initial, step=0)
        self.log_metrics({**metrics, "epochs_trained": epoch}, step=epoch)

    def mark_diverged(self, where: str) -> None:
        self.client.set_tag(self.run_id, DIVERGED_TAG, where)

    def diverged_at(self) -> str | None:
        """'epoch E step S' where the run's loss diverged, if it did."""
        return self.tags.get(DIVERGED_TAG)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)

    def end(self, status: str, reason: str) -> None:
        """FINISHED, FAILED or KILLED, with the one-line reason as the ``stop_reason`` tag."""
        self.set_tags({STOP_REASON_TAG: reason})
        self.finish(status)

    def log_model_input(self, model_id: str) -> None:
        """An MLflow logged model as an input of this run (once), e.g. the model it was fine-tuned from."""
        if model_id not in {model.model_id for model in self.get().inputs.model_inputs}:
            self.client.log_inputs(self.run_id, models=[LoggedModelInput(model_id)])

    def log_datasets(self, datasets: dict[str, tuple[str, str]]) -> None:
        """MLflow dataset inputs: context ("training", "validation") -> (location, SHA-256 of the file).

        MLflow caps a digest at 36 characters: the digest is the hash's prefix, the whole hash a tag.
        """
        inputs = []
        for context, (location, sha256) in datasets.items():
            with warnings.catch_warnings():  # a local path matches several source types; any of them names it
                warnings.simplefilter("ignore", UserWarning)
                source = resolve_dataset_source(location)
            dataset = MetaDataset(source, *dataset_reference(location, sha256))
            inputs.append(DatasetInput(dataset._to_mlflow_entity(),
                                       [InputTag("mlflow.data.context", context), InputTag("sha256", sha256)]))
        try:
            self.client.log_inputs(self.run_id, datasets=inputs)
        except MlflowException as error:
            # MLflow adds a dataset to the experiment by looking for it, then inserting it: runs logging the
            # same new dataset at once (a sweep's first trials) collide on its key, and the loser's call is
            # rolled back whole. Logged again, it finds the winner's dataset and links to it.
            if not any(marker in error.message for marker in UNIQUE_KEY_VIOLATIONS):
                raise
            self.client.log_inputs(self.run_id, datasets=inputs)
