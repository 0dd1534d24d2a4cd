"""check_beton: a damaged .beton or a lying sidecar is refused, naming the file, before training starts."""
import json

import numpy as np
import pytest

from pipeline.config.schema import DataConfig
from pipeline.data.integrity import ChecksumMismatchError, CorruptDatasetError, check_beton
from pipeline.data.loaders import build_train_loader
from pipeline.data.sidecar import SidecarError, read_sidecar, sidecar_path
from pipeline.data.sources import DigitsSource
from pipeline.data.writing import write_beton

from ffcv.reader import Reader


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine") / "digits.beton"
    write_beton(DigitsSource("val", 8), path, num_workers=1)
    return path


@pytest.fixture
def beton(pristine, tmp_path):
    """A fresh copy of a good .beton and its sidecar, free to damage."""
    copy = tmp_path / pristine.name
    copy.write_bytes(pristine.read_bytes())
    sidecar_path(copy).write_text(sidecar_path(pristine).read_text())
    return copy


def _edit_sidecar(beton, **changes):
    record = json.loads(sidecar_path(beton).read_text()) | changes
    sidecar_path(beton).write_text(json.dumps(record))


def test_a_sound_file_passes_every_check_including_the_checksum(beton):
    assert check_beton(beton, verify_checksum=True).num_classes == 10


def test_truncated_beton_is_refused_naming_the_file(beton):
    data = beton.read_bytes()
    beton.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptDatasetError, match=rf"{beton.name}.*truncated"):
        check_beton(beton)


def test_truncated_beton_with_a_matching_size_record_is_still_refused(beton):
    data = beton.read_bytes()
    beton.write_bytes(data[:300])
    _edit_sidecar(beton, size_bytes=300)
    with pytest.raises(CorruptDatasetError, match=beton.name):
        check_beton(beton)


def test_overwritten_header_is_refused_naming_the_file(beton):
    data = bytearray(beton.read_bytes())
    data[:16] = b"\xff" * 16
    beton.write_bytes(bytes(data))
    with pytest.raises(CorruptDatasetError, match=rf"{beton.name}.*version"):
        check_beton(beton)


def test_overwritten_allocation_table_is_refused(beton):
    data = bytearray(beton.read_bytes())
    data[-24:] = b"\x00" * 24  # the last entry's (sample, ptr, size)
    beton.write_bytes(bytes(data))
    with pytest.raises(CorruptDatasetError, match=beton.name):
        check_beton(beton)


def test_changed_bytes_fail_the_sidecar_checksum(beton):
    first_pixel = int(Reader(str(beton)).metadata["f0"]["data_ptr"][0])
    data = bytearray(beton.read_bytes())
    data[first_pixel] ^= 0xFF  # one pixel of the first image: structure intact, content changed
    beton.write_bytes(bytes(data))
    check_beton(beton)  # the structure still checks out...
    with pytest.raises(ChecksumMismatchError, match=rf"{beton.name}.*SHA-256"):
        check_beton(beton, verify_checksum=True)  # ...the bytes do not


def test_missing_sidecar_is_refused_as_an_unfinished_write(beton):
    sidecar_path(beton).unlink()
    with pytest.raises(SidecarError, match="did not finish"):
        read_sidecar(beton)


def test_sidecar_that_is_not_json_is_refused_naming_it(beton):
    sidecar_path(beton).write_text("{not json")
    with pytest.raises(SidecarError, match=sidecar_path(beton).name):
        read_sidecar(beton)


def test_label_outside_the_sidecars_class_range_is_refused(beton):
    sidecar = read_sidecar(beton)
    counts = sidecar.counts_per_class
    # A sidecar claiming only digits 0-8: the file's 9s are outside the class range.
    fewer = {name: count for name, count in counts.items() if name != "9"}
    fewer["0"] += counts["9"]
    _edit_sidecar(beton, classes=[str(d) for d in range(9)], counts_per_class=fewer)
    with pytest.raises(CorruptDatasetError, match=r"label 9 of sample \d+ is outside the class range \[0, 9\)"):
        check_beton(beton)


def test_counts_per_class_that_differ_from_the_file_are_refused(beton):
    counts = read_sidecar(beton).counts_per_class
    counts["0"], counts["1"] = counts["0"] + 1, counts["1"] - 1
    _edit_sidecar(beton, counts_per_class=counts)
    with pytest.raises(CorruptDatasetError, match="counts per class"):
        check_beton(beton)


def test_the_train_loader_refuses_a_corrupt_file_before_building(beton):
    beton.write_bytes(beton.read_bytes()[:-100])
    with pytest.raises(CorruptDatasetError, match=beton.name):
        build_train_loader(DataConfig(), beton, batch_size=8, img_size=8, device="cpu")


def test_labels_read_by_the_check_are_the_written_ones(beton):
    from pipeline.data.integrity import read_contents

    assert np.array_equal(read_contents(beton).labels, DigitsSource("val", 8).labels)
