"""Locations: a local path or a URI (``s3://``, ``gs://``, ``file://``, any fsspec/pyarrow filesystem)."""
from __future__ import annotations

from pathlib import Path


def is_uri(location: str) -> bool:
    return "://" in location


def absolute(location: str | None) -> str | None:
    """A local path made absolute (Ray workers run in another working directory); URIs and None as given."""
    if location is None or is_uri(location):
        return location
    return str(Path(location).expanduser().resolve())


def join(location: str, *parts: str) -> str:
    return "/".join([location.rstrip("/"), *parts]) if is_uri(location) else str(Path(location, *parts))
