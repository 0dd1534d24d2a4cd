"""`vitsweep evaluate` in one process: what it measures (training's own validation path and Tally, plus the
confusion matrix and each sample's prediction from the same pass), how MLflow records it (a run of its own
in the model's experiment, its metrics on the logged model with the dataset), and bad input refused
before anything is written. Exactness against a trained run's own val_top1, EMA and Ray workers:
tests/test_after_training.py."""
import contextlib
import csv
import dataclasses
import io
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
import torch
from mlflow.tracking import MlflowClient

from pipeline.cli import EXIT_INVALID_INPUT, main
from pipeline.config.schema import DataConfig
from pipeline.data.loaders import build_val_loader
from pipeline.data.sidecar import WriteOptions, read_sidecar
from pipeline.data.writing import write_beton
from pipeline.trained.evaluation import (ROLE, ROLE_TAG, SOURCE_MODEL_TAG, SOURCE_RUN_TAG, Evaluation, SampleRecorder,
                                         class_name_differences, plan_evaluation, record_evaluation, source_label)
from pipeline.trained.model_source import ModelSource, Provenance
from pipeline.tracking.store import MlflowStore, command_line
from pipeline.components.metrics import ConfusionTally
from pipeline.components.metrics import validation_metrics
from carded_models import card_logits, card_probabilities, carded_smoke_model, log_in_new_store
from conftest import per_test_under_mutation
from test_data_images import NoiseSource


def _evaluate_args(logged_run, *args: str, data: str | None = None) -> list[str]:
    return ["evaluate", logged_run.model_uri, "--data", data or str(logged_run.data["val"]),
            "--set", f"tracking.mlflow_uri={logged_run.uri}", "--set", f"run.storage_path={logged_run.storage}", *args]


def _evaluate(logged_run, *args: str, data: str | None = None) -> int:
    return main(_evaluate_args(logged_run, *args, data=data))


def _evaluations(logged_run) -> list:
    client = MlflowClient(logged_run.uri)
    experiment = client.get_experiment_by_name("vitsweep").experiment_id
    return client.search_runs([experiment], f"tags.`{ROLE_TAG}` = '{ROLE}'", order_by=["attributes.start_time DESC"])


def _read(logged_run, run, name: str) -> str:
    with tempfile.TemporaryDirectory() as directory:
        return Path(MlflowClient(logged_run.uri).download_artifacts(run.info.run_id, name, directory)).read_text()


@pytest.fixture(scope=per_test_under_mutation("module"))
def evaluated(logged_run):
    """One evaluation of the logged model on the digits val set, at a 0.875 crop: (console, its MLflow run)."""
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        assert _evaluate(logged_run, "--crop-ratio", "0.875") == 0
    return console.getvalue(), MlflowClient(logged_run.uri).get_run(_evaluations(logged_run)[0].info.run_id)


def test_its_metrics_are_training_validations_on_the_same_loader_and_weights(logged_run, evaluated):
    _, run = evaluated
    data = DataConfig(num_workers=1, val_crop_ratio=0.875)
    loader = build_val_loader(data, logged_run.data["val"], 64, 16, "cpu")
    expected = validation_metrics(logged_run.model, loader, torch.float32, torch.device("cpu"))
    assert {key: run.data.metrics[key] for key in expected} == pytest.approx(expected, rel=1e-6)
    assert run.data.metrics["val_top1"] == expected["val_top1"]  # counts, not floats: exactly


def test_the_run_is_an_evaluation_in_the_models_experiment_linked_to_its_run_and_model(logged_run, evaluated):
    _, run = evaluated
    client = MlflowClient(logged_run.uri)
    source = client.get_run(logged_run.run_id)
    assert run.info.experiment_id == source.info.experiment_id and run.info.status == "FINISHED"
    tags = run.data.tags
    assert (tags[ROLE_TAG], tags[SOURCE_RUN_TAG], tags[SOURCE_MODEL_TAG]) == (ROLE, logged_run.run_id,
                                                                              logged_run.model_id)
    assert run.info.run_name == "eval logged on val" and logged_run.run_id in tags["mlflow.note.content"]
    assert [i.model_id for i in run.inputs.model_inputs] == [logged_run.model_id]
    assert (run.data.params["crop_ratio"], run.data.params["img_size"], run.data.params["data.num_samples"]) == (
        "0.875", "16", "360")


def test_its_metrics_are_the_logged_models_on_the_dataset(logged_run, evaluated):
    _, run = evaluated
    (dataset,) = run.inputs.dataset_inputs
    sha256 = read_sidecar(logged_run.data["val"]).sha256
    assert dataset.dataset.name == "val.beton" and dataset.dataset.digest == sha256[:32]
    assert {t.key: t.value for t in dataset.tags} == {"mlflow.data.context": "evaluation", "sha256": sha256}
    model_metrics = MlflowClient(logged_run.uri).get_logged_model(logged_run.model_id).metrics
    from_evaluation = {m.key: m.value for m in model_metrics if m.run_id == run.info.run_id}
    assert from_evaluation == {key: run.data.metrics[key] for key in ("val_top1", "val_top5", "val_loss")}
    assert {(m.dataset_name, m.dataset_digest) for m in model_metrics if m.run_id == run.info.run_id} == {
        ("val.beton", sha256[:32])}


def test_the_confusion_matrix_per_class_table_and_predictions_agree_with_the_metrics(logged_run, evaluated):
    _, run = evaluated
    confusion = list(csv.reader(io.StringIO(_read(logged_run, run, "confusion_matrix.csv"))))
    classes = read_sidecar(logged_run.data["val"]).classes  # the data's names: its labels are the truth
    assert confusion[0] == ["true \\ predicted", *classes] and [row[0] for row in confusion[1:]] == classes
    counts = np.array([[int(value) for value in row[1:]] for row in confusion[1:]])
    counts_per_class = read_sidecar(logged_run.data["val"]).counts_per_class
    assert counts.sum(axis=1).tolist() == list(counts_per_class.values())  # every sample once
    assert 100.0 * np.trace(counts) / counts.sum() == pytest.approx(run.data.metrics["val_top1"])
    per_class = list(csv.DictReader(io.StringIO(_read(logged_run, run, "per_class_accuracy.csv"))))
    assert [int(row["correct"]) for row in per_class] == np.diag(counts).tolist()
    predictions = list(csv.DictReader(io.StringIO(_read(logged_run, run, "predictions.csv"))))
    assert len(predictions) == 360 and [int(row["index"]) for row in predictions] == list(range(360))
    assert sum(int(row["correct"]) for row in predictions) == np.trace(counts)
    assert {"confusion_matrix.png", "vitsweep.log"} <= {a.path for a in MlflowClient(logged_run.uri).list_artifacts(
        run.info.run_id)}
    # the plot's title (the PNG's Title): the trained run's name, the data, top-1 as the run logged it
    trained_name = MlflowClient(logged_run.uri).get_run(logged_run.run_id).info.run_name
    with tempfile.TemporaryDirectory() as directory:
        png = MlflowClient(logged_run.uri).download_artifacts(run.info.run_id, "confusion_matrix.png", directory)
        assert Image.open(png).text["Title"] == f"{trained_name} on val.beton: top-1 {run.data.metrics['val_top1']:.2f}%"


def test_the_console_says_what_was_evaluated_the_metrics_and_where_they_are(evaluated):
    console, run = evaluated
    assert "evaluating runs:/" in console and "[mlflow_run] on" in console and "360 images, 10 classes, 16 px, crop 0.875" in console
    assert f"val_top1 {run.data.metrics['val_top1']:.2f}%" in console and "per class (top-1): 0 " in console
    assert "warning: the data's class names differ from the model's: 'digit 0' != '0'; " in console
    assert f"recorded as MLflow run {run.info.run_id}" in console and "workflowType=machine_learning" in console


def test_the_confusion_tally_counts_true_against_predicted_classes():
    tally = ConfusionTally(3)
    tally.add(torch.tensor([[9.0, 0, 0], [0, 9.0, 0], [0, 9.0, 0], [0, 0, 9.0]]), torch.tensor([0, 1, 2, 2]))
    assert tally.reduced(torch.device("cpu")).tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    assert ConfusionTally.per_class_accuracy(tally.counts) == [100.0, 100.0, 50.0]


# -- bad input: exit 2 naming it, nothing written --------------------------------------------------


@pytest.fixture
def nothing_written(logged_run):
    """Asserts after the test that the store holds no new run and the storage no new file."""
    before = (len(_evaluations(logged_run)), sorted(logged_run.storage.rglob("*")))
    yield
    assert (len(_evaluations(logged_run)), sorted(logged_run.storage.rglob("*"))) == before


@pytest.fixture(scope="module")
def two_classes(tmp_path_factory):
    path = tmp_path_factory.mktemp("two-classes") / "noise.beton"
    write_beton(NoiseSource(), path, WriteOptions(write_mode="raw"), num_workers=1)
    return path


@pytest.mark.parametrize("args, message", [
    (["--crop-ratio", "1.5"], "--crop-ratio 1.5: Input should be less than or equal to 1"),
    (["--img-size", "12"], "model.img_size=12"),
    (["--workers", "-1"], "--workers -1: give 1 or more Ray workers"),
    (["--batch-size", "0"], "--batch-size 0: need at least 1"),
    (["--address", "auto"], "--address auto runs the evaluation on Ray workers: give --workers N"),
])
def test_a_bad_option_is_refused_naming_it(logged_run, nothing_written, capsys, args, message):
    assert _evaluate(logged_run, *args) == EXIT_INVALID_INPUT
    assert message in capsys.readouterr().err


def test_a_missing_source_is_refused_naming_it(logged_run, nothing_written, capsys):
    assert main(["evaluate", "no-such-run", "--data", str(logged_run.data["val"]),
                 "--set", f"run.storage_path={logged_run.storage}"]) == EXIT_INVALID_INPUT
    assert "model source 'no-such-run' does not exist" in capsys.readouterr().err


def test_a_missing_dataset_is_refused_naming_it(logged_run, nothing_written, capsys):
    assert _evaluate(logged_run, data=str(logged_run.storage / "x.beton")) == EXIT_INVALID_INPUT
    assert f"dataset '{logged_run.storage / 'x.beton'}' does not exist" in capsys.readouterr().err


def test_data_of_another_class_count_is_refused_naming_both(logged_run, nothing_written, two_classes, capsys):
    assert main(["evaluate", logged_run.model_uri, "--data", str(two_classes),
                 "--set", f"tracking.mlflow_uri={logged_run.uri}"]) == EXIT_INVALID_INPUT
    assert f"classifies 10 classes but dataset '{two_classes}' has 2 (even, odd)" in capsys.readouterr().err


def test_ema_weights_a_run_never_had_are_refused(logged_run, nothing_written, capsys):
    assert _evaluate(logged_run, "--ema") == EXIT_INVALID_INPUT
    assert "holds no EMA weights" in capsys.readouterr().err


# -- the model card's preprocessing, eval mode and every sample once, against an oracle by hand --------

class Squares32(NoiseSource):
    """21 random 32 x 32 images of the 10 digit classes (21: no multiple of the batch of 8 below)."""

    def __init__(self):
        super().__init__()
        self.classes = [f"digit {index}" for index in range(10)]
        self.labels = np.arange(21, dtype=np.int64) % 10
        self.sizes = np.full((21, 2), 32)

    def load_image(self, index):
        return np.random.default_rng(100 + index).integers(0, 256, (32, 32, 3), dtype=np.uint8)


def test_evaluate_feeds_the_model_as_its_card_says_in_eval_mode_each_sample_once(tmp_path, capsys):
    """A model whose card evaluates 16 px at a 0.5 crop with its own mean and std, on 32 px images: each
    sample's input is its central 16 px square (unresized) normalised by hand; the model in eval mode
    (its convolutional stem's BatchNorm uses its running statistics); 21 samples in batches of 8."""
    source = Squares32()
    write_beton(source, tmp_path / "squares.beton", WriteOptions(write_mode="raw"), num_workers=1)
    model = carded_smoke_model(10, seed=3)
    with torch.no_grad():  # running statistics far from a batch's own: train mode would give other logits
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(2.0, 3.0)
    uri, model_uri = log_in_new_store(tmp_path, model, source.classes)

    assert main(["evaluate", model_uri, "--data", str(tmp_path / "squares.beton"),
                 "--batch-size", "8", "--set", f"tracking.mlflow_uri={uri}",
                 "--set", f"run.storage_path={tmp_path}"]) == 0
    capsys.readouterr()
    client = MlflowClient(uri)
    (evaluation,) = client.search_runs([client.get_experiment_by_name("vitsweep").experiment_id],
                                       f"tags.`{ROLE_TAG}` = '{ROLE}'")
    rows = list(csv.DictReader(io.StringIO(Path(client.download_artifacts(
        evaluation.info.run_id, "predictions.csv", str(tmp_path))).read_text())))

    probability, expected = card_probabilities(model, np.stack([source.load_image(i) for i in range(21)])).max(dim=1)
    assert [int(row["index"]) for row in rows] == list(range(21))  # no padding row counted
    assert [int(row["predicted"]) for row in rows] == expected.tolist()
    # the top-1 probability follows every pixel (an untrained model's class often does not)
    assert [float(row["probability"]) for row in rows] == pytest.approx(probability.tolist(), rel=1e-5)
    assert evaluation.data.metrics["val_top1"] == pytest.approx(100.0 * np.mean(expected.numpy() == source.labels))


def test_flip_tta_averages_each_images_logits_with_its_mirror_images(tmp_path, capsys):
    """The same 21 squares with --flip-tta: each sample's probabilities are the softmax of the mean of the
    model's logits for its crop and for the crop mirrored left-right (the central crop of a mirrored image
    is the mirrored central crop), by hand."""
    source = Squares32()
    write_beton(source, tmp_path / "squares.beton", WriteOptions(write_mode="raw"), num_workers=1)
    model = carded_smoke_model(10, seed=5)
    uri, model_uri = log_in_new_store(tmp_path, model, source.classes)

    assert main(["evaluate", model_uri, "--data", str(tmp_path / "squares.beton"), "--flip-tta",
                 "--set", f"tracking.mlflow_uri={uri}", "--set", f"run.storage_path={tmp_path}"]) == 0
    assert "crop 0.5, each image's logits averaged with its mirror image's (flip TTA); this process" in (
        capsys.readouterr().out)
    client = MlflowClient(uri)
    (evaluation,) = client.search_runs([client.get_experiment_by_name("vitsweep").experiment_id],
                                       f"tags.`{ROLE_TAG}` = '{ROLE}'")
    rows = list(csv.DictReader(io.StringIO(Path(client.download_artifacts(
        evaluation.info.run_id, "predictions.csv", str(tmp_path))).read_text())))
    images = np.stack([source.load_image(i) for i in range(21)])
    averaged = (card_logits(model, images) + card_logits(model, images[:, :, ::-1])) / 2
    probability, expected = averaged.softmax(dim=1).max(dim=1)
    assert [int(row["predicted"]) for row in rows] == expected.tolist()
    assert [float(row["probability"]) for row in rows] == pytest.approx(probability.tolist(), rel=1e-5)
    unflipped = card_probabilities(model, images).max(dim=1).values
    assert not np.allclose(unflipped.numpy(), probability.numpy(), rtol=1e-3)  # the mirror changed what it saw
    assert evaluation.data.params["flip_tta"] == "True"
    assert "(flip TTA)" in evaluation.data.tags["mlflow.note.content"]


# -- what the evaluation run is called, for each kind of source --------------------------------------------

def _source(kind: str, given: str, location: str = "/runs/x/model.safetensors", **provenance) -> ModelSource:
    return ModelSource({}, None, Provenance(given, kind, location, **provenance))


def test_an_evaluations_label_names_the_registry_entry_the_run_the_checkpoint_or_the_file(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    trained = MlflowStore(uri).create_run("vitsweep", "digits16")
    cases = {
        "models:/digits@champion": (_source("registered_model", "models:/digits@champion", registered_name="digits",
                                            registered_version="3", registered_alias="champion"), "digits@champion"),
        "models:/digits/3": (_source("registered_model", "models:/digits/3", registered_name="digits",
                                     registered_version="3"), "digits/3"),
        "runs:": (_source("mlflow_run", f"runs:/{trained.run_id}/model", run_id=trained.run_id), "digits16"),
        "checkpoint": (_source("checkpoint_dir", "runs/e2e/checkpoint_000001",  # of a run MLflow knows: still the path
                               location="/abs/runs/e2e/checkpoint_000001", run_id=trained.run_id), "e2e/checkpoint_000001"),
        "file": (_source("safetensors", "/weights/best.safetensors/"), "best.safetensors"),
        "run name": (_source("run_name", "digits16", location="/abs/runs/digits16/x.safetensors",
                             run_id=trained.run_id), "digits16"),
    }
    for case, (source, label) in cases.items():
        assert source_label(source, uri) == label, case


def test_an_ema_evaluation_is_named_and_measured_as_the_emas_and_its_data_without_the_suffix(logged_run, tmp_path):
    """The plan of the suite's logged run, its provenance made EMA's (as `--ema` resolves it): the run is
    `eval <label> on <data> (ema)` and its metrics training's EMA names."""
    from pipeline.config.loading import load_config

    plan = plan_evaluation(logged_run.model_uri, str(logged_run.data["val"]),
                           load_config("smoke", [f"tracking.mlflow_uri={logged_run.uri}",
                                                 f"run.storage_path={tmp_path}"]))
    ema = dataclasses.replace(plan, source=dataclasses.replace(
        plan.source, provenance=dataclasses.replace(plan.source.provenance, ema=True)))
    evaluation = Evaluation({"val_top1": 50.0, "val_top5": 90.0, "val_loss": 1.5}, np.eye(10, dtype=np.int64),
                            np.arange(10), np.arange(10), np.full(10, 0.5))
    recorded = record_evaluation(ema, evaluation)
    assert recorded.run_name == "eval logged on val (ema)"
    run = MlflowClient(logged_run.uri).get_run(recorded.run_id)
    assert {key: run.data.metrics[key] for key in ("val_top1_ema", "val_top5_ema", "val_loss_ema")} == {
        "val_top1_ema": 50.0, "val_top5_ema": 90.0, "val_loss_ema": 1.5}
    assert "val_top1" not in run.data.metrics and plan.experiment == "vitsweep"
    with tempfile.TemporaryDirectory() as directory:  # its plot says whose weights: the EMA's
        png = MlflowClient(logged_run.uri).download_artifacts(recorded.run_id, "confusion_matrix.png", directory)
        assert Image.open(png).text["Title"] == "logged (EMA) on val.beton: top-1 50.00%"
    MlflowClient(logged_run.uri).delete_run(recorded.run_id)  # the module's other tests count its evaluations


def test_class_names_are_compared_label_by_label_only_where_the_model_says_its_own(logged_run, tmp_path):
    from pipeline.config.loading import load_config

    plan = plan_evaluation(logged_run.model_uri, str(logged_run.data["val"]),
                           load_config("smoke", [f"tracking.mlflow_uri={logged_run.uri}", f"run.storage_path={tmp_path}"]))
    data = plan.classes  # the digits' own: '0' ... '9'
    named = dataclasses.replace(plan.source, card=plan.source.card.model_copy(update={"class_names": (
        *data[:3], "three", *data[4:])}))
    assert class_name_differences(dataclasses.replace(plan, source=named)) == ["'three' != '3'"]
    unnamed = dataclasses.replace(plan.source, card=plan.source.card.model_copy(update={"class_names": None}))
    assert class_name_differences(dataclasses.replace(plan, source=unnamed)) == []


def test_a_recorder_that_saw_no_batch_has_no_samples():
    assert SampleRecorder(3).samples() == {"labels": [], "predicted": [], "probability": []}


def test_the_run_records_every_setting_of_the_evaluation_as_a_param_and_says_it_in_words(logged_run, evaluated):
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    console, run = evaluated
    sidecar = read_sidecar(logged_run.data["val"])
    source = MlflowClient(logged_run.uri).get_run(logged_run.run_id)
    params = run.data.params
    location = params.pop("source.location")
    assert location.startswith(source.info.artifact_uri.rsplit("/artifacts", 1)[0]) or location.endswith(
        "model.safetensors"), location
    # the card's preprocessing: the smoke model's ImageNet statistics (timm's constants), 16 px, the 0.875 asked
    assert params == {
        "source": logged_run.model_uri, "source.kind": "mlflow_run", "ema": "False", "model.name": "xcit_nano_12_p8",
        "data": str(logged_run.data["val"]), "data.sha256": sidecar.sha256, "data.num_samples": "360",
        "data.num_classes": "10", "img_size": "16", "crop_ratio": "0.875", "mean": str(list(IMAGENET_DEFAULT_MEAN)),
        "std": str(list(IMAGENET_DEFAULT_STD)), "flip_tta": "False", "workers": "this process", "batch_size": "64",
        "source.run_id": logged_run.run_id, "source.model_id": logged_run.model_id}
    metrics = run.data.metrics
    assert run.data.tags["mlflow.note.content"] == (
        f"Evaluation of **logged** (trained by [run {logged_run.run_id}](#/experiments/{source.info.experiment_id}/runs/"
        f"{logged_run.run_id})) on `val.beton` (360 images, 10 classes) at 16 px, center crop 0.875: top-1 "
        f"{metrics['val_top1']:.2f}%, top-5 {metrics['val_top5']:.2f}%, loss {metrics['val_loss']:.4f}.")
    assert run.data.tags["vitsweep.source"] == logged_run.model_uri
    assert run.data.tags["mlflow.source.name"] == command_line()  # the command, as every run records it
    assert (run.info.status, run.data.tags["stop_reason"]) == ("FINISHED", "completed")
    assert (f"evaluating {logged_run.model_uri} [mlflow_run] on {logged_run.data['val']}: 360 images, 10 classes, "
            "16 px, crop 0.875; this process") in console


@pytest.mark.parametrize("count, listed", [(6, "a, b, c, d, e, ..."), (5, "a, b, c, d, e")])
def test_data_of_other_classes_is_refused_naming_its_first_five_and_what_to_do(logged_run, nothing_written, tmp_path,
                                                                             capsys, count, listed):
    class OtherClasses(NoiseSource):
        def __init__(self):
            super().__init__()
            self.classes = list("abcdef"[:count])
            self.labels = np.arange(2 * count, dtype=np.int64) % count
            self.sizes = np.full((2 * count, 2), 16)

        def load_image(self, index):
            return np.full((16, 16, 3), index, dtype=np.uint8)

    path = tmp_path / "other.beton"
    write_beton(OtherClasses(), path, WriteOptions(write_mode="raw"), num_workers=1)
    assert main(["evaluate", logged_run.model_uri, "--data", str(path),
                 "--set", f"tracking.mlflow_uri={logged_run.uri}"]) == EXIT_INVALID_INPUT
    assert (f"classifies 10 classes but dataset '{path}' has {count} ({listed}); evaluate it on data of the "
            "classes it was trained on") in capsys.readouterr().err


def test_a_batch_of_one_is_a_batch(logged_run, tmp_path, monkeypatch):
    from pipeline.config.loading import load_config

    monkeypatch.delenv("VITSWEEP_CACHE_DIR")  # the node's cache directory unset: the run storage's data-cache/

    plan = plan_evaluation(logged_run.model_uri, str(logged_run.data["val"]),
                           load_config("smoke", [f"tracking.mlflow_uri={logged_run.uri}", f"run.storage_path={tmp_path}"]),
                           batch_size=1)
    assert (plan.batch_size, plan.workers, plan.source.provenance.ema) == (1, 0, False)  # defaults: here, final weights
    assert plan.cache_dir == tmp_path / "data-cache" and plan.tracking_uri == logged_run.uri


def test_the_ranks_samples_are_put_back_in_the_datasets_order():
    """Rank r of W reads positions r, r + W, ... (ffcv's DistributedSampler): 7 samples over 3 ranks, by hand."""
    from pipeline.trained.evaluation import in_dataset_order

    shards = [{"labels": [0, 3, 6], "predicted": [10, 13, 16]}, {"labels": [1, 4], "predicted": [11, 14]},
              {"labels": [2, 5], "predicted": [12, 15]}]
    assert in_dataset_order(shards) == {"labels": [0, 1, 2, 3, 4, 5, 6], "predicted": [10, 11, 12, 13, 14, 15, 16]}
    assert in_dataset_order([{"labels": [4, 2]}]) == {"labels": [4, 2]}  # one process: as it read them


def test_more_workers_than_a_local_rays_cpus_is_bad_input_but_a_cluster_may_grow():
    from pipeline.errors import InvalidInputError
    from pipeline.trained.evaluation import check_workers_fit

    with pytest.raises(InvalidInputError) as refused:
        check_workers_fit(3, 2.0, local=True)
    assert str(refused.value) == ("--workers 3 need 3 CPUs; this machine's local Ray has 2: give fewer, or join a "
                                  "cluster with --address")
    check_workers_fit(2, 2.0, local=True)
    check_workers_fit(3, 2.0, local=False)


def _plan(logged_run, tmp_path, **provenance):
    """The suite's logged run's plan, its provenance changed as another source's would read."""
    from pipeline.config.loading import load_config

    plan = plan_evaluation(logged_run.model_uri, str(logged_run.data["val"]),
                           load_config("smoke", [f"tracking.mlflow_uri={logged_run.uri}", f"run.storage_path={tmp_path}"]))
    return dataclasses.replace(plan, source=dataclasses.replace(
        plan.source, provenance=dataclasses.replace(plan.source.provenance, **provenance)))


def test_an_ema_evaluation_on_ray_workers_is_announced_and_described_as_such(logged_run, tmp_path):
    from pipeline.console import Console, active_console
    from pipeline.trained.evaluation import announce, describe

    plan = dataclasses.replace(_plan(logged_run, tmp_path, ema=True, run_id=None, experiment_id=None), workers=2)
    stream, previous = io.StringIO(), active_console()
    Console(stream=stream).activate()
    try:
        announce(plan, address_given=True)
        announce(dataclasses.replace(plan, workers=1), address_given=False)
    finally:
        previous.activate()
    assert stream.getvalue().splitlines() == [
        f"evaluating {logged_run.model_uri} (EMA weights) [mlflow_run] on {logged_run.data['val']}: 360 images, "
        "10 classes, 16 px, crop 1; 2 Ray workers (cluster)",
        f"evaluating {logged_run.model_uri} (EMA weights) [mlflow_run] on {logged_run.data['val']}: 360 images, "
        "10 classes, 16 px, crop 1; 1 Ray worker"]
    metrics = {"val_top1_ema": 12.5, "val_top5_ema": 50.0, "val_loss_ema": 2.25}
    assert describe(plan, metrics, "logged") == (
        "Evaluation of **logged** (its EMA weights) on `val.beton` (360 images, 10 classes) at 16 px, center crop 1: "
        "top-1 12.50%, top-5 50.00%, loss 2.2500.")  # no run that trained it: no link
    # a run without its experiment (or the reverse) makes no link either: it would open no page
    for half in ({"run_id": "r1", "experiment_id": None}, {"run_id": None, "experiment_id": "7"}):
        half_known = dataclasses.replace(_plan(logged_run, tmp_path, ema=True, **half), workers=2)
        assert "trained by" not in describe(half_known, metrics, "logged"), half


def test_a_source_that_names_no_store_is_recorded_in_the_configs_store_and_experiment(logged_run, tmp_path):
    """A downloaded MLflow model directory knows its run but not its store: the evaluation goes to the
    config's tracking URI and experiment."""
    import mlflow

    from pipeline.config.loading import load_config

    location = MlflowClient(logged_run.uri).get_logged_model(logged_run.model_id).artifact_location
    directory = mlflow.artifacts.download_artifacts(artifact_uri=location, dst_path=str(tmp_path / "model"))
    store = f"sqlite:///{tmp_path}/other.db"
    plan = plan_evaluation(directory, str(logged_run.data["val"]),
                           load_config("smoke", [f"tracking.mlflow_uri={store}", "tracking.experiment=evaluations",
                                                 f"run.storage_path={tmp_path}"]))
    assert plan.source.provenance.kind == "mlflow_model_dir" and plan.source.provenance.tracking_uri is None
    assert plan.tracking_uri == store and plan.experiment == "evaluations"

    # a card that records no preprocessing (written before cards did): the config's crop, mean and std, at
    # the model's own size
    mlmodel = Path(directory) / "MLmodel"
    document = yaml.safe_load(mlmodel.read_text())
    del document["metadata"]["vitsweep"]["preprocessing"]
    mlmodel.write_text(yaml.safe_dump(document))
    plan = plan_evaluation(directory, str(logged_run.data["val"]),
                           load_config("smoke", [f"tracking.mlflow_uri={store}", f"run.storage_path={tmp_path}",
                                                 "data.val_crop_ratio=0.5", "data.mean=[0.1, 0.2, 0.3]",
                                                 "data.std=[0.4, 0.5, 0.6]"]))
    pre = plan.preprocessing
    assert (pre.img_size, pre.crop_ratio, tuple(pre.mean), tuple(pre.std)) == (16, 0.5, (0.1, 0.2, 0.3), (0.4, 0.5, 0.6))


def test_a_registered_sources_entry_is_among_the_evaluations_params(logged_run, tmp_path):
    from pipeline.trained.evaluation import evaluation_params

    plan = _plan(logged_run, tmp_path, kind="registered_model", registered_name="digits", registered_version="3",
                 registered_alias="champion", run_id=None, model_id=None)
    params = evaluation_params(dataclasses.replace(plan, workers=2))
    assert {key: params[key] for key in params if key.startswith("source.")} == {
        "source.kind": "registered_model", "source.location": plan.source.provenance.location,
        "source.registered_name": "digits", "source.registered_version": "3", "source.registered_alias": "champion"}
    assert params["workers"] == 2


def test_an_evaluation_goes_to_its_sources_experiment_where_mlflow_knows_it(tmp_path):
    from pipeline.trained.evaluation import _experiment

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    pretraining = MlflowStore(uri).create_run("pretraining", "digits-pretrained").get().info.experiment_id
    assert _experiment(uri, Provenance("digits-pretrained", "run_name", "/x", experiment_id=pretraining)) == "pretraining"
    assert _experiment(uri, Provenance("weights.safetensors", "safetensors", "/x")) is None  # a file: the config's


def test_an_evaluation_of_a_file_is_recorded_with_its_log_and_without_links_it_lacks(logged_run, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    plan = dataclasses.replace(_plan(logged_run, tmp_path, kind="safetensors", given=str(tmp_path / "best.safetensors"),
                                     run_id=None, model_id=None, experiment_id=None), tracking_uri=uri)
    log = tmp_path / "vitsweep.log"
    log.write_text("what the libraries said\n")
    evaluation = Evaluation({"val_top1": 50.0, "val_top5": 90.0, "val_loss": 1.5}, np.eye(10, dtype=np.int64),
                            np.arange(10), np.arange(10), np.full(10, 0.5))
    recorded = record_evaluation(plan, evaluation, log_file=log)
    client = MlflowClient(uri)
    run = client.get_run(recorded.run_id)
    assert (recorded.tracking_uri, recorded.experiment_id, recorded.run_name) == (
        uri, run.info.experiment_id, "eval best.safetensors on val")
    assert run.info.run_name == "eval best.safetensors on val" and run.info.status == "FINISHED"
    assert SOURCE_RUN_TAG not in run.data.tags and SOURCE_MODEL_TAG not in run.data.tags
    assert not run.inputs.model_inputs
    assert "vitsweep.log" in {a.path for a in client.list_artifacts(recorded.run_id)}
    gone = record_evaluation(plan, evaluation, log_file=tmp_path / "no-such.log")  # a log that is not there: no artifact
    assert "no-such.log" not in {a.path for a in client.list_artifacts(gone.run_id)}


def test_the_evaluation_of_a_model_from_another_experiment_is_planned_in_that_experiment(logged_run, tmp_path):
    from carded_models import log_carded
    from pipeline.config.loading import load_config

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    model_uri = log_carded(uri, tmp_path, carded_smoke_model(10, seed=1), [f"digit {i}" for i in range(10)],
                           experiment="pretraining")
    plan = plan_evaluation(model_uri, str(logged_run.data["val"]),
                           load_config("smoke", [f"tracking.mlflow_uri={uri}", f"run.storage_path={tmp_path}"]))
    assert plan.experiment == "pretraining" and plan.tracking_uri == uri  # not the config's "vitsweep"


def test_the_confusion_plots_title_names_the_model_its_ema_the_data_and_the_top1():
    from pipeline.trained.evaluation import confusion_title

    assert confusion_title("digits16", True, "val.beton", 93.456) == "digits16 (EMA) on val.beton: top-1 93.46%"
    assert confusion_title("digits16", False, "val.beton", 50.0) == "digits16 on val.beton: top-1 50.00%"
