"""A sweep's plots (matplotlib, Agg): what the parent run's ``plots/`` and summary show.

- the metric against each searched knob that varies: a numeric axis for a range, a categorical one
  (values in order) for a choice or a non-numeric knob; each configuration's mean ± sd over seeds;
- the metric against parameters and GFLOPs with the Pareto front of the completed trials, for each
  cost that really varies: values within ``SAME_COST`` of each other are one level (svPN variants 14
  parameters apart are one model size, not a trade-off), and a front needs two levels;
- the metric against the accelerator-hours each trial spent, with the Pareto front (``spend``);
- each knob's importance (``importance``) as bars.

Every figure is built by its own function and checked after drawing: x tick labels that would
overlap (many or long categories) are turned until none do.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from pipeline.sweeps.importance import KnobImportance  # noqa: E402
from pipeline.sweeps.report import SEED_KEY, SeedGroup, TrialRow, cell, has_seeds, knob_keys, seed_groups  # noqa: E402
from pipeline.sweeps.spaces import short_keys  # noqa: E402
from pipeline.sweeps.spend import SweepSpend, pareto_front  # noqa: E402
from pipeline.sweeps.tracking import COMPLETED, EARLY_STOPPED  # noqa: E402

SAME_COST = 0.01  # costs within 1 % of the largest are one level: not a trade-off to draw
COSTS = (("params_m", "parameters (M)", "params"), ("gflops", "GFLOPs", "gflops"))
DPI = 120


def cost_levels(costs: list[float]) -> list[list[float]]:
    """``costs`` sorted into levels: a value within ``SAME_COST`` of the largest cost from the level's
    first value joins that level."""
    levels: list[list[float]] = []
    tolerance = SAME_COST * max((abs(c) for c in costs), default=0.0)
    for cost in sorted(costs):
        if levels and cost - levels[-1][0] <= tolerance:
            levels[-1].append(cost)
        else:
            levels.append([cost])
    return levels


# --------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------

def _numeric(values: list[Any]) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _scatter_states(ax, points: list[tuple[Any, float, str]]) -> None:
    styles = {COMPLETED: dict(color="C0", label="completed"),
              EARLY_STOPPED: dict(color="C7", marker="x", label="stopped early")}
    for state, style in styles.items():
        chosen = [(x, y) for x, y, s in points if s == state]
        if chosen:
            ax.scatter(*zip(*chosen), s=36, **style)


def _label_metric_axes(ax, xlabel: str, metric: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{metric} (last epoch)")
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def knob_figure(rows: list[TrialRow], key: str, metric: str, log: bool = False, discrete: bool = False,
                groups: list[SeedGroup] = ()) -> Figure | None:
    """The metric against one knob (None when it takes one value): numeric unless ``discrete`` or
    non-numeric, then one category per value in order; ``groups``' mean ± sd over seeds beside."""
    present = [r for r in rows if key in r.knobs and not math.isnan(r.value(metric))]
    labels = [cell(r.knobs[key]) for r in present]
    if len(set(labels)) < 2:  # a constant knob says nothing
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    values = [r.knobs[key] for r in present]
    if _numeric(values) and not discrete:
        positions = values
        if log:
            ax.set_xscale("log")
        else:
            ax.ticklabel_format(axis="x", useOffset=False)
    else:
        order = sorted(set(labels), key=lambda label: values[labels.index(label)]) if _numeric(values) \
            else list(dict.fromkeys(labels))
        positions = [order.index(label) for label in labels]
        ax.set_xticks(range(len(order)), order)
        ax.set_xlim(-0.5, len(order) - 0.5)
    _scatter_states(ax, [(x, r.value(metric), r.state) for x, r in zip(positions, present)])
    for index, group in enumerate(g for g in groups if key in g.knobs and cell(g.knobs[key]) in labels):
        x = positions[labels.index(cell(group.knobs[key]))]
        ax.errorbar([x], [group.mean(metric)], yerr=[group.spread(metric)], fmt="D", color="C3", capsize=6,
                    label=f"mean ± sd over seeds (n = {group.n(metric)})" if index == 0 else None)
    _label_metric_axes(ax, key, metric)
    return _laid_out(fig)


def split_costs(rows: list[TrialRow]) -> tuple[list[tuple[str, str, str]], list[tuple[str, list[float]]]]:
    """The costs (attribute, axis label, file name part) with more than one level among ``rows``, and
    (axis label, values) of the ones that are a single level."""
    varying, constant = [], []
    for attribute, label, name in COSTS:
        costs = [getattr(r, attribute) for r in rows if getattr(r, attribute)]
        if len(cost_levels(costs)) > 1:
            varying.append((attribute, label, name))
        elif costs:
            constant.append((label, costs))
    return varying, constant


def cost_figure(rows: list[TrialRow], metric: str, mode: str) -> Figure | None:
    """The metric against each cost (parameters, GFLOPs) with more than one level, with the Pareto
    front of the completed trials where they span two levels; None when no cost varies."""
    scored = [r for r in rows if not math.isnan(r.value(metric))]
    varying, constant = split_costs(scored)
    if not varying:
        return None
    fig, axes = plt.subplots(1, len(varying), figsize=(6 * len(varying), 5), squeeze=False)
    for ax, (attribute, label, _) in zip(axes[0], varying):
        measured = [r for r in scored if getattr(r, attribute)]
        _scatter_states(ax, [(getattr(r, attribute), r.value(metric), r.state) for r in measured])
        completed = [(getattr(r, attribute), r.value(metric)) for r in measured if r.state == COMPLETED]
        front = pareto_front(completed, mode)
        if len(cost_levels([cost for cost, _ in completed])) > 1 and len(front) > 1:
            ax.step(*zip(*front), where="post", color="C3", label="Pareto front")
        ax.ticklabel_format(axis="x", useOffset=False)
        _label_metric_axes(ax, label, metric)
    if constant:  # said once, in words: a near-constant axis would be all digits and no information
        fig.suptitle("; ".join(f"{label}: {_span(costs)} in every trial (within {SAME_COST:.0%}: one level)"
                               for label, costs in constant), fontsize="medium")
    return _laid_out(fig)


def spend_figure(rows: list[TrialRow], metric: str, spend: SweepSpend) -> Figure | None:
    """The metric against the accelerator-hours each trial spent, the Pareto front's trials named;
    None when no trial has both."""
    measured = [r for r in rows if r.accelerator_hours is not None and not math.isnan(r.value(metric))]
    if not measured:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    _scatter_states(ax, [(r.accelerator_hours, r.value(metric), r.state) for r in measured])
    if spend.front:
        ax.step([r.accelerator_hours for r in spend.front], [r.value(metric) for r in spend.front], where="post",
                color="C3", label="Pareto front")
        for row in spend.front:
            ax.annotate(row.trial_id, (row.accelerator_hours, row.value(metric)), textcoords="offset points",
                        xytext=(4, 4), fontsize="small")
    ax.ticklabel_format(axis="x", useOffset=False)
    ax.margins(x=0.12)  # room for the names of the front's cheapest and dearest trials
    _label_metric_axes(ax, f"{spend.unit} spent", metric)
    ax.set_title(f"{cell(spend.total)} {spend.unit} in all; the best trial alone "
                 f"{cell(spend.best.accelerator_hours) if spend.best else '-'}", fontsize="medium")
    return _laid_out(fig)


def _span(values: list[float]) -> str:
    low, high = cell(min(values)), cell(max(values))
    return low if low == high else f"{low} to {high}"


def importance_figure(found: KnobImportance) -> Figure | None:
    """A horizontal bar per ranked knob, the most important on top; None when none was ranked."""
    if not found.assessed:
        return None
    names = short_keys(found.importances)
    keys = list(found.importances)[::-1]
    fig, ax = plt.subplots(figsize=(7, 1.4 + 0.45 * len(keys)))
    ax.barh([names[key] for key in keys], [found.importances[key] for key in keys], color="C0")
    for y, key in enumerate(keys):
        ax.text(found.importances[key] + 0.01, y, f"{found.importances[key]:.2f}", va="center", fontsize="small")
    ax.set_xlim(0, 1.1)
    ax.set_xlabel(f"share of {found.metric}'s explained variance (fANOVA, {found.configurations} configurations)")
    ax.grid(axis="x", alpha=0.3)
    return _laid_out(fig)


# --------------------------------------------------------------------------------------------------
# Tick labels that never overlap
# --------------------------------------------------------------------------------------------------

def overlapping_tick_labels(axis, renderer) -> list[tuple[str, str]]:
    """Pairs of this axis's drawn tick labels whose boxes intersect."""
    boxes = [(label.get_text(), label.get_window_extent(renderer)) for label in axis.get_ticklabels()
             if label.get_visible() and label.get_text()]
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]


def _laid_out(fig: Figure) -> Figure:
    """Laid out and drawn, each x axis's tick labels turned (30°, then 90°) while any two overlap."""
    fig.tight_layout()
    fig.canvas.draw()
    for ax in fig.axes:
        for angle in (30, 90):
            if not overlapping_tick_labels(ax.xaxis, fig.canvas.get_renderer()):
                break
            ax.tick_params(axis="x", labelrotation=angle)
            plt.setp(ax.get_xticklabels(), ha="right", va="center" if angle == 90 else "baseline",
                     rotation_mode="anchor")
            fig.tight_layout()
            fig.canvas.draw()
    return fig


# --------------------------------------------------------------------------------------------------
# The sweep's plots, as files
# --------------------------------------------------------------------------------------------------

def save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_sweep(rows: list[TrialRow], metric: str, mode: str, directory: Path, log_keys: set[str],
               discrete_keys: set[str] = frozenset(), spend: SweepSpend | None = None) -> list[Path]:
    """Each knob's figure (seeds summarised, not plotted as a knob), then the costs' figure, then the
    spend's (``spend``: the sweep's)."""
    directory.mkdir(parents=True, exist_ok=True)
    scored = [r for r in rows if not math.isnan(r.value(metric))]
    groups = seed_groups(scored) if has_seeds(scored) else []
    written = []
    for key, name in short_keys(knob_keys(scored)).items():
        if key == SEED_KEY:  # seeds are repeats: each configuration's mean ± sd is drawn on its knobs
            continue
        fig = knob_figure(scored, key, metric, log=key in log_keys, discrete=key in discrete_keys, groups=groups)
        if fig is not None:
            written.append(save(fig, directory / f"{metric}_vs_{name}.png"))
    costs = cost_figure(scored, metric, mode)
    if costs is not None:
        shown = "_and_".join(name for _, _, name in split_costs(scored)[0])
        written.append(save(costs, directory / f"{metric}_vs_{shown}.png"))
    spent = spend_figure(scored, metric, spend) if spend is not None else None
    if spent is not None:
        written.append(save(spent, directory / f"{metric}_vs_accelerator_hours.png"))
    return written
