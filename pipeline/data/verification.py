"""``verify_dataset``: a dataset, wherever it lives, checked against its sidecar once per machine.

The driver calls it for ``data.train`` and ``data.val`` before any worker starts: a local path or
``file://`` URI through ``check_beton`` and its SHA-256; another URI's bytes streamed and hashed.
A success is remembered in ``verified-datasets.json`` under the file's identity, so an unchanged
multi-hundred-GB file is not hashed again on every run; any rewrite is.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from filelock import FileLock

from pipeline.atomic import write_text_atomically
from pipeline.data.integrity import (
    ChecksumMismatchError, CorruptDatasetError, check_beton, check_sidecar_names, verify_sha256,
)
from pipeline.data.sidecar import Sidecar
from pipeline.data.staging import CACHE_DIR_ENV, StagingError, open_filesystem, read_location_sidecar
from pipeline.uris import is_uri, redact

# Verified datasets are remembered per machine, not beside the data: the record holds what this
# machine sees (inode, mtime), a dataset directory or bucket is often read-only, and a record
# beside a file could travel with a replacement of it.
VERIFIED_RECORD = "verified-datasets.json"
# fsspec's info() keys that change whenever a remote object is rewritten, by filesystem.
_REMOTE_VERSION_KEYS = ("ETag", "etag", "generation", "VersionId", "mtime", "LastModified", "last_modified",
                        "updated", "created")


def verified_record_path() -> Path:
    """``$VITSWEEP_CACHE_DIR``, else ``$XDG_CACHE_HOME/vitsweep``, else ``~/.cache/vitsweep``; then the record."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser() / VERIFIED_RECORD
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "vitsweep" / VERIFIED_RECORD


def verify_dataset(location: str, record: Path | None = None) -> Sidecar:
    """Check a dataset, wherever it lives, against its sidecar, bytes included; return the sidecar.

    A local path or ``file://`` URI is checked in place: structure, counts and SHA-256. Another
    URI's bytes are streamed and hashed (staging hashes them again as each node copies them). A
    successful hash is remembered in ``record`` (default ``verified_record_path()``) under the
    file's identity -- size, mtime and inode locally; size and version (ETag, generation, mtime)
    remotely -- and the sidecar's SHA-256: an unchanged file is not hashed again; any rewrite is.
    """
    record = record or verified_record_path()
    if not is_uri(location) or location.startswith("file://"):
        path = Path(open_filesystem(location)[1] if is_uri(location) else location).expanduser()
        sidecar = check_beton(path)
        stat = path.stat()
        identity = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino, "sha256": sidecar.sha256}
        _verify_once(str(path.resolve()), identity, record, lambda: verify_sha256(path, sidecar))
        return sidecar
    sidecar = read_location_sidecar(location)
    filesystem, remote = open_filesystem(location)
    check_sidecar_names(sidecar, Path(remote).name, redact(location))
    try:
        info = filesystem.info(remote)
    except Exception as err:  # noqa: BLE001  (each filesystem raises its own network and auth errors)
        raise StagingError(redact(f"cannot reach {location!r}: {type(err).__name__}: {err}")) from None
    if info.get("size") != sidecar.size_bytes:
        raise CorruptDatasetError(
            f"{redact(location)!r} is {info.get('size')} bytes but its sidecar records {sidecar.size_bytes}: the "
            "file is truncated or was replaced without its sidecar; write it again"
        )
    version = {key: str(info[key]) for key in _REMOTE_VERSION_KEYS if info.get(key) is not None}
    identity = {"size": sidecar.size_bytes, **version, "sha256": sidecar.sha256}

    def hash_remote() -> None:
        with filesystem.open(remote, "rb") as handle:
            actual = hashlib.file_digest(handle, "sha256").hexdigest()
        if actual != sidecar.sha256:
            raise ChecksumMismatchError(
                f"{redact(location)!r} has SHA-256 {actual} but its sidecar records {sidecar.sha256}: the file is "
                "corrupt or was replaced without its sidecar; write it again"
            )

    # Without a version the filesystem cannot say "unchanged": hash every time rather than trust it.
    _verify_once(redact(location), identity if version else None, record, hash_remote)
    return sidecar


def _verify_once(key: str, identity: dict | None, record: Path, verify) -> None:
    """Run ``verify`` unless ``record`` remembers ``key`` verified with this very ``identity``; then remember it."""
    if identity is not None and _read_record(record).get(key) == identity:
        return
    verify()
    if identity is None:
        return
    record.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(record) + ".lock"):  # concurrent drivers each add their own entry
        entries = _read_record(record)
        entries[key] = identity
        write_text_atomically(record, json.dumps(entries, indent=1, sort_keys=True) + "\n")


def _read_record(record: Path) -> dict:
    try:
        entries = json.loads(record.read_text())
    except (OSError, ValueError):  # absent or damaged: nothing is remembered, everything is hashed
        return {}
    return entries if isinstance(entries, dict) else {}
