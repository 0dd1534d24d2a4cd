"""A ``.beton`` is whole and matches its sidecar: checked before any training step starts.

ffcv's own ``Reader`` trusts the file: a truncated ``.beton`` reads short arrays silently and
fails (or decodes garbage) deep inside a JIT-compiled loader thread. ``check_beton`` opens the
file with that same ``ffcv.reader.Reader`` and checks every structure the loader will follow:
header, field types, metadata length, allocation table, each image's data pointer, the labels'
range -- and, on request, the SHA-256 recorded in the sidecar.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

import pipeline.data.runtime  # noqa: F401  (first: imports ffcv keeping torch's thread count)
from pipeline.data.sidecar import Sidecar, chunk_sha256s, read_sidecar, sha256_of
from pipeline.errors import InvalidInputError
from pipeline.uris import special_file_kind

# ffcv after pipeline.data.runtime, which imports it keeping torch's thread count
from ffcv.fields import IntField, RGBImageField
from ffcv.reader import Reader
from ffcv.types import ALLOC_TABLE_TYPE, CURRENT_VERSION, FieldDescType, HeaderType

FIELDS = {"image": RGBImageField, "label": IntField}
_JPG, _RAW = 0, 1  # RGBImageField's stored modes


class CorruptDatasetError(InvalidInputError):
    """A ``.beton`` is truncated, overwritten, or inconsistent with its sidecar."""


class ChecksumMismatchError(CorruptDatasetError):
    """A ``.beton``'s bytes do not hash to the SHA-256 its sidecar records."""


@dataclass(frozen=True)
class BetonContents:
    """What a structurally sound ``.beton`` holds, read from its metadata (no image is decoded)."""

    widths: np.ndarray
    heights: np.ndarray
    labels: np.ndarray
    size_bytes: int

    @property
    def num_samples(self) -> int:
        return len(self.labels)


def _not_there(path: Path) -> str:
    special = special_file_kind(path)
    return f"is {special}, not a .beton file" if special else "does not exist"


def read_contents(path: str | Path) -> BetonContents:
    """Open ``path`` with ffcv's Reader and check every structure a Loader follows."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"dataset {str(path)!r} {_not_there(path)}")
    size = path.stat().st_size

    def corrupt(problem: str) -> CorruptDatasetError:
        return CorruptDatasetError(
            f"{str(path)!r} is not a complete ffcv .beton: {problem}; write it again (`vitsweep data write`)"
        )

    if size < HeaderType.itemsize:
        raise corrupt(f"{size} bytes is shorter than the {HeaderType.itemsize}-byte header")
    version = int(np.fromfile(path, dtype=HeaderType, count=1)[0]["version"])
    if version != CURRENT_VERSION:
        raise corrupt(f"header says format version {version}, ffcv reads version {CURRENT_VERSION}")
    try:
        reader = Reader(str(path))
    except Exception as err:  # any failure to parse is corruption, whatever numpy raised
        raise corrupt(f"ffcv cannot read its header ({type(err).__name__}: {err})") from None

    types = {name: type(handler) for name, handler in reader.handlers.items()}
    if types != FIELDS:
        readable = {name: t.__name__ for name, t in types.items()}
        raise corrupt(f"fields are {readable}, expected {{'image': 'RGBImageField', 'label': 'IntField'}}")
    num_samples = int(reader.num_samples)
    if len(reader.metadata) != num_samples:
        raise corrupt(f"header promises {num_samples} samples, the metadata holds {len(reader.metadata)}")
    data_start = HeaderType.itemsize + FieldDescType.itemsize * len(FIELDS) + reader.metadata.nbytes
    table_at = int(reader.header["alloc_table_ptr"])
    if not data_start <= table_at <= size or (size - table_at) % ALLOC_TABLE_TYPE.itemsize:
        raise corrupt(f"allocation table offset {table_at} does not fit a {size}-byte file")
    table = reader.alloc_table
    if len(table) and int((table["ptr"] + table["size"]).max()) > table_at:
        raise corrupt("an allocated region runs past the start of the allocation table")

    image, labels = reader.metadata["f0"], np.asarray(reader.metadata["f1"], dtype=np.int64)
    order = np.argsort(table["ptr"])
    ptrs, sizes = table["ptr"][order], table["size"][order]
    slot = np.clip(np.searchsorted(ptrs, image["data_ptr"]), 0, max(len(ptrs) - 1, 0))
    if not len(ptrs) or not np.array_equal(ptrs[slot], image["data_ptr"]):
        raise corrupt("an image's data pointer is not in the allocation table")
    if not np.isin(image["mode"], (_JPG, _RAW)).all() or (image["width"] == 0).any() or (image["height"] == 0).any():
        raise corrupt("an image has an unknown storage mode or a zero size")
    raw = image["mode"] == _RAW
    raw_bytes = image["width"].astype(np.uint64) * image["height"].astype(np.uint64) * np.uint64(3)
    if (sizes[slot][raw] != raw_bytes[raw]).any():
        raise corrupt("a raw image's stored bytes do not match its width x height x 3")
    return BetonContents(
        widths=np.asarray(image["width"], dtype=np.int64),
        heights=np.asarray(image["height"], dtype=np.int64),
        labels=labels,
        size_bytes=size,
    )


def check_beton(path: str | Path, sidecar: Sidecar | None = None, verify_checksum: bool = False) -> Sidecar:
    """Raise a ``CorruptDatasetError`` naming ``path`` unless it is whole and matches its sidecar.

    Structure, size, sample count, counts per class and label range are always checked (they
    read only the header, metadata and allocation table). ``verify_checksum`` also hashes every
    byte; staging always does, since that is when bytes move.
    """
    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"dataset {str(path)!r} {_not_there(path)}")
    sidecar = sidecar or read_sidecar(path)
    check_sidecar_names(sidecar, path.name, str(path))
    size = path.stat().st_size
    if size != sidecar.size_bytes:
        raise CorruptDatasetError(
            f"{str(path)!r} is {size} bytes but its sidecar records {sidecar.size_bytes}: the file is truncated "
            "or was replaced; write or stage it again"
        )
    contents = read_contents(path)
    if contents.num_samples != sidecar.num_samples:
        raise CorruptDatasetError(
            f"{str(path)!r} holds {contents.num_samples} samples but its sidecar records {sidecar.num_samples}"
        )
    outside = np.flatnonzero((contents.labels < 0) | (contents.labels >= sidecar.num_classes))
    if outside.size:
        first = int(outside[0])
        raise CorruptDatasetError(
            f"{str(path)!r}: label {int(contents.labels[first])} of sample {first} is outside the class range "
            f"[0, {sidecar.num_classes}) of its sidecar ({len(outside)} such sample(s))"
        )
    counts = np.bincount(contents.labels, minlength=sidecar.num_classes).tolist()
    if counts != list(sidecar.counts_per_class.values()):
        raise CorruptDatasetError(f"{str(path)!r}: its counts per class {counts} differ from its sidecar's")
    if verify_checksum:
        verify_sha256(path, sidecar)
    return sidecar


def verify_sha256(path: str | Path, sidecar: Sidecar) -> None:
    """``path``'s bytes against the sidecar: chunk by chunk on every core where it lists chunk digests,
    else (sidecars written before those) the whole file's SHA-256 on one."""
    if sidecar.chunk_sha256 is not None:
        actual_chunks = chunk_sha256s(path, sidecar.chunk_bytes)
        bad = [index for index, (a, b) in enumerate(zip(actual_chunks, sidecar.chunk_sha256)) if a != b]
        if bad or len(actual_chunks) != len(sidecar.chunk_sha256):
            raise ChecksumMismatchError(
                f"{str(path)!r}: {len(bad) or 'the number of'} {sidecar.chunk_bytes}-byte chunk(s) differ from the "
                f"SHA-256 digests its sidecar records (first: chunk {bad[0] if bad else len(actual_chunks)}, at byte "
                f"{(bad[0] if bad else len(actual_chunks)) * sidecar.chunk_bytes}): the bytes changed after writing "
                "(corruption, or a different file under the same name); write or stage it again"
            )
        return
    expected = sidecar.sha256
    actual = sha256_of(path)
    if actual != expected:
        raise ChecksumMismatchError(
            f"{str(path)!r} has SHA-256 {actual} but its sidecar records {expected}: the bytes changed after "
            "writing (corruption, or a different file under the same name); write or stage it again"
        )


def check_sidecar_names(sidecar: Sidecar, name: str, where: str) -> None:
    """A sidecar describes the file it sits beside: one copied or renamed next to another .beton is refused."""
    if sidecar.file != name:
        raise CorruptDatasetError(
            f"{where!r}: its sidecar describes {sidecar.file!r}, not {name!r} (a sidecar copied or renamed "
            "away from its file); write the dataset again, or put the right sidecar beside it"
        )
