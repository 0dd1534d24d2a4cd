"""The MLflow model registry: a run's logged model as a version of a registered model, with an alias.

``vitsweep register SOURCE NAME [--alias A]`` and ``vitsweep tune ... --register NAME [--alias A]``
register through ``register_run``: the version points at the run's MLflow 3 logged model
(``models:/<model_id>``, so ``models:/NAME@ALIAS`` is a model source, pyfunc and servable model), and
carries what the run knows: its description, final metrics, datasets (name and SHA-256), model and
knobs (a sweep trial's), as the version's description and tags. A run has one version per
registered model: registering it again finds that version (and moves the alias to it) instead of
adding another. The run is any model source (``pipeline.trained.model_source``) that names an MLflow
run, or a sweep's best trial (``pipeline.sweeps.best_trial``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS
from mlflow.utils.validation import _validate_model_alias_name, _validate_model_alias_name_reserved, _validate_model_name

from pipeline.errors import InvalidInputError
from pipeline.tracking.store import SWEEP_TAG, TRIAL_TAG, MlflowRun, run_model_id
from pipeline.tracking.connection import fluent_tracking_uri

REPORTED_METRICS = ("val_top1", "val_top5", "val_loss", "val_top1_ema", "val_top5_ema", "val_loss_ema", "train_loss",
                    "epochs_trained")


@dataclass(frozen=True)
class Registration:
    name: str
    version: str
    alias: str | None
    run_id: str
    model_id: str
    tracking_uri: str
    created: bool  # False: the run was registered under this name already

    @property
    def uri(self) -> str:
        """The model URI to load it by: the alias's, else the version's."""
        return f"models:/{self.name}@{self.alias}" if self.alias else f"models:/{self.name}/{self.version}"


MAX_NAME_LENGTH = 256  # MLflow's registry schema (registered_models.name, String(256)); SQLite alone does not enforce it


def check_registry_names(name: str, alias: str | None) -> None:
    """MLflow's own rules for a registered model's name and an alias, as bad input naming the value; and
    those MLflow leaves to its database or to the reader: a name its schema holds on every backend, an
    alias that cannot be read as a version number (``models:/NAME@3`` beside ``models:/NAME/3``)."""
    refused = f"cannot register as {name!r}" + (f" with alias {alias!r}" if alias else "")
    try:
        _validate_model_name(name)
        if alias is not None:
            _validate_model_alias_name(alias)
            _validate_model_alias_name_reserved(alias)
    except MlflowException as err:
        raise InvalidInputError(f"{refused}: {err.message}") from None
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidInputError(f"cannot register as a {len(name)}-character name: MLflow's registry holds names of "
                                f"up to {MAX_NAME_LENGTH} characters")
    if alias is not None and alias.isdigit():
        raise InvalidInputError(f"{refused}: an alias of digits reads as a version number (models:/{name}/{alias} is "
                                f"version {alias}); give it a word, e.g. 'best' or 'champion'")


def register_run(tracking_uri: str, run_id: str, name: str, alias: str | None = None,
                 model_id: str | None = None) -> Registration:
    """The run's logged model (``model_id``, else its own) as a version of ``name`` (the run's existing
    version of it, if any), and ``alias`` pointing at that version."""
    check_registry_names(name, alias)
    run = MlflowRun(tracking_uri, run_id)
    client = run.client
    found = run.get()
    model_id = model_id or _logged_model(client, found)
    # the name matched here, not in the filter: MLflow's filter grammar has no escape for a quote in it
    existing = [version for version in client.search_model_versions(f"run_id = '{run_id}'")
                if version.name == name and version.source == f"models:/{model_id}"]  # not another model's version
    if existing:
        version, created = min(existing, key=lambda v: int(v.version)), False
    else:
        try:
            client.create_registered_model(name)
        except MlflowException as err:
            if err.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                raise
        # MLflow resolves a models:/<model_id> source through the process's tracking URI.
        with fluent_tracking_uri(tracking_uri):
            version = client.create_model_version(name, source=f"models:/{model_id}", run_id=run_id,
                                                  model_id=model_id, description=describe_version(found),
                                                  tags=version_tags(found))
        created = True
    _list_on_logged_model(client, model_id, name, version.version)
    if alias is not None:
        client.set_registered_model_alias(name, alias, version.version)
    return Registration(name, str(version.version), alias, run_id, model_id, tracking_uri, created)


def _list_on_logged_model(client, model_id: str, name: str, version: int | str) -> None:
    """The version in the logged model's ``mlflow.modelVersions`` tag, as ``mlflow.register_model`` (and
    the tracking server's handler) records it: MLflow's model page reads its registrations there."""
    listed = json.loads(client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
    if not any(entry["name"] == name and str(entry["version"]) == str(version) for entry in listed):
        client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps([*listed, {"name": name, "version": version}])})


def _logged_model(client, run) -> str:
    if model_id := run_model_id(client, run):
        return model_id
    raise InvalidInputError(f"run {run.info.run_name!r} ({run.info.run_id}, {run.info.status}) logged no model: "
                            "only a run that finished (FINISHED, its final model logged) can be registered")


def describe_version(run) -> str:
    """The training run's own description, then its final metrics and where it came from, in plain text:
    the UI's versions table shows a description as written (the run page renders the run's markdown)."""
    metrics = run.data.metrics
    shown = ", ".join(f"{key} {metrics[key]:.4g}" for key in REPORTED_METRICS if key in metrics)
    origin = f"run '{run.info.run_name}' ({run.info.run_id})"
    if run.data.tags.get(TRIAL_TAG):
        origin += f", trial {run.data.tags[TRIAL_TAG]} of sweep '{run.data.tags.get(SWEEP_TAG, '?')}'"
    parts = (_plain(run.data.tags.get("mlflow.note.content", "")), f"Final: {shown}." if shown else "", f"From {origin}.")
    return " ".join(part for part in parts if part)


def _plain(markdown: str) -> str:
    """vitsweep's run descriptions without their markdown: **bold** as is, `code` in quotes, one line."""
    return " ".join(re.sub(r"\*\*(.+?)\*\*", r"\1", markdown).replace("`", "'").split())


def version_tags(run) -> dict[str, str]:
    """The run's final metrics, its datasets (name and SHA-256 per context), model (name, size, arguments) and knobs."""
    tags = {key: f"{run.data.metrics[key]:.6g}" for key in REPORTED_METRICS if key in run.data.metrics}
    for dataset_input in run.inputs.dataset_inputs if run.inputs else []:
        input_tags = {tag.key: tag.value for tag in dataset_input.tags}
        context = input_tags.get("mlflow.data.context", "dataset")
        tags[f"dataset.{context}"] = dataset_input.dataset.name
        if "sha256" in input_tags:
            tags[f"dataset.{context}.sha256"] = input_tags["sha256"]
    for key, value in run.data.params.items():  # the model's arguments are logged one param each, model.args.<name>
        if key in ("model.name", "model.img_size") or key.startswith("model.args."):
            tags[key] = value
    for key in ("knobs", SWEEP_TAG, TRIAL_TAG):
        if key in run.data.tags:
            tags[key] = run.data.tags[key]
    tags["run_name"] = run.info.run_name
    return tags
