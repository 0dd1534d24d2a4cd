"""A model whose card says how to feed it, with an oracle for that computed without vitsweep.

The card evaluates 16 px images at a 0.5 center crop with its own mean and std (none of them the
defaults), so a 32 px image's input is its central 16 x 16 square, unresized: numpy slices and
normalises it by hand. ``log_in_new_store`` (``log_carded``: in a given store) logs a model with such
a card by training's own ``log_model``, for `predict`, `evaluate` and the served pyfunc to read (tests/test_prediction.py,
tests/test_evaluation.py, tests/test_serving.py)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

CARD_MEAN, CARD_STD, CARD_CROP = (0.2, 0.3, 0.4), (0.5, 0.6, 0.7), 0.5
CARD_OVERRIDES = (f"data.mean={list(CARD_MEAN)}", f"data.std={list(CARD_STD)}", f"data.val_crop_ratio={CARD_CROP}")


def carded_smoke_model(num_classes: int, seed: int) -> torch.nn.Module:
    """The smoke preset's model with random weights (``seed``), in eval mode."""
    from pipeline.components.modeling import build_model
    from pipeline.config.loading import load_config

    torch.manual_seed(seed)
    return build_model(load_config("smoke").model, num_classes).eval()


def log_in_new_store(root: Path, model: torch.nn.Module, classes: Sequence[str]) -> tuple[str, str]:
    """``model`` logged with the card above in a new SQLite store under ``root``: (store URI, models:/ URI)."""
    uri = f"sqlite:///{root}/mlflow.db"
    return uri, log_carded(uri, root, model, classes)


def log_carded(tracking_uri: str, root: Path, model: torch.nn.Module, classes: Sequence[str],
               run_tags: dict[str, str] | None = None, experiment: str = "vitsweep", run_name: str = "carded") -> str:
    """``model`` logged with the card above in the store at ``tracking_uri`` (its weights file written in
    ``root`` first) by training's own ``log_model``, in a new run (``run_name``, ``run_tags``) of ``experiment``: its URI,
    ``models:/<model_id>`` (MLflow 3's, which vitsweep's commands and MLflow's loaders both take)."""
    from safetensors.torch import save_model

    from pipeline.components.model_card import ModelCard
    from pipeline.config.loading import load_config
    from pipeline.tracking.store import MlflowStore
    from pipeline.trained.serving import log_model

    save_model(model, str(root / "model.safetensors"))
    run = MlflowStore(tracking_uri).create_run(experiment, run_name, tags=run_tags)
    card = ModelCard.of_run(load_config("smoke", list(CARD_OVERRIDES)), len(classes), classes)
    model_id = log_model(run, model, [root / "model.safetensors"], card, step=1)
    run.end("FINISHED", "completed")
    return f"models:/{model_id}"


def card_logits(model: torch.nn.Module, images: np.ndarray) -> torch.Tensor:
    """Logits of 32 px uint8 images [N, 32, 32, 3] fed as the card says, by hand: the central 16 x 16
    square (rows and columns 8..23), to 0-1, minus the mean, over the std."""
    crops = images[:, 8:24, 8:24].astype(np.float64) / 255.0
    normalised = ((crops - np.array(CARD_MEAN)) / np.array(CARD_STD)).transpose(0, 3, 1, 2)
    with torch.no_grad():
        return model(torch.tensor(np.ascontiguousarray(normalised), dtype=torch.float32))


def card_probabilities(model: torch.nn.Module, images: np.ndarray) -> torch.Tensor:
    """Class probabilities of ``card_logits``."""
    return card_logits(model, images).softmax(dim=1)
