"""MLflow's UI (3.17, a real `mlflow server` on loopback) in headless Chromium, opened by the links
vitsweep gives: a training run and a sweep's trials read as model-training runs (the runs table, not
the GenAI "Overview"), with the sweep's knobs as columns and on the compare page; a fine-tuned trial's
page leads to the model it started from, and that model's page to the run that trained it.

The store is what README's "Fine-tuning" commands leave (``conftest.readme_finetuning``): a 2-epoch
smoke run and a 2-trial fine-tuning sweep from it.

The screenshots go to $VITSWEEP_UI_SCREENSHOTS when set (`make ui-screenshots` refreshes the README's
tests/ui_screenshots/), else to the test's temp dir."""
import os
import re
from pathlib import Path

import pytest
from mlflow import MlflowClient

from conftest import mlflow_server
from pipeline.tracking import ui_compare_link, ui_link
from webdriver import NO_ASSISTANT_PANEL, Browser

pytestmark = pytest.mark.slow

PRETRAINED = "digits16"  # the README's pre-training run
PRINTED_LINK = re.compile(r"then open: (http://127\.0\.0\.1:5000/\S+)")  # what a local store's command prints


@pytest.fixture(scope="module")
def store(readme_finetuning) -> tuple[Path, dict[str, str]]:
    """The README's fine-tuning store and the UI links its two commands printed."""
    storage, (pretrain, sweep) = readme_finetuning
    links = {"demo": PRINTED_LINK.search(pretrain.stdout).group(1), "sweep": PRINTED_LINK.search(sweep.stdout).group(1)}
    return storage, links


@pytest.fixture(scope="module")
def server(store) -> str:
    """`mlflow server` on a free loopback port over the store."""
    store, _ = store
    with mlflow_server(store / "mlflow-server.log", "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}") as uri:
        yield uri


@pytest.fixture(scope="module")
def runs(store):
    """The demo run, the sweep's parent and its trials, and their experiment id."""
    store, _ = store
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("vitsweep").experiment_id
    found = client.search_runs([experiment])
    role = lambda run: run.data.tags.get("vitsweep.role")  # noqa: E731
    [demo] = [run for run in found if run.info.run_name == PRETRAINED]
    [sweep] = [run for run in found if role(run) == "sweep"]
    trials = [run for run in found if role(run) == "trial"]
    assert len(trials) == 2
    return experiment, demo, sweep, trials


@pytest.fixture
def screenshots(tmp_path) -> Path:
    return Path(os.environ.get("VITSWEEP_UI_SCREENSHOTS") or tmp_path)


@pytest.fixture
def browser(server):
    """Chromium as a visitor who has dismissed the MLflow Assistant panel; nothing else is preset, so
    the model-training mode must come from the link."""
    with Browser(width=1400, height=900) as chromium:
        chromium.seed_local_storage(server, NO_ASSISTANT_PANEL)
        yield chromium


def _printed(store, which: str, server: str) -> str:
    """The link the command printed, on this test's server instead of `mlflow ui`'s default address."""
    return store[1][which].replace("http://127.0.0.1:5000", server)


def test_the_link_a_training_run_prints_opens_its_page_as_a_model_training_run(server, store, runs, browser,
                                                                               screenshots):
    _, demo, _, _ = runs
    link = _printed(store, "demo", server)
    assert link == ui_link(server, runs[0], run_id=demo.info.run_id)
    browser.open(link)
    browser.wait_for_text("Overview", "Parameters", "val_top1")
    browser.screenshot(screenshots / "demo_run.png")
    facts = browser.facts()
    assert facts["heading"] == PRETRAINED
    assert "Model registry" in facts["text"]  # the model-training sidebar
    assert "Observability" not in facts["text"]  # GenAI's sidebar


def test_the_link_a_sweep_prints_opens_its_runs_table_with_a_column_per_knob(server, store, runs, browser,
                                                                             screenshots):
    _, _, sweep, _ = runs
    browser.open(_printed(store, "sweep", server))
    browser.wait_for_text(sweep.info.run_name, "val_top1")
    browser.screenshot(screenshots / "sweep_runs.png")
    facts = browser.facts(every_column=True)
    assert facts["heading"] == "Runs" and "Parameters" in facts["column_groups"]  # not GenAI's "Overview"
    assert {"params.`lr`", "params.`layer_decay`", "metrics.`val_top1`", "metrics.`epochs_trained`"} <= set(
        facts["columns"])


def test_the_compare_link_of_a_sweeps_trials_compares_them_by_their_knob(server, runs, browser, screenshots):
    experiment, _, _, trials = runs
    browser.open(ui_compare_link(server, experiment, [run.info.run_id for run in trials]))
    browser.wait_for_text("Comparing 2 Runs", "Parallel Coordinates Plot")
    browser.screenshot(screenshots / "sweep_compare.png")
    text = browser.facts()["text"]
    decays = {run.data.params["optim.layer_decay"] for run in trials}
    assert "optim.layer_decay" in text and decays <= set(text.split()), decays


LINKS_TO_JS = "return [...document.querySelectorAll('a[href]')].map(a => a.href).filter(h => h.includes(arguments[0]))"


def test_a_fine_tuned_trials_page_leads_to_the_model_it_started_from_and_on_to_the_run_that_trained_it(
        server, runs, browser, screenshots):
    experiment, source, _, trials = runs
    [source_model] = source.outputs.model_outputs
    trial = min(trials, key=lambda run: run.info.run_name)
    browser.open(ui_link(server, experiment, run_id=trial.info.run_id))
    browser.wait_for_text(trial.info.run_name, "Logged models")
    browser.screenshot(screenshots / "finetuned_run.png")
    [to_model, *_] = browser.script(LINKS_TO_JS, f"/models/{source_model.model_id}")  # the run's input, linked
    browser.open(to_model)
    browser.wait_for_text(source_model.model_id, "Source run", PRETRAINED)
    browser.screenshot(screenshots / "source_model.png")
    assert browser.script(LINKS_TO_JS, f"/runs/{source.info.run_id}")  # the model's page links its training run
