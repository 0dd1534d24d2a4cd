"""Every local place a command will create or write, checked before anything starts.

A path below a file, on a read-only or virtual filesystem (``/proc``) or without permission would
otherwise fail as a traceback from deep inside MLflow, Ray or ffcv once work has begun; here it is
bad input (exit 2) naming the setting, the path and the reason. The rule for one path is
``pipeline.uris.location_problem``; this module lists the paths.
"""
from __future__ import annotations

import os
from pathlib import Path

from pipeline import uris
from pipeline.config.schema import ExperimentConfig
from pipeline.uris import location_problem
from pipeline.data.verification import verified_record_path
from pipeline.data.staging import CACHE_DIR_ENV, cache_dir_for
from pipeline.errors import InvalidInputError


def check_can_create(directories: dict[str, str | Path | None] | None = None,
                     files: dict[str, str | Path | None] | None = None) -> None:
    """Raise InvalidInputError naming every directory, or file (by its folder), that cannot be created or written;
    each is given by the setting or argument that names it."""
    problems = [f"{name}: {problem}" for name, location in (directories or {}).items()
                if (problem := location_problem(location, kind="directory", create=True))]
    problems += [f"{name}: {problem}" for name, location in (files or {}).items()
                 if (problem := location_problem(location, kind="file", create=True))]
    if len(problems) == 1:
        raise InvalidInputError(problems[0])
    if problems:
        raise InvalidInputError("nothing can be written to these paths:\n  " + "\n  ".join(problems))


def run_directories(cfg: ExperimentConfig, sweep: bool = False) -> dict[str, str | Path]:
    """The local directories a training run (``sweep``: a sweep of them) creates or writes, by the
    setting that names them: its storage (run directories, the default MLflow store and its artifacts),
    the datasets `data.prepare` writes, the staging cache of a dataset URI and the record of verified
    datasets. A URI is left to its filesystem."""
    directories: dict[str, str | Path] = {"run.storage_path": cfg.run.storage_path}
    if sweep and cfg.tune.storage_path:
        directories["tune.storage_path"] = cfg.tune.storage_path
    if cfg.data.prepare:
        directories.update({f"data.{split} (written by data.prepare)": Path(getattr(cfg.data, split)).expanduser().parent
                            for split in ("train", "val")})
    if uris.is_uri(cfg.data.train) or uris.is_uri(cfg.data.val):  # staged into this node's cache
        directories[_cache_setting(cfg)] = cache_dir_for(cfg.data, cfg.run.storage_path)
    directories["the record of verified datasets"] = verified_record_path().parent
    return {name: path for name, path in directories.items() if not uris.is_uri(str(path))}


def _cache_setting(cfg: ExperimentConfig) -> str:
    if cfg.data.cache_dir:
        return "data.cache_dir"
    if os.environ.get(CACHE_DIR_ENV):
        return f"${CACHE_DIR_ENV}"
    return "the staging cache (default: under run.storage_path)"
