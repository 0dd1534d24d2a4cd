"""Classifying images with a trained model: top-K class names and probabilities, each image fed as
the model's own validation fed it (``pipeline.data.images``).

``ImageClassifier`` is the one implementation behind ``vitsweep predict`` and the MLflow pyfunc that
every logged model carries (``pipeline.trained.serving``). As timm's ``inference.py``, it reports class
names and softmax probabilities, best first; the names are the training set's (the model's card).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from pipeline.data.images import UnreadableImageError, center_crop_side, read_image, to_model_input
from pipeline import uris
from pipeline.errors import InvalidInputError
from pipeline.components.model_card import EvalPreprocessing, ModelCard
from pipeline.trained.model_source import ModelSource

DEFAULT_TOPK = 5  # at most: a model with fewer classes gives them all (as timm's inference.py caps it)
BATCH_SIZE = 64  # images per forward pass


def default_topk(num_classes: int) -> int:
    return min(DEFAULT_TOPK, num_classes)


@dataclass(frozen=True)
class Prediction:
    """One image's ``k`` most probable classes, best first: index, name and softmax probability."""

    classes: tuple[int, ...]
    labels: tuple[str, ...]
    probabilities: tuple[float, ...]

    def as_dict(self) -> dict[str, list]:
        return {"labels": list(self.labels), "probabilities": list(self.probabilities), "classes": list(self.classes)}


class ImageClassifier:
    """A model with its class names and its evaluation preprocessing: decoded RGB images in, top-K out."""

    def __init__(self, model: nn.Module, card: ModelCard, preprocessing: EvalPreprocessing):
        self.model, self.card, self.preprocessing = model.eval(), card, preprocessing
        self.labels = card.class_names or tuple(str(index) for index in range(card.num_classes))

    @classmethod
    def of(cls, source: ModelSource, preprocessing: EvalPreprocessing | None = None) -> ImageClassifier:
        """The source's model, fed as its card says (or as ``preprocessing`` says, at its size)."""
        model = source.build(None if preprocessing is None else preprocessing.img_size)
        if preprocessing is None:
            if source.card.preprocessing is None:
                raise InvalidInputError(f"model source {source.provenance.given!r} does not record how it was "
                                        "evaluated (a checkpoint older than model cards); give the preprocessing")
            preprocessing = source.card.preprocessing
        return cls(model, source.card, preprocessing)

    def resolve_topk(self, topk: int | None) -> int:
        """``topk`` if the model has that many classes (``None``: ``default_topk``)."""
        if topk is None:
            return default_topk(self.card.num_classes)
        if not 1 <= topk <= self.card.num_classes:
            raise InvalidInputError(f"top-k {topk}: the model has {self.card.num_classes} classes; give 1.."
                                    f"{self.card.num_classes}")
        return topk

    def check_croppable(self, image: np.ndarray, name: str) -> np.ndarray:
        """``image`` if its center crop is at least a pixel (UnreadableImageError naming it, before any batch)."""
        center_crop_side(image, self.preprocessing.crop_ratio, name)
        return image

    def classify(self, images: Sequence[np.ndarray], topk: int | None = None) -> list[Prediction]:
        """The ``topk`` (``None``: ``default_topk``) most probable classes of each HxWx3 uint8 RGB image."""
        topk = self.resolve_topk(topk)
        found = []
        p = self.preprocessing
        for start in range(0, len(images), BATCH_SIZE):
            batch = to_model_input(list(images[start:start + BATCH_SIZE]), p.img_size, p.crop_ratio, p.mean, p.std)
            with torch.no_grad():
                probabilities, classes = self.model(batch).float().softmax(dim=1).topk(topk, dim=1)
            for row_probabilities, row_classes in zip(probabilities.tolist(), classes.tolist()):
                found.append(Prediction(tuple(row_classes), tuple(self.labels[c] for c in row_classes),
                                        tuple(row_probabilities)))
        return found


IMAGE_SUFFIXES = frozenset(suffix.lower() for suffix in Image.registered_extensions())


def image_files(inputs: Sequence[str]) -> list[Path]:
    """The files to classify: each file as given, and every file with an image suffix under each
    directory (sorted, recursively); InvalidInputError for a path that does not exist or a directory
    holding no image file."""
    files: list[Path] = []
    for given in inputs:
        path = Path(given).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
            if not found:
                raise InvalidInputError(f"directory {given!r} holds no image files (none named *.png, *.jpg, "
                                        "*.jpeg, *.webp, ... under it)")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            special = uris.special_file_kind(path)
            raise InvalidInputError(f"image {given!r} " + (f"is {special}, not an image file" if special
                                                           else "does not exist"))
    return files


def classify_files(classifier: ImageClassifier, files: Sequence[Path], topk: int | None = None
                   ) -> Iterator[tuple[Path, Prediction | UnreadableImageError]]:
    """Each file with its prediction, or the error that names why it is not a readable image."""
    topk = classifier.resolve_topk(topk)
    for start in range(0, len(files), BATCH_SIZE):
        chunk, readable = files[start:start + BATCH_SIZE], {}
        outcomes: dict[Path, Prediction | UnreadableImageError] = {}
        for path in chunk:
            try:
                readable[path] = classifier.check_croppable(read_image(path), repr(str(path)))
            except UnreadableImageError as err:
                outcomes[path] = err
        predictions = classifier.classify(list(readable.values()), topk) if readable else []
        outcomes.update(zip(readable, predictions))
        for path in chunk:
            yield path, outcomes[path]
