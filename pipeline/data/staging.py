"""``stage_dataset``: a dataset URI copied once per node into a node-local cache, then read there.

FFCV reads its file with random access through mmap (``os_cache``) or page reads; doing that
over s3/gs/NFS from every worker would be slow and costly. So each node copies a URI
(``s3://``, ``gs://``, ``hdfs://``, ``file://``: any filesystem ``fsspec`` can open, pyarrow's
included) once into ``cache_dir``; the workers of that node share the copy.

- One copier per node: a file lock in ``cache_dir``; the others wait, then find the copy done.
- A partial copy never counts: bytes go to a temporary name and are hashed while they stream
  (each chunk the sidecar lists a digest for on its own thread, so hashing keeps up with the
  network on every core; older sidecars: the whole file on one); only a copy whose digests match
  the remote sidecar is renamed into place, and the sidecar, written last beside it, is what
  marks it complete.
- The cache is keyed by that SHA-256, so a dataset rewritten under the same URI is fetched anew.

A plain local path is read in place (it is already on a filesystem this node mounts); write it
as ``file:///...`` to have it staged, e.g. from a shared NFS mount.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from filelock import FileLock
from tqdm import tqdm

from pipeline.config import DataConfig
from pipeline.data.atomic import PARTIAL_MARK, partial_path, publish
from pipeline.data.integrity import ChecksumMismatchError
from pipeline.data.sidecar import SIDECAR_SUFFIX, Sidecar, SidecarError, parse_sidecar, read_sidecar, sidecar_path, write_sidecar
from pipeline.errors import InvalidInputError
from pipeline.uris import is_uri, redact

_COPY_CHUNK = 8 << 20
_PENDING_CHUNKS = 8  # chunks read but not yet hashed, at most (8 x 64 MiB)
CACHE_DIR_ENV = "VITSWEEP_CACHE_DIR"  # a node's local staging directory, set by the cluster
log = logging.getLogger(__name__)


class StagingError(InvalidInputError):
    """A dataset URI cannot be reached or read from this node."""


def cache_dir_for(data: DataConfig, storage_path: str) -> Path:
    """This node's staging directory: ``data.cache_dir``; else ``$VITSWEEP_CACHE_DIR``; else
    ``<run.storage_path>/data-cache``; else (storage is a URI) the temp dir.

    ``VITSWEEP_CACHE_DIR`` is set per node by the cluster (its local NVMe, see ``cluster/``): one
    config then stages onto each node's own disk, never onto the shared ``run.storage_path``.
    """
    if data.cache_dir:
        return Path(data.cache_dir).expanduser()
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    if not is_uri(storage_path):
        return Path(storage_path).expanduser() / "data-cache"
    return Path(tempfile.gettempdir()) / "vitsweep-data-cache"


def stage_dataset(uri_or_path: str, cache_dir: str | Path) -> Path:
    """The local path to read ``uri_or_path`` from: the path itself, or this node's verified copy."""
    if not is_uri(uri_or_path):
        path = Path(uri_or_path).expanduser()
        if not path.is_file():
            raise InvalidInputError(f"dataset {uri_or_path!r} does not exist (a local path, or a URI such as s3://...)")
        return path
    filesystem, remote = _open_filesystem(uri_or_path)
    sidecar = _read_remote_sidecar(filesystem, remote, uri_or_path)
    cache = Path(cache_dir).expanduser() / sidecar.sha256[:16]
    local = cache / Path(remote).name
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache) + ".lock"):
        if _is_complete_copy(local, sidecar):
            return local
        for stale in cache.glob(f"{local.name}{PARTIAL_MARK}*"):  # left by a copier that was killed
            stale.unlink(missing_ok=True)
        log.info("staging %s into %s (%d bytes)", redact(uri_or_path), local, sidecar.size_bytes)
        _copy_verified(filesystem, remote, uri_or_path, local, sidecar)
    return local


def read_location_sidecar(uri_or_path: str) -> Sidecar:
    """The sidecar of a dataset wherever it lives, read without staging it (the driver checks before workers start)."""
    if not is_uri(uri_or_path):
        return read_sidecar(uri_or_path)
    filesystem, remote = _open_filesystem(uri_or_path)
    return _read_remote_sidecar(filesystem, remote, uri_or_path)


def _open_filesystem(uri: str):
    import fsspec

    try:
        return fsspec.core.url_to_fs(uri)
    except ImportError as err:  # e.g. s3fs / gcsfs not installed
        raise StagingError(redact(f"cannot open {uri!r}: {err}")) from None
    except (ValueError, OSError) as err:
        raise StagingError(redact(f"cannot open {uri!r}: {type(err).__name__}: {err}")) from None


def _read_remote_sidecar(filesystem, remote: str, uri: str) -> Sidecar:
    where = redact(uri + SIDECAR_SUFFIX)
    try:
        text = filesystem.cat_file(remote + SIDECAR_SUFFIX)
    except FileNotFoundError:
        raise StagingError(
            f"cannot read {where!r}: not found or not reachable from this node (every staged .beton needs its "
            "sidecar beside it; check the URI, the network and the credentials)"
        ) from None
    except Exception as err:  # network and auth errors differ per filesystem; all mean unreachable
        raise StagingError(redact(f"cannot reach {where!r}: {type(err).__name__}: {err}")) from None
    return parse_sidecar(text.decode() if isinstance(text, bytes) else text, where)


def _is_complete_copy(local: Path, sidecar: Sidecar) -> bool:
    if not (local.is_file() and sidecar_path(local).is_file()):
        return False
    try:
        return read_sidecar(local) == sidecar and local.stat().st_size == sidecar.size_bytes
    except SidecarError:
        return False


def _copy_verified(filesystem, remote: str, uri: str, local: Path, sidecar: Sidecar) -> None:
    partial = partial_path(local)
    hasher = _StreamHasher(sidecar)
    try:
        with filesystem.open(remote, "rb") as source, open(partial, "wb") as target, tqdm(
            total=sidecar.size_bytes, unit="B", unit_scale=True, desc=f"staging {local.name}", leave=False,
            disable=sidecar.size_bytes < (256 << 20),
        ) as progress:
            while chunk := source.read(_COPY_CHUNK):
                target.write(chunk)
                hasher.update(chunk)
                progress.update(len(chunk))
            problem = hasher.mismatch()
    except FileNotFoundError:
        partial.unlink(missing_ok=True)
        raise StagingError(f"cannot read {redact(uri)!r}: not found or not reachable from this node") from None
    except Exception as err:
        partial.unlink(missing_ok=True)
        raise StagingError(redact(f"copying {uri!r} to {str(local)!r} failed: {type(err).__name__}: {err}")) from None
    finally:
        hasher.close()
    try:
        if problem:
            raise ChecksumMismatchError(
                f"{redact(uri)!r} {problem}: the remote file is corrupt or was replaced without its sidecar; nothing was staged"
            )
        publish(partial, local)
        write_sidecar(local, sidecar)
    finally:
        partial.unlink(missing_ok=True)


class _StreamHasher:
    """Hashes a file as it streams past, against its sidecar's digests.

    With chunk digests in the sidecar, each completed chunk is hashed on a thread pool (hashlib
    releases the GIL), at most ``_PENDING_CHUNKS`` chunks held at once; without them, the whole
    file's SHA-256 on the copying thread.
    """

    def __init__(self, sidecar: Sidecar):
        self.sidecar = sidecar
        self.chunk_bytes = sidecar.chunk_bytes
        self.whole = None if self.chunk_bytes else hashlib.sha256()
        self.pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1) if self.chunk_bytes else None
        self.pieces: list[bytes] = []
        self.filled = 0
        self.digests: list[Future] = []

    def update(self, data: bytes) -> None:
        if self.whole is not None:
            self.whole.update(data)
            return
        view = memoryview(data)
        while len(view):
            take = view[: self.chunk_bytes - self.filled]
            self.pieces.append(take)
            self.filled += len(take)
            view = view[len(take):]
            if self.filled == self.chunk_bytes:
                self._submit()

    def _submit(self) -> None:
        if len(self.digests) >= _PENDING_CHUNKS:
            self.digests[-_PENDING_CHUNKS].result()  # bound the memory held by chunks not yet hashed
        self.digests.append(self.pool.submit(_sha256_of_pieces, self.pieces))
        self.pieces, self.filled = [], 0

    def mismatch(self) -> str | None:
        """What differs from the sidecar, or None once every byte has been seen and matches."""
        if self.whole is not None:
            actual = self.whole.hexdigest()
            return None if actual == self.sidecar.sha256 else (
                f"has SHA-256 {actual} but its sidecar records {self.sidecar.sha256}")
        if self.pieces or not self.digests:
            self._submit()  # the last, shorter chunk (or the only one, of an empty file)
        actual = [digest.result() for digest in self.digests]
        bad = [index for index, (a, b) in enumerate(zip(actual, self.sidecar.chunk_sha256)) if a != b]
        if len(actual) != len(self.sidecar.chunk_sha256):
            return (f"has {len(actual)} chunks of {self.chunk_bytes} bytes but its sidecar records "
                    f"{len(self.sidecar.chunk_sha256)}")
        if bad:
            return (f"has {len(bad)} {self.chunk_bytes}-byte chunk(s) whose SHA-256 differs from its sidecar's "
                    f"(first: chunk {bad[0]}, at byte {bad[0] * self.chunk_bytes})")
        return None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _sha256_of_pieces(pieces: list) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()
