"""Staging over HTTP: parallel ranged reads, each chunk verified as it lands, the configured number of
streams, and nothing partial left behind by a refused, failed or interrupted copy."""
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import VITSWEEP, copy_with_sidecar, vitsweep_env, wait_for
from pipeline.cli import EXIT_INVALID_INPUT, EXIT_OK, main
from pipeline.data.integrity import ChecksumMismatchError, CorruptDatasetError, check_beton
from pipeline.data.sidecar import chunk_count, read_sidecar, sidecar_path
from pipeline.data.staging import StagingError, stage_dataset
from range_server import RangeServer

REPO = Path(__file__).resolve().parents[1]
CHUNK = 1 << 20  # the sidecars' chunk size here: 5 to 7 chunks of the 4-7 MB digits file (ffcv's
# page allocation between its writer processes varies the size from one write to the next)


def files_in(cache) -> list[str]:
    return sorted(p.name for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


@pytest.fixture
def beton(digits16):
    return digits16["val"]


def test_every_chunk_is_read_as_its_own_range_with_the_configured_streams_at_once(beton, tmp_path):
    remote = copy_with_sidecar(beton, tmp_path / "bucket", CHUNK)
    chunks = chunk_count(remote.stat().st_size, CHUNK)
    assert chunks > 4  # more chunks than streams: the bound is what is seen
    with RangeServer(remote.parent, hold_until_in_flight=4) as server:
        local = stage_dataset(server.url(remote.name), tmp_path / "cache", streams=4)
    assert (server.peak_in_flight, server.ranges_served) == (4, chunks)
    assert local.read_bytes() == beton.read_bytes()
    assert check_beton(local, verify_checksum=True) == read_sidecar(remote)


def test_a_corrupted_chunk_is_refused_naming_it_and_nothing_is_staged(beton, tmp_path):
    flipped = 3 * CHUNK + 100
    remote = copy_with_sidecar(beton, tmp_path / "bucket", CHUNK, flip_at=flipped)
    with RangeServer(remote.parent) as server:
        with pytest.raises(ChecksumMismatchError, match=rf"chunk 3 \(bytes {3 * CHUNK}-{4 * CHUNK - 1}\)"):
            stage_dataset(server.url(remote.name), tmp_path / "cache", streams=4)
    assert files_in(tmp_path / "cache") == []


def test_a_sidecar_without_chunk_digests_is_copied_in_ranges_then_verified_whole(beton, tmp_path):
    remote = copy_with_sidecar(beton, tmp_path / "old")
    with RangeServer(remote.parent) as server:
        check_beton(stage_dataset(server.url(remote.name), tmp_path / "cache", streams=4), verify_checksum=True)
    damaged = copy_with_sidecar(beton, tmp_path / "damaged", flip_at=CHUNK + 5)
    with RangeServer(damaged.parent) as server:
        with pytest.raises(ChecksumMismatchError, match="has SHA-256"):
            stage_dataset(server.url(damaged.name), tmp_path / "other-cache", streams=4)
    assert files_in(tmp_path / "other-cache") == []


def test_a_connection_dropped_mid_range_fails_the_stage_naming_the_uri_and_leaves_nothing(beton, tmp_path):
    remote = copy_with_sidecar(beton, tmp_path / "bucket", CHUNK)
    last_chunk_start = (chunk_count(remote.stat().st_size, CHUNK) - 1) * CHUNK
    assert last_chunk_start >= 4 * CHUNK  # earlier ranges land before the last one drops
    with RangeServer(remote.parent, fail_ranges_from=last_chunk_start) as server:
        with pytest.raises(StagingError, match=rf"{server.url(remote.name)}.*failed"):
            stage_dataset(server.url(remote.name), tmp_path / "cache", streams=4)
    assert files_in(tmp_path / "cache") == []


def test_a_server_that_ignores_byte_ranges_is_refused_saying_so(beton, tmp_path):
    remote = copy_with_sidecar(beton, tmp_path / "bucket", CHUNK)
    with RangeServer(remote.parent, honour_ranges=False) as server:
        with pytest.raises(CorruptDatasetError, match="byte ranges"):
            stage_dataset(server.url(remote.name), tmp_path / "cache", streams=2)
    assert files_in(tmp_path / "cache") == []


def test_a_remote_file_longer_than_its_sidecar_says_is_refused(beton, tmp_path):
    remote = copy_with_sidecar(beton, tmp_path / "bucket", CHUNK)
    with open(remote, "ab") as grown:
        grown.write(b"appended")
    with RangeServer(remote.parent) as server:
        with pytest.raises(CorruptDatasetError, match=f"{remote.stat().st_size} bytes but its sidecar records"):
            stage_dataset(server.url(remote.name), tmp_path / "cache", streams=2)
    assert files_in(tmp_path / "cache") == []


def test_an_interrupted_stage_leaves_no_partial_file_and_the_next_one_copies_it_whole(beton, tmp_path):
    remote = copy_with_sidecar(beton, tmp_path / "bucket", CHUNK)
    cache = tmp_path / "cache"
    with RangeServer(remote.parent, hold_until_in_flight=3) as server:  # more than the 2 opened: held
        stage = subprocess.Popen([VITSWEEP, "data", "stage", server.url(remote.name), "--cache-dir", str(cache),
                                  "--streams", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=vitsweep_env())
        try:
            wait_for(lambda: server.in_flight == 2, 60, "the stage's 2 range requests")
            stage.send_signal(signal.SIGINT)
            server.release()
            _, err = stage.communicate(timeout=60)
        finally:
            stage.kill()
        assert stage.returncode != 0 and "interrupted" in err
        assert files_in(cache) == []
        local = stage_dataset(server.url(remote.name), cache, streams=2)
    assert local.read_bytes() == beton.read_bytes()
    assert files_in(cache) == sorted([local.name, sidecar_path(local).name])


def readme_stage_command() -> list[str]:
    """The README's `vitsweep data stage` line, as its words (the comment dropped)."""
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("vitsweep data stage ")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0], comments=True)


def test_the_readmes_data_stage_line_runs_as_written_with_its_streams(beton, tmp_path, capsys):
    words = readme_stage_command()
    streams = int(words[words.index("--streams") + 1])
    remote = copy_with_sidecar(beton, tmp_path / "bucket", 64 << 10)
    assert chunk_count(remote.stat().st_size, 64 << 10) > streams
    with RangeServer(remote.parent, hold_until_in_flight=streams) as server:
        # As written, but against this loopback server and into this test's cache.
        words[words.index("s3://bucket/train.beton")] = server.url(remote.name)
        words[words.index("--cache-dir") + 1] = str(tmp_path / "cache")
        assert main(words[1:]) == EXIT_OK
    assert server.peak_in_flight == streams
    local = Path(capsys.readouterr().out.strip())
    assert local.parent.parent == tmp_path / "cache" and local.read_bytes() == beton.read_bytes()


@pytest.mark.parametrize("streams,allowed", [("0", "greater than or equal to 1"), ("257", "less than or equal to 256")])
def test_data_stage_refuses_a_number_of_streams_out_of_range_naming_the_flag(tmp_path, capsys, streams, allowed):
    assert main(["data", "stage", "file:///nowhere/x.beton", "--cache-dir", str(tmp_path), "--streams", streams]) == \
        EXIT_INVALID_INPUT
    assert f"--streams {streams}: Input should be {allowed}" in capsys.readouterr().err
