"""README's "Fine-tuning" commands end to end (``conftest.readme_finetuning``, the store the MLflow UI check
browses too): a pre-training run, then a sweep whose trials start from it. Each trial first evaluates the
weights it loaded, before any step, at the source's own accuracy; it records where they came from and
takes the source's logged model as its input; the sweep saved the source once for all its trials; in
MLflow's UI a fine-tuned trial's page leads to the model it started from, and that model's page to the run
that trained it."""
import json
import math

import pytest
from mlflow.tracking import MlflowClient

from conftest import wait_for
from pipeline.tracking.ui import ui_link
from pipeline.trained.transfer import PLAN_ARTIFACT, SWEEP_SOURCES

pytestmark = pytest.mark.slow

PRETRAINED = "digits16"


@pytest.fixture(scope="module")
def runs(readme_finetuning):
    storage, _ = readme_finetuning
    client = MlflowClient(f"sqlite:///{storage / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("vitsweep").experiment_id
    found = client.search_runs([experiment])
    [source] = [run for run in found if run.info.run_name == PRETRAINED]
    # the store's only sweep over this space (the MLflow UI check adds README "A first sweep" to it)
    [sweep] = [run for run in found if run.data.tags.get("vitsweep.role") == "sweep"
               and run.info.run_name.startswith("finetune_lr_layer_decay-")]
    trials = [run for run in found if run.data.tags.get("mlflow.parentRunId") == sweep.info.run_id]
    assert len(trials) == 2 and all(run.info.status == "FINISHED" for run in [source, *trials])
    return client, source, sweep, trials


def test_each_trial_first_evaluates_the_weights_it_loaded_at_the_source_runs_final_accuracy(runs):
    client, source, _, trials = runs
    for trial in trials:
        [initial] = client.get_metric_history(trial.info.run_id, "initial_val_top1")
        assert initial.step == 0 and initial.value == source.data.metrics["val_top1"]  # same data, resolution
        [loss] = client.get_metric_history(trial.info.run_id, "initial_val_loss")
        assert loss.value == pytest.approx(source.data.metrics["val_loss"], rel=1e-5)
        assert [m.step for m in client.get_metric_history(trial.info.run_id, "val_top1")] == [1]


def test_each_trial_records_its_source_and_takes_the_source_model_as_its_input(runs):
    client, source, _, trials = runs
    [source_model] = source.outputs.model_outputs
    for trial in trials:
        tags = trial.data.tags
        assert (tags["init.source"], tags["init.kind"], tags["init.run_id"], tags["init.model_id"]) == (
            PRETRAINED, "run_name", source.info.run_id, source_model.model_id)
        assert tags["init.summary"].startswith(f"{PRETRAINED} (run {source.info.run_id}): ")
        inputs = client.get_run(trial.info.run_id).inputs.model_inputs  # search_runs leaves them out (3.17)
        assert [model.model_id for model in inputs] == [source_model.model_id]
        assert trial.data.params["model.init_from"] == PRETRAINED
        with open(client.download_artifacts(trial.info.run_id, PLAN_ARTIFACT)) as handle:
            plan = json.load(handle)
        assert not plan["reset"] and not plan["resampled"] and len(plan["loaded"]) == int(tags["init.loaded"]) > 100
        assert f"Starts from `{PRETRAINED} (run {source.info.run_id})" in tags["mlflow.note.content"]


def test_each_trial_logs_its_log_uniform_rates_log10_for_the_charts_and_the_uniform_knob_alone(runs):
    _, _, _, trials = runs
    for trial in trials:
        params = trial.data.params
        assert float(params["log10_lr"]) == pytest.approx(math.log10(float(params["lr"])), abs=1e-6)
        assert "layer_decay" in params and "log10_layer_decay" not in params  # uniform: charted as sampled


def test_the_sweep_saved_its_source_once_for_every_trial_that_starts_from_it(readme_finetuning, runs):
    storage, (_, sweep_output) = readme_finetuning
    _, _, sweep, _ = runs
    saved = list((storage / sweep.info.run_name / SWEEP_SOURCES).iterdir())
    assert len(saved) == 1 and saved[0].suffix == ".safetensors"
    assert "sweep " + sweep.info.run_name in sweep_output.stdout and "2 trials (random" in sweep_output.stdout


@pytest.fixture(scope="module")
def server(readme_store_server) -> str:
    """`mlflow server` over the README's fine-tuning store (the session's, which the MLflow UI check reads too)."""
    return readme_store_server


LINKS_TO_JS = "return [...document.querySelectorAll('a[href]')].map(a => a.href).filter(h => h.includes(arguments[0]))"


def test_a_fine_tuned_trials_page_leads_to_the_model_it_started_from_and_on_to_the_run_that_trained_it(
        server, runs, browser, screenshots):
    _, source, _, trials = runs
    [source_model] = source.outputs.model_outputs
    trial = min(trials, key=lambda run: run.info.run_name)
    browser.open(ui_link(server, source.info.experiment_id, run_id=trial.info.run_id))
    browser.wait_for_text(trial.info.run_name, "Logged models")
    # the links come with later requests than the text (the run's input models, the model's run): a page
    # whose text has settled can still lack them
    [to_model, *_] = wait_for(lambda: browser.script(LINKS_TO_JS, f"/models/{source_model.model_id}"), 60,
                              "the run page's link to its input model")
    browser.screenshot(screenshots / "finetuned_run.png")
    browser.open(to_model)
    browser.wait_for_text(source_model.model_id, "Source run", PRETRAINED)
    wait_for(lambda: browser.script(LINKS_TO_JS, f"/runs/{source.info.run_id}"), 60,
             "the model page's link to the run that trained it")
    browser.screenshot(screenshots / "source_model.png")
