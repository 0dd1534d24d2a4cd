"""Image sources a ``.beton`` is written from: an ImageFolder tree, CIFAR pickles, or ``digits``.

Every source is an indexable dataset of ``(HxWx3 uint8 RGB array, label)`` -- what ffcv's
``DatasetWriter.from_indexed_dataset`` and ``RGBImageField`` take -- plus what the sidecar
records: class names in label order, one label per sample, and each image's size before writing.
"""
from __future__ import annotations

import copy
import os
import pickle
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from pipeline.errors import InvalidInputError

SPLITS = ("train", "val")
DIGITS = "digits"
DIGITS_VAL_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0  # fixed: the demo's train and val never overlap, on every machine
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


class SkippedFilesWarning(UserWarning):
    """Files in an ImageFolder tree that are not readable images were left out of the dataset."""


class SmallClassWarning(UserWarning):
    """A class holds fewer images than ``--per-class`` asked for; all of them were kept."""


class ImageSource:
    """An indexable dataset of RGB uint8 images and integer labels, described for the sidecar."""

    kind: str
    location: str
    split: str | None
    classes: list[str]
    labels: np.ndarray  # int64, one per sample, in [0, len(classes))
    sizes: np.ndarray  # (N, 2) int: each image's (width, height) as the source stores it
    skipped: list[str]  # files that were not images (ImageFolder only)
    selected_classes: list[str] | None = None  # SubsetSource: the source's classes kept (None: all)
    per_class: int | None = None  # SubsetSource: at most this many images of each class

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return self.load_image(index), int(self.labels[index])

    def load_image(self, index: int) -> np.ndarray:
        raise NotImplementedError

    def describe(self, index: int) -> str:
        """Where sample ``index`` comes from, for error messages."""
        return f"{self.location} sample {index}"

    def without_unreadable(self, reasons: dict[int, str]) -> ImageSource:
        """This source without the samples that could not be loaded (index -> why). A source of
        files leaves such files out as it leaves out those it cannot identify; a source in memory
        has no bad files, only a fault: the write is refused, naming every sample."""
        raise InvalidInputError(f"{len(reasons)} sample(s) could not be loaded; nothing was written:\n"
                                + "\n".join(f"  {self.describe(index)}: {reason}" for index, reason in reasons.items()))


def to_rgb_array(image: Image.Image) -> np.ndarray:
    """Any PIL image as HxWx3 uint8 RGB: grayscale, palette, CMYK, alpha and 16-bit all converted.

    Alpha is dropped as torchvision's ImageFolder loader drops it (``convert("RGB")``), so both
    loaders in the benchmark, and models trained on either, see the same pixels. 16-bit
    grayscale keeps its 8 most significant bits (Pillow's own convert would clip at 255).
    """
    if image.mode in _SIXTEEN_BIT_MODES:
        wide = np.asarray(image).astype(np.int64)
        gray = (np.clip(wide, 0, 65535) >> 8).astype(np.uint8)
        return np.ascontiguousarray(np.repeat(gray[:, :, None], 3, axis=2))
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")  # Pillow's warning-free route for palettes with transparency
    if image.mode != "RGB":
        image = image.convert("RGB")
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8))


def open_source(source: str, split: str | None = None, img_size: int | None = None) -> ImageSource:
    """``digits``, a CIFAR-10/100 python-pickle directory, or an ImageFolder directory."""
    if split is not None and split not in SPLITS:
        raise InvalidInputError(f"split {split!r} is not one of {list(SPLITS)}")
    if source == DIGITS:
        return DigitsSource(_require_split(split, DIGITS), img_size or 32)
    root = Path(source).expanduser()
    if not root.exists():
        raise InvalidInputError(
            f"source {source!r} does not exist; valid sources: an ImageFolder directory (one folder per "
            f"class), a CIFAR-10/100 python-pickle directory, or {DIGITS!r}"
        )
    if not root.is_dir():
        raise InvalidInputError(f"source {source!r} is a file; a source is a directory or {DIGITS!r}")
    cifar = find_cifar(root)
    if cifar is not None:
        return CifarSource(cifar, _require_split(split, f"CIFAR at {source!r}"))
    if split is None and set(SPLITS) <= _folders(root):
        raise InvalidInputError(
            f"source {source!r} holds the folders {' and '.join(SPLITS)}: they are its splits, not classes; "
            f"choose one with --split {{{','.join(SPLITS)}}}"
        )
    if split is not None:
        if not (root / split).is_dir():
            raise InvalidInputError(
                f"--split {split} given, but ImageFolder root {source!r} has no {split!r} folder; "
                "pass the split's own folder without --split instead"
            )
        root = root / split
    return ImageFolderSource(root, split)


def _folders(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}


def _require_split(split: str | None, what: str) -> str:
    if split is None:
        raise InvalidInputError(f"{what} has a train and a val split: choose one with --split {{{','.join(SPLITS)}}}")
    return split


class ImageFolderSource(ImageSource):
    """ImageNet's layout: ``root/<class>/**/<image>``; classes are the sorted folder names.

    Every file is identified by its content (a header read, no decode), so extensions do not
    matter. A file that is not a readable image is left out and named, with the reason, in a
    ``SkippedFilesWarning``: here when its header cannot be read, in ``without_unreadable`` when it
    fails to decode while the dataset is written (truncated data).
    """

    kind = "imagefolder"

    def __init__(self, root: str | Path, split: str | None = None, scan_threads: int = 16):
        root = Path(root)
        if not root.is_dir():
            raise InvalidInputError(f"ImageFolder root {str(root)!r} does not exist or is not a directory")
        self.location, self.split = str(root), split
        self.root = root
        self.classes = sorted(_folders(root))
        if not self.classes:
            raise InvalidInputError(
                f"ImageFolder root {str(root)!r} has no class folders; expected {root}/<class name>/<images>"
            )
        candidates = [(label, path) for label, name in enumerate(self.classes) for path in _files_under(root / name)]
        with ThreadPoolExecutor(scan_threads) as pool:  # header reads are I/O-bound
            headers = list(tqdm(pool.map(_image_size, (p for _, p in candidates)), total=len(candidates),
                                desc=f"scanning {root.name}", unit="file", leave=False, disable=len(candidates) < 5000))
        kept = [(label, path, size) for (label, path), size in zip(candidates, headers) if isinstance(size, tuple)]
        unreadable = {str(path): reason for (_, path), reason in zip(candidates, headers) if isinstance(reason, str)}
        self.skipped = []
        self._keep([path for _, path, _ in kept], [label for label, _, _ in kept], [size for _, _, size in kept],
                   unreadable)

    def _keep(self, paths: list[Path], labels: list[int], sizes: list, unreadable: dict[str, str]) -> None:
        """Hold these samples, every class still having one; ``unreadable`` (path -> why) is left out, named."""
        counts = np.bincount(labels, minlength=len(self.classes))
        empty = [name for name, count in zip(self.classes, counts) if count == 0]
        if empty:
            raise InvalidInputError(
                f"ImageFolder class folder(s) {empty} under {str(self.root)!r} hold no readable images; every class "
                "needs at least one image (remove the empty folders or add their images)"
                + "".join(f"\n  {path}: {reason}" for path, reason in unreadable.items())
            )
        self.paths = paths
        self.labels = np.array(labels, dtype=np.int64)
        self.sizes = np.array(sizes, dtype=np.int64).reshape(-1, 2)
        self.skipped = [*self.skipped, *unreadable]
        if unreadable:
            warnings.warn(
                f"skipped {len(unreadable)} file(s) under {str(self.root)!r} that are not readable images; they are "
                "left out of the dataset:" + "".join(f"\n  {path}: {reason}" for path, reason in unreadable.items()),
                SkippedFilesWarning, stacklevel=3,
            )

    def without_unreadable(self, reasons: dict[int, str]) -> ImageFolderSource:
        kept = [index for index in range(len(self)) if index not in reasons]
        rest = copy.copy(self)
        rest._keep([self.paths[i] for i in kept], [int(self.labels[i]) for i in kept], [self.sizes[i] for i in kept],
                   {str(self.paths[index]): reason for index, reason in reasons.items()})
        return rest

    def load_image(self, index: int) -> np.ndarray:
        with Image.open(self.paths[index]) as image:
            return to_rgb_array(image)

    def describe(self, index: int) -> str:
        return str(self.paths[index])


def _files_under(directory: Path) -> list[Path]:
    found = []
    for parent, folders, files in os.walk(directory, followlinks=True):
        folders.sort()
        found.extend(Path(parent) / name for name in sorted(files))
    return found


def _image_size(path: Path) -> tuple[int, int] | str:
    """(width, height) from the file's header, or why it is not a readable image."""
    try:
        with Image.open(path) as image:  # reads the header only
            return image.size
    except PermissionError:
        raise InvalidInputError(f"cannot read {str(path)!r}: permission denied") from None
    except UnidentifiedImageError:
        return "not an image (no image format recognises its content)"
    except (OSError, ValueError) as err:
        return f"unreadable header ({type(err).__name__}: {err})"


CIFAR_LAYOUTS = {
    # kind: (sub-folder of the download, meta file, label-name key, label key, train files, val files)
    "cifar10": ("cifar-10-batches-py", "batches.meta", b"label_names", b"labels",
                [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]),
    "cifar100": ("cifar-100-python", "meta", b"fine_label_names", b"fine_labels", ["train"], ["test"]),
}


def find_cifar(root: Path) -> tuple[str, Path] | None:
    """(kind, folder) when ``root`` is, or directly holds, an extracted CIFAR python download."""
    for kind, (folder, meta, *_) in CIFAR_LAYOUTS.items():
        for candidate in (root, root / folder):
            if (candidate / meta).is_file():
                return kind, candidate
    return None


class CifarSource(ImageSource):
    """CIFAR-10/100 in their python-pickle download format (a user's local copy; 100 uses fine labels).

    The files are Python pickles, as distributed: open only copies you trust.
    """

    def __init__(self, found: tuple[str, Path], split: str):
        self.kind, folder = found
        _, meta_file, names_key, labels_key, train_files, val_files = CIFAR_LAYOUTS[self.kind]
        self.location, self.split = str(folder), split
        meta = _unpickle(folder / meta_file)
        if names_key not in meta:
            raise InvalidInputError(f"{str(folder / meta_file)!r} has no {names_key.decode()!r}; not a {self.kind} meta file")
        self.classes = [name.decode() if isinstance(name, bytes) else str(name) for name in meta[names_key]]
        images, labels = [], []
        for name in train_files if split == "train" else val_files:
            batch = _unpickle(folder / name)
            if b"data" not in batch or labels_key not in batch:
                raise InvalidInputError(
                    f"{str(folder / name)!r} lacks 'data' or {labels_key.decode()!r}; not a {self.kind} batch"
                )
            data = np.asarray(batch[b"data"], dtype=np.uint8)
            batch_labels = np.asarray(batch[labels_key], dtype=np.int64)
            if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(batch_labels):
                raise InvalidInputError(
                    f"{str(folder / name)!r} holds data of shape {data.shape} with {len(batch_labels)} labels; "
                    "expected (N, 3072) uint8 rows and N labels"
                )
            bad = np.flatnonzero((batch_labels < 0) | (batch_labels >= len(self.classes)))
            if bad.size:
                raise InvalidInputError(
                    f"{str(folder / name)!r}: label {batch_labels[bad[0]]} of row {bad[0]} is outside the class "
                    f"range [0, {len(self.classes)}) of {meta_file!r}"
                )
            images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
            labels.append(batch_labels)
        self.images = np.ascontiguousarray(np.concatenate(images))
        self.labels = np.concatenate(labels)
        self.sizes = np.full((len(self.labels), 2), 32, dtype=np.int64)
        self.skipped = []

    def load_image(self, index: int) -> np.ndarray:
        return self.images[index]


def _unpickle(path: Path) -> dict:
    if not path.is_file():
        raise InvalidInputError(f"CIFAR file {str(path)!r} is missing; is the download fully extracted?")
    try:
        with open(path, "rb") as handle:
            return pickle.load(handle, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
        raise InvalidInputError(f"CIFAR file {str(path)!r} is not a readable python pickle: {err}") from None


class DigitsSource(ImageSource):
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), upscaled to RGB ``img_size``.

    Offline on any machine with scikit-learn. The split is fixed: a stratified 80/20 split with
    seed ``DIGITS_SPLIT_SEED``, so ``train`` and ``val`` never share an image.
    """

    kind = "digits"

    def __init__(self, split: str, img_size: int = 32):
        from sklearn.datasets import load_digits  # here: scikit-learn's import costs seconds, digits only need it
        from sklearn.model_selection import train_test_split

        if split not in SPLITS:
            raise InvalidInputError(f"digits split {split!r} is not one of {list(SPLITS)}")
        if not 8 <= img_size <= 1024:
            raise InvalidInputError(f"digits image size {img_size} must be within [8, 1024] pixels")
        digits = load_digits()
        train, val = train_test_split(
            np.arange(len(digits.target)), test_size=DIGITS_VAL_FRACTION,
            stratify=digits.target, random_state=DIGITS_SPLIT_SEED,
        )
        self.indices = chosen = np.sort(train if split == "train" else val)  # into load_digits()
        # 0..16 ink levels -> 0..255 gray
        self.gray8 = np.round(digits.images[chosen] * (255 / 16)).astype(np.uint8)
        self.labels = digits.target[chosen].astype(np.int64)
        self.classes = [str(d) for d in range(10)]
        self.img_size = img_size
        self.sizes = np.full((len(self.labels), 2), img_size, dtype=np.int64)
        self.location, self.split, self.skipped = "sklearn.datasets.load_digits", split, []

    def load_image(self, index: int) -> np.ndarray:
        gray = Image.fromarray(self.gray8[index]).resize((self.img_size, self.img_size), Image.BICUBIC)
        return to_rgb_array(gray)

    def describe(self, index: int) -> str:
        return f"digits {self.split} sample {index}"


def check_per_class(per_class: int | None) -> None:
    if per_class is not None and per_class < 1:
        raise InvalidInputError(f"--per-class {per_class}: need at least 1 image of each class")


class SubsetSource(ImageSource):
    """Some classes of another source and at most ``per_class`` images of each: a small, or few-shot,
    dataset from any source (e.g. a transfer task: pre-train on some digits, fine-tune on a few images
    of the others).

    ``classes`` (the source's class names) are kept in the order given and relabelled 0..k-1; None keeps
    every class. ``per_class`` takes the first images of each class in the source's order (digits: a
    fixed stratified shuffle), so the same arguments always give the same images; a class with fewer
    images keeps them all, with a ``SmallClassWarning``.
    """

    def __init__(self, source: ImageSource, classes: list[str] | None = None, per_class: int | None = None):
        chosen = list(classes) if classes else list(source.classes)
        unknown = [name for name in chosen if name not in source.classes]
        if unknown:
            raise InvalidInputError(f"--classes {','.join(unknown)}: not classes of {source.location!r}; its classes: "
                                    f"{', '.join(source.classes)}")
        if len(set(chosen)) != len(chosen):
            raise InvalidInputError(f"--classes {','.join(chosen)} names a class twice")
        check_per_class(per_class)
        label_of = {source.classes.index(name): new for new, name in enumerate(chosen)}
        taken = np.zeros(len(chosen), dtype=np.int64)
        indices = []
        for index, label in enumerate(source.labels):
            new = label_of.get(int(label))
            if new is not None and (per_class is None or taken[new] < per_class):
                taken[new] += 1
                indices.append(index)
        short = [f"{name} ({count})" for name, count in zip(chosen, taken) if per_class and count < per_class]
        if short:
            warnings.warn(f"--per-class {per_class}: {', '.join(short)} hold(s) fewer images; all of them are kept",
                          SmallClassWarning, stacklevel=2)
        self.inner, self.indices = source, np.array(indices, dtype=np.int64)
        self.kind, self.location, self.split, self.skipped = source.kind, source.location, source.split, source.skipped
        self.classes, self.selected_classes, self.per_class = chosen, (chosen if classes else None), per_class
        self.labels = np.array([label_of[int(source.labels[i])] for i in self.indices], dtype=np.int64)
        self.sizes = source.sizes[self.indices]

    def load_image(self, index: int) -> np.ndarray:
        return self.inner.load_image(int(self.indices[index]))

    def describe(self, index: int) -> str:
        return self.inner.describe(int(self.indices[index]))
