"""What a trained model is: its model section, its classes, and how it was fed at evaluation.

Training records a ``ModelCard`` where its weights go, so that whatever later starts from them
(``pipeline.trained.model_source``: fine-tuning, evaluation, prediction, serving) can rebuild the model,
name its outputs and preprocess images as its own validation did:

- in every checkpoint's ``vitsweep_checkpoint.json`` (``pipeline.components.checkpointing``), under ``card``;
- in the MLflow model's ``MLmodel`` file, as its metadata under ``vitsweep``
  (``mlflow.models.get_model_info(uri).metadata["vitsweep"]``).

Checkpoints written before cards existed still say which model they hold (name, args, img_size,
num_classes): ``ModelCard.from_identity`` reads that, with no class names or preprocessing.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.config.schema import DataConfig, ExperimentConfig, ModelConfig
from pipeline.errors import InvalidInputError

CARD_FORMAT = "vitsweep.model.v1"
MLFLOW_METADATA_KEY = "vitsweep"  # the card's key in an MLflow model's metadata
# The card in a .safetensors file's metadata (JSON), as pipeline.trained.transfer.save_source writes it: such a
# file is a model source that says what model it holds.
SAFETENSORS_CARD_KEY = "vitsweep.card"


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EvalPreprocessing(_Record):
    """How validation fed the model (``pipeline.data.loaders.build_val_loader``): a center crop of
    ``crop_ratio`` of the shorter side (``data.val_crop_ratio``), resized to ``img_size``, then
    normalised by ``mean`` / ``std`` (``data.mean`` / ``data.std``, on 0-1 pixel values)."""

    img_size: int = Field(ge=1)
    crop_ratio: float = Field(gt=0.0, le=1.0)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


class ModelCard(_Record):
    """One trained model: ``model`` (the config's model section it was trained with: name, args,
    img_size, drop_path_rate), ``num_classes``, ``class_names`` (the training set's, label order;
    None where unrecorded) and ``preprocessing`` (its evaluation's; None where unrecorded)."""

    format: Literal["vitsweep.model.v1"] = CARD_FORMAT
    model: ModelConfig
    num_classes: int = Field(ge=1)
    class_names: tuple[str, ...] | None = None
    preprocessing: EvalPreprocessing | None = None

    @classmethod
    def of_run(cls, cfg: ExperimentConfig, num_classes: int, class_names: Sequence[str] = ()) -> ModelCard:
        """The card of a run trained with ``cfg`` on a dataset of these classes (its sidecar's)."""
        return cls(
            model=cfg.model, num_classes=num_classes, class_names=tuple(class_names) or None,
            preprocessing=EvalPreprocessing(img_size=cfg.model.img_size, crop_ratio=cfg.data.val_crop_ratio,
                                            mean=cfg.data.mean, std=cfg.data.std),
        )

    @classmethod
    def from_identity(cls, identity: dict[str, Any], where: str) -> ModelCard:
        """What a checkpoint's model identity (``checkpointing.model_identity``) says: no classes, no preprocessing."""
        return cls.from_dict({"model": {key: identity[key] for key in ("name", "args", "img_size") if key in identity},
                              "num_classes": identity.get("num_classes")}, where)

    @classmethod
    def from_dict(cls, record: Any, where: str) -> ModelCard:
        """A card read back (checkpoint metadata, MLflow metadata); InvalidInputError naming ``where`` if it is none."""
        try:
            return cls.model_validate(record)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<card>'}: {e['msg']}"
                                 for e in err.errors(include_url=False))
            raise InvalidInputError(f"{where} does not describe its model as vitsweep does ({problems})") from None

    def eval_preprocessing(self, data: DataConfig, img_size: int | None = None,
                           crop_ratio: float | None = None) -> EvalPreprocessing:
        """How to feed this model for evaluation: its own validation's preprocessing (a card without
        one: ``data``'s crop, mean and std at the model's size), with ``img_size`` / ``crop_ratio`` instead
        where given; InvalidInputError naming a value out of range."""
        recorded = self.preprocessing or EvalPreprocessing(img_size=self.model.img_size, crop_ratio=data.val_crop_ratio,
                                                           mean=data.mean, std=data.std)
        chosen = {"img_size": img_size, "crop_ratio": crop_ratio}
        try:
            return EvalPreprocessing(**{**recorded.model_dump(), **{k: v for k, v in chosen.items() if v is not None}})
        except ValidationError as err:
            problems = "; ".join(f"--{str(e['loc'][0]).replace('_', '-')} {e['input']}: {e['msg']}"
                                 for e in err.errors(include_url=False))
            raise InvalidInputError(problems) from None

    def as_dict(self) -> dict[str, Any]:
        """JSON- and YAML-ready (lists for tuples)."""
        return self.model_dump(mode="json")
