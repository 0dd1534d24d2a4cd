"""``data.prepare: digits``: write the offline digits dataset to ``data.train``/``data.val`` if absent.

Used by the embedded demo and the tests, so a fresh machine trains without any download. Safe to
call from every worker of a node at once: a lock beside each file makes one of them write it.
"""
from __future__ import annotations

from pathlib import Path

from filelock import FileLock

from pipeline.config.schema import DataConfig, ExperimentConfig
from pipeline.console import active_console
from pipeline.data.sidecar import WriteOptions, read_sidecar, sidecar_path
from pipeline.data.sources import DIGITS, DigitsSource
from pipeline.errors import InvalidInputError
from pipeline.uris import is_uri


def prepare_digits(data: DataConfig, img_size: int, num_workers: int | None = None) -> tuple[Path, Path]:
    """Absolute (train, val) paths, written at ``img_size`` px (raw mode: exact pixels) if absent.

    Absolute because Ray Train workers do not run in the driver's working directory.
    """
    written = []
    for split, location in (("train", data.train), ("val", data.val)):
        if is_uri(location):
            raise InvalidInputError(
                f"data.prepare='digits' writes local files, but data.{split}={location!r} is a URI; "
                "point it at a local path"
            )
        path = Path(location).expanduser().resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            if path.exists() and not sidecar_path(path).exists():
                raise InvalidInputError(
                    f"data.prepare='digits' would write data.{split}={location!r}, which exists without a "
                    "sidecar (not written by vitsweep); remove it or unset data.prepare"
                )
            if path.exists():
                _check_written_digits(path, f"data.{split}={location!r}", img_size)
            else:
                # Here, not at the top: ffcv's writer (numba) takes seconds to import, on the path to
                # Ray's start of every run that has its dataset already.
                from pipeline.data.writing import write_beton

                source = DigitsSource(split, img_size)
                active_console().line(f"writing the offline digits dataset, {split} split: {len(source)} images at "
                                      f"{img_size} px -> {path}")
                write_beton(source, path, WriteOptions(write_mode="raw"), num_workers=num_workers)
        written.append(path)
    return written[0], written[1]


def _check_written_digits(path: Path, name: str, img_size: int) -> None:
    """A file written before is this run's data only if it holds the digits at this run's size: a run at
    another ``model.img_size`` would otherwise train on images of the first run's."""
    sidecar = read_sidecar(path)
    sizes = sidecar.image_size
    if sidecar.source.kind != DIGITS:
        raise InvalidInputError(f"data.prepare='digits' finds {name} holding {sidecar.source.kind} images, not "
                                "digits; unset data.prepare to train on it")
    if {sizes.min_width, sizes.max_width, sizes.min_height, sizes.max_height} != {img_size}:
        raise InvalidInputError(
            f"data.prepare='digits' finds {name} written at {sizes.max_width} px, but model.img_size is {img_size}: "
            f"point data.train and data.val at new files (e.g. digits_{img_size}_train.beton), or remove these")


def prepare_offline_data(cfg: ExperimentConfig) -> None:
    """Write the offline dataset the config asks for (``data.prepare``), unless it is there already."""
    if cfg.data.prepare == "digits":
        prepare_digits(cfg.data, cfg.model.img_size)
