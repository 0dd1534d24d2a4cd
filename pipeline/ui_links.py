"""Links into MLflow's UI (3.17) for a run, an experiment's runs table or a comparison of runs.

Every link carries ``workflowType=machine_learning``: MLflow 3.17's UI opens an experiment in GenAI
mode ("Overview": traces, token usage) unless the link or the visitor's saved toggle says otherwise,
and ignores the ``mlflow.experimentKind`` tag. The query parameter works on every route.
"""
from __future__ import annotations

import json

WORKFLOW_TYPE = "workflowType=machine_learning"


def _ui_root(uri: str) -> str:
    if not uri.startswith(("http://", "https://")):
        raise ValueError(f"MLflow UI links need a tracking server URI (http:// or https://), not {uri!r}")
    return uri.rstrip("/")


def ui_link(uri: str, experiment_id: str, run_id: str | None = None, view: str | None = None) -> str:
    """A run's page (``run_id``), else the experiment's runs table, opened in saved view ``view`` if given."""
    root = f"{_ui_root(uri)}/#/experiments/{experiment_id}"
    if run_id is not None:
        return f"{root}/runs/{run_id}?{WORKFLOW_TYPE}"
    shared_view = "" if view is None else f"viewStateShareKey={view}&"
    return f"{root}/runs?{shared_view}{WORKFLOW_TYPE}"


def ui_compare_link(uri: str, experiment_id: str, run_ids: list[str]) -> str:
    """The UI's compare page of these runs (its own links carry the JSON lists unencoded)."""
    return (f"{_ui_root(uri)}/#/compare-runs?runs={json.dumps(run_ids, separators=(',', ':'))}"
            f"&experiments={json.dumps([experiment_id])}&{WORKFLOW_TYPE}")
