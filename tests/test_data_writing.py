"""write_beton: round trips, the sidecar, atomic output, and failures that must not hang or leave files."""
import json
import os
import signal
import threading

import numpy as np
import pytest
from PIL import Image

from pipeline.data.runtime import ThreadCountPreservingLoader
from pipeline.data.sidecar import WriteOptions, read_sidecar, sha256_of, sidecar_path
from pipeline.data.sources import ImageFolderSource, ImageSource, SkippedFilesWarning
from pipeline.data.writing import WriteFailedError, write_beton
from pipeline.errors import InvalidInputError

from ffcv.fields.decoders import CenterCropRGBImageDecoder, IntDecoder, SimpleRGBImageDecoder
from ffcv.loader import OrderOption


class ArraySource(ImageSource):
    """Images and labels held in memory: the smallest real source."""

    kind, location, split = "imagefolder", "memory", None

    def __init__(self, images, labels, num_classes):
        self.images, self.labels = images, np.asarray(labels, dtype=np.int64)
        self.classes = [f"c{i}" for i in range(num_classes)]
        self.sizes = np.array([[image.shape[1], image.shape[0]] for image in images])
        self.skipped = []

    def load_image(self, index):
        return self.images[index]


def random_source(count=50, size=(12, 9), num_classes=5, seed=0) -> ArraySource:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (count, size[1], size[0], 3), dtype=np.uint8)
    return ArraySource(list(images), rng.integers(0, num_classes, count), num_classes)


def read_back(path, decoder) -> tuple[np.ndarray, np.ndarray]:
    loader = ThreadCountPreservingLoader(
        str(path), batch_size=16, num_workers=1, order=OrderOption.SEQUENTIAL, drop_last=False,
        pipelines={"image": [decoder], "label": [IntDecoder()]},
    )
    batches = [(images.copy(), labels.copy()) for images, labels in loader]  # ffcv reuses its buffers
    return np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches]).reshape(-1)


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir())


def test_raw_mode_round_trip_is_bit_identical_with_identical_labels(tmp_path):
    source = random_source()
    write_beton(source, tmp_path / "raw.beton", num_workers=2)
    images, labels = read_back(tmp_path / "raw.beton", SimpleRGBImageDecoder())
    assert np.array_equal(images, np.stack(source.images))
    assert np.array_equal(labels, source.labels)


def test_jpg_mode_round_trip_is_close_at_the_chosen_quality(tmp_path):
    smooth = [np.repeat(np.linspace(0, 255, 16, dtype=np.uint8)[None, :, None], 16, 0).repeat(3, 2)] * 4
    source = ArraySource(smooth, [0, 1, 0, 1], 2)
    write_beton(source, tmp_path / "jpg.beton", WriteOptions(write_mode="jpg", jpeg_quality=95), num_workers=1)
    images, labels = read_back(tmp_path / "jpg.beton", SimpleRGBImageDecoder())
    assert np.abs(images.astype(int) - np.stack(smooth)).mean() < 3
    assert labels.tolist() == [0, 1, 0, 1]


def test_max_resolution_downscales_the_longest_side(tmp_path):
    source = random_source(count=4, size=(40, 20))
    sidecar = write_beton(source, tmp_path / "small.beton", WriteOptions(max_resolution=16), num_workers=1)
    assert (sidecar.image_size.max_width, sidecar.image_size.max_height) == (16, 8)


def test_variable_size_images_read_back_through_the_center_crop_decoder(tmp_path):
    sizes = [(20, 10), (10, 20), (15, 15)]
    images = [np.full((h, w, 3), 40 * i, np.uint8) for i, (w, h) in enumerate(sizes)]
    write_beton(ArraySource(images, [0, 1, 2], 3), tmp_path / "mixed.beton", num_workers=1)
    decoded, _ = read_back(tmp_path / "mixed.beton", CenterCropRGBImageDecoder((8, 8), ratio=1.0))
    assert [int(image.mean()) for image in decoded] == [0, 40, 80]


def test_sidecar_records_source_classes_counts_sizes_options_and_checksum(tmp_path):
    source = random_source(count=20, size=(12, 9), num_classes=3)
    options = WriteOptions(write_mode="proportion", compress_probability=0.25, jpeg_quality=80)
    write_beton(source, tmp_path / "d.beton", options, num_workers=2)
    sidecar = read_sidecar(tmp_path / "d.beton")
    assert sidecar.classes == ["c0", "c1", "c2"] and sidecar.num_classes == 3
    assert list(sidecar.counts_per_class.values()) == np.bincount(source.labels, minlength=3).tolist()
    assert sidecar.num_samples == 20 and sidecar.write == options
    assert (sidecar.image_size.min_width, sidecar.image_size.mean_height) == (12, 9.0)
    assert sidecar.sha256 == sha256_of(tmp_path / "d.beton")
    assert sidecar.size_bytes == (tmp_path / "d.beton").stat().st_size
    assert json.loads(sidecar_path(tmp_path / "d.beton").read_text())["source"]["kind"] == "imagefolder"


def test_existing_output_is_kept_unless_overwrite_is_given(tmp_path):
    write_beton(random_source(seed=1), tmp_path / "d.beton", num_workers=1)
    before = sha256_of(tmp_path / "d.beton")
    with pytest.raises(InvalidInputError, match="--overwrite"):
        write_beton(random_source(seed=2), tmp_path / "d.beton", num_workers=1)
    assert sha256_of(tmp_path / "d.beton") == before
    write_beton(random_source(seed=2), tmp_path / "d.beton", num_workers=1, overwrite=True)
    assert read_sidecar(tmp_path / "d.beton").sha256 == sha256_of(tmp_path / "d.beton") != before


def test_output_must_be_named_beton(tmp_path):
    with pytest.raises(InvalidInputError, match=r"\.beton"):
        write_beton(random_source(), tmp_path / "d.ffcv")


def test_label_outside_the_class_range_is_rejected_before_writing(tmp_path):
    source = random_source(count=10, num_classes=3)
    source.labels[4] = 3
    with pytest.raises(InvalidInputError, match=r"label 3 is outside the class range \[0, 3\)"):
        write_beton(source, tmp_path / "d.beton", num_workers=1)
    assert leftovers(tmp_path) == []


def test_a_truncated_image_is_left_out_and_named_like_a_file_that_is_no_image(tmp_path):
    images = tmp_path / "images"
    for label in ("cat", "dog"):
        (images / label).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
                images / label / f"{i}.jpg", quality=95)
    whole = (images / "cat" / "1.jpg").read_bytes()
    (images / "cat" / "1.jpg").write_bytes(whole[: len(whole) // 2])  # header intact, data truncated
    (images / "dog" / "2.jpg").write_bytes(b"no image at all")
    with pytest.warns(SkippedFilesWarning) as caught:
        sidecar = write_beton(ImageFolderSource(images), tmp_path / "d.beton", num_workers=2)
    named = "\n".join(str(warning.message) for warning in caught)
    assert f"{images / 'dog' / '2.jpg'}: not an image" in named
    assert f"{images / 'cat' / '1.jpg'}: OSError: image file is truncated" in named
    assert sidecar.num_samples == 4 and sidecar.counts_per_class == {"cat": 2, "dog": 2}
    assert sidecar.source.skipped_files == 2
    _, labels = read_back(tmp_path / "d.beton", CenterCropRGBImageDecoder((32, 32), ratio=1.0))
    assert labels.tolist() == [0, 0, 1, 1]


def test_a_class_whose_only_image_is_truncated_fails_the_write_naming_it_and_leaves_no_file(tmp_path):
    images = tmp_path / "images"
    for label in ("cat", "dog"):
        (images / label).mkdir(parents=True)
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
            images / label / "0.jpg", quality=95)
    whole = (images / "dog" / "0.jpg").read_bytes()
    (images / "dog" / "0.jpg").write_bytes(whole[: len(whole) // 2])
    out = tmp_path / "out"
    with pytest.raises(InvalidInputError, match=r"\['dog'\].*no readable images(.|\n)*0\.jpg: OSError: image file is trunc"):
        write_beton(ImageFolderSource(images), out / "d.beton", num_workers=2)
    assert leftovers(out) == []


class GrayscaleArraySource(ArraySource):
    """Hands the writer a 2-D array for one sample: ffcv's encoder would raise in its process."""

    def load_image(self, index):
        return self.images[index][:, :, 0] if index == 7 else self.images[index]


def test_an_image_ffcv_cannot_encode_fails_the_write_naming_it(tmp_path):
    source = random_source(count=30)  # in memory: no file to leave out, a fault of the source
    with pytest.raises(InvalidInputError, match=r"sample 7: ValueError: an image must be an HxWx3 uint8 array"):
        write_beton(GrayscaleArraySource(source.images, source.labels, 5), tmp_path / "d.beton", num_workers=2)
    assert leftovers(tmp_path) == []


class KilledWorkerSource(ArraySource):
    """The writer process loading sample 7 dies at once, as if the OOM killer took it."""

    def load_image(self, index):
        if index == 7:
            os._exit(9)
        return self.images[index]


@pytest.mark.timeout(120)  # the failure this guards against is a hang
def test_a_writer_process_that_dies_fails_the_write_instead_of_hanging(tmp_path):
    source = random_source(count=300)
    with pytest.raises(WriteFailedError, match="exited with code 9"):
        write_beton(KilledWorkerSource(source.images, source.labels, 5), tmp_path / "d.beton", num_workers=2)
    assert leftovers(tmp_path) == []


@pytest.mark.timeout(120)
def test_a_dead_writer_process_fails_a_write_running_on_another_thread(tmp_path):
    source = random_source(count=300)
    outcome = []

    def write():
        try:
            write_beton(KilledWorkerSource(source.images, source.labels, 5), tmp_path / "d.beton", num_workers=2)
        except WriteFailedError as error:
            outcome.append(error)

    writing = threading.Thread(target=write)
    writing.start()
    writing.join()
    assert len(outcome) == 1 and "exited with code 9" in str(outcome[0])
    assert leftovers(tmp_path) == []


@pytest.mark.timeout(120)
def test_a_dead_writer_process_fails_the_write_while_sigint_is_ignored(tmp_path):
    source = random_source(count=300)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under nohup, or a handler-owning host
    try:
        with pytest.raises(WriteFailedError, match="exited with code 9"):
            write_beton(KilledWorkerSource(source.images, source.labels, 5), tmp_path / "d.beton", num_workers=2)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert leftovers(tmp_path) == []
