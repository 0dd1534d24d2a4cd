"""MLflow tracking: where runs are recorded and whether that store can be reached."""
from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.config import ExperimentConfig

DEFAULT_STORE_NAME = "mlflow.db"


def resolve_tracking_uri(cfg: ExperimentConfig) -> str:
    """Config first, then ``MLFLOW_TRACKING_URI``, else a SQLite file under the run's storage path."""
    if cfg.tracking.mlflow_uri:
        return cfg.tracking.mlflow_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
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
