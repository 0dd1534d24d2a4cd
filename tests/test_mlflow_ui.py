"""MLflow's UI (3.17, a real `mlflow server` on loopback) in headless Chromium, opened by the links
vitsweep gives: a training run and a sweep's trials read as model-training runs (the runs table, not
the GenAI "Overview"), with the sweep's knobs as columns and on the compare page; the sweep's chart
view drawn as its saved view configures it; its summary page on the parent run.

The store is a user's after README "Fine-tuning" (``conftest.readme_finetuning``) and then, in the same
directory, README "A first sweep" (8 random trials over the learning rate and weight decay: the sweep
browsed here) and the demo's command, each joining the session's warm Ray as README "Fine-tuning"'s do.

The training run's logged model, evaluated and registered as README "After training" does, lists on
its page the evaluation (its dataset and metrics).

The screenshots go to $VITSWEEP_UI_SCREENSHOTS when set (`make ui-screenshots` refreshes the README's
tests/ui_screenshots/), else to the test's temp dir."""
import contextlib
import io
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from mlflow import MlflowClient

from conftest import (readme_block, readme_output, readme_shell_env, run_vitsweep, train_command, untracked_by_git,
                      wait_for)
from pipeline.tracking.ui import ui_compare_link, ui_link
from webdriver import SCATTER_CHARTS_JS

pytestmark = pytest.mark.slow

PRINTED_LINK = re.compile(r"then open: (http://127\.0\.0\.1:5000/\S+)")  # what a local store's command prints
SUMMARY_LINK = re.compile(r"the sweep's result on one page: (http://127\.0\.0\.1:5000/\S+)")
# the runs page's table / chart / artifacts switch: a radio input hidden inside the label a user clicks
CHART_VIEW = "label:has(input[name=runs-view-mode][value=CHART])"
AUTOMATIC_NAME = re.compile(r"^training (xcit_nano_12_p8-\d{8}-\d{6}): ", re.M)  # `<model>-<time>`
# The demo's config (`make demo`: the default preset) on the suite's 16 px digits, 2 of its 6 epochs (its
# warmup epoch and one cosine step: 64 % and 78 % in two measurements; 3 epochs: 87.5 %). Chance is 10 %: a
# loader pairing images with the wrong labels, or a model that does not train, stays near it, far below 4x chance.
DEMO_EPOCHS, DEMO_FLOOR = 2, 40.0


@pytest.fixture(scope="module")
def first_sweep(readme_finetuning, warm_rays) -> subprocess.CompletedProcess:
    """README "A first sweep"'s command as written, in README "Fine-tuning"'s directory after its commands."""
    storage, _ = readme_finetuning
    (command,) = readme_block("## A first sweep")
    result = subprocess.run(["bash", "-c", command], cwd=storage.parent, capture_output=True, text=True,
                            env={**readme_shell_env(), **warm_rays.running().joining}, timeout=1200)
    assert result.returncode == 0, f"{command}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def store(readme_finetuning, first_sweep, warm_rays, digits16) -> tuple[Path, dict[str, str], str]:
    """A store holding what a user has after README "Fine-tuning", README "A first sweep" and the demo: the
    pre-trained run, a 2-trial sweep fine-tuning it, the 8-trial first sweep, and the demo's run (its config,
    shortened) under its automatic name; and the UI links the demo and the first sweep printed."""
    storage, _ = readme_finetuning
    sweep = first_sweep
    demo = run_vitsweep(train_command(storage, digits16, "model.img_size=16", f"optim.epochs={DEMO_EPOCHS}",
                                      config="default"), env=warm_rays.running().joining)
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    links = {"demo": PRINTED_LINK.search(demo.stdout).group(1), "sweep": PRINTED_LINK.search(sweep.stdout).group(1),
             "summary": SUMMARY_LINK.search(sweep.stdout).group(1)}
    return storage, links, AUTOMATIC_NAME.search(demo.stdout).group(1)


@pytest.fixture(scope="module")
def server(store, readme_store_server) -> str:
    """`mlflow server` over the store, once it holds the first sweep and the demo's run (the session's server of README
    "Fine-tuning"'s store, which the fine-tuning check reads too)."""
    return readme_store_server


FIRST_SWEEP_TRIALS = 8  # README "A first sweep": tune.num_samples in tune_spaces/smoke_lr_wd.yaml


@pytest.fixture(scope="module")
def runs(store):
    """The demo run, the first sweep's parent and its trials, and their experiment id."""
    storage, _, _ = store
    client = MlflowClient(f"sqlite:///{storage / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("vitsweep").experiment_id
    found = client.search_runs([experiment])
    [demo] = [run for run in found if run.info.run_name == store[2]]
    [sweep] = [run for run in found if run.data.tags.get("vitsweep.role") == "sweep"
               and run.info.run_name.startswith("smoke_lr_wd-")]
    trials = [run for run in found if run.data.tags.get("mlflow.parentRunId") == sweep.info.run_id]
    assert len(trials) == FIRST_SWEEP_TRIALS
    return experiment, demo, sweep, trials


def _printed(store, which: str, server: str) -> str:
    """The link the command printed, on this test's server instead of `mlflow ui`'s default address."""
    return store[1][which].replace("http://127.0.0.1:5000", server)


REGISTERED = "ui-classifier"


@pytest.fixture(scope="module")
def evaluated(store, runs):
    """The training run's model evaluated on its validation set and registered, by the commands themselves
    in this process (a few seconds: no training); the evaluation's MLflow run, and the UI link `register`
    printed."""
    from pipeline.cli import main
    from pipeline.trained.evaluation import ROLE, ROLE_TAG

    storage, _, _ = store
    experiment, trained, _, _ = runs
    source, settings = f"runs:/{trained.info.run_id}/model", ["--set", f"run.storage_path={storage}"]
    data = storage.parent / trained.data.params["data.val"]  # a relative path is the user directory's (the store's parent)
    assert main(["evaluate", source, "--data", str(data), *settings]) == 0
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["register", source, REGISTERED, "--alias", "champion", *settings]) == 0
    client = MlflowClient(f"sqlite:///{storage / 'mlflow.db'}")
    # the store's other evaluations (README "After training" evaluates its pre-trained run) name another source
    (evaluation,) = client.search_runs([experiment], f"tags.`{ROLE_TAG}` = '{ROLE}' and "
                                                     f"tags.`vitsweep.source_run_id` = '{trained.info.run_id}'")
    return evaluation, PRINTED_LINK.search(printed.getvalue()).group(1)


def test_the_logged_models_page_lists_its_evaluation_on_its_dataset(
        server, store, runs, evaluated, browser, screenshots):
    experiment, trained, _, _ = runs
    evaluated, _ = evaluated
    (output,) = MlflowClient(f"sqlite:///{store[0] / 'mlflow.db'}").get_run(trained.info.run_id).outputs.model_outputs
    assert evaluated.data.tags["vitsweep.source_model_id"] == output.model_id
    data_name = Path(trained.data.params["data.val"]).name
    browser.open(f"{server}/#/experiments/{experiment}/models/{output.model_id}?workflowType=machine_learning")
    browser.wait_for_text(evaluated.info.run_name, data_name)
    browser.screenshot(screenshots / "model_page.png")
    text = browser.facts()["text"]
    # the evaluation's val_top1 row: metric, dataset, source run, value (the table's columns, one line each)
    value = _as_the_ui_prints(evaluated.data.metrics["val_top1"])
    assert f"val_top1\n{data_name} (#" in text and f"\n{evaluated.info.run_name}\n{value}\n" in text


def test_the_models_tab_names_each_model_after_its_run_a_trials_after_its_trial_and_sweep(server, runs, browser,
                                                                                          screenshots):
    experiment, demo, sweep, trials = runs
    names = [demo.info.run_name, *(f"{run.data.tags['trial_id']} of {sweep.info.run_name}" for run in trials)]
    browser.open(f"{server}/#/experiments/{experiment}/models?workflowType=machine_learning")
    # "Logged from": the command as run, the demo's paths included (a LOCAL source would show its last part only)
    browser.wait_for_text("Logged from", *names, demo.data.tags["mlflow.source.name"])
    with browser.sized(1280, 800):
        browser.screenshot(screenshots / "models_tab.png")


def test_the_link_register_prints_opens_the_versions_page_in_the_model_training_view(
        server, evaluated, browser, screenshots):
    _, printed = evaluated
    browser.open(printed.replace("http://127.0.0.1:5000", server))
    browser.wait_for_text("Version 1", "champion")
    browser.screenshot(screenshots / "model_version.png")
    facts = browser.facts()
    assert REGISTERED in facts["text"] and "Model registry" in facts["text"]  # the model-training sidebar
    assert "Observability" not in facts["text"]  # GenAI's sidebar


def _as_the_ui_prints(value: float) -> str:
    """A metric as MLflow's UI shows it (JavaScript's number to text): 90.0 as "90", 87.5 as "87.5"."""
    return str(int(value)) if value.is_integer() else repr(value)


def test_the_link_a_training_run_prints_opens_its_page_as_a_model_training_run(server, store, runs, browser,
                                                                               screenshots):
    _, demo, _, _ = runs
    link = _printed(store, "demo", server)
    assert link == ui_link(server, runs[0], run_id=demo.info.run_id)
    browser.open(link)
    browser.wait_for_text("Overview", "Parameters", "val_top1")
    browser.screenshot(screenshots / "demo_run.png")
    facts = browser.facts()
    assert facts["heading"] == demo.info.run_name
    assert "Model registry" in facts["text"]  # the model-training sidebar
    assert "Observability" not in facts["text"]  # GenAI's sidebar


KNOBS = {"optim.lr_per_512": "lr_per_512", "optim.weight_decay": "weight_decay"}  # the first sweep's, and their columns
# what its charts plot: both knobs are log-uniform, so by their log10 (MLflow 3.17's charts have no log axis)
CHARTED = ("log10_lr_per_512", "log10_weight_decay")


def test_the_link_a_sweep_prints_opens_its_runs_table_with_a_column_per_knob(server, store, runs, browser,
                                                                             screenshots):
    _, _, sweep, trials = runs
    browser.open(_printed(store, "sweep", server))
    browser.wait_for_text(sweep.info.run_name, *(run.info.run_name for run in trials), "val_top1")  # the rows
    facts = browser.facts(every_column=True)
    assert facts["heading"] == "Runs" and "Parameters" in facts["column_groups"]  # not GenAI's "Overview"
    knob_columns = [f"params.`{name}`" for name in KNOBS.values()]
    assert {"metrics.`val_top1`", *knob_columns} <= set(facts["columns"])
    # on a 1280 x 800 screen (the Assistant panel open, as on a first visit): the metric and every knob in view, on
    # screen inside the table, and the best trial first
    with browser.sized(1280, 800):
        browser.screenshot(screenshots / "sweep_runs.png")
        shown = browser.facts()
    for column in ["metrics.`val_top1`", *knob_columns]:
        assert column in shown["boxes"], (column, shown["columns"])
        left, right = shown["boxes"][column]
        assert 0 <= left < right <= shown["table_right"], (column, shown["boxes"], shown["table_right"])
    best = max(run.data.metrics["val_top1"] for run in trials)
    assert any(run.info.run_name in shown["first_row"] for run in trials if run.data.metrics["val_top1"] == best)


def test_the_compare_link_of_a_sweeps_trials_compares_them_by_their_knob(server, runs, browser, screenshots):
    experiment, _, _, trials = runs
    browser.open(ui_compare_link(server, experiment, [run.info.run_id for run in trials]))
    browser.wait_for_text(f"Comparing {FIRST_SWEEP_TRIALS} Runs", "Parallel Coordinates Plot")
    browser.screenshot(screenshots / "sweep_compare.png")
    words = set(browser.facts()["text"].split())
    assert set(KNOBS) <= words
    assert {trial.data.params[key] for trial in trials for key in KNOBS} <= words  # each trial's values


def test_the_sweeps_chart_view_opens_on_its_charts_across_and_against_the_knobs_then_per_epoch(
        server, store, runs, browser, screenshots):
    _, _, sweep, trials = runs
    browser.open(_printed(store, "sweep", server))
    browser.wait_for_text(sweep.info.run_name, "val_top1")
    browser.click(CHART_VIEW)  # then nothing else: the saved view holds the charts
    # the cards below the window are drawn when scrolled to; the sections' names show their cards' counts
    browser.wait_for_text("val_top1 across the knobs\n(1)", f"val_top1 against each knob\n({len(CHARTED)})",
                          "per epoch\n(2)", "system/node0")
    browser.screenshot(screenshots / "sweep_charts.png")
    text = browser.facts()["text"]
    assert (text.index("across the knobs") < text.index("against each knob") < text.index("per epoch")
            < text.index("Model metrics") < text.index("system/node0"))
    # a 2-trial sweep has no parallel-coordinates chart (its lines would run along its frame), and says why
    (finetuning,) = MlflowClient(f"sqlite:///{store[0] / 'mlflow.db'}").search_runs(
        [runs[0]], "tags.`vitsweep.role` = 'sweep' and attributes.run_name LIKE 'finetune_lr_layer_decay-%'")
    assert "a parallel-coordinates chart needs 3 trials or more" in finetuning.data.tags["mlflow.note.content"]
    assert "parallel-coordinates chart needs" not in sweep.data.tags["mlflow.note.content"]


def test_each_knobs_scatter_shows_every_trials_point_clear_of_the_charts_toolbar(server, store, runs, browser,
                                                                                 screenshots):
    """At 1280 x 800 with the Assistant panel open (a first visit), each knob's scatter, scrolled to, with the
    pointer over it: Plotly then shows its toolbar (the modebar) over the plot's top, where the best trials sit."""
    _, _, sweep, trials = runs
    with browser.sized(1280, 800):
        browser.open(_printed(store, "sweep", server))
        browser.wait_for_text(sweep.info.run_name, "val_top1")
        browser.click(CHART_VIEW)
        browser.wait_for_text("val_top1 against each knob")
        # a card is drawn once scrolled to: the section's top, then past each scatter to the next
        browser.scroll_to(browser.element_by_xpath("//*[text()='val_top1 against each knob']"))
        for name in CHARTED:
            title = f"{name} vs. val_top1"
            chart = wait_for(lambda: _scatter_titled(browser, title), 60, f"the {name} scatter drawn")  # noqa: B023
            browser.scroll_to(chart["plot"], below_top=100)  # the whole plot on the 800-px screen
            browser.hover(chart["plot"], ".nsewdrag")
            chart = wait_for(_settled_with_its_toolbar(browser, title), 30, f"the {name} scatter's toolbar")
            if name == CHARTED[0]:
                browser.screenshot(screenshots / "sweep_scatter_toolbar.png")
            assert len(chart["markers"]) == len(trials), chart
            left, top, right, bottom = chart["area"]
            tool_left, tool_top, tool_right, tool_bottom = chart["toolbar"]
            # where Plotly puts it: a non-empty box at the plot's top, on its right
            assert tool_left < tool_right and tool_top < tool_bottom and top - 5 <= tool_top <= top + 10, chart
            assert tool_right > (left + right) / 2, chart
            for marker_left, marker_top, marker_right, marker_bottom in chart["markers"]:
                assert left <= (marker_left + marker_right) / 2 <= right and top <= (marker_top + marker_bottom) / 2 <= bottom, chart
                overlaps = (marker_left < tool_right and tool_left < marker_right
                            and marker_top < tool_bottom and tool_top < marker_bottom)
                assert not overlaps, (name, chart)
            browser.scroll_to(chart["plot"], below_top=-(chart["area"][3] - chart["area"][1]))  # past it: the next one drawn


def _scatter_titled(browser, title: str) -> dict | None:
    """The drawn scatter card titled ``title`` (``SCATTER_CHARTS_JS``'s facts), None before it is drawn."""
    return next((chart for chart in browser.script(SCATTER_CHARTS_JS) if chart["title"] == title), None)


def _settled_with_its_toolbar(browser, title: str) -> Callable[[], dict | None]:
    """A condition for ``wait_for``: the scatter titled ``title`` once its toolbar is shown and two reads in a
    row agree on every box (its layout settled, the toolbar's fade-in over)."""
    previous: list[dict | None] = [None]

    def settled() -> dict | None:
        chart, (before,) = _scatter_titled(browser, title), previous
        previous[0] = chart
        same = chart and before and all(chart[key] == before[key] for key in ("area", "markers", "toolbar"))
        return chart if same and chart["toolbar_shown"] else None

    return settled


def test_the_sweeps_summary_link_shows_its_result_on_one_page(server, store, runs, browser, screenshots):
    _, _, sweep, _ = runs
    browser.open(_printed(store, "summary", server))
    browser.wait_for_text(sweep.info.run_name, "summary.html")
    page = wait_for(lambda: browser.in_frame("iframe.mlflow-html-iframe", SUMMARY_PAGE_JS), 60, "summary.html drawn")
    browser.screenshot(screenshots / "sweep_summary.png")
    assert f"Sweep {sweep.info.run_name} (finished)" in page["text"] and sweep.data.tags["best_trial_id"] in page["text"]
    assert "knob importance for val_top1 (fANOVA over 8 configurations; shares sum to 1):" in page["text"]
    # it reads as written: the space's description ends its own sentence, and its trials trained 1 epoch
    assert ".." not in page["text"] and "1 epoch each" in page["text"] and "after 1 epoch." in page["text"]
    assert "Random search over optim.lr_per_512, optim.weight_decay (8 trials, fifo)" in page["text"]
    # the answers first (best trial, which knob mattered, what it cost), the recipe's departures after them
    text = page["text"]
    assert text.index("Best configuration") < text.index("Which knob mattered") < text.index("Recipe: closest to paper")
    assert page["images"] and all(width > 0 for width in page["images"])  # the plots, embedded and decoded


SUMMARY_PAGE_JS = """
if (!document.body || !document.body.innerText.includes('Which knob mattered')) return null;
return {text: document.body.innerText, images: [...document.images].map(image => image.naturalWidth)};
"""


def test_the_readmes_first_sweep_prints_what_the_readme_shows_and_writes_only_its_runs(first_sweep, readme_finetuning,
                                                                                       runs):
    shown = readme_output("## A first sweep")
    printed = first_sweep.stdout.splitlines()
    for started in (line for line in printed if line.endswith(": started")):  # each trial started, trained, ended
        trial = started.removesuffix(": started")
        assert f"{trial}: epoch 1/1" in first_sweep.stdout and f"{trial}: completed" in first_sweep.stdout
    assert sum(line.endswith(": started") for line in printed) == FIRST_SWEEP_TRIALS
    table_at = next(at for at, line in enumerate(printed) if re.fullmatch(r"sweep smoke_lr_wd-\d{8}-\d{6} \(finished\):", line))
    assert printed[table_at + 1].startswith(shown[1].removesuffix("…").rstrip())  # the table's head, as README cuts it
    # the knobs ranked as README shows them: in one epoch the learning rate makes the difference, weight decay has no time to
    importance_head = next(line for line in shown if line.startswith("knob importance"))
    at = printed.index(importance_head)
    ranked = lambda lines, start: [line.split()[0] for line in lines[start + 1:start + 3]]  # noqa: E731
    assert ranked(printed, at) == ranked(shown, shown.index(importance_head)) == ["lr_per_512", "weight_decay"]
    best = re.search(r"^best trial (\w+): val_top1 [\d.]+  lr_per_512=[\d.e-]+ weight_decay=[\d.e-]+\n"
                     r"  its MLflow model: models:/(m-\w+) \(", first_sweep.stdout, re.M)
    (best_run,) = [run for run in runs[3] if run.data.tags["trial_id"] == best.group(1)]
    assert best_run.outputs.model_outputs[0].model_id == best.group(2)
    assert re.search(r"then open: http://127\.0\.0\.1:5000/#/experiments/\d+/runs\?viewStateShareKey="
                     r"vitsweep-smoke_lr_wd-\d{8}-\d{6}&workflowType=machine_learning$", first_sweep.stdout, re.M)
    storage, _ = readme_finetuning
    assert untracked_by_git(storage.parent) == []  # everything it wrote is under ./vitsweep-runs (ignored)


def test_the_demo_run_is_named_automatically_and_learns_the_digits(store, runs):
    storage, _, name = store
    _, demo, _, _ = runs
    assert demo.info.run_name == name and (storage / name / "vitsweep.log").is_file()
    assert demo.data.params["model.name"] == "xcit_nano_12_p8" and demo.data.params["optim.lr"] == "0.001"
    assert demo.data.metrics["val_top1"] >= DEMO_FLOOR
