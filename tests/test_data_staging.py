"""stage_dataset: one verified copy per node; partial copies, bad checksums and unreachable URIs refused."""
import logging
import multiprocessing
import socket

import pytest

from conftest import copy_with_sidecar
from pipeline.data.integrity import ChecksumMismatchError, check_beton
from pipeline.data.sidecar import SidecarError, chunk_sha256s, parse_sidecar, read_sidecar, sidecar_path
from pipeline.data.sources import DigitsSource
from pipeline.config.schema import DataConfig
from pipeline.data.staging import StagingError, cache_dir_for, read_location_sidecar, stage_dataset
from pipeline.data.writing import write_beton
from pipeline.errors import InvalidInputError


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """A .beton and its sidecar on a 'remote' filesystem, reached as a file:// URI."""
    path = tmp_path_factory.mktemp("bucket") / "digits_val.beton"
    write_beton(DigitsSource("val", 8), path, num_workers=1)
    return path


def uri(path) -> str:
    return f"file://{path}"


def copies_made(caplog) -> int:
    return sum(record.getMessage().startswith("staging ") for record in caplog.records)


def test_a_local_path_is_read_in_place(remote, tmp_path):
    assert stage_dataset(str(remote), tmp_path / "cache") == remote
    assert not (tmp_path / "cache").exists()


def test_a_missing_local_path_is_invalid_input_naming_it(tmp_path):
    with pytest.raises(InvalidInputError, match="absent.beton"):
        stage_dataset(str(tmp_path / "absent.beton"), tmp_path / "cache")


def test_a_uri_is_copied_once_into_the_cache_and_verified(remote, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pipeline.data.staging")
    local = stage_dataset(uri(remote), tmp_path / "cache")
    assert local.parent.parent == tmp_path / "cache" and local.name == remote.name
    assert check_beton(local, verify_checksum=True) == read_sidecar(remote)
    assert stage_dataset(uri(remote), tmp_path / "cache") == local
    assert copies_made(caplog) == 1


def test_a_partial_copy_never_counts_as_staged(remote, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pipeline.data.staging")
    local = stage_dataset(uri(remote), tmp_path / "cache")
    # A copier killed mid-way: half the bytes under the final name, no sidecar, a stray partial.
    sidecar_path(local).unlink()
    local.write_bytes(remote.read_bytes()[:1000])
    (local.parent / f"{local.name}.partial-123-abc").write_bytes(b"half")
    assert stage_dataset(uri(remote), tmp_path / "cache") == local
    check_beton(local, verify_checksum=True)
    assert sorted(p.name for p in local.parent.iterdir()) == [local.name, sidecar_path(local).name]
    assert copies_made(caplog) == 2


def _stage_in_a_worker(source_uri, cache, barrier, results):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("pipeline.data.staging").addHandler(handler)
    logging.getLogger("pipeline.data.staging").setLevel(logging.INFO)
    barrier.wait()  # all workers of the "node" ask at the same moment
    path = stage_dataset(source_uri, cache)
    results.put((str(path), len(records)))


def test_the_workers_of_one_node_share_a_single_copy(remote, tmp_path):
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    workers = [context.Process(target=_stage_in_a_worker, args=(uri(remote), tmp_path / "cache", barrier, results))
               for _ in range(2)]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
    assert len({path for path, _ in outcomes}) == 1
    assert sum(copies for _, copies in outcomes) == 1
    check_beton(outcomes[0][0], verify_checksum=True)


def test_a_remote_file_that_fails_its_checksum_is_not_staged(remote, tmp_path):
    damaged = tmp_path / "bucket" / remote.name
    damaged.parent.mkdir()
    data = bytearray(remote.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    sidecar_path(damaged).write_text(sidecar_path(remote).read_text())
    with pytest.raises(ChecksumMismatchError, match="SHA-256"):
        stage_dataset(uri(damaged), tmp_path / "cache")
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.endswith(".lock")] == []


def test_written_sidecars_list_chunk_digests_that_staging_verifies_in_parallel(remote, tmp_path):
    sidecar = read_sidecar(remote)
    assert sidecar.chunk_sha256 == chunk_sha256s(remote, sidecar.chunk_bytes)
    local = stage_dataset(uri(copy_with_sidecar(remote, tmp_path / "bucket", chunk_bytes=1024)), tmp_path / "cache")
    check_beton(local, verify_checksum=True)


def test_a_changed_chunk_is_refused_naming_it(remote, tmp_path):
    middle = remote.stat().st_size // 2  # image bytes: the structure stays valid
    damaged = copy_with_sidecar(remote, tmp_path / "bucket", chunk_bytes=1024, flip_at=middle)
    chunk = middle // 1024
    with pytest.raises(ChecksumMismatchError, match=rf"chunk {chunk} \(bytes {chunk * 1024}-{chunk * 1024 + 1023}\)"):
        stage_dataset(uri(damaged), tmp_path / "cache")
    with pytest.raises(ChecksumMismatchError, match=f"first: chunk {chunk}, at byte {chunk * 1024}"):
        check_beton(damaged, verify_checksum=True)


def test_a_sidecar_written_before_chunk_digests_is_verified_whole(remote, tmp_path):
    old = copy_with_sidecar(remote, tmp_path / "old")
    assert read_sidecar(old).chunk_sha256 is None
    check_beton(stage_dataset(uri(old), tmp_path / "cache"), verify_checksum=True)
    damaged = copy_with_sidecar(remote, tmp_path / "damaged", flip_at=remote.stat().st_size // 2)
    with pytest.raises(ChecksumMismatchError, match="has SHA-256"):
        stage_dataset(uri(damaged), tmp_path / "other-cache")
    with pytest.raises(ChecksumMismatchError, match="has SHA-256"):
        check_beton(damaged, verify_checksum=True)


def test_a_sidecar_whose_chunk_list_does_not_fit_the_file_size_is_refused(remote):
    text = read_sidecar(remote).model_copy(update=dict(chunk_bytes=1024, chunk_sha256=["0" * 64])).model_dump_json()
    with pytest.raises(SidecarError, match="chunks of 1024 bytes"):
        parse_sidecar(text, "x.json")


def test_a_uri_without_its_sidecar_is_a_staging_error(tmp_path):
    (tmp_path / "lonely.beton").write_bytes(b"x" * 100)
    with pytest.raises(StagingError, match="lonely.beton.json"):
        stage_dataset(uri(tmp_path / "lonely.beton"), tmp_path / "cache")


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again when the probe closes


def test_an_unreachable_uri_is_a_staging_error_naming_it(tmp_path):
    unreachable = f"http://127.0.0.1:{_closed_port()}/data/train.beton"
    with pytest.raises(StagingError, match=r"cannot reach .http://127\.0\.0\.1"):
        stage_dataset(unreachable, tmp_path / "cache")


def test_a_filesystem_whose_package_is_missing_names_the_package(tmp_path):
    # s3fs/gcsfs are per-cluster installs, not vitsweep dependencies.
    try:
        import s3fs  # noqa: F401
    except ImportError:
        with pytest.raises(StagingError, match="s3fs"):
            stage_dataset("s3://bucket/train.beton", tmp_path / "cache")
    else:
        with pytest.raises(StagingError, match="bucket"):
            stage_dataset("s3://bucket-that-does-not-exist-vitsweep/train.beton", tmp_path / "cache")


def test_the_cache_dir_is_configured_or_under_local_run_storage(tmp_path, monkeypatch):
    monkeypatch.delenv("VITSWEEP_CACHE_DIR", raising=False)
    assert cache_dir_for(DataConfig(cache_dir=str(tmp_path / "nvme")), "runs") == tmp_path / "nvme"
    assert cache_dir_for(DataConfig(), str(tmp_path / "runs")) == tmp_path / "runs" / "data-cache"
    assert not str(cache_dir_for(DataConfig(), "s3://bucket/runs")).startswith("s3:")


def test_a_nodes_cache_dir_variable_overrides_run_storage_but_not_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("VITSWEEP_CACHE_DIR", str(tmp_path / "local-nvme"))
    assert cache_dir_for(DataConfig(), str(tmp_path / "runs")) == tmp_path / "local-nvme"
    assert cache_dir_for(DataConfig(cache_dir=str(tmp_path / "set")), "runs") == tmp_path / "set"


def test_a_uris_sidecar_is_read_without_copying_the_dataset(remote, tmp_path):
    assert read_location_sidecar(uri(remote)) == read_sidecar(remote) == read_location_sidecar(str(remote))
