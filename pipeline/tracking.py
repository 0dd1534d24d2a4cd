"""MLflow tracking: where runs are recorded, and the one object every run is written through.

``MlflowRun`` (a store URI, a run id, one client) is the only writer of runs: the driver opens or
continues a training run's, Ray Train's controller logs each epoch into it (``MLflowEpochLogger``),
and sweeps key their parent and child runs on top of it (``pipeline.sweeps.tracking``). Reports
read through ``MlflowStore``. The store itself is resolved and checked here before any run starts.
"""
from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import shutil
import sqlite3
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag, LoggedModelInput, Metric, Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from mlflow.tracking import MlflowClient
from ray.train import UserCallback

from pipeline.config.schema import ExperimentConfig
from pipeline.uris import location_problem, uri_password_problem
from pipeline.console import library_prints, say
from pipeline.atomic import partial_path, publish_if_absent, write_text_atomically
from pipeline.errors import InvalidInputError
from pipeline.components.model_card import MLFLOW_METADATA_KEY, ModelCard
from pipeline.report_keys import DIVERGED_KEY, INITIAL_PREFIX

DEFAULT_STORE_NAME = "mlflow.db"
LOGGED_MODEL_NAME = "model"  # each run's MLflow model: runs:/<run_id>/model
LOGGED_MODEL_FILES = "extra_files"  # where mlflow.pytorch keeps a logged model's extra files (its weights)
RUN_RECORD = "mlflow_run.json"  # beside Ray's files in the run directory: a restarted run continues its MLflow run
DIVERGED_TAG = DIVERGED_KEY  # the MLflow tag saying where the loss diverged
# Why a run ended, one line: completed, diverged: ..., error: ..., interrupted: SIGINT; sweeps add
# early_stopped: ... for trials their scheduler stopped.
STOP_REASON_TAG = "stop_reason"
# How a store's database says an insert met a row another process had just added (SQLite, PostgreSQL, MySQL).
UNIQUE_KEY_VIOLATIONS = ("IntegrityError", "UniqueViolation", "duplicate key", "Duplicate entry")


def resolve_tracking_uri(cfg: ExperimentConfig) -> str:
    """Config first, then ``MLFLOW_TRACKING_URI``, else a SQLite file under the run's storage path."""
    if cfg.tracking.mlflow_uri:
        return cfg.tracking.mlflow_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        problem = uri_password_problem(os.environ["MLFLOW_TRACKING_URI"])
        if problem:
            raise InvalidInputError(f"MLFLOW_TRACKING_URI {problem}")
        return os.environ["MLFLOW_TRACKING_URI"]
    store = Path(cfg.run.storage_path).expanduser().resolve() / DEFAULT_STORE_NAME
    return f"sqlite:///{store}"


def check_reachable(uri: str, timeout_s: float = 5.0) -> str:
    """Raise ConnectionError with the reason when ``uri`` cannot be used; return a short description.

    A server is asked for its ``/health`` within ``timeout_s`` (never a hang); a SQLite or file
    store needs a writable directory.
    """
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as reply:
                if reply.status != 200:
                    raise ConnectionError(f"MLflow server {uri} answered /health with HTTP {reply.status}")
        except (urllib.error.URLError, OSError) as err:
            raise ConnectionError(f"MLflow server {uri} is unreachable: {getattr(err, 'reason', err)}") from None
        return f"server {uri} is up"
    if uri.startswith("sqlite:///"):
        directory = Path(uri.removeprefix("sqlite:///")).parent
    elif uri.startswith("file://"):
        directory = Path(uri.removeprefix("file://"))
    elif "://" not in uri:
        directory = Path(uri)
    else:
        raise ConnectionError(f"MLflow URI {uri!r}: vitsweep can check http(s)://, sqlite:/// and file:// stores")
    problem = location_problem(directory, kind="directory", create=True)
    if problem:
        raise ConnectionError(f"MLflow store {uri}: {problem}")
    return f"local store under {directory} ({'exists' if directory.exists() else 'will be created'})"


def require_reachable(uri: str) -> None:
    """``check_reachable`` as bad input (exit 2): checked before anything starts."""
    try:
        check_reachable(uri)
    except ConnectionError as err:
        raise InvalidInputError(str(err)) from None


def is_local_store(uri: str) -> bool:
    return uri.startswith(("sqlite:///", "file://")) or "://" not in uri


def local_artifact_root(uri: str) -> str | None:
    """Artifacts of a SQLite store live beside its file; MLflow's default would be ./mlruns in
    whatever directory the process runs from. A server decides for itself (None)."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()


def check_logger_can_reach(uri: str, ray_address: str | None) -> None:
    """Ray Train's controller, which logs each epoch, runs on the driver's node; a Ray Client
    driver (``ray://``) runs on the cluster, so it cannot see a store that is a local file here."""
    if ray_address and ray_address.startswith("ray://") and is_local_store(uri):
        raise InvalidInputError(
            f"MLflow store {uri} is a local file, but with --address {ray_address} the run is logged from the "
            "cluster's head node, which cannot reach it; set tracking.mlflow_uri (or MLFLOW_TRACKING_URI) to "
            "an MLflow server the cluster can reach, or submit with `ray job submit`"
        )


SAVED_VIEW_TAG = "mlflow.sharedViewState."  # MLflow 3.17 UI: an experiment tag per saved runs-table view


WORKFLOW_TYPE = "workflowType=machine_learning"  # MLflow 3.17's UI opens experiments in its GenAI view otherwise
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store


def _ui_root(uri: str) -> str:
    if not uri.startswith(("http://", "https://")):
        raise ValueError(f"MLflow UI links need a tracking server URI (http:// or https://), not {uri!r}")
    return uri.rstrip("/")


def ui_link(uri: str, experiment_id: str, run_id: str | None = None, view: str | None = None,
            artifact: str | None = None) -> str:
    """A run's page (``run_id``; its ``artifact`` shown, if given), else the experiment's runs table,
    opened in saved view ``view`` if given.

    Every link carries ``workflowType=machine_learning``: the UI ignores the ``mlflow.experimentKind``
    tag, and the query parameter works on every route.
    """
    root = f"{_ui_root(uri)}/#/experiments/{experiment_id}"
    if run_id is not None:
        shown = "" if artifact is None else f"/artifacts/{artifact}"
        return f"{root}/runs/{run_id}{shown}?{WORKFLOW_TYPE}"
    shared_view = "" if view is None else f"viewStateShareKey={view}&"
    return f"{root}/runs?{shared_view}{WORKFLOW_TYPE}"


def ui_compare_link(uri: str, experiment_id: str, run_ids: list[str]) -> str:
    """The UI's compare page of these runs (its own links carry the JSON lists unencoded)."""
    return (f"{_ui_root(uri)}/#/compare-runs?runs={json.dumps(run_ids, separators=(',', ':'))}"
            f"&experiments={json.dumps([experiment_id])}&{WORKFLOW_TYPE}")


def ui_server(uri: str) -> str:
    """Where the UI of store ``uri`` is served: the server itself, or `mlflow ui` for a local store."""
    return uri if uri.startswith(("http://", "https://")) else LOCAL_UI


def where_to_look(uri: str, experiment_id: str, run_id: str | None = None, view: str | None = None) -> str:
    """The console's lines saying where a run or sweep is in the MLflow UI."""
    link = ui_link(ui_server(uri), experiment_id, run_id, view)
    if uri.startswith(("http://", "https://")):
        return f"  MLflow UI: {link}"
    return f"  see it with: mlflow ui --backend-store-uri {uri}\n  then open: {link}"


def command_line() -> str:
    """The command this process runs, as the UI's Source shows it."""
    return " ".join(["vitsweep", *sys.argv[1:]]) if Path(sys.argv[0]).name in ("vitsweep", "__main__.py") else "vitsweep"


def run_origin(description: str, source: str) -> dict[str, str]:
    """Tags the UI shows as the run's Description, Created by and Source."""
    return {"mlflow.note.content": description, "mlflow.user": getpass.getuser(), "mlflow.source.name": source,
            "mlflow.source.type": "LOCAL"}


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


def open_client(uri: str) -> MlflowClient:
    """A client of the store at ``uri``, a new local one created whole first (``create_sqlite_store``);
    a local file that is not a whole store of this MLflow is bad input, said in one line."""
    if not uri.startswith("sqlite:///"):
        return MlflowClient(uri)
    database = Path(uri.removeprefix("sqlite:///"))
    create_sqlite_store(database)
    try:
        return MlflowClient(uri)
    except Exception as error:  # noqa: BLE001  (MLflow's schema check, or SQLAlchemy and alembic re-creating a half store)
        raise InvalidInputError(unopenable_store_problem(uri, database, error)) from None


def unopenable_store_problem(uri: str, database: Path, error: Exception) -> str:
    """Why the SQLite store cannot be opened, and what to do: a file left half-created (by a command
    stopped while it created it, before vitsweep built stores whole) holds no runs and can be moved aside."""
    from mlflow.store.db.utils import _get_latest_schema_revision

    reason = f"MLflow store {uri} cannot be opened: {(str(error).strip().splitlines() or [repr(error)])[0]}"
    try:
        revision, runs = sqlite_store_facts(database)
    except sqlite3.Error:  # not a SQLite database at all: MLflow's reason says so
        return reason
    head = _get_latest_schema_revision()
    if revision == head:
        return reason
    return (f"MLflow store {uri} cannot be opened: its schema is at revision {revision or '(none)'}, MLflow "
            f"{mlflow.__version__}'s at {head}, and it holds {runs} run(s). A store whose creation was cut short "
            f"holds none: move {database} aside and the next command creates a new store. A store of an older "
            f"MLflow is upgraded by `mlflow db upgrade {uri}` (back it up first)")


def sqlite_store_facts(database: Path) -> tuple[str | None, int]:
    """The MLflow schema revision of a SQLite store and how many runs it holds, read without MLflow."""
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        revision = (db.execute("SELECT version_num FROM alembic_version").fetchone() or [None])[0] \
            if "alembic_version" in tables else None
        runs = db.execute("SELECT count(*) FROM runs").fetchone()[0] if "runs" in tables else 0
    return revision, runs


def create_sqlite_store(database: Path) -> None:
    """Create the SQLite store ``database`` unless it exists, so that it appears whole or not at all.

    MLflow creates a store's tables in the file itself, by ~4 s of schema migrations. A command ended
    meanwhile (a signal while the driver's checks open the store on a thread that dies with it) left a
    half-migrated file, refused ever after as an "out-of-date database schema"; two commands creating
    it at once collided on the same migration. Built in the system's temporary directory, the store
    is copied beside its place and linked there, never over one another command made meanwhile.
    """
    if database.exists():
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    database.parent.mkdir(parents=True, exist_ok=True)
    final_uri = f"sqlite:///{database}"
    with tempfile.TemporaryDirectory(prefix="vitsweep-new-store-") as scratch:
        built = Path(scratch) / database.name
        SqlAlchemyStore(f"sqlite:///{built}", local_artifact_root(final_uri)).engine.dispose()
        partial = partial_path(database)
        try:
            shutil.copyfile(built, partial)
            publish_if_absent(partial, database)
        finally:
            partial.unlink(missing_ok=True)


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

    def log_model_input(self, model_id: str) -> None:
        """The run used this logged model (the UI links them)."""
        self.client.log_inputs(self.run_id, models=[LoggedModelInput(model_id)])

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

    def log_model(self, model, weights: list[Path], card: ModelCard, step: int) -> str:
        """The final weights (safetensors: the model's, and its EMA's where there is one) as run
        artifacts, and the model as one MLflow model (``pipeline.serving``): its ``pytorch`` flavor
        (``mlflow.pytorch.load_model`` restores the module) and an image-classifying
        ``python_function`` flavor (``mlflow models serve``), carrying the same weights files
        (``extra_files/``) and its card (MLmodel ``metadata["vitsweep"]``), so that a ``runs:/`` or
        ``models:/`` URI is a complete model source (``pipeline.model_source``); linked to the
        metrics of epoch ``step`` (the last: MLflow's default would be step 0's). Returns the
        logged model's id."""
        from mlflow.models import Model

        from pipeline import serving

        for path in weights:
            self.log_artifact(path)
        # The run active (not only named): MLflow files the logged model under the active run's experiment.
        with _fluent_tracking_uri(self.uri), mlflow.start_run(run_id=self.run_id), library_prints():
            # pt2 (MLflow 3's default) traces a fixed batch size; the pickled module serves any batch.
            logged = Model.log(None, flavor=serving, name=LOGGED_MODEL_NAME, flavor_name="pytorch", step=step,
                               metadata={MLFLOW_METADATA_KEY: card.as_dict()}, pytorch_model=model.eval(),
                               weights=weights, card=card, serialization_format="pickle")
        return logged.model_id

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


def monitor_node_system(uri: str, run_id: str, node_id: str, interval_s: float = 10.0) -> NodeSystemMetrics | None:
    """A background monitor logging this node's CPU, memory (and, with NVML, GPU) use into the run's
    System metrics tab until it is finished (or the run ends); ``None`` where the store is a local
    file of another node. Checked before any client exists: opening a client creates a local store."""
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return None
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    monitor = NodeSystemMetrics(run_id, sampling_interval=interval_s, node_id=node_id, tracking_uri=uri)
    monitor.start()
    return monitor


def dataset_reference(location: str, sha256: str) -> tuple[str, str]:
    """How a dataset input is named in MLflow: (file name, digest). MLflow caps a digest at 36
    characters: it is the SHA-256's prefix (``log_datasets`` adds the whole hash as a tag)."""
    return Path(location).name, sha256[:32]


class NodeSystemMetrics(SystemMetricsMonitor):
    """MLflow's system-metrics monitor, which also logs a last sample when it is finished: MLflow's own
    logs only at the end of each full sampling interval, so a run shorter than one would have none."""

    def finish(self) -> None:
        super().finish()
        try:
            self.collect_metrics()
            self.publish_metrics(self.aggregate_metrics())  # with what the loop sampled since its last one
            self.mlflow_logger.flush()
        except Exception as err:  # noqa: BLE001  (as MLflow's own monitor: never fail the run over its metrics)
            logging.getLogger("mlflow.system_metrics").warning("could not log the last system metrics sample: %s", err)


@contextlib.contextmanager
def _fluent_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (``log_model``) reads a process-global URI, and ``set_tracking_uri`` also
    exports it as MLFLOW_TRACKING_URI to every later subprocess: set both for the block only, then
    leave MLflow unset again (vitsweep's processes never set a global URI of their own)."""
    exported = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(None)  # unsets the global and the exported variable
        if exported is not None:
            os.environ["MLFLOW_TRACKING_URI"] = exported


class MLflowEpochLogger(UserCallback):
    """Ray Train callback (runs in the controller, on the driver's node): one MLflow step per epoch.

    Workers report already all-reduced metrics, so rank 0's dict is the run's.
    """

    def __init__(self, run: MlflowRun, epochs: int, announce: bool = True):
        """``announce``: print the epoch line on the console (a sweep shows its own table instead)."""
        self.run, self.epochs, self.announce = run, epochs, announce

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        reported = metrics[0]
        show = say if self.announce else print  # print: to the log file only
        if reported.get(DIVERGED_KEY):
            where = f"epoch {int(reported['epoch'])} step {int(reported['step'])}"
            self.run.mark_diverged(where)
            show(f"loss diverged at {where}: stopping")
            return
        self.run.log_epoch(reported)
        show(
            f"epoch {int(reported['epoch'])}/{self.epochs}  train_loss {reported['train_loss']:.4f}  "
            f"val_loss {reported['val_loss']:.4f}  val_top1 {reported['val_top1']:.2f}%  "
            f"val_top5 {reported['val_top5']:.2f}%  lr {reported['lr']:.2e}  "
            f"{reported['images_per_sec']:.0f} img/s  {reported['epoch_time_s']:.1f}s"
            + ("  (checkpoint saved)" if checkpoint is not None else "")
            + ("  (resumed from a checkpoint)" if "resumed_at_epoch" in reported else "")
        )
