"""verify_dataset: a dataset's bytes match its sidecar before any worker starts, for a local path,
a file:// URI and any other URI (over HTTP: its chunks in parallel byte ranges, with a progress line);
an unchanged file is trusted from the record of its verification, a remote one's kept on the shared
run storage."""
import json
import os
import re
from pathlib import Path

import fsspec
import pytest

from conftest import copy_with_sidecar
from pipeline.data import verification
from pipeline.data.integrity import ChecksumMismatchError, CorruptDatasetError
from pipeline.data.sidecar import chunk_count, read_sidecar, sidecar_path
from pipeline.data.verification import verify_dataset, verified_record_path
from pipeline.errors import InvalidInputError
from range_server import RangeServer


@pytest.fixture
def pristine(digits16):
    return digits16["val"]


@pytest.fixture
def beton(pristine, tmp_path):
    """A fresh copy of a good .beton and its sidecar, free to damage."""
    copy = tmp_path / "data" / pristine.name
    copy.parent.mkdir()
    copy.write_bytes(pristine.read_bytes())
    sidecar_path(copy).write_text(sidecar_path(pristine).read_text())
    return copy


@pytest.fixture
def remote(pristine):
    """A good .beton and its sidecar behind a memory:// URI, whose info() carries a version ('created')."""
    filesystem = fsspec.filesystem("memory")
    filesystem.pipe("/bucket/val.beton", pristine.read_bytes())
    filesystem.pipe("/bucket/val.beton.json", sidecar_path(pristine).read_bytes())
    yield filesystem, "memory://bucket/val.beton"
    filesystem.rm("/bucket", recursive=True)


def _change_64_bytes_mid_file(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 64]) + data[middle + 64:]


def test_a_sound_local_dataset_is_verified_and_its_sidecar_returned(beton, tmp_path):
    assert verify_dataset(str(beton), tmp_path / "verified.json").num_classes == 10


def test_a_local_beton_with_64_bytes_changed_mid_file_is_refused(beton, tmp_path):
    size = beton.stat().st_size
    beton.write_bytes(_change_64_bytes_mid_file(beton.read_bytes()))
    assert beton.stat().st_size == size
    with pytest.raises(ChecksumMismatchError, match=rf"{beton.name}.*SHA-256"):
        verify_dataset(str(beton), tmp_path / "verified.json")


def test_the_same_damaged_file_as_a_file_uri_is_refused(beton, tmp_path):
    beton.write_bytes(_change_64_bytes_mid_file(beton.read_bytes()))
    with pytest.raises(ChecksumMismatchError, match=beton.name):
        verify_dataset(f"file://{beton}", tmp_path / "verified.json")


def test_a_damaged_file_behind_another_uri_is_refused_before_staging(pristine, tmp_path):
    filesystem = fsspec.filesystem("memory")
    filesystem.pipe("/bucket/val.beton", _change_64_bytes_mid_file(pristine.read_bytes()))
    filesystem.pipe("/bucket/val.beton.json", sidecar_path(pristine).read_bytes())
    try:
        with pytest.raises(ChecksumMismatchError, match="memory://bucket/val.beton"):
            verify_dataset("memory://bucket/val.beton", tmp_path / "verified.json")
    finally:
        filesystem.rm("/bucket", recursive=True)


def test_a_sound_file_behind_another_uri_is_verified(remote, tmp_path):
    assert verify_dataset(remote[1], tmp_path / "verified.json").num_samples > 0


def test_an_unchanged_file_is_trusted_from_its_record_without_hashing_again(beton, tmp_path):
    record = tmp_path / "verified.json"
    verify_dataset(str(beton), record)
    assert json.loads(record.read_text())[str(beton.resolve())]["inode"] == beton.stat().st_ino
    # Bytes changed behind the record's back, with size, mtime and inode restored: a second hash
    # would refuse the file, so its acceptance shows the record was used instead.
    stat = beton.stat()
    changed = _change_64_bytes_mid_file(beton.read_bytes())
    with open(beton, "r+b") as handle:  # in place: the same inode
        handle.write(changed)
    os.utime(beton, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    verify_dataset(str(beton), record)


def test_a_file_rewritten_after_its_verification_is_hashed_again_and_refused(beton, tmp_path):
    record = tmp_path / "verified.json"
    verify_dataset(str(beton), record)
    stat = beton.stat()
    beton.write_bytes(_change_64_bytes_mid_file(beton.read_bytes()))
    os.utime(beton, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    with pytest.raises(ChecksumMismatchError):
        verify_dataset(str(beton), record)


def test_a_sidecar_beside_another_file_is_refused_naming_both(beton, tmp_path):
    renamed = beton.with_name("other.beton")
    beton.rename(renamed)
    sidecar_path(beton).rename(sidecar_path(renamed))
    with pytest.raises(CorruptDatasetError, match=r"describes 'val.beton', not 'other.beton'"):
        verify_dataset(str(renamed), tmp_path / "verified.json")


def test_a_dataset_path_that_is_no_file_is_named_as_what_it_is(tmp_path):
    os.mkfifo(tmp_path / "train.beton")
    for given, kind in ((tmp_path / "train.beton", "a named pipe (FIFO)"), (Path("/dev/null"), "a character device")):
        with pytest.raises(InvalidInputError, match=re.escape(f"dataset {str(given)!r} is {kind}, not a .beton file")):
            verify_dataset(str(given), tmp_path / "verified.json")


def test_the_record_lives_in_the_node_cache_dir_when_the_cluster_sets_one(tmp_path, monkeypatch):
    monkeypatch.setenv("VITSWEEP_CACHE_DIR", str(tmp_path / "nvme"))
    assert verified_record_path() == tmp_path / "nvme" / "verified-datasets.json"


def test_a_remote_file_rewritten_with_the_same_size_is_hashed_again_and_refused(remote, pristine, tmp_path):
    filesystem, uri = remote
    record = tmp_path / "verified.json"
    verify_dataset(uri, record)
    before = filesystem.info("/bucket/val.beton")
    filesystem.pipe("/bucket/val.beton", _change_64_bytes_mid_file(pristine.read_bytes()))  # a new object version
    after = filesystem.info("/bucket/val.beton")
    assert after["size"] == before["size"] and after["created"] != before["created"]
    with pytest.raises(ChecksumMismatchError, match=uri):
        verify_dataset(uri, record)


def test_an_unchanged_remote_file_is_trusted_from_its_record_by_size_and_version(remote, pristine, tmp_path):
    filesystem, uri = remote
    record = tmp_path / "verified.json"
    verify_dataset(uri, record)
    assert json.loads(record.read_text())[uri]["created"] == str(filesystem.info("/bucket/val.beton")["created"])
    # Bytes changed inside the same object version: a second hash would refuse it, so its acceptance
    # shows the record was used instead.
    stored = filesystem.store["/bucket/val.beton"]
    stored.seek(0)
    stored.write(_change_64_bytes_mid_file(pristine.read_bytes()))
    verify_dataset(uri, record)


# --------------------------------------------------------------------------------------------------
# A remote dataset behind an object store's HTTP interface (tests/range_server.py): its chunks read in
# parallel byte ranges, once, and the record on the run storage every head shares
# --------------------------------------------------------------------------------------------------

CHUNK = 1 << 20  # the sidecars' chunk size here: 5 to 7 chunks of the digits file


def test_a_remote_dataset_is_read_once_in_parallel_ranges_one_per_chunk(pristine, tmp_path):
    remote = copy_with_sidecar(pristine, tmp_path / "bucket", CHUNK)
    chunks = chunk_count(remote.stat().st_size, CHUNK)
    assert chunks > 4  # more chunks than streams: the bound is what is seen
    with RangeServer(remote.parent, hold_until_in_flight=4) as server:
        assert verify_dataset(server.url(remote.name), tmp_path / "verified.json", streams=4) == read_sidecar(remote)
    assert (server.peak_in_flight, server.ranges_served) == (4, chunks)
    assert server.bytes_sent == remote.stat().st_size + sidecar_path(remote).stat().st_size  # each byte once


def test_a_changed_chunk_of_a_remote_dataset_is_refused_naming_it_and_what_to_do(pristine, tmp_path):
    remote = copy_with_sidecar(pristine, tmp_path / "bucket", CHUNK, flip_at=2 * CHUNK + 7)
    with RangeServer(remote.parent) as server, pytest.raises(
            ChecksumMismatchError, match=rf"chunk 2 \(bytes {2 * CHUNK}-{3 * CHUNK - 1}\).*write it again"):
        verify_dataset(server.url(remote.name), tmp_path / "verified.json", streams=4)
    assert not (tmp_path / "verified.json").exists()  # a refusal is not remembered


def test_a_fresh_head_sharing_the_run_storage_does_not_read_a_verified_dataset_again(pristine, tmp_path, monkeypatch):
    """A RayJob's head is new each time, its cache dir empty; the run storage is the shared volume."""
    remote, storage = copy_with_sidecar(pristine, tmp_path / "bucket", CHUNK), tmp_path / "shared" / "vitsweep-runs"
    with RangeServer(remote.parent) as server:
        for head in ("first-head", "fresh-head"):
            monkeypatch.setenv("VITSWEEP_CACHE_DIR", str(tmp_path / head / "nvme"))
            verify_dataset(server.url(remote.name), streams=4, storage_path=str(storage))
    assert server.ranges_served == chunk_count(remote.stat().st_size, CHUNK)  # the first head's pass only
    assert list(json.loads((storage / "verified-datasets.json").read_text())) == [server.url(remote.name)]
    assert not (tmp_path / "first-head").exists()


def test_a_large_remote_dataset_shows_its_progress_then_its_rate(pristine, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(verification, "_SHOW_PROGRESS_FROM", 0)  # the digits file stands for a large one
    monkeypatch.setattr(verification, "PROGRESS_EVERY_S", 0.0)  # a line per chunk
    remote = copy_with_sidecar(pristine, tmp_path / "bucket", CHUNK)
    with RangeServer(remote.parent) as server:
        verify_dataset(server.url(remote.name), tmp_path / "verified.json", streams=2)
    *progress, last = capsys.readouterr().out.splitlines()
    gb = remote.stat().st_size / 1e9
    assert len(progress) == chunk_count(remote.stat().st_size, CHUNK) - 1, progress  # all but the last chunk's
    assert all(re.fullmatch(rf"verifying {remote.name}: [\d.]+ of {gb:.1f} GB \(\d+%\), \d+ MB/s, \d+:\d\d left", line)
               for line in progress), progress
    assert re.fullmatch(rf"verifying {remote.name}: {gb:.1f} GB checked in \d+ s \(\d+ MB/s, 2 ranged reads at once\)",
                        last), last
