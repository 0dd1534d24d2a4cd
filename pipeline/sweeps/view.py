"""The sweep's saved view in MLflow 3.17's UI: what its printed link opens, table and charts.

The UI keeps a saved view as an experiment tag (``pipeline.tracking.store.MlflowStore.save_view``) whose
state holds the runs page's search facets (filter, order) and UI state (``ExperimentPageUIState``
in MLflow's ``experiment-page/models``): the table's columns and, for the chart view, the chart
cards (``compareRunCharts``: ``RunsChartsCardConfig`` objects of ``runs-charts.types.ts``, one
section each) and their sections (``compareRunSections``). A view holding charts opens with them
instead of the UI's generated ones; the UI then only adds cards for metrics no card shows yet, in
the sections named after them ("Model metrics"; a trial's system metrics are ``system/node<rank>/...``,
so "system/node0"), appended below ours (``isAccordionReordered``: the order given here is kept).

The sweep's charts, the first thing its chart view shows:
- "<metric> across the knobs": a parallel-coordinates chart, the page's width, of every knob that
  applies to every trial into the metric (a line per trial, coloured by the metric), for a sweep of
  at least ``PARALLEL_MIN_TRIALS`` trials (the sweep's description says why a smaller one has none);
- "<metric> against each knob": a scatter per knob, one per row and tall enough that the chart's toolbar
  covers no point (``SCATTER_CARD_HEIGHT``; Plotly makes a numeric knob's axis numeric and a choice of
  names one category per value). Neither chart has a log axis in MLflow 3.17: a log-uniform
  knob is drawn by the log10 its trials log beside it (``spaces.log10_param``), evenly spread as sampled;
- "per epoch": the metric and the training loss per epoch, a line per trial;
- the UI's own "Model metrics" (the other metrics), then the system metrics (CPU, memory, GPU) below.
The run seed is a repeat, not a knob: it gets a table column but no chart.
"""
from __future__ import annotations

from typing import Any

from pipeline.components.lr_scaling import EFFECTIVE_LR_PARAM, RATE_INPUTS
from pipeline.sweeps.report import SEED_KEY
from pipeline.sweeps.spaces import SearchSpace, log10_param, short_keys
from pipeline.sweeps.tracking import PARENT_TAG

# Each parallel axis spans its trials' values, so 2 trials' lines run along the chart's frame: an empty-looking box.
PARALLEL_MIN_TRIALS = 3
MODEL_METRICS = "Model metrics"  # the UI's own section of the metrics without a "section/" prefix
# A knob's scatter gets a row of its own, 640 px tall (the UI's cards are 360). Plotly's autorange leaves 5 % of
# the plot's height (plus a marker's radius) above the top point, and the chart's toolbar (Plotly's modebar,
# shown on hover, no view setting hides or moves it) is a 20-px row at the plot's top right, two rows where
# two cards share a row: from a 490-px plot the best trials' points sit below it at any window width.
SCATTER_CARD_HEIGHT = 640

# The runs table's columns by their ag-grid ids, and their widths in px. At 1280 px with the Assistant panel
# open, the table is 698 px wide (measured in Chromium); the row checkbox takes 73 of them.
TABLE_WIDTH, ROW_CHECKBOX_WIDTH = 698, 73
RUN_NAME_COLUMN, CREATED_COLUMN = "attributes.`Run Name`", "runDateAndNestInfo"  # pinned: 190 and 150 px by default
CREATED_WIDTH, METRIC_WIDTH = 130, 90  # "10 minutes ago"; a metric's first 7 digits
RUN_NAME_WIDTHS, KNOB_WIDTHS = (110, 160), (70, 100)  # "layer_decay" needs 80
DURATION_COLUMN, STOP_REASON_COLUMN = "duration", "tags.`stop_reason`"
TRAIN_LOSS = "train_loss"


def param_names(space: SearchSpace) -> dict[str, str]:
    """Each searched and derived key's param in a trial's run (its short name, ``trial.knob_params``)."""
    return short_keys([*space.keys, *(key for rule in space.derive for key in rule.keys)])


def _card(kind: str, uuid: str, section: str, trials: int, **config: Any) -> dict[str, Any]:
    """One chart card as the UI serialises it (``RunsChartsCardConfig`` and its subclass's fields)."""
    return {"uuid": uuid, "type": kind, "runsCountToCompare": trials, "metricSectionId": section, "deleted": False,
            "isGenerated": False, **config}


def _line(uuid: str, section: str, trials: int, metric: str) -> dict[str, Any]:
    return _card("LINE", uuid, section, trials, metricKey=metric, lineSmoothness=0, xAxisScaleType="linear",
                 scaleType="linear", xAxisKey="step", selectedXAxisMetricKey="", yAxisKey="metric",
                 yAxisExpressions=[], ignoreOutliers=False, useGlobalXaxisKey=False, useGlobalLineSmoothing=True)


def chart_state(space: SearchSpace, metric: str, trials: int) -> dict[str, Any]:
    """The chart view's part of the UI state: cards, sections, and every trial shown in them."""
    params = param_names(space)
    knobs = [dim for dim in space.dims if dim.key != SEED_KEY]
    axis = {dim.key: log10_param(params[dim.key]) if dim.is_log else params[dim.key] for dim in knobs}
    everywhere = [dim for dim in knobs if not dim.when] or knobs  # a line needs a value on every axis
    across, against, per_epoch = "vitsweep-across-knobs", "vitsweep-against-each-knob", "vitsweep-per-epoch"
    parallel = trials >= PARALLEL_MIN_TRIALS
    cards = [_card("PARALLEL", "vitsweep-parallel", across, trials, selectedParams=[axis[d.key] for d in everywhere],
                   selectedMetrics=[metric], showAllRuns=True)] if parallel else []
    cards += [_card("SCATTER", f"vitsweep-scatter-{axis[dim.key]}", against, trials,
                    xaxis={"key": axis[dim.key], "type": "PARAM"}, yaxis={"key": metric, "type": "METRIC"})
              for dim in knobs]
    cards += [_line(f"vitsweep-line-{name}", per_epoch, trials, name) for name in dict.fromkeys([metric, TRAIN_LOSS])]
    # (uuid, name, cards per row, card height): the parallel chart gets the whole width, one axis per knob
    sections = [(across, f"{metric} across the knobs", 1, None)] if parallel else []
    sections += [(against, f"{metric} against each knob", 1, SCATTER_CARD_HEIGHT), (per_epoch, "per epoch", 2, None),
                 ("vitsweep-model-metrics", MODEL_METRICS, 3, None)]
    return {
        "compareRunCharts": cards,
        "compareRunSections": [{"uuid": uuid, "name": name, "display": True, "isReordered": False, "deleted": False,
                                "isGenerated": False, "columns": columns, **({"cardHeight": height} if height else {})}
                               for uuid, name, columns, height in sections],
        "isAccordionReordered": True,  # keep these sections in this order; the UI adds system metrics' below
        "runsHiddenMode": "SHOW_ALL",  # the UI charts only its first 10 runs otherwise
    }


def sweep_view(space: SearchSpace, metric: str, mode: str, parent_run_id: str, trials: int) -> dict[str, Any]:
    """The whole saved view: the trials (children of the sweep's parent run), best first, the sweep's
    metric and a column per knob, and the chart view above.

    MLflow 3.17's runs table pins the row checkbox, Run Name and Created on the left and then shows every
    selected metric before any param, so each other metric shown would push the knobs out of view: they
    are one click away (Columns), and in the sweep's summary and `vitsweep compare`. The view also sets
    the table's column order and widths (ag-grid's column state, which the view keeps): Duration after
    the knobs, and the pinned columns narrowed so that the metric and the knobs fit the table a 1280-px
    window leaves beside the Assistant panel, which MLflow opens on a visitor's first load."""
    rates = [EFFECTIVE_LR_PARAM] if set(space.keys) & set(RATE_INPUTS) else []  # as report.table shows them
    knobs = [f"params.`{name}`" for name in [*param_names(space).values(), *rates]]
    columns = [f"metrics.`{metric}`", *knobs, STOP_REASON_COLUMN]
    widths = _column_widths(columns[0], knobs)
    return {"searchFilter": f"tags.`{PARENT_TAG}` = '{parent_run_id}'", "orderByKey": f"metrics.`{metric}`",
            "orderByAsc": mode == "min", "selectedColumns": columns,
            "columnOrder": [RUN_NAME_COLUMN, CREATED_COLUMN, *columns, DURATION_COLUMN], "columnWidths": widths,
            **chart_state(space, metric, trials)}


def _column_widths(metric_column: str, knob_columns: list[str]) -> dict[str, int]:
    """Widths that fit the metric and the knobs beside the pinned columns in ``TABLE_WIDTH``: the knobs
    share what is left (within ``KNOB_WIDTHS``), then the run name gives up what they still lack."""
    left = TABLE_WIDTH - ROW_CHECKBOX_WIDTH - CREATED_WIDTH - METRIC_WIDTH
    knob = max(KNOB_WIDTHS[0], min(KNOB_WIDTHS[1], (left - RUN_NAME_WIDTHS[1]) // max(len(knob_columns), 1)))
    run_name = max(RUN_NAME_WIDTHS[0], min(RUN_NAME_WIDTHS[1], left - knob * len(knob_columns)))
    return {RUN_NAME_COLUMN: run_name, CREATED_COLUMN: CREATED_WIDTH, metric_column: METRIC_WIDTH,
            **dict.fromkeys(knob_columns, knob)}
