"""``write_beton``: an image source into a ``.beton`` (ffcv's ``DatasetWriter``) and its sidecar.

A failed write never leaves a file that looks complete: ffcv writes to a temporary name beside
the target, which is fsynced and renamed into place only after the result checks out; the
sidecar, which is what marks a ``.beton`` as finished, is written last.

An image that fails to decode in a writer process (truncated data behind an intact header) is
handled as a file whose header cannot be read: the source leaves it out, naming it
(``ImageSource.without_unreadable``), and the samples are written again without it.

ffcv's writer waits for its worker processes without ever checking that they are alive, so one
crashed worker would hang the write forever. Its waiting loop checks them here (a dead worker is
an error raised in the writing thread, whichever thread that is), and an image that cannot be
decoded is recorded and reported after the pass instead of killing its worker.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import multiprocessing
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pipeline.atomic import partial_path, publish
from pipeline.data.integrity import read_contents
from pipeline.data.runtime import FFCV_VERSION, preserved_torch_threads
from pipeline.data.sidecar import (
    CHUNK_BYTES,
    ImageSizeStats,
    Sidecar,
    SourceInfo,
    WriteOptions,
    file_digests,
    sidecar_path,
    write_sidecar,
)
from pipeline.data.sources import ImageSource
from pipeline.errors import InvalidInputError

# ffcv after pipeline.data.runtime, which imports it keeping torch's thread count
from ffcv.fields import IntField, RGBImageField
from ffcv import writer as ffcv_writer
from ffcv.writer import MIN_PAGE_SIZE, DatasetWriter

BETON_SUFFIX = ".beton"
_CHUNK = 100  # samples per work item: small enough to balance workers, large enough to amortise queues


class WriteFailedError(RuntimeError):
    """The write itself failed (a worker died); nothing was left at the target path."""


def check_output(out: str | Path, overwrite: bool = False) -> Path:
    """``out`` as a path a new ``.beton`` may be written to; InvalidInputError saying why not (checked before a
    source is scanned, which may read every image's header)."""
    out = Path(out).expanduser()
    if out.suffix != BETON_SUFFIX:
        raise InvalidInputError(f"output {str(out)!r} must end in {BETON_SUFFIX!r}")
    if out.exists() and not overwrite:
        raise InvalidInputError(f"output {str(out)!r} already exists; pass --overwrite to replace it")
    return out


def write_beton(
    source: ImageSource,
    out: str | Path,
    options: WriteOptions | None = None,
    num_workers: int | None = None,
    overwrite: bool = False,
) -> Sidecar:
    """Write ``source`` to ``out`` with ``num_workers`` processes (default: every CPU); returns the sidecar."""
    options = options or WriteOptions()
    out = check_output(out, overwrite)
    if len(source) == 0:
        raise InvalidInputError(f"source {source.location!r} holds no images")
    _check_labels(source)
    workers = max(1, min(num_workers or os.cpu_count() or 1, len(source)))
    out.parent.mkdir(parents=True, exist_ok=True)

    partial = partial_path(out)
    try:
        failed = _write_samples(source, partial, options, workers)
        if failed:  # rare: a second pass over the source is cheaper than decoding every image twice
            source = source.without_unreadable(_failure_reasons(source, failed))
            failed = _write_samples(source, partial, options, workers)
        if failed:  # a file that changed between the passes
            raise InvalidInputError(_describe_failures(source, failed))
        contents = read_contents(partial)  # the loader will follow these structures; check them now
        counts = np.bincount(contents.labels, minlength=len(source.classes)).tolist()
        whole_sha256, chunk_sha256 = file_digests(partial, CHUNK_BYTES)
        sidecar = Sidecar(
            file=out.name,
            size_bytes=contents.size_bytes,
            sha256=whole_sha256,
            chunk_bytes=CHUNK_BYTES,
            chunk_sha256=chunk_sha256,
            num_samples=contents.num_samples,
            classes=list(source.classes),
            counts_per_class=dict(zip(source.classes, counts)),
            image_size=ImageSizeStats(
                min_width=int(contents.widths.min()), max_width=int(contents.widths.max()),
                mean_width=round(float(contents.widths.mean()), 2),
                min_height=int(contents.heights.min()), max_height=int(contents.heights.max()),
                mean_height=round(float(contents.heights.mean()), 2),
            ),
            write=options,
            source=SourceInfo(kind=source.kind, location=source.location, split=source.split,
                              skipped_files=len(source.skipped), selected_classes=source.selected_classes,
                              per_class=source.per_class),
            ffcv_version=FFCV_VERSION,
            created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        )
        # An old sidecar beside the new file would vouch for the wrong bytes: it goes first.
        sidecar_path(out).unlink(missing_ok=True)
        publish(partial, out)
        write_sidecar(out, sidecar)
        return sidecar
    finally:
        partial.unlink(missing_ok=True)


def _check_labels(source: ImageSource) -> None:
    outside = np.flatnonzero((source.labels < 0) | (source.labels >= len(source.classes)))
    if outside.size:
        first = int(outside[0])
        raise InvalidInputError(
            f"{source.describe(first)}: label {int(source.labels[first])} is outside the class range "
            f"[0, {len(source.classes)}) ({len(outside)} such sample(s))"
        )


def page_size_for(source: ImageSource, options: WriteOptions) -> int:
    """ffcv stores each sample within one page: the page must hold the largest stored image."""
    longest = int(source.sizes.max())
    if options.max_resolution is not None:
        longest = min(longest, options.max_resolution)
    # Raw bytes bound a JPEG of the same image, up to its headers (~1 KiB; 64 KiB of slack).
    largest = 3 * longest * longest + (64 << 10)
    # ffcv's default 8 MiB pages, but 2 MiB for small datasets: every writer process leaves one
    # partly filled page, which would dwarf a few MB of digits.
    total = 3 * int((np.minimum(source.sizes, longest).prod(axis=1)).sum())
    floor = 4 * MIN_PAGE_SIZE if total > (256 << 20) else MIN_PAGE_SIZE
    return max(floor, 1 << (largest - 1).bit_length())


def _write_samples(source: ImageSource, partial: Path, options: WriteOptions, workers: int) -> list[int]:
    """Run ffcv's parallel writer into ``partial``; the indices of samples that failed to load."""
    fields = {
        "image": RGBImageField(
            write_mode=options.write_mode, max_resolution=options.max_resolution,
            jpeg_quality=options.jpeg_quality, compress_probability=options.compress_probability,
        ),
        "label": IntField(),
    }
    failures = multiprocessing.Array(ctypes.c_bool, len(source), lock=False)
    guarded = _GuardedSource(source, failures, seed_per_sample=options.write_mode == "proportion")
    writer = DatasetWriter(str(partial), fields, page_size=page_size_for(source, options), num_workers=workers)
    with _tracked_writer_processes() as workers, _waiting_checks_workers(workers, partial):
        try:
            with preserved_torch_threads(), _labelled_progress(f"writing {source.kind} {source.split or ''}".strip()):
                writer.from_indexed_dataset(guarded, chunksize=_CHUNK)
        except BaseException:  # a dead worker, the user's Ctrl-C, or an error of the writer itself
            _stop(workers)
            _release_shared_metadata(writer)
            raise
    return [index for index, failed in enumerate(failures) if failed]


@contextlib.contextmanager
def _labelled_progress(label: str):
    """ffcv's writer draws an unlabelled tqdm bar; give it a label and a unit while it writes
    (ffcv 1.0.2 calls the ``tqdm`` its module imported: that name is swapped for the write)."""
    unlabelled = ffcv_writer.tqdm
    ffcv_writer.tqdm = functools.partial(unlabelled, desc=label, unit="img")
    try:
        yield
    finally:
        ffcv_writer.tqdm = unlabelled


class _GuardedSource:
    """The source as ffcv's writer workers see it: a sample that fails to load is recorded, not fatal.

    A worker that raised would die and leave ffcv's writer waiting forever; instead the sample is
    written as a 1x1 placeholder, flagged in shared memory, and the whole write is rejected after.
    """

    def __init__(self, source: ImageSource, failures, seed_per_sample: bool):
        self.source, self.failures, self.seed_per_sample = source, failures, seed_per_sample

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        if self.seed_per_sample:
            # 'proportion' draws np.random in the worker: seed by index so the choice is reproducible
            # (forked workers would otherwise all share one random stream).
            np.random.seed(index)
        try:
            image, label = self.source[index]
            check_encodable(image)
            return image, label
        except Exception:  # reported with its message after the pass, from the main process
            self.failures[index] = True
            return np.zeros((1, 1, 3), dtype=np.uint8), 0


def check_encodable(image) -> None:
    """What ffcv's RGBImageField.encode needs; raised there, it would kill the writer process."""
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        described = f"{image.dtype} array of shape {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
        raise ValueError(f"an image must be an HxWx3 uint8 array, got a {described}")


def _failure_reasons(source: ImageSource, failed: list[int]) -> dict[int, str]:
    """Why each failed sample failed, found again in this process (a writer process only flags it)."""
    reasons = {}
    for index in failed:
        try:
            check_encodable(source[index][0])
            reasons[index] = "failed in a writer process only"
        except Exception as err:  # noqa: BLE001  (whatever decoding raised is the reason)
            reasons[index] = f"{type(err).__name__}: {err}"
    return reasons


def _describe_failures(source: ImageSource, failed: list[int]) -> str:
    return (f"{len(failed)} image(s) could not be read; nothing was written. Remove or replace them:\n"
            + "\n".join(f"  {source.describe(index)}: {reason}" for index, reason in
                         _failure_reasons(source, failed).items()))


class _TrackedProcess(multiprocessing.Process):
    """ffcv's writer processes, recorded as they start so the write can see them exit."""

    started: list[multiprocessing.Process] = []

    def start(self) -> None:
        super().start()
        _TrackedProcess.started.append(self)


@contextlib.contextmanager
def _tracked_writer_processes() -> Iterator[list[multiprocessing.Process]]:
    # ffcv keeps its worker Process objects local to one function; it creates them through the
    # name `Process` in ffcv.writer, so for the duration of one write that name is ours.
    _TrackedProcess.started = []
    original, ffcv_writer.Process = ffcv_writer.Process, _TrackedProcess
    try:
        yield _TrackedProcess.started
    finally:
        ffcv_writer.Process = original


@contextlib.contextmanager
def _waiting_checks_workers(workers: list[multiprocessing.Process], partial: Path) -> Iterator[None]:
    # ffcv 1.0.2 waits for its workers' progress in a loop around the `sleep` its module imported;
    # for one write that name also checks the workers, so a dead one ends the wait with an error in
    # the writing thread (no signal to the main thread, which may be busy elsewhere or ignore it).
    def sleep_then_check(seconds: float) -> None:
        time.sleep(seconds)
        for process in workers:
            if process.exitcode not in (None, 0):
                raise WriteFailedError(
                    f"an ffcv writer process (pid {process.pid}) exited with code {process.exitcode} "
                    f"while writing {str(partial)!r}; nothing was written"
                )

    original, ffcv_writer.sleep = ffcv_writer.sleep, sleep_then_check
    try:
        yield
    finally:
        ffcv_writer.sleep = original


def _stop(workers: list[multiprocessing.Process]) -> None:
    for process in workers:
        if process.is_alive():  # the others would wait forever for the dead one's page
            process.terminate()
            process.join(timeout=5)


def _release_shared_metadata(writer: DatasetWriter) -> None:
    # ffcv unlinks its shared-memory metadata only after a successful write; this is the other case.
    shared = getattr(writer, "metadata_sm", None)
    if shared is None or isinstance(shared, int):
        return
    try:
        shared.close()
        shared.unlink()
    except FileNotFoundError:
        pass
