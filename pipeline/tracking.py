"""MLflow tracking: where runs are recorded and whether that store can be reached."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ray.train import UserCallback

from pipeline.config import ExperimentConfig, uri_password_problem
from pipeline.errors import InvalidInputError

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
    existing = next((p for p in [directory, *directory.parents] if p.exists()), Path("/"))
    if not os.access(existing, os.W_OK):
        raise ConnectionError(f"MLflow store {uri}: {existing} is not writable")
    return f"local store under {directory} ({'exists' if directory.exists() else 'will be created'})"


DIVERGED_TAG = "diverged"  # the worker's report key, and the MLflow tag saying where the loss diverged
RUN_RECORD = "mlflow_run.json"  # beside Ray's files in the run directory: a restarted run continues its MLflow run


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


def experiment_id(client, experiment: str) -> str:
    """The id of the named experiment, created (artifacts beside a local store) if it is new."""
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        return found.experiment_id
    return client.create_experiment(experiment, artifact_location=local_artifact_root(client.tracking_uri))


def start_or_continue_run(uri: str, experiment: str, run_dir: Path, run_name: str,
                          tags: dict[str, str] | None = None) -> str:
    """The MLflow run id of this training run: the recorded one when the run restarts, else a new run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    record = run_dir / RUN_RECORD
    if record.is_file():
        saved = json.loads(record.read_text())
        if saved["tracking_uri"] == uri:
            client.update_run(saved["run_id"], status="RUNNING")
            return saved["run_id"]
    run_id = client.create_run(experiment_id(client, experiment), run_name=run_name, tags=tags or {}).info.run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"tracking_uri": uri, "run_id": run_id, "experiment": experiment}))
    return run_id


def log_run_setup(uri: str, run_id: str, cfg: ExperimentConfig, files: dict[str, str], facts: dict[str, Any],
                  tags: dict[str, str]) -> None:
    """Params (every resolved config value under its dotted key), model facts, tags, setup artifacts."""
    from mlflow.entities import Param, RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    logged = client.get_run(run_id).data.params
    params = {key: str(value) for key, value in cfg.flat().items()}
    params.update({f"model_facts.{key}": str(value) for key, value in facts.items()})
    new = [Param(key, value) for key, value in params.items() if key not in logged]  # a restart re-logs nothing
    client.log_batch(run_id, params=new, tags=[RunTag(k, v) for k, v in tags.items()])
    with tempfile.TemporaryDirectory() as directory:
        for name, text in files.items():
            (Path(directory) / name).write_text(text)
            client.log_artifact(run_id, str(Path(directory) / name))


def diverged_at(uri: str, run_id: str) -> str | None:
    """'epoch E step S' where the run's loss diverged, if it did."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri).get_run(run_id).data.tags.get(DIVERGED_TAG)


def finish_run(uri: str, run_id: str, status: str) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).set_terminated(run_id, status=status)


def log_trained_model(uri: str, run_id: str, model, weights: Path, img_size: int) -> None:
    """The final weights as safetensors, and the model via mlflow.pytorch (``load_model`` restores it)."""
    import mlflow
    import mlflow.pytorch
    import numpy as np

    client = mlflow.tracking.MlflowClient(uri)
    client.log_artifact(run_id, str(weights))
    example = np.zeros((1, 3, img_size, img_size), dtype=np.float32)
    with _fluent_tracking_uri(uri), mlflow.start_run(run_id=run_id):
        # pt2 (MLflow 3's default) traces a fixed batch size; the pickled module serves any batch.
        mlflow.pytorch.log_model(model.eval(), name="model", input_example=example, serialization_format="pickle")


@contextlib.contextmanager
def _fluent_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (``log_model``) reads a process-global URI, and ``set_tracking_uri`` also
    exports it as MLFLOW_TRACKING_URI to every later subprocess: set both for the block only, then
    leave MLflow unset again (vitsweep's processes never set a global URI of their own)."""
    import mlflow

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

    def __init__(self, uri: str, run_id: str, epochs: int):
        self.uri, self.run_id, self.epochs = uri, run_id, epochs

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        reported = metrics[0]
        if reported.get(DIVERGED_TAG):
            where = f"epoch {int(reported['epoch'])} step {int(reported['step'])}"
            MlflowClient(self.uri).set_tag(self.run_id, DIVERGED_TAG, where)
            print(f"loss diverged at {where}: stopping", flush=True)
            return
        epoch = int(reported["epoch"])
        now = int(time.time() * 1000)
        values = [Metric(key, float(value), now, epoch) for key, value in reported.items()
                  if key != "epoch" and isinstance(value, (int, float))]
        MlflowClient(self.uri).log_batch(self.run_id, metrics=values)
        print(
            f"epoch {epoch + 1}/{self.epochs}  train_loss {reported['train_loss']:.4f}  "
            f"val_loss {reported['val_loss']:.4f}  val_top1 {reported['val_top1']:.2f}%  "
            f"val_top5 {reported['val_top5']:.2f}%  lr {reported['lr']:.2e}  "
            f"{reported['images_per_sec']:.0f} img/s  {reported['epoch_time_s']:.1f}s"
            + ("  (checkpoint saved)" if checkpoint is not None else "")
            + ("  (resumed from a checkpoint)" if "resumed_at_epoch" in reported else ""),
            flush=True,
        )

    def after_exception(self, run_context, worker_exceptions) -> None:
        return None
