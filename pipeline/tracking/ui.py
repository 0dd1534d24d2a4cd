"""Links into the MLflow UI: a run's page, an experiment's runs table in a saved view, the compare page,
a registered model version's page, and the console lines that say where to look."""
from __future__ import annotations

import json
from urllib.parse import quote

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


def ui_version_link(uri: str, name: str, version: str) -> str:
    """A registered model version's page (the UI's ``/models/:modelName/versions/:version``)."""
    return f"{_ui_root(uri)}/#/models/{quote(name, safe='')}/versions/{version}?{WORKFLOW_TYPE}"


def ui_server(uri: str) -> str:
    """Where the UI of store ``uri`` is served: the server itself, or `mlflow ui` for a local store."""
    return uri if uri.startswith(("http://", "https://")) else LOCAL_UI


def where_to_look(uri: str, experiment_id: str, run_id: str | None = None, view: str | None = None) -> str:
    """The console's lines saying where a run or sweep is in the MLflow UI."""
    return _see_it(uri, ui_link(ui_server(uri), experiment_id, run_id, view))


def model_line(model_id: str) -> str:
    """The console's line naming a run's logged model by its URI (MLflow 3's, which vitsweep's commands take too)."""
    return f"  its MLflow model: models:/{model_id} (a model source for vitsweep's commands and MLflow's loaders)"


def where_to_look_at_version(uri: str, name: str, version: str) -> str:
    """The console's lines saying where a registered model version is in the MLflow UI."""
    return _see_it(uri, ui_version_link(ui_server(uri), name, version))


def _see_it(uri: str, link: str) -> str:
    if uri.startswith(("http://", "https://")):
        return f"  MLflow UI: {link}"
    return f"  see it with: mlflow ui --backend-store-uri {uri}\n  then open: {link}"
