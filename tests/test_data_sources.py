"""Image sources: digits, ImageFolder trees, CIFAR pickles -- and the bad inputs each must name."""
import pickle

import numpy as np
import pytest
from PIL import Image

from pipeline.data.sources import (
    CifarSource,
    DigitsSource,
    ImageFolderSource,
    SkippedFilesWarning,
    SmallClassWarning,
    SubsetSource,
    find_cifar,
    open_source,
)
from pipeline.errors import InvalidInputError


def _save(path, image: Image.Image, **params) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, **params)


def _rgb(seed: int, size=(12, 10)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_digits_splits_are_disjoint_stratified_and_together_the_whole_dataset():
    train, val = DigitsSource("train", 8), DigitsSource("val", 8)
    assert not set(train.indices) & set(val.indices)
    assert sorted([*train.indices, *val.indices]) == list(range(1797))
    assert len(val) == pytest.approx(0.2 * 1797, abs=1)
    assert np.bincount(val.labels).min() >= 35  # every digit in val, about 36 of each


def test_digits_split_is_the_same_on_every_call():
    assert np.array_equal(DigitsSource("val", 8).gray8, DigitsSource("val", 8).gray8)


def test_digits_images_are_rgb_uint8_at_the_requested_size():
    image, label = DigitsSource("train", 24)[0]
    assert image.shape == (24, 24, 3) and image.dtype == np.uint8
    assert (image[..., 0] == image[..., 1]).all() and 0 <= label < 10


def test_imagefolder_classes_are_the_sorted_folder_names_and_labels_follow_them(tmp_path):
    for name, seed in (("zebra", 0), ("ant", 1), ("ant", 2)):
        _save(tmp_path / name / f"{seed}.png", _rgb(seed))
    source = ImageFolderSource(tmp_path)
    assert source.classes == ["ant", "zebra"]
    assert source.labels.tolist() == [0, 0, 1]
    assert source.sizes.tolist() == [[12, 10]] * 3


def test_missing_source_path_is_invalid_input_naming_it(tmp_path):
    with pytest.raises(InvalidInputError, match="nowhere"):
        open_source(str(tmp_path / "nowhere"))


def test_empty_imagefolder_class_is_invalid_input_naming_the_class(tmp_path):
    _save(tmp_path / "cat" / "a.png", _rgb(0))
    (tmp_path / "dog").mkdir()
    with pytest.raises(InvalidInputError, match="dog"):
        ImageFolderSource(tmp_path)


def test_class_folder_holding_only_non_images_counts_as_empty(tmp_path):
    _save(tmp_path / "cat" / "a.png", _rgb(0))
    (tmp_path / "dog").mkdir()
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    with pytest.raises(InvalidInputError, match="dog"):
        ImageFolderSource(tmp_path)


def test_files_that_are_not_readable_images_are_skipped_and_each_is_named_in_a_warning(tmp_path):
    _save(tmp_path / "cat" / "a.png", _rgb(0))
    _save(tmp_path / "cat" / "b.jpg", _rgb(1), quality=95)
    (tmp_path / "cat" / "README.txt").write_text("hello")
    (tmp_path / "cat" / ".DS_Store").write_bytes(b"\x00\x01junk")
    (tmp_path / "cat" / "fake.jpg").write_bytes(b"this is not a jpeg")
    (tmp_path / "cat" / "d.txt").write_text("more")
    with pytest.warns(SkippedFilesWarning, match="skipped 4 file") as caught:
        source = ImageFolderSource(tmp_path)
    assert len(source) == 2 and len(source.skipped) == 4
    assert all(f"{tmp_path / 'cat' / name}: not an image" in str(caught[0].message)
               for name in ("README.txt", ".DS_Store", "fake.jpg", "d.txt"))


def _expected_rgb(mode: str, pixels: np.ndarray) -> np.ndarray:
    if mode == "I;16":
        return np.repeat((pixels >> 8).astype(np.uint8)[..., None], 3, axis=2)
    if mode == "L":
        return np.repeat(pixels[..., None], 3, axis=2)
    return pixels[..., :3]  # RGBA: alpha dropped, like torchvision's loader


@pytest.mark.parametrize("mode", ["L", "RGBA", "I;16"])
def test_grayscale_alpha_and_16_bit_images_are_converted_to_rgb_uint8(tmp_path, mode):
    rng = np.random.default_rng(0)
    shape = {"L": (6, 7), "RGBA": (6, 7, 4), "I;16": (6, 7)}[mode]
    pixels = rng.integers(0, 65536 if mode == "I;16" else 256, shape).astype(np.uint16 if mode == "I;16" else np.uint8)
    _save(tmp_path / "c" / "image.png", Image.fromarray(pixels))
    image, _ = ImageFolderSource(tmp_path)[0]
    assert image.dtype == np.uint8 and image.shape == (6, 7, 3)
    assert np.array_equal(image, _expected_rgb(mode, pixels))


def test_cmyk_images_are_converted_to_rgb(tmp_path):
    cmyk = _rgb(3).convert("CMYK")
    _save(tmp_path / "c" / "print.tiff", cmyk)
    image, _ = ImageFolderSource(tmp_path)[0]
    assert np.array_equal(image, np.asarray(cmyk.convert("RGB")))


def test_palette_images_with_transparency_are_converted_to_rgb(tmp_path):
    palette = _rgb(4).convert("P")
    palette.info["transparency"] = 0
    _save(tmp_path / "c" / "icon.png", palette, transparency=0)
    image, _ = ImageFolderSource(tmp_path)[0]
    assert image.shape == (10, 12, 3) and image.dtype == np.uint8


def write_cifar10(root, train_rows=6, test_rows=4, bad_label=None):
    """A tiny CIFAR-10 download in its python-pickle format (same keys, dtypes and layout)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    with open(folder / "batches.meta", "wb") as handle:
        pickle.dump({b"label_names": names, b"num_cases_per_batch": train_rows}, handle)
    batches = {f"data_batch_{i}": train_rows for i in range(1, 6)} | {"test_batch": test_rows}
    for name, rows in batches.items():
        labels = [int(x) for x in rng.integers(0, 10, rows)]
        if bad_label is not None and name == "data_batch_2":
            labels[1] = bad_label
        data = rng.integers(0, 256, (rows, 3072), dtype=np.uint8)
        with open(folder / name, "wb") as handle:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, handle)
    return folder


def test_cifar10_pickles_are_read_as_32px_rgb_with_their_label_names(tmp_path):
    folder = write_cifar10(tmp_path)
    source = open_source(str(tmp_path), split="train")
    assert isinstance(source, CifarSource) and source.kind == "cifar10"
    assert len(source) == 30 and source.classes[0] == "airplane"
    with open(folder / "data_batch_1", "rb") as handle:
        first = pickle.load(handle, encoding="bytes")
    image, label = source[0]
    # rows are 1024 red, 1024 green, 1024 blue values, each plane row-major
    assert np.array_equal(image, first[b"data"][0].reshape(3, 32, 32).transpose(1, 2, 0))
    assert label == first[b"labels"][0]
    assert len(open_source(str(folder), split="val")) == 4


def test_cifar100_uses_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    fine = [f"class{i}".encode() for i in range(100)]
    with open(folder / "meta", "wb") as handle:
        pickle.dump({b"fine_label_names": fine, b"coarse_label_names": [b"c"] * 20}, handle)
    for name, labels in (("train", [99, 5, 0]), ("test", [7])):
        with open(folder / name, "wb") as handle:
            pickle.dump({b"data": np.zeros((len(labels), 3072), np.uint8), b"fine_labels": labels,
                         b"coarse_labels": [0] * len(labels)}, handle)
    assert find_cifar(tmp_path) == ("cifar100", folder)
    source = open_source(str(tmp_path), split="train")
    assert source.kind == "cifar100" and len(source.classes) == 100
    assert source.labels.tolist() == [99, 5, 0]


def test_cifar_label_outside_the_class_range_is_invalid_input_naming_file_and_value(tmp_path):
    write_cifar10(tmp_path, bad_label=10)
    with pytest.raises(InvalidInputError, match=r"data_batch_2.*label 10.*\[0, 10\)"):
        open_source(str(tmp_path), split="train")


@pytest.mark.parametrize("source", ["digits", "cifar", "imagefolder"])
def test_sources_with_two_splits_require_choosing_one(tmp_path, source):
    if source == "cifar":
        write_cifar10(tmp_path)
    if source == "imagefolder":  # only train/ and val/: splits, which must not become two classes
        _save(tmp_path / "train" / "a" / "1.png", _rgb(0))
        _save(tmp_path / "val" / "a" / "1.png", _rgb(1))
    with pytest.raises(InvalidInputError, match=r"--split \{train,val\}"):
        open_source("digits" if source == "digits" else str(tmp_path))


def test_imagefolder_split_selects_the_split_folder(tmp_path):
    _save(tmp_path / "train" / "a" / "1.png", _rgb(0))
    _save(tmp_path / "val" / "a" / "1.png", _rgb(1))
    _save(tmp_path / "val" / "b" / "1.png", _rgb(2))
    assert len(open_source(str(tmp_path), split="val")) == 2
    assert open_source(str(tmp_path), split="train").classes == ["a"]


def test_a_subset_keeps_the_named_classes_relabelled_in_order_and_the_first_images_of_each():
    digits = DigitsSource("train", 8)
    subset = SubsetSource(digits, ["7", "2"], per_class=3)
    assert subset.classes == ["7", "2"] and np.bincount(subset.labels).tolist() == [3, 3]
    assert [subset.classes[label] for label in subset.labels] == [digits.classes[digits.labels[i]] for i in subset.indices]
    firsts = [i for i, label in enumerate(digits.labels) if label == 7][:3]
    assert [i for i, label in zip(subset.indices, subset.labels) if label == 0] == firsts
    image, label = subset[0]
    assert label == subset.labels[0] and np.array_equal(image, digits[subset.indices[0]][0])
    assert (subset.selected_classes, subset.per_class) == (["7", "2"], 3)


def test_a_subset_of_every_class_caps_each_and_warns_of_a_class_with_fewer_images():
    digits = DigitsSource("val", 8)
    with pytest.warns(SmallClassWarning, match=r"--per-class 36: 2 \(35\), 8 \(35\) hold\(s\) fewer images"):
        subset = SubsetSource(digits, per_class=36)
    assert subset.classes == digits.classes and subset.selected_classes is None
    assert np.bincount(subset.labels).tolist() == [36, 36, 35, 36, 36, 36, 36, 36, 35, 36]


@pytest.mark.parametrize("classes, per_class, message", [
    (["3", "eleven"], None, "--classes eleven: not classes of"),
    (["3", "3"], None, "names a class twice"),
    (None, 0, "--per-class 0: need at least 1"),
])
def test_a_subset_of_classes_the_source_lacks_is_refused_naming_them(classes, per_class, message):
    with pytest.raises(InvalidInputError, match=message):
        SubsetSource(DigitsSource("val", 8), classes, per_class)
