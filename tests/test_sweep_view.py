"""The sweep's saved view: the runs table and the chart view's cards, as MLflow 3.17's UI reads them
(the browser check, tests/test_mlflow_ui.py, shows them drawn)."""
import json

import numpy as np
import pytest
from mlflow.utils.validation import MAX_EXPERIMENT_TAG_VAL_LENGTH

from pipeline.sweeps.spaces import available_spaces, load_space, load_spaces
from pipeline.sweeps.trial import knob_params
from pipeline.sweeps.view import MODEL_METRICS, sweep_view


def _cards(state: dict, kind: str) -> list[dict]:
    return [card for card in state["compareRunCharts"] if card["type"] == kind]


def _section(state: dict, card: dict) -> str:
    return {s["uuid"]: s["name"] for s in state["compareRunSections"]}[card["metricSectionId"]]


def test_the_parallel_coordinates_chart_runs_from_every_knob_into_the_metric():
    state = sweep_view(load_space("fsne_code_size"), "val_top1", "max", "parent", trials=8)
    (parallel,) = _cards(state, "PARALLEL")
    assert parallel["selectedParams"] == ["code_size", "match_baseline_params"] and parallel["selectedMetrics"] == ["val_top1"]
    assert parallel["showAllRuns"] and parallel["runsCountToCompare"] == 8
    assert _section(state, parallel) == "val_top1 across the knobs"
    assert state["compareRunSections"][0]["columns"] == 1  # the page's width: one axis per knob


MLFLOW_CARD_HEIGHT = 360  # MLflow 3.17's chart card height where a section sets none (its UI bundle: `cardHeight ?? 360`)


def test_each_knobs_scatter_has_a_row_of_its_own_taller_than_the_uis_cards():
    # the browser check (test_mlflow_ui) shows why: from this height Plotly's toolbar covers no point
    state = sweep_view(load_space("smoke_lr_wd"), "val_top1", "max", "parent", trials=8)
    sections = {s["name"]: s for s in state["compareRunSections"]}
    assert sections["val_top1 against each knob"]["columns"] == 1
    assert sections["val_top1 against each knob"]["cardHeight"] > MLFLOW_CARD_HEIGHT
    assert all("cardHeight" not in s for name, s in sections.items() if name != "val_top1 against each knob")


def test_a_sweep_of_two_trials_has_no_parallel_coordinates_chart():
    # each axis would span exactly the two trials' values: both lines on the chart's frame
    state = sweep_view(load_space("finetune_lr_layer_decay"), "val_top1", "max", "parent", trials=2)
    assert not _cards(state, "PARALLEL") and len(_cards(state, "SCATTER")) == 2
    assert [s["name"] for s in state["compareRunSections"]] == ["val_top1 against each knob", "per epoch", MODEL_METRICS]
    three = sweep_view(load_space("finetune_lr_layer_decay"), "val_top1", "max", "parent", trials=3)
    assert len(_cards(three, "PARALLEL")) == 1


@pytest.mark.parametrize("space", available_spaces())
def test_the_metric_and_the_knobs_fit_a_1280_px_window_beside_the_assistant_panel(space):
    state = sweep_view(load_space(space), "val_top1", "max", "parent", trials=8)
    knobs = [c for c in state["selectedColumns"] if c.startswith("params.")]
    # Run Name and Created stay pinned on the left; Duration goes after the knobs and the stop reason
    assert state["columnOrder"] == ["attributes.`Run Name`", "runDateAndNestInfo", "metrics.`val_top1`", *knobs,
                                    "tags.`stop_reason`", "duration"]
    widths = state["columnWidths"]
    # the table beside the open panel is 698 px wide in Chromium at 1280 px, 73 of them the row checkbox
    assert 73 + widths["attributes.`Run Name`"] + widths["runDateAndNestInfo"] + widths["metrics.`val_top1`"] + sum(
        widths[knob] for knob in knobs) <= 698
    assert all(widths[knob] >= 70 for knob in knobs) and widths["attributes.`Run Name`"] >= 110  # still legible


def test_the_metric_is_plotted_against_each_knob():
    state = sweep_view(load_space("fsne_code_size"), "val_loss", "min", "parent", trials=8)
    scatters = _cards(state, "SCATTER")
    assert [(c["xaxis"], c["yaxis"]) for c in scatters] == [
        ({"key": knob, "type": "PARAM"}, {"key": "val_loss", "type": "METRIC"}) for knob in ("code_size", "match_baseline_params")]
    assert {_section(state, card) for card in scatters} == {"val_loss against each knob"}


def test_the_metric_and_the_training_loss_per_epoch_come_next_then_the_uis_own_section():
    state = sweep_view(load_space("lr_wd"), "val_top1", "max", "parent", trials=10)
    lines = _cards(state, "LINE")
    assert [(c["metricKey"], c["xAxisKey"]) for c in lines] == [("val_top1", "step"), ("train_loss", "step")]
    assert {_section(state, card) for card in lines} == {"per epoch"}
    # the UI appends the trials' system metrics (system/node0/...) in their own section below these
    assert [s["name"] for s in state["compareRunSections"]] == [
        "val_top1 across the knobs", "val_top1 against each knob", "per epoch", MODEL_METRICS]
    assert state["isAccordionReordered"] and state["runsHiddenMode"] == "SHOW_ALL"


def test_a_knob_that_applies_to_some_trials_gets_a_scatter_but_no_parallel_axis():
    # a trial without a knob's value would be left out of the parallel chart (MLflow drops incomplete runs)
    state = sweep_view(load_space("eit_channel_ratio"), "val_top1", "max", "parent", trials=7)
    (parallel,) = _cards(state, "PARALLEL")
    assert parallel["selectedParams"] == ["channel_schedule"]
    assert [c["xaxis"]["key"] for c in _cards(state, "SCATTER")] == [
        "channel_schedule", "mha_ratio_range.0", "mha_ratio_range.1"]


def test_a_log_uniform_knob_is_charted_by_its_log10_and_tabled_as_sampled():
    # lr_wd: both knobs log-uniform; fine-tuning: the rate log-uniform, the layer decay uniform
    state = sweep_view(load_space("lr_wd"), "val_top1", "max", "parent", trials=10)
    assert _cards(state, "PARALLEL")[0]["selectedParams"] == ["log10_lr_per_512", "log10_weight_decay"]
    assert [c["xaxis"]["key"] for c in _cards(state, "SCATTER")] == ["log10_lr_per_512", "log10_weight_decay"]
    assert "params.`lr_per_512`" in state["selectedColumns"] and not any("log10" in c for c in state["selectedColumns"])
    state = sweep_view(load_space("finetune_lr_layer_decay"), "val_top1", "max", "parent", trials=2)
    assert [c["xaxis"]["key"] for c in _cards(state, "SCATTER")] == ["log10_lr", "layer_decay"]


def test_a_trial_logs_a_log_uniform_knobs_log10_beside_it():
    knobs = {"optim.lr": 2.5e-5, "optim.layer_decay": 0.75, "model.args.lr": 1e-3}
    assert knob_params(knobs, {"optim.lr", "model.args.lr"}) == {
        "optim.lr": 2.5e-5, "layer_decay": 0.75, "args.lr": 1e-3,
        "log10_optim.lr": pytest.approx(np.log10(2.5e-5), abs=1e-6), "log10_args.lr": pytest.approx(-3.0, abs=1e-6)}
    assert knob_params(knobs) == {"optim.lr": 2.5e-5, "layer_decay": 0.75, "args.lr": 1e-3}


def test_the_seed_is_a_table_column_but_no_chart():
    state = sweep_view(load_space("eit_vs_vit_digits"), "val_top1", "max", "parent", trials=10)
    assert "params.`seed`" in state["selectedColumns"]
    assert _cards(state, "PARALLEL")[0]["selectedParams"] == ["name"]
    assert [c["xaxis"]["key"] for c in _cards(state, "SCATTER")] == ["name"]


def test_the_table_shows_the_sweeps_trials_best_first():
    state = sweep_view(load_space("lr_wd"), "val_loss", "min", "abc123", trials=10)
    assert state["searchFilter"] == "tags.`mlflow.parentRunId` = 'abc123'"
    assert state["orderByKey"] == "metrics.`val_loss`" and state["orderByAsc"]  # a loss: lowest first
    # the sweep's metric, then the knobs (lr_wd searches the per-batch rate: the rate each trial trained at
    # follows them), then why each trial ended; no other metric or attribute: MLflow shows each selected
    # metric before any param, and pins Run Name, Created and Duration
    assert state["selectedColumns"] == ["metrics.`val_loss`", "params.`lr_per_512`", "params.`weight_decay`",
                                        "params.`optim.lr_effective`", "tags.`stop_reason`"]


@pytest.mark.parametrize("space", available_spaces())
def test_every_shipped_space_with_lr_and_weight_decay_fits_mlflows_experiment_tag(space):
    # with lr_wd's rate and weight decay unless the space decides the rate itself (a fine-tuning space)
    decides_rate = {"optim.lr", "optim.lr_per_512"} & set(load_space(space).keys)
    names = [space] if space == "lr_wd" or decides_rate else [space, "lr_wd"]
    state = sweep_view(load_spaces(names), "val_top1", "max", "0" * 32, trials=100)
    envelope = json.dumps({"name": "sweep x", "createdAt": 0, "updatedAt": 0, "state": json.dumps(state)})
    assert len(envelope) < MAX_EXPERIMENT_TAG_VAL_LENGTH
