"""Which MLflow store a command writes to, whether it can be reached, and a client of it.

The store is resolved (config, then ``MLFLOW_TRACKING_URI``, else a SQLite file under the run's
storage path) and checked before any run starts; a new local store is created whole or not at all.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from pipeline.atomic import partial_path, publish_if_absent
from pipeline.config.schema import ExperimentConfig
from pipeline.errors import InvalidInputError
from pipeline.uris import location_problem, uri_password_problem

DEFAULT_STORE_NAME = "mlflow.db"


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


def is_new_local_store(uri: str) -> bool:
    """A SQLite store whose file does not exist yet: opening it first creates it (``create_sqlite_store``)."""
    return uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists()


def is_missing_local_store(uri: str) -> bool:
    """A local store (``sqlite:///``, ``file://``, a bare path) that does not exist: opening it creates it."""
    return is_local_store(uri) and not Path(uri.removeprefix("sqlite:///").removeprefix("file://")).exists()


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


@contextlib.contextmanager
def fluent_tracking_uri(uri: str) -> Iterator[None]:
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
