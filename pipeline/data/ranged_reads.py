"""A remote file read through parallel ranged reads, each chunk checked against its sidecar as it lands:
``copy_verified_ranges`` (a node staging it) and ``verify_ranges`` (the driver checking it before any
worker starts).

One stream from an object store runs at what one connection gets (~100 MB/s on S3 or GCS): an hour
for an ImageNet ``.beton`` of ~350 GB, while a cluster's GPUs wait. So the file is read as the
sidecar's chunks (64 MiB each), separate byte ranges, ``streams`` at once, each with fsspec's own
ranged read ``filesystem.cat_file(path, start, end)``: a ranged GET on s3/gs/http (one request per
chunk, where ``open().seek().read()`` would issue one per block of its read-ahead cache), a seek and
read on ``file://``, on every filesystem fsspec (or pyarrow through it) opens. Each chunk is hashed on
the thread that fetched it (hashlib releases the GIL) and used only once its SHA-256 matches the
sidecar's; the first chunk that does not stops the read, named. A copy of a sidecar written before
chunk digests is read the same way in 64 MiB ranges, then the whole file is hashed once.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from tqdm import tqdm

from pipeline.data.integrity import ChecksumMismatchError, CorruptDatasetError
from pipeline.data.sidecar import CHUNK_BYTES, Sidecar, chunk_count, sha256_of

_SHOW_PROGRESS_FROM = 256 << 20  # bytes: smaller copies finish before a bar says anything


def copy_verified_ranges(filesystem, remote: str, target: Path, sidecar: Sidecar, streams: int, where: str) -> None:
    """Write ``remote``'s bytes into ``target`` (created), ``streams`` ranged reads at once, each
    chunk checked against ``sidecar`` before it is written; raise naming the first that differs.

    ``where`` names the remote file in messages (redacted). ``target`` is left for the caller to
    publish or delete: nothing here makes it look complete.
    """
    with open(target, "wb") as handle:
        handle.truncate(sidecar.size_bytes)  # every range lands at its offset, in any order

    def write_at(start: int, data: bytes) -> None:
        descriptor = os.open(target, os.O_WRONLY)  # no O_CREAT: a copy abandoned meanwhile is not re-created
        try:
            view = memoryview(data)
            while view:
                view = view[os.pwrite(descriptor, view, start + len(data) - len(view)):]
        finally:
            os.close(descriptor)

    with tqdm(total=sidecar.size_bytes, unit="B", unit_scale=True, desc=f"staging {Path(remote).name}",
              leave=False, disable=sidecar.size_bytes < _SHOW_PROGRESS_FROM) as progress:
        _read_verified_ranges(filesystem, remote, sidecar, streams, where, "nothing was staged", write_at,
                              progress.update)
    if sidecar.chunk_sha256 is None:
        actual = sha256_of(target)
        if actual != sidecar.sha256:
            raise ChecksumMismatchError(
                f"{where!r} has SHA-256 {actual} but its sidecar records {sidecar.sha256}: the remote file is corrupt "
                "or was replaced without its sidecar; nothing was staged"
            )


def verify_ranges(filesystem, remote: str, sidecar: Sidecar, streams: int, where: str,
                  progress: Callable[[int], None]) -> None:
    """Check every chunk of ``remote`` against ``sidecar``'s chunk digests, ``streams`` ranged reads at
    once, calling ``progress`` with each chunk's length as it passes; raise naming the first that differs."""
    assert sidecar.chunk_sha256 is not None, "a sidecar without chunk digests is verified whole"
    _read_verified_ranges(filesystem, remote, sidecar, streams, where, "write it again", None, progress)


def _read_verified_ranges(filesystem, remote: str, sidecar: Sidecar, streams: int, where: str, outcome: str,
                          use: Callable[[int, bytes], None] | None, progress: Callable[[int], None]) -> None:
    """Every range of ``remote``, ``streams`` at once, each checked and then given to ``use`` (with its
    offset); ``outcome`` ends a refusal's message (what the caller did not do)."""
    size = filesystem.size(remote)
    if size is not None and size != sidecar.size_bytes:
        raise CorruptDatasetError(
            f"{where!r} is {size} bytes but its sidecar records {sidecar.size_bytes}: the file is truncated or "
            f"was replaced without its sidecar; {outcome}"
        )
    range_bytes = sidecar.chunk_bytes or CHUNK_BYTES
    pool = ThreadPoolExecutor(max_workers=streams, thread_name_prefix="vitsweep-ranges")
    pending = {pool.submit(_read_range, filesystem, remote, sidecar, index * range_bytes, where, outcome, use)
               for index in range(chunk_count(sidecar.size_bytes, range_bytes))}
    try:
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                progress(future.result())  # the first failed range stops the read
    finally:
        # Ranges not started are dropped; one still running finds its target gone or writes into an unlinked file.
        pool.shutdown(wait=False, cancel_futures=True)


def _read_range(filesystem, remote: str, sidecar: Sidecar, start: int, where: str, outcome: str,
                use: Callable[[int, bytes], None] | None) -> int:
    """Fetch one range, check its chunk's digest, hand it to ``use``; return its length."""
    end = min(sidecar.size_bytes, start + (sidecar.chunk_bytes or CHUNK_BYTES))
    data = filesystem.cat_file(remote, start=start, end=end)
    if len(data) != end - start:
        raise CorruptDatasetError(
            f"{where!r}: bytes {start}-{end - 1} came back as {len(data)} bytes, not {end - start}: the server does "
            "not honour byte ranges (HTTP Range requests), or the file is shorter than its sidecar records; "
            f"{outcome}"
        )
    if sidecar.chunk_sha256 is not None:
        index = start // sidecar.chunk_bytes
        actual, expected = hashlib.sha256(data).hexdigest(), sidecar.chunk_sha256[index]
        if actual != expected:
            raise ChecksumMismatchError(
                f"{where!r}: chunk {index} (bytes {start}-{end - 1}) has SHA-256 {actual} but its sidecar records "
                f"{expected}: the remote file is corrupt or was replaced without its sidecar; {outcome}"
            )
    if use is not None:
        use(start, data)
    return len(data)
