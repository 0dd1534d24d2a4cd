"""A distillation teacher from any model source (``distill.teacher_from``): resolved and checked on the
driver before Ray starts, saved once where every worker reads it, built there from its card.

As ``model.init_from``'s source (``pipeline.trained.transfer``), the resolved weights, card and provenance
are written whole into the run directory (``teacher_source.safetensors``; a sweep keeps one file per source
under its ``init_sources``): a restarted run keeps the teacher it started with even where an alias has moved
since, and no worker downloads from MLflow. The teacher runs at the student's input size, normalised as its
card says it was trained (timm's DistillationTeacher bridges the two normalisations).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pipeline import uris
from pipeline.components.distillation import frozen_teacher
from pipeline.components.modeling import build_model, checked_model, size_problem
from pipeline.config.schema import DistillConfig
from pipeline.errors import ConfigError, InvalidInputError
from pipeline.trained.transfer import (read_saved_source, read_saved_weights, save_source, saved_source_card,
    saved_source_exists)

if TYPE_CHECKING:  # the driver's side resolves sources (MLflow among them); a worker only reads the saved file
    from pipeline.trained.model_source import ModelSource

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


def check_teacher(source: ModelSource, num_classes: int, img_size: int, sizes: Iterable[int] = ()) -> None:
    """The teacher says what model it is, classifies the student's classes, and its weights run at the
    student's ``img_size`` and at every crop size it is fed there (``sizes``: data.progressive's); an
    InvalidInputError naming ``distill.teacher_from`` and what does not hold."""
    given = source.provenance.given
    if source.card is None:
        raise InvalidInputError(f"distill.teacher_from={given!r} is a bare weights file: it does not say which model "
                                "it holds; give it as distill.teacher (its timm name) and distill.teacher_checkpoint, "
                                "or give a run, checkpoint or MLflow model as distill.teacher_from")
    model = source.card.model
    if source.card.num_classes != num_classes:
        raise InvalidInputError(f"distill.teacher_from={given!r}: it classifies {source.card.num_classes} classes and "
                                f"the student's data has {num_classes}")
    try:
        source.build(img_size)
        section = model.model_copy(update={"img_size": img_size})
        built = checked_model(section, num_classes)
    except (InvalidInputError, ConfigError) as err:
        reason = str(err).partition("}: ")[2] or str(err).removeprefix(f"model source {given!r}: ")
        raise InvalidInputError(f"distill.teacher_from={given!r}: its model {model.name} (trained at {model.img_size} "
                                f"px) cannot teach at the student's {img_size} px: {reason}") from None
    for size in sorted(set(sizes) - {img_size}):
        problem = size_problem(built, size)
        if problem:
            raise InvalidInputError(f"distill.teacher_from={given!r}: its model {model.name} cannot run on the "
                                    f"student's {size} px crops (data.progressive): {problem}")


def resolve_teacher(distill: DistillConfig, num_classes: int, img_size: int, sizes: Iterable[int], run_dir: str,
                    storage_path: str, tracking_uri: str) -> TeacherWeights:
    """``distill.teacher_from`` resolved and checked (``check_teacher``), before anything starts; a run
    restarted under its name takes the teacher it saved when it first started, which must be that source."""
    location = uris.join(run_dir, TEACHER_FILE)
    if saved_source_exists(location):
        source = read_saved_source(location)
        saved = (source.provenance.given, source.provenance.ema)
        if saved != (distill.teacher_from, distill.teacher_ema):
            raise InvalidInputError(
                f"{run_dir} distils from the teacher it saved when it started, {_named(*saved)}; this config names "
                f"{_named(distill.teacher_from, distill.teacher_ema)}: give the run another run.name")
    else:
        source = resolved_teacher(distill.teacher_from, distill.teacher_ema, storage_path, tracking_uri)
    check_teacher(source, num_classes, img_size, sizes)
    return TeacherWeights(location, source)


def resolved_teacher(teacher_from: str, ema: bool, storage_path: str, tracking_uri: str) -> ModelSource:
    """``distill.teacher_from`` resolved as any model source; an InvalidInputError naming the key where it is none."""
    from pipeline.trained.model_source import resolve_model_source

    try:
        return resolve_model_source(teacher_from, storage_path=storage_path, tracking_uri=tracking_uri, ema=ema)
    except InvalidInputError as err:
        raise InvalidInputError(f"distill.teacher_from: {err}") from None


def saved_teacher(location: str, num_classes: int, img_size: int, sizes: Iterable[int]) -> TeacherWeights:
    """A sweep trial's teacher: the source its sweep saved, checked at this trial's sizes (a TPE sample's
    size was not among those the sweep checked): InvalidInputError, the trial pruned, where it cannot teach."""
    if not saved_source_exists(location):
        raise InvalidInputError(f"the sweep saved no teacher at {location}")
    check_teacher(read_saved_source(location), num_classes, img_size, sizes)
    return TeacherWeights(location)


def _named(given: str, ema: bool) -> str:
    return f"{given!r}{' (its EMA weights)' if ema else ''}"


def load_teacher(location: str, img_size: int, device: torch.device | str = "cpu"):
    """A worker's teacher: the saved source's model at the student's ``img_size`` with its weights, frozen,
    normalised as trained (read without MLflow, which a worker does not import)."""
    card = saved_source_card(location)
    model = build_model(card.model.model_copy(update={"img_size": img_size}), card.num_classes)
    model.load_state_dict(read_saved_weights(location))
    preprocessing = card.preprocessing
    return frozen_teacher(model.eval(), device, None if preprocessing is None else (preprocessing.mean, preprocessing.std))
