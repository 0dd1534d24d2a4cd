"""README "After training", run verbatim (the ``after_training`` fixture: after README "Fine-tuning"'s pre-training
and its sweep with `--register`, in the same directory: evaluate, register, evaluate the registered model's EMA
on 2 Ray workers, export the validation images, predict): the
evaluation of a run's own validation set gives exactly its final val_top1 (and its EMA's), prediction agrees
with evaluation image by image, the registry round-trip carries the run's metrics and dataset, and the
README's `mlflow models serve` answers its image request on loopback."""
import contextlib
import csv
import io
import json
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import (answers_200, free_port, readme_block, readme_shell_env, stop_process_group, untracked_by_git,
                      wait_for)
from warm_ray import README_SECTION as WARM_RAY_SECTION
from pipeline.cli import main
from pipeline.data.sidecar import read_sidecar

pytestmark = pytest.mark.slow

RUN, REGISTERED, VAL = "digits16", "digits-classifier", "vitsweep-runs/data/digits_16_val.beton"
AFTER_TRAINING = "## After training"
SWEEP_MODEL = "digits16-finetuned"  # what README "Fine-tuning"'s sweep registers its best trial as


@dataclass(frozen=True)
class AfterTraining:
    """A user's directory after README "Fine-tuning"'s commands (its pre-training run, the model here,
    and its 2-trial sweep, whose best trial `vitsweep tune --register` registered) and then "After
    training"'s ``vitsweep`` commands, run verbatim in it (the serving lines are run by the serving test)."""

    home: Path
    commands: dict[str, subprocess.CompletedProcess]  # each README command that ran, by its text
    sweep: subprocess.CompletedProcess
    warm_ray_sessions: list[str]  # the Ray sessions under the warm Ray's temp dir, the commands' RAY_TMPDIR

    @property
    def storage(self) -> Path:
        return self.home / "vitsweep-runs"

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.storage / 'mlflow.db'}"

    def command(self, starting: str) -> subprocess.CompletedProcess:
        """The result of the one README command that starts with ``starting``."""
        (found,) = [result for command, result in self.commands.items() if command.startswith(starting)]
        return found


@pytest.fixture(scope="module")
def after_training(readme_finetuning, warm_rays, tmp_path_factory) -> AfterTraining:
    """In the shell of README "Fine-tuning"'s commands (RAY_ADDRESS=auto: the commands that use Ray join the
    warm Ray); the warm Ray is stopped after them: the next module that joins it (`ray job submit`'s) comes after
    the fine-tuning check's, which runs no command."""
    storage, (_, sweep) = readme_finetuning
    home, env, commands = storage.parent, {**readme_shell_env(), **warm_rays.running().joining}, {}
    # each command's wall time, for whoever sizes the suite (beside, not in, the user's directory)
    timings = (tmp_path_factory.mktemp("after-training") / "commands.log").open("a", buffering=1)
    for command in [line for line in readme_block(AFTER_TRAINING) if line.startswith("vitsweep ")]:
        started = time.monotonic()
        commands[command] = subprocess.run(["bash", "-c", command], cwd=home, env=env, capture_output=True,
                                           text=True, timeout=900)
        timings.write(f"{time.monotonic() - started:7.1f} s  {command}\n")
        assert commands[command].returncode == 0, (command, commands[command].stdout[-3000:],
                                                   commands[command].stderr[-3000:])
    timings.close()
    ray_dir = Path(warm_rays.running().ray_dir) / "ray"
    sessions = sorted(path.name for path in ray_dir.glob("session_2*"))
    warm_rays.stop()
    return AfterTraining(home, commands, sweep, sessions)


@pytest.fixture(scope="module")
def store(after_training):
    """(client, the training run, its evaluations by source: plain and EMA)."""
    client = MlflowClient(after_training.uri)
    experiment = client.get_experiment_by_name("vitsweep").experiment_id
    (trained,) = client.search_runs([experiment], f"attributes.run_name = '{RUN}'")
    evaluations = client.search_runs([experiment], f"tags.`vitsweep.source_run_id` = '{trained.info.run_id}'")
    by_weights = {run.data.params["ema"]: client.get_run(run.info.run_id) for run in evaluations}
    assert set(by_weights) == {"False", "True"}
    return client, trained, by_weights


def _artifact_rows(client, run, name: str) -> list[dict[str, str]]:
    with tempfile.TemporaryDirectory() as directory:
        return list(csv.DictReader(io.StringIO(Path(client.download_artifacts(run.info.run_id, name, directory))
                                               .read_text())))


def test_every_readme_command_that_uses_ray_joined_the_warm_ray_its_shell_exported(after_training):
    """README "A warm local Ray": in the shell that ran its lines (`ray start --head`, then its `export`s),
    "Fine-tuning"'s and "After training"'s commands as written join the running Ray instead of starting their
    own: each `train`, `tune` and `evaluate` ran (with RAY_ADDRESS=auto a command joins a running Ray or fails),
    and Ray's temp dir (RAY_TMPDIR, theirs too) holds the warm Ray's session alone."""
    warm_ray = readme_block(WARM_RAY_SECTION)
    assert [line.split("#")[0].strip() for line in warm_ray if not line.startswith("ray start --head")] == [
        "export RAY_ADDRESS=auto"], warm_ray
    readme = readme_block("## Fine-tuning") + readme_block(AFTER_TRAINING)
    ray_commands = [line for line in readme if re.match(r"vitsweep (train|tune|evaluate) ", line)]
    assert len(ray_commands) == 4 and all(after_training.command(c).returncode == 0 for c in ray_commands[2:])
    assert len(after_training.warm_ray_sessions) == 1, after_training.warm_ray_sessions


def test_evaluating_a_run_on_its_own_validation_set_gives_exactly_its_final_val_top1(store, after_training):
    _, trained, evaluations = store
    evaluated = evaluations["False"].data.metrics
    assert (evaluated["val_top1"], evaluated["val_top5"]) == (trained.data.metrics["val_top1"],
                                                              trained.data.metrics["val_top5"])
    assert evaluated["val_loss"] == pytest.approx(trained.data.metrics["val_loss"], rel=1e-4)
    console = after_training.command(f"vitsweep evaluate {RUN}").stdout
    assert f"val_top1 {trained.data.metrics['val_top1']:.2f}%" in console and "per class (top-1): 0 " in console


def test_the_registered_models_ema_on_two_ray_workers_gives_exactly_the_runs_final_ema_val_top1(store):
    client, trained, evaluations = store
    ema = evaluations["True"]
    assert (ema.data.metrics["val_top1_ema"], ema.data.metrics["val_top5_ema"]) == (
        trained.data.metrics["val_top1_ema"], trained.data.metrics["val_top5_ema"])
    assert (ema.data.params["workers"], ema.data.params["source.registered_alias"]) == ("2", "champion")
    predictions = _artifact_rows(client, ema, "predictions.csv")
    assert [int(row["index"]) for row in predictions] == list(range(360))  # every sample once, in order
    labels = [int(row["label"]) for row in _artifact_rows(client, evaluations["False"], "predictions.csv")]
    assert [int(row["label"]) for row in predictions] == labels


def test_both_evaluations_are_metrics_of_the_runs_logged_model_on_the_validation_set(store):
    client, trained, evaluations = store
    (output,) = trained.outputs.model_outputs
    on_data = {(m.key, m.run_id): m for m in client.get_logged_model(output.model_id).metrics if m.dataset_name}
    assert set(on_data) == {(key, run.info.run_id) for run in evaluations.values() for key in run.data.metrics}
    assert {m.dataset_name for m in on_data.values()} == {"digits_16_val.beton"}


@pytest.fixture(scope="module")
def predicted(after_training):
    """`vitsweep predict --json` of the run on every validation image the README exported, in this process."""
    images = after_training.storage / "digit-images"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["predict", RUN, str(images), "--topk", "1", "--json",
                     "--set", f"run.storage_path={after_training.storage}"]) == 0
    return json.loads(out.getvalue())


def test_predict_agrees_with_evaluate_on_the_exported_validation_images(store, predicted, after_training):
    client, _, evaluations = store
    evaluated = _artifact_rows(client, evaluations["False"], "predictions.csv")
    assert len(predicted) == 16
    for entry in predicted:
        index, true_class = re.fullmatch(r"(\d+)_(\w+)\.png", Path(entry["image"]).name).groups()
        row = evaluated[int(index)]
        assert (row["class"], row["predicted_class"]) == (true_class, entry["labels"][0]), entry["image"]
        assert float(row["probability"]) == pytest.approx(entry["probabilities"][0], rel=1e-5)
    readme = after_training.command("vitsweep predict models:/").stdout  # the registered model: the same weights
    for entry in predicted:
        assert f"{entry['image'].removeprefix(str(after_training.home) + '/')}: {entry['labels'][0]} " in readme


def test_the_registered_version_carries_the_runs_metrics_and_datasets(store, after_training):
    client, trained, _ = store
    (found,) = client.search_model_versions(f"name = '{REGISTERED}'")
    version = client.get_model_version(REGISTERED, found.version)  # MLflow 3.17's search leaves aliases empty
    assert version.run_id == trained.info.run_id and version.aliases == ["champion"]
    assert version.tags["val_top1"] == f"{trained.data.metrics['val_top1']:.6g}"
    assert version.tags["val_top1_ema"] == f"{trained.data.metrics['val_top1_ema']:.6g}"
    val = after_training.home / VAL
    assert (version.tags["dataset.validation"], version.tags["dataset.validation.sha256"]) == (
        val.name, read_sidecar(val).sha256)
    assert "xcit_nano_12_p8" in version.description


def test_registering_the_run_again_adds_no_version(store, after_training, capsys):
    client, trained, _ = store
    assert main(["register", RUN, REGISTERED, "--set", f"run.storage_path={after_training.storage}"]) == 0
    assert f"is '{REGISTERED}' version 1 already: no new version" in capsys.readouterr().out
    assert len(client.search_model_versions(f"name = '{REGISTERED}'")) == 1


def test_the_sweep_registered_its_best_trial_and_registering_the_sweep_again_adds_no_version(store, after_training,
                                                                                            capsys):
    client = store[0]
    assert "registered run " in after_training.sweep.stdout and f"models:/{SWEEP_MODEL}@best" in \
        after_training.sweep.stdout
    (parent,) = client.search_runs([store[1].info.experiment_id], "tags.`vitsweep.role` = 'sweep' and "
                                                                  "attributes.run_name LIKE 'finetune_lr_layer_decay-%'")
    (version,) = client.search_model_versions(f"name = '{SWEEP_MODEL}'")
    assert version.run_id == parent.data.tags["best_run_id"] and version.tags["trial_id"] == parent.data.tags[
        "best_trial_id"]
    assert main(["register", parent.info.run_name, SWEEP_MODEL,
                 "--set", f"run.storage_path={after_training.storage}"]) == 0
    assert "already: no new version" in capsys.readouterr().out
    assert len(client.search_model_versions(f"name = '{SWEEP_MODEL}'")) == 1


# -- serving -----------------------------------------------------------------------------------------------


def _readme_line(starting: str, port: int) -> str:
    (line,) = [line for line in readme_block(AFTER_TRAINING) if re.match(rf"(\S+=\S+\s+)*{re.escape(starting)}", line)]
    return line.replace("5001", str(port))  # the README's port aside: this machine may be serving on it


@pytest.fixture(scope="module")
def served(after_training, tmp_path_factory):
    """README's `mlflow models serve` line, on a free loopback port, stopped (its process group) after."""
    port = free_port()
    command = _readme_line("mlflow models serve", port).removesuffix("&").strip()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = log_path.open("w")
    process = subprocess.Popen(["bash", "-c", command], cwd=after_training.home, env=readme_shell_env(), stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)

    def answers() -> bool:
        assert process.poll() is None, log_path.read_text()[-3000:]
        return answers_200(f"http://127.0.0.1:{port}/ping")

    try:
        wait_for(answers, 300, f"`mlflow models serve` on port {port}")
        yield port
    finally:
        stop_process_group(process)
        log.close()


def test_mlflow_models_serve_answers_the_readmes_image_request_as_predict_does(served, predicted, after_training):
    curl = subprocess.run(["bash", "-c", _readme_line("curl", served)], cwd=after_training.home,
                          env=readme_shell_env(), capture_output=True, text=True, timeout=300)
    assert curl.returncode == 0, curl.stderr
    (answer,) = json.loads(curl.stdout)["predictions"]
    assert len(answer["labels"]) == len(answer["probabilities"]) == len(answer["classes"]) == 3
    (first,) = [entry for entry in predicted if Path(entry["image"]).name.startswith("000_")]
    assert answer["labels"][0] == first["labels"][0]
    assert answer["probabilities"][0] == pytest.approx(first["probabilities"][0], rel=1e-5)


def test_a_served_request_with_an_unreadable_image_is_a_400_naming_it(served):
    body = json.dumps({"dataframe_split": {"columns": ["image"], "data": [["bm90IGFuIGltYWdl"]]}}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{served}/invocations", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code == 400 and "row 0 is not a readable image" in err.value.read().decode()


def test_the_readmes_commands_leave_nothing_for_git_but_what_the_project_ignores(after_training, served):
    """Every file README "Fine-tuning"'s and "After training"'s commands wrote (runs, store, datasets, the
    exported images), served and requested as written, lies under a path the project's .gitignore ignores
    (``vitsweep-runs/``): `git status` in a clone shows nothing new."""
    subprocess.run(["bash", "-c", _readme_line("curl", served)], cwd=after_training.home, env=readme_shell_env(),
                   capture_output=True, timeout=300, check=True)
    assert untracked_by_git(after_training.home) == []
    assert (after_training.storage / "digit-images").is_dir() and (after_training.home / ".gitignore").is_file()
