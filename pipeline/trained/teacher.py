"""A distillation teacher from any model source (``distill.teacher_from``): resolved and checked on the
driver before Ray starts, saved once where every worker reads it, built there from its card.

As ``model.init_from``'s source (``pipeline.trained.transfer``), the resolved weights, card and provenance
are written whole into the run directory (``teacher_source.safetensors``; a sweep keeps one file per source
under its ``init_sources``): a restarted run keeps the teacher it started with even where an alias has moved
since, and no worker downloads from MLflow. The teacher runs at the student's input size, normalised as its
card says it was trained (timm's DistillationTeacher bridges the two normalisations).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline import uris
from pipeline.components.distillation import frozen_teacher
from pipeline.config.schema import DistillConfig
from pipeline.errors import ConfigError, InvalidInputError
from pipeline.trained.model_source import ModelSource, resolve_model_source
from pipeline.trained.transfer import read_saved_source, save_source, saved_source_exists

TEACHER_FILE = "teacher_source.safetensors"  # in a run directory: the teacher the run distils from


@dataclass(frozen=True)
class TeacherWeights:
    """Where the workers read the teacher; ``source``: the resolved source while only the driver holds it."""

    location: str
    source: ModelSource | None = None

    def save(self) -> None:
        """Write the teacher where the workers read it, once: a restarted run keeps the one it started with."""
        if self.source is not None and not saved_source_exists(self.location):
            save_source(self.source, self.location)


def check_teacher(source: ModelSource, num_classes: int, img_size: int) -> None:
    """The teacher says what model it is, classifies the student's classes and runs at the student's input
    size; an InvalidInputError naming ``distill.teacher_from`` and what does not hold."""
    given = source.provenance.given
    if source.card is None:
        raise InvalidInputError(f"distill.teacher_from={given!r} is a bare weights file: it does not say which model "
                                "it holds; give it as distill.teacher (its timm name) and distill.teacher_checkpoint, "
                                "or give a run, checkpoint or MLflow model as distill.teacher_from")
    try:
        card = source.card
        if card.num_classes != num_classes:
            raise InvalidInputError(f"it classifies {card.num_classes} classes and the student's data has {num_classes}")
        source.build(img_size)
    except (InvalidInputError, ConfigError) as err:
        raise InvalidInputError(f"distill.teacher_from={given!r}: {str(err).removeprefix(f'model source {given!r}: ')}"
                                ) from None


def resolve_teacher(distill: DistillConfig, num_classes: int, img_size: int, run_dir: str, storage_path: str,
                    tracking_uri: str) -> TeacherWeights:
    """``distill.teacher_from`` resolved and checked, before anything starts; a run restarted under its name
    takes the teacher it saved when it first started."""
    location = uris.join(run_dir, TEACHER_FILE)
    source = (read_saved_source(location) if saved_source_exists(location)
              else resolve_model_source(distill.teacher_from, storage_path=storage_path, tracking_uri=tracking_uri))
    check_teacher(source, num_classes, img_size)
    return TeacherWeights(location, source)


def load_teacher(location: str, img_size: int, device: torch.device | str = "cpu"):
    """A worker's teacher: the saved source built at the student's ``img_size``, frozen, normalised as trained."""
    source = read_saved_source(location)
    preprocessing = source.card.preprocessing
    return frozen_teacher(source.build(img_size), device,
                          None if preprocessing is None else (preprocessing.mean, preprocessing.std))
