"""``verify_dataset``: a dataset, wherever it lives, checked against its sidecar once.

The driver calls it for ``data.train`` and ``data.val`` before any worker starts: a local path or
``file://`` URI through ``check_beton`` and its SHA-256; another URI's chunks read as parallel byte
ranges, each against the sidecar's chunk digest (``ranged_reads.verify_ranges``), with a progress
line for a large file. A success is remembered in ``verified-datasets.json`` under the file's
identity, so an unchanged multi-hundred-GB file is not read again on every run; any rewrite is. A
local file's record is this machine's (it holds what this machine sees); a remote one's lives in the
run storage, which a cluster's nodes share, so a fresh head (a RayJob's) finds it too.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from filelock import FileLock

from pipeline.atomic import write_text_atomically
from pipeline.data.integrity import (
    ChecksumMismatchError, CorruptDatasetError, check_beton, check_sidecar_names, verify_sha256,
)
from pipeline.console import active_console
from pipeline.data.ranged_reads import verify_ranges
from pipeline.data.sidecar import Sidecar
from pipeline.data.staging import (
    CACHE_DIR_ENV, DEFAULT_STREAMS, StagingError, open_filesystem, read_location_sidecar,
)
from pipeline.uris import is_uri, redact

# Verified datasets are remembered where the verifier is, not beside the data: a dataset directory
# or bucket is often read-only, and a record beside a file could travel with a replacement of it.
# A local file's record is per machine (it holds what this machine sees: inode, mtime); a remote
# file's identity (size, object version) is the same from every node, so its record is shared.
VERIFIED_RECORD = "verified-datasets.json"
_SHOW_PROGRESS_FROM = 256 << 20  # bytes: smaller files are read before a progress line says anything
PROGRESS_EVERY_S = 10.0
# fsspec's info() keys that change whenever a remote object is rewritten, by filesystem.
_REMOTE_VERSION_KEYS = ("ETag", "etag", "generation", "VersionId", "mtime", "LastModified", "last_modified",
                        "updated", "created")


def verified_record_path() -> Path:
    """``$VITSWEEP_CACHE_DIR``, else ``$XDG_CACHE_HOME/vitsweep``, else ``~/.cache/vitsweep``; then the record."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser() / VERIFIED_RECORD
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "vitsweep" / VERIFIED_RECORD


def shared_record_path(storage_path: str | None) -> Path:
    """Where a remote dataset's verification is remembered: the run storage, when it is a directory
    (on a cluster, the shared filesystem every head mounts), else ``verified_record_path()``."""
    if storage_path and not is_uri(storage_path):
        return Path(storage_path).expanduser() / VERIFIED_RECORD
    return verified_record_path()


def verify_dataset(location: str, record: Path | None = None, streams: int = DEFAULT_STREAMS,
                   storage_path: str | None = None) -> Sidecar:
    """Check a dataset, wherever it lives, against its sidecar, bytes included; return the sidecar.

    A local path or ``file://`` URI is checked in place: structure, counts and SHA-256. Another
    URI's chunks are read ``streams`` byte ranges at once and each checked against the sidecar's
    chunk digest (a sidecar without them: the whole file streamed and hashed). A success is
    remembered in ``record`` -- by default this machine's ``verified_record_path()`` for a local
    file, ``shared_record_path(storage_path)`` for a remote one -- under the file's identity: size,
    mtime and inode locally; size and version (ETag, generation, mtime) remotely; and the sidecar's
    SHA-256. An unchanged file is not read again; any rewrite is.
    """
    if not is_uri(location) or location.startswith("file://"):
        path = Path(open_filesystem(location)[1] if is_uri(location) else location).expanduser()
        sidecar = check_beton(path)
        stat = path.stat()
        identity = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino, "sha256": sidecar.sha256}
        _verify_once(str(path.resolve()), identity, record or verified_record_path(),
                     lambda: verify_sha256(path, sidecar))
        return sidecar
    sidecar, where = read_location_sidecar(location), redact(location)
    filesystem, remote = open_filesystem(location)
    check_sidecar_names(sidecar, Path(remote).name, where)
    try:
        info = filesystem.info(remote)
    except Exception as err:  # noqa: BLE001  (each filesystem raises its own network and auth errors)
        raise StagingError(redact(f"cannot reach {location!r}: {type(err).__name__}: {err}")) from None
    if info.get("size") != sidecar.size_bytes:
        raise CorruptDatasetError(
            f"{where!r} is {info.get('size')} bytes but its sidecar records {sidecar.size_bytes}: the "
            "file is truncated or was replaced without its sidecar; write it again"
        )
    version = {key: str(info[key]) for key in _REMOTE_VERSION_KEYS if info.get(key) is not None}
    identity = {"size": sidecar.size_bytes, **version, "sha256": sidecar.sha256}

    def read_remote() -> None:
        if sidecar.chunk_sha256 is not None:
            with _ProgressLine(f"verifying {Path(remote).name}", sidecar.size_bytes, streams) as progress:
                verify_ranges(filesystem, remote, sidecar, streams, where, progress.advance)
            return
        with filesystem.open(remote, "rb") as handle:  # a sidecar written before chunk digests: one stream
            actual = hashlib.file_digest(handle, "sha256").hexdigest()
        if actual != sidecar.sha256:
            raise ChecksumMismatchError(
                f"{where!r} has SHA-256 {actual} but its sidecar records {sidecar.sha256}: the file is "
                "corrupt or was replaced without its sidecar; write it again"
            )

    # Without a version the filesystem cannot say "unchanged": read it every time rather than trust it.
    _verify_once(where, identity if version else None, record or shared_record_path(storage_path), read_remote)
    return sidecar


class _ProgressLine:
    """The driver's progress while it reads a large file: done, rate and time left every
    ``PROGRESS_EVERY_S`` seconds, then one line with the whole read's rate."""

    def __init__(self, label: str, total: int, streams: int):
        self.label, self.total, self.streams, self.done = label, total, streams, 0
        self.shown = total >= _SHOW_PROGRESS_FROM

    def __enter__(self) -> _ProgressLine:
        self.started = self.last = time.monotonic()
        return self

    def advance(self, size: int) -> None:
        self.done += size
        now = time.monotonic()
        if self.shown and now - self.last >= PROGRESS_EVERY_S and self.done < self.total:
            self.last = now
            rate = self.done / (now - self.started)
            left = (self.total - self.done) / rate
            active_console().progress(f"{self.label}: {self.done / 1e9:.1f} of {self.total / 1e9:.1f} GB "
                                      f"({100 * self.done / self.total:.0f}%), {rate / 1e6:.0f} MB/s, "
                                      f"{left // 60:.0f}:{left % 60:02.0f} left")

    def __exit__(self, failed, *_) -> None:
        if self.shown and failed is None:
            seconds = max(time.monotonic() - self.started, 1e-9)
            active_console().line(f"{self.label}: {self.total / 1e9:.1f} GB checked in {seconds:.0f} s "
                                  f"({self.total / seconds / 1e6:.0f} MB/s, {self.streams} ranged reads at once)")


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
