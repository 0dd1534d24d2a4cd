"""`vitsweep register`: a run's logged model becomes a version of a registered model carrying the run's
description, metrics, datasets and knobs, an alias points at it, and `models:/NAME@ALIAS` is then a model
source; the same run registered again adds no version; a sweep stands for its best trial that trained
every epoch. Bad input (names MLflow refuses, a sweep with no finished trial, a source that is no run)
is exit 2 with nothing registered. Runs are recorded as training records them, in a real sqlite store."""
import json

import pytest
import torch
from mlflow.entities import Dataset, DatasetInput
from mlflow.tracking import MlflowClient
from safetensors.torch import save_model

from pipeline.cli import EXIT_INVALID_INPUT, main
from pipeline.config.loading import load_config
from pipeline.data.sidecar import read_sidecar
from pipeline.components.model_card import ModelCard
from pipeline.trained.model_source import resolve_model_source
from pipeline.components.modeling import build_model
from pipeline.trained.serving import log_model
from pipeline.sweeps.tracking import open_child_run, open_parent_run
from pipeline.tracking.store import MlflowRun, MlflowStore
from pipeline.trained.registry import register_run
from pipeline.tracking.connection import fluent_tracking_uri
from pipeline.errors import InvalidInputError


def _register(store: str, *args: str) -> int:
    return main(["register", *args, "--set", f"tracking.mlflow_uri={store}"])


def _versions(store: str, name: str) -> list:
    return MlflowClient(store).search_model_versions(f"name = '{name}'")


def _listed_versions(logged_run) -> list[dict]:
    """The versions the logged model's page shows as its registrations (MLflow's own `register_model` tag)."""
    listed = json.loads(MlflowClient(logged_run.uri).get_logged_model(logged_run.model_id).tags["mlflow.modelVersions"])
    return [{"name": entry["name"], "version": str(entry["version"])} for entry in listed]


def test_a_run_registers_as_a_version_of_its_logged_model_with_its_metrics_and_datasets(logged_run, capsys):
    assert _register(logged_run.uri, logged_run.model_uri, "digits-model", "--alias", "champion") == 0
    assert "registered run" in capsys.readouterr().out
    (version,) = _versions(logged_run.uri, "digits-model")
    assert (version.run_id, version.source) == (logged_run.run_id, f"models:/{logged_run.model_id}")
    assert (version.tags["val_top1"], version.tags["val_loss"]) == ("12.5", "2.3")
    assert version.tags["dataset.validation"] == "val.beton"
    assert version.tags["dataset.training.sha256"] == read_sidecar(logged_run.data["train"]).sha256
    assert version.tags["run_name"] == "logged"
    # the smoke preset's model (pipeline/config/presets/smoke.yaml), each constructor argument a tag of its own
    assert {key: value for key, value in version.tags.items() if key.startswith("model.")} == {
        "model.name": "xcit_nano_12_p8", "model.img_size": "16", "model.args.depth": "2"}
    # the run's description ("**xcit_nano_12_p8**, untrained.", markdown the run page renders) in plain text:
    # the versions table shows a description as written
    assert version.description.startswith("xcit_nano_12_p8, untrained. Final: val_top1 12.5"), version.description
    assert {"name": "digits-model", "version": "1"} in _listed_versions(logged_run)
    source = resolve_model_source("models:/digits-model@champion", storage_path=".", tracking_uri=logged_run.uri)
    assert (source.provenance.model_id, source.provenance.registered_version) == (logged_run.model_id, "1")
    assert all(torch.equal(source.weights[key], value) for key, value in logged_run.model.state_dict().items())


def test_the_same_run_registered_again_adds_no_version_and_moves_the_alias(logged_run, capsys):
    for alias in ("first", "second"):
        assert _register(logged_run.uri, logged_run.model_uri, "twice", "--alias", alias) == 0
    assert "is 'twice' version 1 already: no new version" in capsys.readouterr().out
    assert len(_versions(logged_run.uri, "twice")) == 1
    model = MlflowClient(logged_run.uri).get_registered_model("twice")
    assert model.aliases == {"first": 1, "second": 1}
    assert [listed for listed in _listed_versions(logged_run) if listed["name"] == "twice"] == [
        {"name": "twice", "version": "1"}]


@pytest.fixture(scope="module")
def trained_weights(tmp_path_factory):
    cfg = load_config("smoke")
    model = build_model(cfg.model, 10).eval()
    path = tmp_path_factory.mktemp("weights") / "model.safetensors"
    save_model(model, str(path))
    return model, path, ModelCard.of_run(cfg, 10)


def _finished_runs_with_models(tmp_path, trained_weights, names: tuple[str, ...]) -> tuple[str, list[str]]:
    """A new store holding a FINISHED run per name, each with its model logged as training logs it."""
    store = f"sqlite:///{tmp_path}/mlflow.db"
    model, weights, card = trained_weights
    run_ids = []
    for name in names:
        run = MlflowStore(store).create_run("vitsweep", name)
        log_model(run, model, [weights], card, step=1)
        run.end("FINISHED", "completed")
        run_ids.append(run.run_id)
    return store, run_ids


def test_a_second_run_becomes_the_next_version_and_takes_the_alias(tmp_path, trained_weights):
    store, (first, second) = _finished_runs_with_models(tmp_path, trained_weights, ("first", "second"))
    registered = [register_run(store, run_id, "family", "best") for run_id in (first, second)]
    assert [(r.version, r.run_id, r.created) for r in registered] == [("1", first, True), ("2", second, True)]
    client = MlflowClient(store)
    assert client.get_registered_model("family").aliases == {"best": 2}
    by_version = {str(v.version): v for v in client.search_model_versions("name = 'family'")}
    assert by_version["2"].run_id == second and by_version["2"].tags["run_name"] == "second"
    assert by_version["2"].source == f"models:/{registered[1].model_id}"
    assert registered[1].uri == "models:/family@best"
    # the first run's model, registered under a second name too, lists both registrations on its page
    register_run(store, first, "sibling")
    listed = json.loads(client.get_logged_model(registered[0].model_id).tags["mlflow.modelVersions"])
    assert [(entry["name"], str(entry["version"])) for entry in listed] == [("family", "1"), ("sibling", "1")]


def test_a_name_with_quotes_registers_and_registers_again_as_the_same_version(tmp_path, trained_weights):
    """MLflow allows quotes in a registered model's name, which its search filters cannot hold."""
    store, (run_id,) = _finished_runs_with_models(tmp_path, trained_weights, ("quoted",))
    name = """Ada's "digits" model"""
    registered = [register_run(store, run_id, name, alias) for alias in ("best", "champion")]
    assert [(r.version, r.created) for r in registered] == [("1", True), ("1", False)]
    assert MlflowClient(store).get_registered_model(name).aliases == {"best": 1, "champion": 1}
    source = resolve_model_source(f"models:/{name}@champion", storage_path=".", tracking_uri=store)
    assert source.provenance.model_id == registered[0].model_id


def test_a_models_uri_registers_that_model_of_its_run_not_the_runs_own(tmp_path, trained_weights):
    store, (run_id,) = _finished_runs_with_models(tmp_path, trained_weights, ("two-models",))
    (first,) = MlflowRun(store, run_id).get().outputs.model_outputs
    model, weights, card = trained_weights
    second = log_model(MlflowRun(store, run_id), model, [weights], card, step=2)  # the run's own now
    assert _register(store, f"models:/{first.model_id}", "older") == 0
    assert _register(store, f"runs:/{run_id}/model", "newer") == 0
    assert [(v.name, v.source) for v in _versions(store, "older") + _versions(store, "newer")] == [
        ("older", f"models:/{first.model_id}"), ("newer", f"models:/{second}")]


def test_a_run_whose_model_an_older_vitsweep_named_model_registers_it(tmp_path, trained_weights):
    """Before each model was named after its run (and pointed at by the run's vitsweep.model_id tag), every
    run's model was named "model": such a run's model is still the run's own, for `register` and runs:/ID/model."""
    import mlflow

    store = f"sqlite:///{tmp_path}/mlflow.db"
    run = MlflowStore(store).create_run("vitsweep", "older")
    with fluent_tracking_uri(store), mlflow.start_run(run_id=run.run_id):
        logged = mlflow.pytorch.log_model(trained_weights[0], name="model", serialization_format="pickle",
                                          pip_requirements=["torch"])
    run.end("FINISHED", "completed")
    assert register_run(store, run.run_id, "older").model_id == logged.model_id


def test_a_run_registered_twice_outside_vitsweep_stands_for_its_first_version(tmp_path, trained_weights):
    store, (run_id,) = _finished_runs_with_models(tmp_path, trained_weights, ("twice",))
    first = register_run(store, run_id, "family")
    # a second version of the same run, made with MLflow's own client (vitsweep adds none)
    with fluent_tracking_uri(store):  # MLflow resolves a models:/ source through the process's tracking URI
        MlflowClient(store).create_model_version("family", source=f"models:/{first.model_id}", run_id=run_id)
    again = register_run(store, run_id, "family", "best")
    assert (again.version, again.created) == ("1", False)
    assert MlflowClient(store).get_registered_model("family").aliases == {"best": 1}


def test_a_versions_description_is_its_runs_in_plain_text_then_its_final_metrics_and_origin(tmp_path,
                                                                                           trained_weights):
    store, (described, bare) = _finished_runs_with_models(tmp_path, trained_weights, ("described", "bare"))
    MlflowRun(store, described).set_tags({"mlflow.note.content": "**xcit** at `optim.lr=3e-4`,\n  seed 1.",
                                          "trial_id": "t9"})  # a trial whose sweep is not recorded
    MlflowRun(store, described).log_metrics({"val_loss": 0.30001, "val_top1": 91.23456, "train_loss": 0.2}, step=3)
    # a dataset input logged by MLflow's own client, with no context and no digest tag
    MlflowClient(store).log_inputs(bare, datasets=[DatasetInput(Dataset("shared.beton", "0" * 8, "local", "{}"), [])])
    for run_id in (described, bare):
        register_run(store, run_id, "described")
    found = {v.run_id: v for v in MlflowClient(store).search_model_versions("name = 'described'")}
    assert found[bare].tags == {"dataset.dataset": "shared.beton", "run_name": "bare"}
    versions = {run_id: version.description for run_id, version in found.items()}
    assert versions[described] == ("xcit at 'optim.lr=3e-4', seed 1. Final: val_top1 91.23, val_loss 0.3, train_loss 0.2. "
                                   f"From run 'described' ({described}), trial t9 of sweep '?'.")
    assert versions[bare] == f"From run 'bare' ({bare})."


def test_a_run_without_a_logged_model_is_refused_by_registering_itself(tmp_path):
    run = MlflowStore(f"sqlite:///{tmp_path}/mlflow.db").create_run("vitsweep", "crashed")
    run.end("FAILED", "error: out of memory")
    with pytest.raises(InvalidInputError, match=rf"run 'crashed' \({run.run_id}, FAILED\) logged no model: only a run "
                                                 r"that finished \(FINISHED, its final model logged\) can be registered"):
        register_run(run.uri, run.run_id, "family")


def test_registering_checks_the_alias_itself_not_only_the_command_line(tmp_path, trained_weights):
    store, (run_id,) = _finished_runs_with_models(tmp_path, trained_weights, ("digits",))
    with pytest.raises(InvalidInputError, match="an alias of digits reads as a version number"):
        register_run(store, run_id, "family", "3")
    assert MlflowClient(store).search_registered_models() == []
    assert register_run(store, run_id, "n" * 256).created  # the longest name MLflow's schema holds


# -- sweeps --------------------------------------------------------------------------------------------


def _sweep(tmp_path, trained_weights, trials: dict[str, tuple[str, float]], metric: str = "val_top1") -> str:
    """A sweep as `vitsweep tune` leaves it: its directory's record and its MLflow parent run, with a child
    run per trial (``trial_id: (stop reason, metric)``), started in that order; trials that trained every
    epoch logged their model."""
    store = f"sqlite:///{tmp_path}/mlflow.db"
    parent = open_parent_run(store, "vitsweep", "lr-sweep")
    model, weights, card = trained_weights
    for trial_id, (reason, value) in trials.items():
        child = open_child_run(store, "vitsweep", parent.run_id, "lr-sweep", trial_id, trial_id, {"optim.lr": value})
        child.log_metrics({metric: value}, step=1)
        if reason == "completed":
            log_model(child, model, [weights], card, step=1)
        child.end("FINISHED", reason)
    parent.finish("FINISHED")
    base = load_config("smoke", [f"run.storage_path={tmp_path}", f"tune.metric={metric}"])
    record = {"name": "lr-sweep", "tracking_uri": store, "parent_run_id": parent.run_id,
              "base_config": base.model_dump(mode="json")}
    (tmp_path / "lr-sweep").mkdir()
    (tmp_path / "lr-sweep" / "vitsweep_sweep.json").write_text(json.dumps(record))
    return store


# The best trial is neither the first nor the last started (nor the newest completed), and a stopped trial
# scores higher than any completed one: only "the completed trial with the best value, by the sweep's
# mode" picks it.
COMPLETED_AROUND_THE_BEST = {"t1": ("completed", 40.0), "t2": ("completed", 70.0), "t3": ("completed", 55.0),
                             "t4": ("early_stopped: ASHA stopped it after epoch 1 of 2", 90.0),
                             "t5": ("completed", 50.0)}


def test_a_sweep_stands_for_its_best_trial_that_trained_every_epoch(tmp_path, trained_weights, capsys):
    store = _sweep(tmp_path, trained_weights, COMPLETED_AROUND_THE_BEST)
    assert main(["register", "lr-sweep", "lr-best", "--set", f"run.storage_path={tmp_path}"]) == 0
    (version,) = _versions(store, "lr-best")
    assert (version.tags["trial_id"], version.tags["sweep"], version.tags["val_top1"]) == ("t2", "lr-sweep", "70")
    assert json.loads(version.tags["knobs"]) == {"optim.lr": 70.0}
    assert "trial t2 of sweep 'lr-sweep'" in version.description
    assert not any(mark in version.description for mark in ("`", "**", "\n"))  # the versions table shows it as is
    printed = capsys.readouterr().out
    assert f"load it as: models:/lr-best/1 (MLflow store {store})" in printed
    # where to see it: the version's page in the model-training view, on the UI `mlflow ui` serves the store on
    assert (f"  see it with: mlflow ui --backend-store-uri {store}\n"
            "  then open: http://127.0.0.1:5000/#/models/lr-best/versions/1?workflowType=machine_learning\n") in printed


def test_a_min_mode_sweep_stands_for_its_lowest_trial(tmp_path, trained_weights):
    # a loss is minimised (tune.mode follows tune.metric): the lowest completed loss is t3's, in the middle
    losses = {"t1": ("completed", 2.0), "t2": ("completed", 3.0), "t3": ("completed", 0.8),
              "t4": ("early_stopped: ASHA stopped it after epoch 1 of 2", 0.1), "t5": ("completed", 1.2)}
    store = _sweep(tmp_path, trained_weights, losses, metric="val_loss")
    assert main(["register", "lr-sweep", "lr-lowest", "--set", f"run.storage_path={tmp_path}"]) == 0
    (version,) = _versions(store, "lr-lowest")
    assert version.tags["trial_id"] == "t3" and json.loads(version.tags["knobs"]) == {"optim.lr": 0.8}


def test_a_sweep_with_no_trial_that_trained_every_epoch_is_refused_naming_its_trials(tmp_path, trained_weights,
                                                                                     capsys):
    store = _sweep(tmp_path, trained_weights, {"t1": ("early_stopped: ASHA stopped it after epoch 1 of 2", 90.0),
                                               "t2": ("error: worker died", 10.0)})
    assert main(["register", str(tmp_path / "lr-sweep"), "lr-best"]) == EXIT_INVALID_INPUT
    err = capsys.readouterr().err
    assert "sweep" in err and "has no trial that trained every epoch (" in err
    assert "t1 early_stopped" in err and "t2 error" in err
    assert "register one of its trials' models instead, runs:/RUN_ID/model with a run id `vitsweep compare` lists" in err
    assert MlflowClient(store).search_registered_models() == []


# -- bad input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, alias, message", [
    ("a/b", None, "Names cannot contain '/' or ':'"),
    ("ok", "latest", "'latest' alias name (case insensitive) is reserved"),
    ("ok", "v2", "Version alias name 'v2' is reserved"),
    ("ok", "no spaces", "Names may only contain alphanumerics"),
    # what MLflow leaves to its database (SQLite keeps 300 characters; PostgreSQL refuses them) or to the reader
    ("n" * 257, None, "MLflow's registry holds names of up to 256 characters"),
    ("ok", "3", "an alias of digits reads as a version number (models:/ok/3 is version 3)"),
])
def test_names_mlflow_refuses_are_refused_before_anything_is_registered(logged_run, capsys, name, alias, message):
    before = MlflowClient(logged_run.uri).search_registered_models()
    assert _register(logged_run.uri, logged_run.model_uri, name, *(["--alias", alias] if alias else [])) == \
        EXIT_INVALID_INPUT
    refused = f"cannot register as {name!r}" + (f" with alias {alias!r}: " if alias else ": ")
    assert (refused if len(name) <= 256 else "cannot register as a 257-character name") in (err := capsys.readouterr().err)
    assert message in err
    assert MlflowClient(logged_run.uri).search_registered_models() == before


def test_a_source_that_is_no_mlflow_run_is_refused(logged_run, tmp_path, capsys):
    assert main(["register", str(logged_run.storage / "model.safetensors"), "loose-file",
                 "--set", f"tracking.mlflow_uri={logged_run.uri}"]) == EXIT_INVALID_INPUT
    assert "(safetensors) names no MLflow run: only a run's logged model can be registered" in capsys.readouterr().err


def test_a_missing_source_is_refused_naming_it(tmp_path, capsys):
    assert main(["register", "no-such-run", "x", "--set", f"run.storage_path={tmp_path}"]) == EXIT_INVALID_INPUT
    assert "model source 'no-such-run' does not exist" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_run_that_logged_no_model_is_refused(logged_run, capsys):
    unfinished = MlflowStore(logged_run.uri).create_run("vitsweep", "crashed")
    unfinished.end("FAILED", "error: out of memory")
    assert _register(logged_run.uri, f"runs:/{unfinished.run_id}/model", "x") == EXIT_INVALID_INPUT
    assert "logged no model named 'model'" in capsys.readouterr().err
