"""MLflow's UI (3.17, a real `mlflow server` on loopback) in headless Chromium, opened by the links
vitsweep gives: a training run and a sweep's trials read as model-training runs (the runs table, not
the GenAI "Overview"), with the sweep's knobs as columns and on the compare page; the logged model's
page lists its evaluations (`vitsweep evaluate`) with their dataset, and its registered version.

The screenshots go to $VITSWEEP_UI_SCREENSHOTS when set (`make ui-screenshots` refreshes the README's
tests/ui_screenshots/), else to the test's temp dir."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from conftest import free_port, vitsweep_env, wait_for
from pipeline.tracking import ui_compare_link, ui_link
from webdriver import NO_ASSISTANT_PANEL, Browser

pytestmark = pytest.mark.slow

MLFLOW = str(Path(sys.executable).parent / "mlflow")
TRAINING_RUN = "xcit-digits"  # README "After training"'s run
PRINTED_LINK = re.compile(r"then open: (http://127\.0\.0\.1:5000/\S+)")  # what a local store's command prints


@pytest.fixture(scope="module")
def store(after_training) -> tuple[Path, dict[str, str]]:
    """What a user has after README "After training" and a small sweep: a 2-epoch training run, its
    evaluations and registered model, a 2-trial grid over the QKV embedding (kept small: 2 cores); and
    the UI links the training run and the sweep printed."""
    train = after_training.command("vitsweep train")
    links = {"demo": PRINTED_LINK.search(train.stdout).group(1),
             "sweep": PRINTED_LINK.search(after_training.sweep.stdout).group(1)}
    return after_training.storage, links


@pytest.fixture(scope="module")
def server(store) -> str:
    """`mlflow server` on a free loopback port over the store, stopped (its whole process group) after."""
    store, _ = store
    port = free_port()
    log = (store / "mlflow-server.log").open("w")
    process = subprocess.Popen(
        [MLFLOW, "server", "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, env=vitsweep_env(), start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(uri, process)
        yield uri
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # its worker processes may ignore SIGTERM while busy
            pass
        with contextlib.suppress(ProcessLookupError):  # whatever of its own group is left
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        log.close()


def _wait_until_healthy(uri: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    def healthy() -> bool:
        assert process.poll() is None, f"mlflow server exited with {process.returncode}"
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    wait_for(healthy, timeout, f"mlflow server at {uri} to answer /health")


@pytest.fixture(scope="module")
def runs(store):
    """The demo run, the sweep's parent and its trials, and their experiment id."""
    store, _ = store
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("vitsweep").experiment_id
    found = client.search_runs([experiment])
    role = lambda run: run.data.tags.get("vitsweep.role")  # noqa: E731
    [demo] = [run for run in found if run.info.run_name == TRAINING_RUN]
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
    assert facts["heading"] == TRAINING_RUN
    assert "Model registry" in facts["text"]  # the model-training sidebar
    assert "Observability" not in facts["text"]  # GenAI's sidebar


def test_the_link_a_sweep_prints_opens_its_runs_table_with_a_column_per_knob(server, store, runs, browser,
                                                                             screenshots):
    browser.open(_printed(store, "sweep", server))
    browser.wait_for_text("qkv-sweep", "val_top1")
    browser.screenshot(screenshots / "sweep_runs.png")
    facts = browser.facts(every_column=True)
    assert facts["heading"] == "Runs" and "Parameters" in facts["column_groups"]  # not GenAI's "Overview"
    assert {"params.`qkv`", "metrics.`val_top1`", "metrics.`epochs_trained`"} <= set(facts["columns"])


def test_the_compare_link_of_a_sweeps_trials_compares_them_by_their_knob(server, runs, browser, screenshots):
    experiment, _, _, trials = runs
    browser.open(ui_compare_link(server, experiment, [run.info.run_id for run in trials]))
    browser.wait_for_text("Comparing 2 Runs", "Parallel Coordinates Plot")
    browser.screenshot(screenshots / "sweep_compare.png")
    text = browser.facts()["text"]
    assert "model.args.qkv" in text and {"linear", "sne"} <= set(text.split())


def test_the_logged_models_page_lists_its_evaluations_on_their_dataset(server, runs, store, browser, screenshots):
    experiment, demo, _, _ = runs
    client = MlflowClient(f"sqlite:///{store[0] / 'mlflow.db'}")
    (output,) = client.get_run(demo.info.run_id).outputs.model_outputs
    evaluations = client.search_runs([experiment], "tags.`vitsweep.role` = 'evaluation'")
    assert {run.data.tags["vitsweep.source_model_id"] for run in evaluations} == {output.model_id}
    browser.open(f"{server}/#/experiments/{experiment}/models/{output.model_id}?workflowType=machine_learning")
    browser.wait_for_text("digits_16_val.beton", "val_top1_ema", "digits-classifier")
    browser.screenshot(screenshots / "model_page.png")
    text = browser.facts()["text"]
    assert {run.info.run_name for run in evaluations} <= set(text.splitlines())  # each evaluation, by its run
    assert "val_top1" in text and "digits-classifier" in text  # the registered model it is a version of
