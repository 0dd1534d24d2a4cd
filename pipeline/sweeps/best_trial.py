"""A finished sweep as one run: the directory a name or path stands for, and its best trial.

A sweep (its name under ``tune.storage_path`` / ``run.storage_path``, or its directory) stands for its
best trial that trained every epoch, by the sweep's metric and mode, as the sweep itself picked it;
``vitsweep register`` registers that trial's model.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline import uris
from pipeline.config.loading import validate
from pipeline.config.schema import ExperimentConfig
from pipeline.errors import InvalidInputError
from pipeline.tracking.connection import require_reachable
from pipeline.tracking.store import MlflowRun


def sweep_directory(given: str, cfg: ExperimentConfig) -> str | None:
    """The sweep directory ``given`` names (its path, or its name in the sweeps' storage), if it is one."""
    from pipeline.sweeps.runner import RECORD_NAME

    if given.startswith(("runs:/", "models:/")):
        return None
    root = cfg.tune.storage_path or cfg.run.storage_path
    for candidate in (uris.absolute(given), uris.join(root, given)):
        if not uris.is_uri(candidate) and (Path(candidate) / RECORD_NAME).is_file():
            return candidate
    return None


def best_trial(given: str, sweep_dir: str) -> tuple[str, str]:
    """(tracking URI, run id) of the sweep's best trial that trained every epoch, by the sweep's metric."""
    from pipeline.sweeps import report
    from pipeline.sweeps.runner import RECORD_NAME

    record = json.loads((Path(sweep_dir) / RECORD_NAME).read_text())
    tune = validate(record["base_config"]).tune
    uri, parent_id = record["tracking_uri"], record.get("parent_run_id")
    require_reachable(uri)
    if not parent_id:
        raise InvalidInputError(f"sweep {given!r} ({sweep_dir}) never started a trial: nothing to register")
    rows = report.sweep_rows(MlflowRun(uri, parent_id), tune.metric)
    best = report.best_row(rows, tune.metric, tune.mode)
    if best is None:
        states = ", ".join(f"{row.trial_id} {row.state}" for row in rows) or "no trials"
        raise InvalidInputError(f"sweep {given!r} has no trial that trained every epoch ({states}): nothing to "
                                "register; register one of its trials' models instead, runs:/RUN_ID/model with a run id "
                                "`vitsweep compare` lists")
    return uri, best.run_id
