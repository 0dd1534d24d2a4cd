"""Running as a ``ray job submit`` driver: what must hold there, and the provenance the job keeps.

A submitted job's driver runs in a temporary copy of the submitted working directory, deleted with
the cluster's session. A relative path in the config would put the run's data there, so in a job
every path a run writes or reads must be absolute (or a URI). The copy carries ``.git`` when the
submit sets ``RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES`` without it (README "`ray job submit`"), so
the commit and dirty flag are read from it exactly as in a local checkout.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from pipeline import uris
from pipeline.config.schema import ExperimentConfig
from pipeline.data.staging import CACHE_DIR_ENV
from pipeline.errors import InvalidInputError

# Set by Ray's JobSupervisor for the entrypoint's process (ray/dashboard/modules/job/job_supervisor.py,
# _get_driver_env_vars); plain `ray.init` drivers and Ray workers do not have it.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
REPO_ROOT = Path(__file__).resolve().parents[1]


def ray_job_id() -> str | None:
    """The submission id when this process is a Ray Job's driver (or its child), else None."""
    config = os.environ.get(RAY_JOB_ENV)
    if config is None:
        return None
    try:
        return json.loads(config).get("metadata", {}).get("job_submission_id") or "unknown"
    except (json.JSONDecodeError, AttributeError):
        return "unknown"


def job_paths(cfg: ExperimentConfig) -> dict[str, str]:
    """The config's local paths a job's run writes or reads, by dotted key (unset ones left out)."""
    paths = {
        "run.storage_path": cfg.run.storage_path,
        "tune.storage_path": cfg.tune.storage_path,
        "data.train": cfg.data.train,
        "data.val": cfg.data.val,
        "data.cache_dir": cfg.data.cache_dir,
        f"${CACHE_DIR_ENV}": os.environ.get(CACHE_DIR_ENV),
    }
    return {key: path for key, path in paths.items() if path and not uris.is_uri(path)}


def check_paths_outlive_job(cfg: ExperimentConfig) -> None:
    """In a Ray Job's driver, refuse relative paths: they would resolve inside the job's temporary
    working directory and vanish with it. Call on the config as given, before paths are made absolute."""
    job = ray_job_id()
    if job is None:
        return
    relative = {key: path for key, path in job_paths(cfg).items() if not Path(path).expanduser().is_absolute()}
    if relative:
        listed = ", ".join(f"{key}={path!r}" for key, path in relative.items())
        raise InvalidInputError(
            f"ray job {job}: {listed} is relative, so it would point into the job's temporary working "
            "directory, which is deleted with the cluster's session; give an absolute path on storage that "
            "outlives the job (e.g. --set run.storage_path=$PWD/vitsweep-runs, expanded by the submitting "
            "shell; shared storage on a real cluster) or a URI (s3://, gs://)"
        )


def git_provenance(repo: Path = REPO_ROOT) -> dict[str, str]:
    """The code's commit and whether tracked files differ from it (``git describe --dirty``'s rule), as
    MLflow tags; 'unknown' without git or outside a checkout (a submitted job whose upload excluded ``.git``)."""
    commit = _git(repo, "rev-parse", "HEAD")
    status = _git(repo, "status", "--porcelain", "--untracked-files=no") if commit else None
    dirty = "unknown" if status is None else str(bool(status)).lower()
    commit = commit or "unknown"
    return {"git_commit": commit, "git_dirty": dirty, "mlflow.source.git.commit": commit}


def _git(repo: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=repo)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
