"""Every logged model serves images: an MLflow model with a ``pytorch`` and an image ``python_function`` flavor.

``log_model`` logs each run's final model once, through MLflow's custom-flavor mechanism
(``mlflow.models.Model.log(flavor=<this module>, ...)`` calls ``save_model`` below), so that one
model directory offers both:

- ``pytorch``, written by ``mlflow.pytorch.save_model`` as before: ``mlflow.pytorch.load_model(uri)``
  gives the ``nn.Module`` (normalised tensors in, logits out);
- ``python_function``, whose ``loader_module`` is this module: ``mlflow.pyfunc.load_model(uri)`` and
  ``mlflow models serve`` get an ``ImagePyfunc`` built from the weights files and the model card the
  model carries (``extra_files/``, MLmodel metadata; nothing unpickled). Its input is a column
  ``image`` of encoded image bytes (PNG, JPEG, ...; base64 in a JSON request) or, from Python, uint8
  arrays HxWx3; its output, per image, the ``labels``, ``probabilities`` and ``classes`` of the
  ``topk`` (a param, default 5, or every class of a model with fewer) most probable classes,
  preprocessed as the model's validation was (``pipeline.trained.prediction.ImageClassifier``, the
  same code as ``vitsweep predict``).

The logged model records a signature and an input example (a blank image at the model's size).
Its ``requirements.txt`` pins the packages the pyfunc imports (explicit: MLflow's inference of them
costs 5-25 s per logged model); vitsweep itself is not on a package index, so serve in vitsweep's
environment: ``mlflow models serve -m models:/NAME@ALIAS --env-manager local``.
"""
from __future__ import annotations

import io
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException
from mlflow.models import Model, ModelSignature
from mlflow.types.schema import Array, ColSpec, DataType, ParamSchema, ParamSpec, Schema
from mlflow.utils.mlflow_tags import MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE
from PIL import Image

from pipeline.components.model_card import MLFLOW_METADATA_KEY, ModelCard
from pipeline.console import library_prints
from pipeline.data.images import UnreadableImageError, as_rgb_array, decode_image
from pipeline.errors import InvalidInputError
from pipeline.trained.model_source import MLMODEL_FILE, read_logged_model_directory
from pipeline.trained.prediction import DEFAULT_TOPK, ImageClassifier, default_topk
from pipeline.tracking.connection import fluent_tracking_uri
from pipeline.tracking.store import MODEL_ID_TAG, MlflowRun, logged_model_name

INPUT_COLUMN = "image"
TOPK_PARAM = "topk"
# Distributions the pyfunc imports (beside vitsweep's own packages), pinned to this environment's versions.
SERVING_DISTRIBUTIONS = ("mlflow", "torch", "timm", "safetensors", "numpy", "pandas", "pillow", "pydantic", "ffcv")


def signature(card: ModelCard) -> ModelSignature:
    """Encoded images in, top-K classes out; ``topk`` defaults to 5, or every class of a model with fewer."""
    return ModelSignature(
        inputs=Schema([ColSpec(DataType.binary, INPUT_COLUMN)]),
        outputs=Schema([ColSpec(Array(DataType.string), "labels"), ColSpec(Array(DataType.double), "probabilities"),
                        ColSpec(Array(DataType.long), "classes")]),
        params=ParamSchema([ParamSpec(TOPK_PARAM, DataType.long, default_topk(card.num_classes))]),
    )


def input_example(card: ModelCard) -> pd.DataFrame:
    """One encoded image of the model's input size: what a request carries."""
    size = card.preprocessing.img_size if card.preprocessing else card.model.img_size
    encoded = io.BytesIO()
    Image.new("RGB", (size, size)).save(encoded, format="PNG")
    return pd.DataFrame({INPUT_COLUMN: [encoded.getvalue()]})


def pip_requirements() -> list[str]:
    return [f"{name}=={version(name)}" for name in SERVING_DISTRIBUTIONS]


def log_model(mlflow_run: MlflowRun, model, weights: list[Path], card: ModelCard, step: int) -> str:
    """The final weights (safetensors: the model's, and its EMA's where there is one) as artifacts of
    ``mlflow_run``, and the model as one MLflow model: its ``pytorch`` flavor (``mlflow.pytorch.load_model``
    restores the module) and an image-classifying ``python_function`` flavor (``mlflow models serve``),
    carrying the same weights files (``extra_files/``) and its card (MLmodel ``metadata["vitsweep"]``),
    so that a ``runs:/`` or ``models:/`` URI is a complete model source (``pipeline.trained.model_source``);
    named after the run (``logged_model_name``: the Models tab lists a sweep's models by trial), linked to
    the metrics of epoch ``step`` (the last: MLflow's default would be step 0's), and the run's tag
    ``MODEL_ID_TAG`` pointing at it. Returns the logged model's id (``models:/<model_id>`` is MLflow 3's
    URI of it)."""
    for path in weights:
        mlflow_run.log_artifact(path)
    # The UI's "Logged from": the run's own source (the vitsweep command), not this process's script (a
    # sweep trial logs its model from Ray's default_worker.py).
    recorded = mlflow_run.get()
    run_tags = recorded.data.tags
    source = {key: run_tags[key] for key in (MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE) if key in run_tags}
    # The run active (not only named): MLflow files the logged model under the active run's experiment.
    with fluent_tracking_uri(mlflow_run.uri), mlflow.start_run(run_id=mlflow_run.run_id), library_prints():
        # pt2 (MLflow 3's default) traces a fixed batch size; the pickled module serves any batch.
        logged = Model.log(None, flavor=sys.modules[__name__], name=logged_model_name(recorded),
                           flavor_name="pytorch", step=step, metadata={MLFLOW_METADATA_KEY: card.as_dict()},
                           pytorch_model=model.eval(), weights=weights, card=card, serialization_format="pickle",
                           tags=source)
    mlflow_run.set_tags({MODEL_ID_TAG: logged.model_id})
    return logged.model_id


def save_model(pytorch_model, path: str, mlflow_model: Model, weights: list[Path], card: ModelCard,
               serialization_format: str = "pickle") -> None:
    """Write the model directory at ``path`` (``Model.log`` calls this): the pytorch flavor with the
    weights files as its extra files, then the python_function flavor pointed at this module."""
    import mlflow.pytorch
    from mlflow import pyfunc
    from mlflow.utils.environment import _CONDA_ENV_FILE_NAME, _PYTHON_ENV_FILE_NAME

    mlflow.pytorch.save_model(
        pytorch_model, path, mlflow_model=mlflow_model, serialization_format=serialization_format,
        extra_files=[str(file) for file in weights], pip_requirements=pip_requirements(),
        signature=signature(card), input_example=input_example(card),
    )
    pyfunc.add_to_model(mlflow_model, loader_module=__name__, conda_env=_CONDA_ENV_FILE_NAME,
                        python_env=_PYTHON_ENV_FILE_NAME)
    mlflow_model.save(str(Path(path) / MLMODEL_FILE))


def _load_pyfunc(path: str, model_config: dict[str, Any] | None = None) -> ImagePyfunc:
    """MLflow's pyfunc entry point: ``path`` is the model directory (the flavor names no data subpath)."""
    return ImagePyfunc(ImageClassifier.of(read_logged_model_directory(path)))


class ImagePyfunc:
    """The python_function flavor: a DataFrame with an ``image`` column in, top-K classes per row out."""

    def __init__(self, classifier: ImageClassifier):
        self.classifier = classifier

    def predict(self, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        topk = (params or {}).get(TOPK_PARAM)
        # MLflow fills in the signature's default, and a model logged before it followed the class count says 5:
        # 5 is the default (up to 5), as an explicit request of 5 cannot be told from it
        topk = None if topk is None or int(topk) == DEFAULT_TOPK else int(topk)
        try:
            images = [self.classifier.check_croppable(_image(value, f"row {row}"), f"row {row}")
                      for row, value in enumerate(model_input[INPUT_COLUMN])]
            predictions = self.classifier.classify(images, topk)
        except InvalidInputError as err:  # a bad image or top-k: the caller's error (HTTP 400 when served)
            raise MlflowException(str(err), error_code=INVALID_PARAMETER_VALUE) from None
        return pd.DataFrame([prediction.as_dict() for prediction in predictions],
                            columns=["labels", "probabilities", "classes"])


def _image(value: Any, name: str) -> np.ndarray:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return decode_image(bytes(value), name)
    if isinstance(value, np.ndarray):
        return as_rgb_array(value, name)
    raise UnreadableImageError(f"{name} is a {type(value).__name__}; give encoded image bytes or a uint8 "
                               "HxWx3 array")
