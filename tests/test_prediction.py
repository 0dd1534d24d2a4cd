"""`vitsweep predict`: the top-K class names and probabilities of image files, as the model's validation
would see them; an unreadable file is named and skipped, exit 1 when none could be classified, and bad
input (a missing source, a folder without images, a top-k the model cannot give) is exit 2. Agreement
with `vitsweep evaluate` on a trained run's validation images: tests/test_after_training.py."""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from carded_models import CARD_CROP, card_probabilities, carded_smoke_model, log_in_new_store
from conftest import DIGITS
from pipeline.cli import EXIT_FAILURE, EXIT_INVALID_INPUT, main
from pipeline.components.model_card import EvalPreprocessing, ModelCard
from pipeline.components.modeling import build_model
from pipeline.config.loading import load_config
from pipeline.errors import InvalidInputError
from pipeline.trained.model_source import ModelSource, Provenance
from pipeline.trained.prediction import ImageClassifier


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """A folder of three PNGs of different sizes (one in a sub-folder) and a text file."""
    root = tmp_path_factory.mktemp("images")
    (root / "more").mkdir()
    paths = [root / "a.png", root / "b.png", root / "more" / "c.png"]
    for seed, (path, size) in enumerate(zip(paths, [(16, 16), (40, 24), (9, 13)])):
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8)).save(path)
    (root / "README.txt").write_text("not an image")
    return root


def _predict(logged_run, *args: str) -> int:
    return main(["predict", logged_run.model_uri, *args, "--set", f"tracking.mlflow_uri={logged_run.uri}"])


def test_a_folder_is_classified_recursively_with_the_models_class_names(logged_run, images, capsys):
    assert _predict(logged_run, str(images), "--topk", "3", "--json") == 0
    found = json.loads(capsys.readouterr().out)
    assert [entry["image"] for entry in found] == [str(images / "a.png"), str(images / "b.png"),
                                                   str(images / "more" / "c.png")]  # README.txt: not by its suffix
    # the values themselves against a hand-computed oracle: test_predict_crops_and_normalises_as_the_models_card_says
    for entry in found:
        assert len(entry["labels"]) == len(set(entry["labels"])) == 3 and set(entry["labels"]) <= set(DIGITS)
        assert entry["probabilities"] == sorted(entry["probabilities"], reverse=True)
        assert 0 < sum(entry["probabilities"]) <= 1 + 1e-6


def test_files_and_folders_given_together_are_classified_in_the_order_given(logged_run, images, capsys):
    assert _predict(logged_run, str(images / "b.png"), str(images / "more"), str(images / "a.png"), "--json") == 0
    assert [entry["image"] for entry in json.loads(capsys.readouterr().out)] == [
        str(images / "b.png"), str(images / "more" / "c.png"), str(images / "a.png")]


def test_the_plain_output_is_one_line_per_image(logged_run, images, capsys):
    assert _predict(logged_run, str(images / "a.png"), "--topk", "2") == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"{images / 'a.png'}: digit ") and line.count("%") == 2


def test_an_unreadable_file_is_named_and_skipped_and_the_rest_classified(logged_run, images, capsys):
    assert _predict(logged_run, str(images / "README.txt"), str(images / "a.png"), "--json") == 0
    captured = capsys.readouterr()
    assert [entry["image"] for entry in json.loads(captured.out)] == [str(images / "a.png")]
    assert f"'{images / 'README.txt'}' is not a readable image" in captured.err and "skipped" in captured.err


def test_an_image_too_small_for_its_center_crop_is_named_and_skipped_and_the_rest_classified(images, tmp_path,
                                                                                              capsys):
    uri, model_uri = log_in_new_store(tmp_path, carded_smoke_model(len(DIGITS), seed=1), DIGITS)
    assert int(CARD_CROP * 1) == 0  # ffcv's crop side of a 1-px-wide image at the card's ratio: under a pixel
    Image.fromarray(np.zeros((40, 1, 3), np.uint8)).save(tmp_path / "sliver.png")
    assert main(["predict", model_uri, str(tmp_path / "sliver.png"), str(images / "a.png"), "--json",
                 "--set", f"tracking.mlflow_uri={uri}"]) == 0
    captured = capsys.readouterr()
    assert [entry["image"] for entry in json.loads(captured.out)] == [str(images / "a.png")]
    assert (f"'{tmp_path / 'sliver.png'}' is 1x40 px: too small for a center crop at ratio {CARD_CROP}; skipped"
            in captured.err)


def test_no_readable_image_at_all_exits_1(logged_run, images, capsys):
    assert _predict(logged_run, str(images / "README.txt")) == EXIT_FAILURE
    assert "none of the 1 file(s) is a readable image" in capsys.readouterr().err


@pytest.mark.parametrize("given, message", [
    ("empty", "directory '{root}/empty' holds no image files (none named *.png, *.jpg, *.jpeg, *.webp, ... under it)"),
    ("missing.png", "image '{root}/missing.png' does not exist"),
    ("pipe.png", "image '{root}/pipe.png' is a named pipe (FIFO), not an image file"),
    ("loop.png", "image '{root}/loop.png' is a symbolic link that loops, not an image file"),
])
def test_a_folder_without_images_or_a_missing_file_is_bad_input(logged_run, tmp_path, capsys, given, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no image here")
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "loop.png").symlink_to("loop.png")
    assert _predict(logged_run, str(tmp_path / given)) == EXIT_INVALID_INPUT
    assert message.format(root=tmp_path) in capsys.readouterr().err


@pytest.mark.parametrize("topk", [0, 11])
def test_a_topk_outside_one_to_the_class_count_is_bad_input(logged_run, images, capsys, topk):
    assert _predict(logged_run, str(images), "--topk", str(topk)) == EXIT_INVALID_INPUT
    assert f"top-k {topk}: the model has 10 classes; give 1..10" in capsys.readouterr().err


def test_topk_one_gives_each_image_its_most_probable_class_alone(logged_run, images, capsys):
    assert _predict(logged_run, str(images / "a.png"), "--topk", "1", "--json") == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert len(entry["labels"]) == len(entry["probabilities"]) == 1


def test_a_model_without_class_names_labels_each_class_by_its_index():
    card = ModelCard.of_run(load_config("smoke"), 10)  # a dataset whose sidecar names no classes
    assert card.class_names is None
    classifier = ImageClassifier(carded_smoke_model(10, seed=2), card, card.preprocessing)
    (found,) = classifier.classify([np.zeros((16, 16, 3), np.uint8)], topk=10)
    assert found.labels == tuple(str(index) for index in found.classes)
    assert sorted(found.classes) == list(range(10))


def _source(card: ModelCard, seed: int = 3) -> ModelSource:
    torch.manual_seed(seed)
    weights = build_model(card.model, card.num_classes).state_dict()
    return ModelSource(weights, card, Provenance(given="model.safetensors", kind="safetensors", location="model.safetensors"))


VIT = ["model.name=vit_mini_p4", "model.args={depth: 1, embed_dim: 40, num_heads: 4}"]


def test_a_classifier_at_another_size_builds_its_model_at_that_size_and_refuses_where_the_weights_cannot_go():
    at_32 = EvalPreprocessing(img_size=32, crop_ratio=1.0, mean=(0.5,) * 3, std=(0.5,) * 3)
    xcit = ImageClassifier.of(_source(ModelCard.of_run(load_config("smoke"), 10)), at_32)
    assert xcit.model.patch_embed.img_size == (32, 32)  # XCiT's Fourier encoding: the same weights at any grid
    assert len(xcit.classify([np.zeros((32, 32, 3), np.uint8)])) == 1
    vit = _source(ModelCard.of_run(load_config("smoke", VIT), 10))
    assert ImageClassifier.of(vit).model.pos_embed.shape[1] == (16 // 4) ** 2 + 1  # the card's 16 px, patch 4
    with pytest.raises(InvalidInputError, match=r"at img_size 32 \(trained at 16\)"):
        ImageClassifier.of(vit, at_32)  # a learned position embedding of a 4x4 grid, not of 8x8


def test_a_source_whose_card_does_not_say_how_it_was_evaluated_needs_the_preprocessing_given():
    card = ModelCard.of_run(load_config("smoke"), 10).model_copy(update={"preprocessing": None})
    with pytest.raises(InvalidInputError) as refused:
        ImageClassifier.of(_source(card))
    assert str(refused.value) == ("model source 'model.safetensors' does not record how it was evaluated (a checkpoint "
                                  "older than model cards); give the preprocessing")
    given = EvalPreprocessing(img_size=16, crop_ratio=0.5, mean=(0.1,) * 3, std=(0.2,) * 3)
    assert ImageClassifier.of(_source(card), given).preprocessing == given


def test_a_missing_source_is_bad_input(tmp_path, images, capsys):
    assert main(["predict", "no-such-run", str(images), "--set", f"run.storage_path={tmp_path}"]) == EXIT_INVALID_INPUT
    assert "model source 'no-such-run' does not exist" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# -- the model card's preprocessing, against an oracle computed by hand ----------------------------------

@pytest.fixture(scope="module")
def carded_model(tmp_path_factory):
    """A logged smoke model whose card evaluates 16 px at a 0.5 crop with its own mean and std."""
    model = carded_smoke_model(len(DIGITS), seed=1)
    uri, source = log_in_new_store(tmp_path_factory.mktemp("carded"), model, DIGITS)
    return source, uri, model


def test_predict_crops_and_normalises_as_the_models_card_says(carded_model, tmp_path, capsys):
    source, uri, model = carded_model
    pixels = np.random.default_rng(7).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "photo.png")
    assert main(["predict", source, str(tmp_path / "photo.png"), "--topk", "10", "--json",
                 "--set", f"tracking.mlflow_uri={uri}"]) == 0
    (found,) = json.loads(capsys.readouterr().out)
    probabilities = card_probabilities(model, pixels[None])[0].numpy()
    expected = {DIGITS[index]: probabilities[index] for index in np.argsort(-probabilities)}
    assert found["labels"] == list(expected)
    assert found["probabilities"] == pytest.approx(list(expected.values()), abs=1e-5)
