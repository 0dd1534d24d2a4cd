"""``stage_dataset``: a dataset URI copied once per node into a node-local cache, then read there.

FFCV reads its file with random access through mmap (``os_cache``) or page reads; doing that
over s3/gs/NFS from every worker would be slow and costly. So each node copies a URI
(``s3://``, ``gs://``, ``http(s)://``, ``hdfs://``, ``file://``: any filesystem ``fsspec`` can
open, pyarrow's included) once into ``cache_dir``; the workers of that node share the copy.

- One copier per node: a file lock in ``cache_dir``; the others wait, then find the copy done.
- Fast: the sidecar's chunks are read as byte ranges, ``data.stage_streams`` at once, each
  verified against its digest as it lands (``pipeline/data/ranged_reads.py``).
- A partial copy never counts: bytes go to a temporary name, removed if the copy fails or is
  interrupted (one left by a killed copier is removed by the next, under the lock); only a copy
  whose every digest matched the remote sidecar is renamed into place, and the sidecar, written
  last beside it, is what marks it complete.
- The cache is keyed by that SHA-256, so a dataset rewritten under the same URI is fetched anew.

A plain local path is read in place (it is already on a filesystem this node mounts); write it
as ``file:///...`` to have it staged, e.g. from a shared NFS mount.
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from filelock import FileLock

from pipeline.config.schema import DataConfig
from pipeline.atomic import PARTIAL_MARK, partial_path, publish
from pipeline.data.integrity import CorruptDatasetError
from pipeline.data.ranged_reads import copy_verified_ranges
from pipeline.data.sidecar import SIDECAR_SUFFIX, Sidecar, SidecarError, parse_sidecar, read_sidecar, sidecar_path, write_sidecar
from pipeline.errors import InvalidInputError
from pipeline.uris import is_uri, redact

DEFAULT_STREAMS = DataConfig.model_fields["stage_streams"].default
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


def stage_dataset(uri_or_path: str, cache_dir: str | Path, streams: int = DEFAULT_STREAMS) -> Path:
    """The local path to read ``uri_or_path`` from: the path itself, or this node's verified copy
    (``streams`` ranged reads at once, ``data.stage_streams``)."""
    if not is_uri(uri_or_path):
        path = Path(uri_or_path).expanduser()
        if not path.is_file():
            raise InvalidInputError(f"dataset {uri_or_path!r} does not exist (a local path, or a URI such as s3://...)")
        return path
    filesystem, remote = open_filesystem(uri_or_path)
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
        _copy_verified(filesystem, remote, uri_or_path, local, sidecar, streams)
    return local


def read_location_sidecar(uri_or_path: str) -> Sidecar:
    """The sidecar of a dataset wherever it lives, read without staging it (the driver checks before workers start)."""
    if not is_uri(uri_or_path):
        return read_sidecar(uri_or_path)
    filesystem, remote = open_filesystem(uri_or_path)
    return _read_remote_sidecar(filesystem, remote, uri_or_path)


def open_filesystem(uri: str):
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


def _copy_verified(filesystem, remote: str, uri: str, local: Path, sidecar: Sidecar, streams: int) -> None:
    partial = partial_path(local)
    try:
        try:
            copy_verified_ranges(filesystem, remote, partial, sidecar, streams, redact(uri))
        except CorruptDatasetError:
            raise
        except FileNotFoundError:
            raise StagingError(f"cannot read {redact(uri)!r}: not found or not reachable from this node") from None
        except Exception as err:  # network and auth errors differ per filesystem
            raise StagingError(
                redact(f"copying {uri!r} to {str(local)!r} failed: {type(err).__name__}: {err}")) from None
        publish(partial, local)
        write_sidecar(local, sidecar)
    finally:
        partial.unlink(missing_ok=True)  # also when interrupted: no partial copy outlives its copier
