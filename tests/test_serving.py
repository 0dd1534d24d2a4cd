"""Every logged model is also an MLflow pyfunc that classifies images: encoded bytes or uint8 arrays in,
the top-K class names and probabilities out, as `vitsweep predict` gives them; `mlflow.pytorch.load_model`
still gives the module. The model is logged by training's own `pipeline.trained.serving.log_model` into a real sqlite
store (untrained weights: what is served is checked against the same weights, not an accuracy).
The HTTP server (`mlflow models serve`) is exercised in tests/test_after_training.py."""
import io
import json
from pathlib import Path

import mlflow
import mlflow.pyfunc
import mlflow.pytorch
import numpy as np
import pandas as pd
import pytest
import torch
from mlflow.exceptions import MlflowException
from PIL import Image

from carded_models import card_probabilities, carded_smoke_model, log_carded, log_in_new_store
from pipeline.cli import EXIT_INVALID_INPUT, main
from pipeline.trained.model_source import resolve_model_source
from pipeline.trained.prediction import ImageClassifier
from pipeline.trained.serving import pip_requirements

CLASSES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """(store URI, model URI, the module) of a run that logged a smoke model whose card evaluates 16 px at a
    0.5 crop with its own mean and std (tests/carded_models.py)."""
    model = carded_smoke_model(len(CLASSES), seed=0)
    return (*log_in_new_store(tmp_path_factory.mktemp("served"), model, CLASSES), model)


@pytest.fixture
def in_store(logged, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", logged[0])  # not mlflow.set_tracking_uri: it would leak
    return logged


def _png(array: np.ndarray) -> bytes:
    encoded = io.BytesIO()
    Image.fromarray(array).save(encoded, format="PNG")
    return encoded.getvalue()


IMAGES = [np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
          for seed, shape in enumerate([(32, 32, 3), (30, 21, 3), (64, 64, 3)])]


def test_the_pyfunc_classifies_encoded_images_and_arrays_as_predict_does(in_store):
    uri, model_uri, model = in_store
    served = mlflow.pyfunc.load_model(model_uri).predict(
        pd.DataFrame({"image": [_png(IMAGES[0]), IMAGES[1], _png(IMAGES[2])]}), params={"topk": 3})
    expected = ImageClassifier.of(resolve_model_source(model_uri, storage_path=".", tracking_uri=uri)).classify(IMAGES, 3)
    assert list(served.columns) == ["labels", "probabilities", "classes"] and len(served) == 3
    for row, prediction in zip(served.itertuples(), expected):
        assert list(row.labels) == list(prediction.labels) and set(row.labels) <= set(CLASSES)
        assert list(row.classes) == list(prediction.classes)
        np.testing.assert_allclose(row.probabilities, prediction.probabilities, rtol=1e-6)
    # and the first against the card's preprocessing computed by hand (predict's engine is no oracle for it)
    expected_first = card_probabilities(model, IMAGES[0][None])[0].numpy()
    top = np.argsort(-expected_first)[:3]
    first = served.iloc[0]
    assert list(first["labels"]) == [CLASSES[index] for index in top]
    np.testing.assert_allclose(first["probabilities"], expected_first[top], atol=1e-5)


def test_the_pyfunc_returns_five_classes_unless_asked(in_store):
    served = mlflow.pyfunc.load_model(in_store[1]).predict(pd.DataFrame({"image": [_png(IMAGES[0])]}))
    assert len(served.loc[0, "labels"]) == 5 and sorted(served.loc[0, "probabilities"], reverse=True) == list(
        served.loc[0, "probabilities"])


def test_mlflow_pytorch_load_model_still_gives_the_module(in_store):
    _, model_uri, model = in_store
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(mlflow.pytorch.load_model(model_uri).eval()(images), model(images))


def test_the_logged_model_has_an_image_signature_an_input_example_and_pinned_requirements(in_store, tmp_path):
    _, model_uri, _ = in_store
    info = mlflow.models.get_model_info(model_uri)
    assert info.signature.inputs.input_names() == ["image"] and info.signature.inputs.inputs[0].type.name == "binary"
    assert [p.name for p in info.signature.params] == ["topk"]
    assert set(info.flavors) == {"pytorch", "python_function"}
    assert info.flavors["python_function"]["loader_module"] == "pipeline.trained.serving"
    example = mlflow.pyfunc.load_model(model_uri).input_example
    assert Image.open(io.BytesIO(example["image"][0])).size == (16, 16)  # the model's own input size
    local = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(tmp_path))) / "requirements.txt"
    assert local.read_text().split() == pip_requirements()


def test_a_model_logged_before_serving_moved_still_loads_and_serves(in_store, tmp_path):
    """Models logged before ``pipeline.serving`` moved to ``pipeline.trained.serving`` name the old
    loader module in their MLmodel file; MLflow imports it by that name."""
    _, model_uri, _ = in_store
    directory = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(tmp_path)))
    mlmodel = directory / "MLmodel"
    text = mlmodel.read_text()
    assert "loader_module: pipeline.trained.serving" in text
    mlmodel.write_text(text.replace("loader_module: pipeline.trained.serving", "loader_module: pipeline.serving"))
    old = mlflow.pyfunc.load_model(str(directory)).predict(pd.DataFrame({"image": [_png(IMAGES[0])]}))
    new = mlflow.pyfunc.load_model(model_uri).predict(pd.DataFrame({"image": [_png(IMAGES[0])]}))
    assert list(old.loc[0, "labels"]) == list(new.loc[0, "labels"])
    np.testing.assert_allclose(old.loc[0, "probabilities"], new.loc[0, "probabilities"], rtol=1e-6)


def test_an_unreadable_image_in_a_request_is_the_callers_error_naming_its_row(in_store):
    with pytest.raises(MlflowException) as err:
        mlflow.pyfunc.load_model(in_store[1]).predict(pd.DataFrame({"image": [_png(IMAGES[0]), b"\x89PNG broken"]}))
    assert err.value.error_code == "INVALID_PARAMETER_VALUE" and "row 1 is not a readable image" in err.value.message


def test_an_image_too_small_for_its_center_crop_is_the_callers_error_naming_its_row(in_store):
    with pytest.raises(MlflowException) as err:  # the card's crop ratio 0.5 of a 1-px side: under a pixel
        mlflow.pyfunc.load_model(in_store[1]).predict(pd.DataFrame({"image": [_png(IMAGES[0]),
                                                                             _png(np.zeros((9, 1, 3), np.uint8))]}))
    assert err.value.error_code == "INVALID_PARAMETER_VALUE"
    assert "row 1 is 1x9 px: too small for a center crop at ratio 0.5" in err.value.message


def test_more_classes_than_the_model_has_are_refused(in_store):
    with pytest.raises(MlflowException, match="top-k 11: the model has 10 classes"):
        mlflow.pyfunc.load_model(in_store[1]).predict(pd.DataFrame({"image": [_png(IMAGES[0])]}), params={"topk": 11})


def test_a_logged_model_is_logged_from_its_runs_vitsweep_command_not_from_the_process_that_logs_it(tmp_path):
    """The UI's "Logged from" of a logged model: a sweep trial logs its model inside Ray's
    default_worker.py (here: pytest), which is not where it came from; its run's command is."""
    from pipeline.tracking.store import run_origin

    uri, command = f"sqlite:///{tmp_path}/mlflow.db", "vitsweep tune --space lr_wd --config smoke"
    logged = log_carded(uri, tmp_path, carded_smoke_model(10, seed=0), [str(digit) for digit in range(10)],
                        run_origin("a trial", command))
    tags = mlflow.MlflowClient(uri).get_logged_model(logged.removeprefix("models:/")).tags
    assert (tags["mlflow.source.name"], tags["mlflow.source.type"]) == (command, "JOB")


def test_a_logged_model_is_named_after_its_run_a_trials_after_its_trial_and_sweep(tmp_path, monkeypatch):
    """The Models tab lists a store's models by name. MLflow refuses a "." in one (a trial's run name holds
    its knobs' values); ``runs:/RUN_ID/NAME`` resolves by that name in MLflow, ``runs:/RUN_ID/model`` in vitsweep."""
    uri, classes, model = f"sqlite:///{tmp_path}/mlflow.db", [str(digit) for digit in range(10)], carded_smoke_model(10, 0)
    logged = {
        "warmup0.5": log_carded(uri, tmp_path, model, classes, run_name="warmup0.5"),
        "a1b2c_00003 lr=0.01": log_carded(uri, tmp_path, model, classes, run_name="a1b2c_00003 lr=0.01",
                                          run_tags={"sweep": "lr_wd-20261207-120000", "trial_id": "a1b2c_00003"}),
    }
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # MLflow's loaders read the store from it
    client = mlflow.MlflowClient(uri)
    models = {run_name: client.get_logged_model(uri_.removeprefix("models:/")) for run_name, uri_ in logged.items()}
    assert {run_name: m.name for run_name, m in models.items()} == {
        "warmup0.5": "warmup0_5", "a1b2c_00003 lr=0.01": "a1b2c_00003 of lr_wd-20261207-120000"}
    for found in models.values():
        assert mlflow.models.get_model_info(f"runs:/{found.source_run_id}/{found.name}").model_uuid == \
            mlflow.models.get_model_info(f"models:/{found.model_id}").model_uuid
        client.set_tag(found.source_run_id, "mlflow.runName", "renamed in the UI")  # still the run's own model
        source = resolve_model_source(f"runs:/{found.source_run_id}/model", storage_path=tmp_path, tracking_uri=uri)
        assert source.provenance.model_id == found.model_id


def test_a_model_with_fewer_than_five_classes_gives_all_of_them_by_default(tmp_path, monkeypatch, capsys):
    """As timm's inference.py caps its top-k at the class count, the default 5 is 3 for a 3-class model: in
    the served pyfunc (the signature's default, which MLflow passes when a request gives none) and in
    `vitsweep predict`; a top-k given beyond the class count is still refused."""
    classes = ("cat", "dog", "bird")
    model = carded_smoke_model(len(classes), seed=4)
    uri, model_uri = log_in_new_store(tmp_path, model, classes)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    ranked = card_probabilities(model, IMAGES[0][None])[0].argsort(descending=True).tolist()
    assert [(p.name, p.default) for p in mlflow.models.get_model_info(model_uri).signature.params] == [("topk", 3)]
    served = mlflow.pyfunc.load_model(model_uri).predict(pd.DataFrame({"image": [_png(IMAGES[0])]}))
    assert list(served.loc[0, "classes"]) == ranked and list(served.loc[0, "labels"]) == [classes[i] for i in ranked]
    # a model logged before: its signature's default was 5, which MLflow passes; it reads as the default too
    older = mlflow.pyfunc.load_model(model_uri).predict(pd.DataFrame({"image": [_png(IMAGES[0])]}), params={"topk": 5})
    assert list(older.loc[0, "classes"]) == ranked
    Image.fromarray(IMAGES[0]).save(tmp_path / "photo.png")
    assert main(["predict", model_uri, str(tmp_path / "photo.png"), "--json", "--set", f"tracking.mlflow_uri={uri}"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["classes"] == ranked
    assert main(["predict", model_uri, str(tmp_path / "photo.png"), "--topk", "5",
                 "--set", f"tracking.mlflow_uri={uri}"]) == EXIT_INVALID_INPUT
    assert "top-k 5: the model has 3 classes; give 1..3" in capsys.readouterr().err
