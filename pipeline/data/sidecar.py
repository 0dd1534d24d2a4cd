"""The JSON sidecar beside each ``.beton``: what it holds, how it was written, and its SHA-256.

``X.beton`` has its sidecar at ``X.beton.json``. The sidecar is written last, after the ``.beton``
is complete and renamed into place, so a ``.beton`` without a sidecar is an unfinished write.
Training reads the class count from it; staging verifies the copied bytes against its checksum.

Besides the whole file's SHA-256, a sidecar records one SHA-256 per ``chunk_bytes`` chunk, so a
file can be verified on every core at once (SHA-256 runs at ~0.5 GB/s per core without SHA
extensions: minutes for an ImageNet ``.beton`` on one). Sidecars written before have no chunk
list and are verified whole.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.atomic import write_text_atomically
from pipeline.errors import InvalidInputError

SIDECAR_FORMAT = "vitsweep.beton.v1"
SIDECAR_SUFFIX = ".json"
_HASH_CHUNK = 8 << 20  # bytes read at a time
CHUNK_BYTES = 64 << 20  # bytes per recorded chunk digest: ~16 per GB, ~5000 (300 kB) for 300 GB


class SidecarError(InvalidInputError):
    """A sidecar is missing, unreadable, or inconsistent with itself."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WriteOptions(_Record):
    """How images are stored: ffcv's ``RGBImageField`` options, exposed as ``vitsweep data write`` flags."""

    # raw: uint8 pixels, exact, fastest to decode; jpg: JPEG-compressed, ~10x smaller for photos;
    # proportion: a random `compress_probability` share as JPEG (ffcv-imagenet's ImageNet setting).
    write_mode: Literal["raw", "jpg", "proportion"] = "raw"
    max_resolution: int | None = Field(None, ge=8)  # longest side after an INTER_AREA downscale
    jpeg_quality: int = Field(90, ge=1, le=100)
    compress_probability: float = Field(0.5, ge=0.0, le=1.0)


# ffcv-imagenet's ImageNet files (write_imagenet.sh 500 0.50 90): longest side 500 px, half the
# images JPEG at quality 90, the rest raw -- `vitsweep data write`'s defaults. Raw ImageNet at full
# size is ~10x larger (slow to stage and verify); all-JPEG decodes slower.
FFCV_IMAGENET_WRITE = WriteOptions(
    write_mode="proportion", max_resolution=500, jpeg_quality=90, compress_probability=0.5,
)


class SourceInfo(_Record):
    kind: Literal["imagefolder", "cifar10", "cifar100", "digits"]
    location: str
    split: Literal["train", "val"] | None = None
    skipped_files: int = Field(0, ge=0)  # non-image files found in an ImageFolder tree
    selected_classes: list[str] | None = None  # `data write --classes`: the source's classes kept (None: all)
    per_class: int | None = Field(None, ge=1)  # `data write --per-class`: at most this many images per class


class ImageSizeStats(_Record):
    """Sizes of the stored images (after ``max_resolution``), in pixels."""

    min_width: int
    max_width: int
    mean_width: float
    min_height: int
    max_height: int
    mean_height: float


class Sidecar(_Record):
    format: Literal["vitsweep.beton.v1"] = SIDECAR_FORMAT
    file: str  # the .beton's file name, so a sidecar renamed away from its file is noticed
    size_bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    num_samples: int = Field(ge=1)
    classes: list[str] = Field(min_length=1)
    counts_per_class: dict[str, int]
    image_size: ImageSizeStats
    write: WriteOptions
    source: SourceInfo
    ffcv_version: str
    created_at: str
    # One SHA-256 per `chunk_bytes` of the file, in order (absent in sidecars written before).
    chunk_bytes: int | None = Field(None, ge=1)
    chunk_sha256: list[str] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @model_validator(mode="after")
    def _counts_match_classes(self) -> Sidecar:
        if list(self.counts_per_class) != self.classes:
            raise ValueError("counts_per_class must list exactly the classes, in label order")
        if sum(self.counts_per_class.values()) != self.num_samples:
            raise ValueError(
                f"counts_per_class sum to {sum(self.counts_per_class.values())}, num_samples is {self.num_samples}"
            )
        if (self.chunk_bytes is None) != (self.chunk_sha256 is None):
            raise ValueError("chunk_bytes and chunk_sha256 come together (or neither, in older sidecars)")
        if self.chunk_bytes is not None and len(self.chunk_sha256) != chunk_count(self.size_bytes, self.chunk_bytes):
            raise ValueError(
                f"chunk_sha256 lists {len(self.chunk_sha256)} digests; a {self.size_bytes}-byte file has "
                f"{chunk_count(self.size_bytes, self.chunk_bytes)} chunks of {self.chunk_bytes} bytes"
            )
        return self


def sidecar_path(beton: str | Path) -> Path:
    beton = Path(beton)
    return beton.with_name(beton.name + SIDECAR_SUFFIX)


def read_sidecar(beton: str | Path) -> Sidecar:
    """The sidecar beside ``beton`` (``sidecar.num_classes`` sizes the model's head)."""
    path = sidecar_path(beton)
    if not path.is_file():
        raise SidecarError(
            f"{str(beton)!r} has no sidecar {path.name!r} beside it: it was not written by "
            "`vitsweep data write`, or its write did not finish; write it again"
        )
    return parse_sidecar(path.read_text(), str(path))


def parse_sidecar(text: str, where: str) -> Sidecar:
    try:
        return Sidecar.model_validate(json.loads(text))
    except json.JSONDecodeError as err:
        raise SidecarError(f"sidecar {where!r} is not valid JSON: {err}") from None
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '<sidecar>'}: {e['msg']}" for e in err.errors(include_url=False)
        )
        raise SidecarError(f"sidecar {where!r} is not a {SIDECAR_FORMAT} sidecar: {problems}") from None


def write_sidecar(beton: str | Path, sidecar: Sidecar) -> Path:
    path = sidecar_path(beton)
    write_text_atomically(path, sidecar.model_dump_json(indent=2) + "\n")
    return path


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def chunk_count(size_bytes: int, chunk_bytes: int) -> int:
    return max(1, -(-size_bytes // chunk_bytes))  # an empty file still has one (empty) chunk


def chunk_sha256s(path: str | Path, chunk_bytes: int = CHUNK_BYTES, workers: int | None = None) -> list[str]:
    """The SHA-256 of each ``chunk_bytes`` chunk of ``path``, hashed on ``workers`` threads (default:
    every CPU; hashlib releases the GIL while it hashes)."""
    size = os.path.getsize(path)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        def digest(index: int) -> str:
            chunk = hashlib.sha256()
            start, end = index * chunk_bytes, min(size, (index + 1) * chunk_bytes)
            while start < end:
                piece = os.pread(descriptor, min(_HASH_CHUNK, end - start), start)
                if not piece:
                    break  # truncated under us: the digest will not match
                chunk.update(piece)
                start += len(piece)
            return chunk.hexdigest()

        with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
            return list(pool.map(digest, range(chunk_count(size, chunk_bytes))))
    finally:
        os.close(descriptor)


def file_digests(path: str | Path, chunk_bytes: int = CHUNK_BYTES) -> tuple[str, list[str]]:
    """The whole file's SHA-256 and its chunk digests, computed side by side (written into sidecars)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        whole = pool.submit(sha256_of, path)
        chunks = chunk_sha256s(path, chunk_bytes)
        return whole.result(), chunks
