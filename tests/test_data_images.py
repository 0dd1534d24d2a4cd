"""Images from files fed to a model exactly as the validation loader feeds the same images from a .beton:
samples exported from a .beton (`data inspect --export`), read back and preprocessed, give the loader's
batch bit for bit, at another size and crop than they are stored at."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.config.schema import DataConfig
from pipeline.data.images import UnreadableImageError, as_rgb_array, decode_image, read_image, to_model_input
from pipeline.data.inspection import export_samples
from pipeline.data.loaders import build_val_loader
from pipeline.data.sidecar import WriteOptions
from pipeline.data.sources import ImageSource
from pipeline.data.writing import write_beton

SIZES = [(37, 23), (16, 16), (20, 41), (64, 48), (9, 30), (33, 33)]  # (width, height): landscape, square, portrait


class NoiseSource(ImageSource):
    """Random pixels at varied sizes and aspect ratios: every crop and resize path shows in the pixels."""

    kind, location, split = "imagefolder", "memory", None

    def __init__(self):
        self.classes = ["even", "odd"]
        self.labels = np.array([i % 2 for i in range(len(SIZES))], dtype=np.int64)
        self.sizes = np.array(SIZES)
        self.skipped = []

    def load_image(self, index):
        width, height = SIZES[index]
        return np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def betons(tmp_path_factory):
    """The same images stored raw and as JPEG."""
    root = tmp_path_factory.mktemp("noise")
    write_beton(NoiseSource(), root / "raw.beton", WriteOptions(write_mode="raw"), num_workers=1)
    write_beton(NoiseSource(), root / "jpg.beton", WriteOptions(write_mode="jpg"), num_workers=1)
    return root


@pytest.mark.parametrize("stored", ["raw", "jpg"])
@pytest.mark.parametrize("img_size, crop_ratio", [(16, 1.0), (24, 0.875), (7, 0.5)])
def test_exported_images_preprocess_to_the_val_loaders_batch_exactly(betons, tmp_path, stored, img_size, crop_ratio):
    path = betons / f"{stored}.beton"
    data = DataConfig(num_workers=1, val_crop_ratio=crop_ratio, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    (loaded, labels, num_real), = list(build_val_loader(data, path, len(SIZES), img_size, "cpu"))
    files = export_samples(path, np.arange(len(SIZES)), ["even", "odd"], tmp_path / "exported")
    assert [f.name for f in files] == ["0_even.png", "1_odd.png", "2_even.png", "3_odd.png", "4_even.png", "5_odd.png"]
    assert [Image.open(f).size for f in files] == SIZES  # as stored: not cropped, not resized
    ours = to_model_input([read_image(f) for f in files], img_size, crop_ratio, data.mean, data.std)
    assert num_real == len(SIZES) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, loaded, rtol=0, atol=0)


def test_jpeg_bytes_decode_as_ffcv_decodes_the_stored_jpeg(betons, tmp_path):
    (png,) = export_samples(betons / "jpg.beton", np.array([3]), ["even", "odd"], tmp_path)
    exported = read_image(png)
    original = NoiseSource().load_image(3)
    assert exported.shape == original.shape and not np.array_equal(exported, original)  # JPEG changed the pixels


def test_grayscale_and_palette_images_decode_to_rgb_as_the_writer_reads_them():
    encoded = io.BytesIO()
    Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4) * 20, mode="L").save(encoded, format="PNG")
    image = decode_image(encoded.getvalue())
    assert image.shape == (3, 4, 3) and image.dtype == np.uint8 and (image[..., 0] == image[..., 2]).all()
    assert as_rgb_array(np.zeros((5, 6), np.uint8)).shape == (5, 6, 3)


def test_bytes_that_are_no_image_are_named():
    with pytest.raises(UnreadableImageError, match="upload.bin is not a readable image"):
        decode_image(b"not an image", "upload.bin")


def test_a_file_that_is_no_image_is_named(tmp_path):
    notes = tmp_path / "notes.png"
    notes.write_text("not a png")
    with pytest.raises(UnreadableImageError, match=f"'{notes}' is not a readable image"):
        read_image(notes)


@pytest.mark.parametrize("array", [np.zeros((4, 4, 4), np.uint8), np.zeros((4, 4, 3), np.float32), np.zeros((0, 4, 3), np.uint8)])
def test_an_array_that_is_no_rgb_image_is_refused_naming_its_shape_and_type(array):
    with pytest.raises(UnreadableImageError, match=f"{array.dtype} array of shape"):
        as_rgb_array(array)
