"""Files that appear complete or not at all: write to a temporary name beside, fsync, rename."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

PARTIAL_MARK = ".partial-"


def partial_path(final: Path) -> Path:
    """A unique temporary name in the final file's directory (a rename never crosses filesystems)."""
    return final.with_name(f"{final.name}{PARTIAL_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_directory(directory: Path) -> None:
    # The rename itself is durable only once the directory entry is flushed.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(partial: Path, final: Path) -> None:
    """fsync ``partial``, rename it onto ``final`` atomically, and make the rename durable."""
    fsync_file(partial)
    os.replace(partial, final)
    fsync_directory(final.parent)


def publish_if_absent(partial: Path, final: Path) -> bool:
    """``publish``, but never over a ``final`` that exists (another process published it first): whether
    this one did. ``partial`` is left for the caller to remove."""
    fsync_file(partial)
    try:
        os.link(partial, final)  # unlike a rename, a link fails where the name is taken
    except FileExistsError:
        return False
    fsync_directory(final.parent)
    return True


def write_bytes_atomically(final: Path, data: bytes) -> None:
    partial = partial_path(final)
    try:
        partial.write_bytes(data)
        publish(partial, final)
    finally:
        partial.unlink(missing_ok=True)


def write_text_atomically(final: Path, text: str) -> None:
    write_bytes_atomically(final, text.encode())
