"""MLflow's UI (3.17, a real `mlflow server` on loopback) in headless Chromium, opened by the links
vitsweep gives: a training run and a sweep's trials read as model-training runs (the runs table, not
the GenAI "Overview"), with the sweep's knobs as columns and on the compare page.

The training run's logged model, evaluated and registered as README "After training" does, lists on
its page the evaluation (its dataset and metrics).

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

from conftest import free_port, run_vitsweep, train_command, vitsweep_env, wait_for
from pipeline.tracking import ui_compare_link, ui_link
from test_tune_e2e import tune_command
from webdriver import NO_ASSISTANT_PANEL, Browser

pytestmark = pytest.mark.slow

MLFLOW = str(Path(sys.executable).parent / "mlflow")
PRINTED_LINK = re.compile(r"then open: (http://127\.0\.0\.1:5000/\S+)")  # what a local store's command prints


@pytest.fixture(scope="module")
def store(tmp_path_factory, digits16) -> tuple[Path, dict[str, str]]:
    """A store holding what a user has after `make demo` and a small sweep: a 2-epoch training run
    and a 2-trial grid over the QKV embedding (kept small: 2 cores); and the UI links each printed."""
    storage = tmp_path_factory.mktemp("ui-store")
    demo = run_vitsweep(train_command(storage, digits16, "optim.epochs=2", "run.name=demo"))
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    space = storage / "qkv.yaml"
    space.write_text("params:\n  model.args.qkv: {values: [linear, sne]}\n")
    sweep = run_vitsweep(tune_command(storage, digits16, space, "optim.epochs=2", "tune.name=qkv-sweep",
                                      "tune.scheduler=fifo"), timeout=1200)
    assert sweep.returncode == 0, sweep.stdout[-4000:] + sweep.stderr[-4000:]
    links = {"demo": PRINTED_LINK.search(demo.stdout).group(1), "sweep": PRINTED_LINK.search(sweep.stdout).group(1)}
    return storage, links


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
    [demo] = [run for run in found if run.info.run_name == "demo"]
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


REGISTERED = "ui-classifier"


@pytest.fixture(scope="module")
def evaluated(store, runs):
    """The training run's model evaluated on its validation set and registered, by the commands themselves
    in this process (a few seconds: no training); the evaluation's MLflow run."""
    from pipeline.cli import main
    from pipeline.evaluation import ROLE, ROLE_TAG

    storage, _ = store
    experiment, trained, _, _ = runs
    source, settings = f"runs:/{trained.info.run_id}/model", ["--set", f"run.storage_path={storage}"]
    data = storage.parent / trained.data.params["data.val"]  # a relative path is the user directory's (the store's parent)
    assert main(["evaluate", source, "--data", str(data), *settings]) == 0
    assert main(["register", source, REGISTERED, "--alias", "champion", *settings]) == 0
    client = MlflowClient(f"sqlite:///{storage / 'mlflow.db'}")
    (evaluation,) = client.search_runs([experiment], f"tags.`{ROLE_TAG}` = '{ROLE}'")
    return evaluation


def test_the_logged_models_page_lists_its_evaluation_on_its_dataset(
        server, store, runs, evaluated, browser, screenshots):
    experiment, trained, _, _ = runs
    (output,) = MlflowClient(f"sqlite:///{store[0] / 'mlflow.db'}").get_run(trained.info.run_id).outputs.model_outputs
    assert evaluated.data.tags["vitsweep.source_model_id"] == output.model_id
    data_name = Path(trained.data.params["data.val"]).name
    browser.open(f"{server}/#/experiments/{experiment}/models/{output.model_id}?workflowType=machine_learning")
    browser.wait_for_text(evaluated.info.run_name, data_name)
    browser.screenshot(screenshots / "model_page.png")
    text = browser.facts()["text"]
    assert f"{evaluated.data.metrics['val_top1']}" in text  # the evaluation's val_top1, on the model's page


def test_the_link_a_training_run_prints_opens_its_page_as_a_model_training_run(server, store, runs, browser,
                                                                               screenshots):
    _, demo, _, _ = runs
    link = _printed(store, "demo", server)
    assert link == ui_link(server, runs[0], run_id=demo.info.run_id)
    browser.open(link)
    browser.wait_for_text("Overview", "Parameters", "val_top1")
    browser.screenshot(screenshots / "demo_run.png")
    facts = browser.facts()
    assert facts["heading"] == "demo"
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
