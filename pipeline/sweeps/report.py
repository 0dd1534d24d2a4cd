"""A sweep's results: one row per trial from MLflow, as CSV, a terminal table and plots.

The same rows feed the parent run's ``results.csv`` and `vitsweep compare`. Plots (matplotlib,
Agg): the metric against each searched knob, and the metric against parameters and GFLOPs with
the Pareto front of the trials that trained every epoch.
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402

from pipeline.lr_scaling import EFFECTIVE_LR_PARAM, RATE_INPUTS  # noqa: E402
from pipeline.sweeps.spaces import short_keys  # noqa: E402
from pipeline.sweeps.tracking import (COMPLETED, EARLY_STOPPED, KNOBS_TAG, PRUNED, STOP_REASON_TAG,  # noqa: E402
                                      TRIAL_TAG, child_runs)
from pipeline.tracking import MlflowRun  # noqa: E402

REPORTED = ("val_top1", "val_top5", "val_loss", "train_loss")


@dataclass(frozen=True)
class TrialRow:
    trial_id: str
    run_id: str
    state: str  # completed, early_stopped, diverged, error, interrupted, running, pruned
    reason: str
    knobs: dict[str, Any]
    epochs: int
    metrics: dict[str, float]  # each reported metric at the trial's last epoch
    params_m: float | None
    gflops: float | None
    lr_effective: float | None = None  # the peak rate it trained at (its per-batch rate scaled to its batch)

    def value(self, metric: str) -> float:
        return self.metrics.get(metric, math.nan)


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def sweep_rows(parent: MlflowRun, metric: str) -> list[TrialRow]:
    rows = []
    for run in child_runs(parent):
        tags, params = run.data.tags, run.data.params
        state, _, reason = tags.get(STOP_REASON_TAG, "running").partition(": ")
        history = MlflowRun(parent.uri, run.info.run_id, parent.client).metric_history(metric)
        params_count = _float(params.get("model_facts.params"))
        rows.append(TrialRow(
            trial_id=tags.get(TRIAL_TAG, ""), run_id=run.info.run_id, state=state, reason=reason,
            knobs=json.loads(tags.get(KNOBS_TAG, "{}")), epochs=len({m.step for m in history}),
            metrics={k: v for k, v in run.data.metrics.items() if k in REPORTED},
            params_m=params_count / 1e6 if params_count is not None else None,
            gflops=_float(params.get("model_facts.gflops")), lr_effective=_float(params.get(EFFECTIVE_LR_PARAM)),
        ))
    return rows


def pruned_rows(pruned: list[dict[str, Any]]) -> list[TrialRow]:
    return [TrialRow("", "", PRUNED, p["reason"], p["knobs"], 0, {}, None, None) for p in pruned]


def ranked(rows: list[TrialRow], metric: str, mode: str) -> list[TrialRow]:
    """Best first: trials with the metric by its last value, then the rest by trial id."""
    sign = -1.0 if mode == "max" else 1.0
    scored = sorted((r for r in rows if not math.isnan(r.value(metric))), key=lambda r: (sign * r.value(metric), r.trial_id))
    return scored + sorted((r for r in rows if math.isnan(r.value(metric))), key=lambda r: (r.state, r.trial_id))


def best_row(rows: list[TrialRow], metric: str, mode: str) -> TrialRow | None:
    """The best trial that trained every epoch (an early-stopped trial's value is from fewer epochs)."""
    completed = [r for r in ranked(rows, metric, mode) if r.state == COMPLETED]
    return completed[0] if completed else None


def knob_keys(rows: list[TrialRow]) -> list[str]:
    keys: dict[str, None] = {}
    for row in rows:
        keys.update(dict.fromkeys(row.knobs))
    return list(keys)


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_cell(v) for v in value) + "]"
    return str(value)


def table(rows: list[TrialRow], metric: str, mode: str) -> tuple[list[str], list[list[str]]]:
    keys = knob_keys(rows)
    # A searched per-batch rate or batch: the rate each trial trained at, beside its knobs.
    rates = ["lr_effective"] if set(keys) & set(RATE_INPUTS) else []
    header = ["trial", "state", *short_keys(keys).values(), *rates, "epochs", metric,
              *[m for m in REPORTED if m != metric], "params_M", "gflops", "reason", "mlflow_run"]
    body = []
    for row in ranked(rows, metric, mode):
        body.append([row.trial_id or "-", row.state, *[_cell(row.knobs.get(k)) for k in keys],
                     *[_cell(row.lr_effective) for _ in rates], str(row.epochs),
                     _cell(row.value(metric)), *[_cell(row.value(m)) for m in REPORTED if m != metric],
                     _cell(row.params_m), _cell(row.gflops), row.reason, row.run_id])
    return header, body


def to_csv(rows: list[TrialRow], metric: str, mode: str) -> str:
    header, body = table(rows, metric, mode)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(header)
    writer.writerows(body)
    return out.getvalue()


def _aligned(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *body)]
    render = (lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())  # noqa: E731
    return "\n".join([render(header), render(["-" * w for w in widths]), *[render(line) for line in body]])


def format_table(rows: list[TrialRow], metric: str, mode: str, max_reason: int = 60) -> str:
    header, body = table(rows, metric, mode)
    return _aligned(header, [[*line[:-2], line[-2][:max_reason], line[-1]] for line in body])


# --------------------------------------------------------------------------------------------------
# Seeds: repeats of one configuration, summarised
# --------------------------------------------------------------------------------------------------

SEED_KEY = "run.seed"


@dataclass(frozen=True)
class SeedGroup:
    """The completed trials of one configuration that differ only in ``run.seed``."""

    knobs: dict[str, Any]  # without the seed
    values: dict[str, list[float]]  # each reported metric, one value per seed

    def n(self, metric: str) -> int:
        return len(self.values.get(metric, []))

    def mean(self, metric: str) -> float:
        values = self.values.get(metric, [])
        return sum(values) / len(values) if values else math.nan

    def spread(self, metric: str) -> float:
        """The sample standard deviation over seeds (0 with one seed)."""
        values, mean = self.values.get(metric, []), self.mean(metric)
        return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0


def has_seeds(rows: list[TrialRow]) -> bool:
    return any(SEED_KEY in row.knobs for row in rows)


def seed_groups(rows: list[TrialRow]) -> list[SeedGroup]:
    """Completed trials grouped by every knob but the seed (an early-stopped trial's value is from fewer epochs)."""
    groups: dict[str, SeedGroup] = {}
    for row in rows:
        if row.state != COMPLETED:
            continue
        knobs = {key: value for key, value in row.knobs.items() if key != SEED_KEY}
        group = groups.setdefault(json.dumps(knobs, sort_keys=True), SeedGroup(knobs, {m: [] for m in REPORTED}))
        for metric in REPORTED:
            if not math.isnan(row.value(metric)):
                group.values[metric].append(row.value(metric))
    return list(groups.values())


def format_seed_table(rows: list[TrialRow], metric: str, mode: str) -> str:
    """One line per configuration: its knobs, n seeds, the metric's mean ± standard deviation and range, best first."""
    groups = sorted(seed_groups(rows), key=lambda g: -g.mean(metric) if mode == "max" else g.mean(metric))
    keys = list(dict.fromkeys(key for group in groups for key in group.knobs))
    header = [*short_keys(keys).values(), "n", f"{metric} mean ± sd", "min", "max",
              *[f"{m} mean" for m in REPORTED if m != metric]]
    body = [[*[_cell(group.knobs.get(key)) for key in keys], str(group.n(metric)),
             f"{group.mean(metric):.2f} ± {group.spread(metric):.2f}", _cell(min(group.values[metric], default=None)),
             _cell(max(group.values[metric], default=None)), *[_cell(group.mean(m)) for m in REPORTED if m != metric]]
            for group in groups]
    return _aligned(header, body)


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------

def pareto_front(points: list[tuple[float, float]], mode: str) -> list[tuple[float, float]]:
    """(cost, metric) points no other point beats with less or equal cost, sorted by cost."""
    better = (lambda a, b: a > b) if mode == "max" else (lambda a, b: a < b)  # noqa: E731
    front: list[tuple[float, float]] = []
    for cost, value in sorted(points, key=lambda p: (p[0], -p[1] if mode == "max" else p[1])):
        if not front or better(value, front[-1][1]):
            front.append((cost, value))
    return front


def _numeric(values: list[Any]) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _scatter_states(ax, points: list[tuple[Any, float, str]]) -> None:
    styles = {COMPLETED: dict(color="C0", label="completed"),
              EARLY_STOPPED: dict(color="C7", marker="x", label="stopped early")}
    for state, style in styles.items():
        chosen = [(x, y) for x, y, s in points if s == state]
        if chosen:
            ax.scatter(*zip(*chosen), s=36, **style)


def _finish(fig, ax, xlabel: str, metric: str, path: Path) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{metric} (last epoch)")
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sweep(rows: list[TrialRow], metric: str, mode: str, directory: Path, log_keys: set[str],
               discrete_keys: set[str] = frozenset()) -> list[Path]:
    """The metric against each knob that varies (a categorical axis for a discrete or non-numeric
    knob), and against parameters and GFLOPs with the Pareto front where the trials differ in size."""
    directory.mkdir(parents=True, exist_ok=True)
    scored = [r for r in rows if not math.isnan(r.value(metric))]
    written = []
    names = short_keys(knob_keys(scored))
    groups = seed_groups(scored) if has_seeds(scored) else []
    for key, name in names.items():
        if key == SEED_KEY:  # seeds are repeats: summarised as each configuration's mean ± sd below
            continue
        present = [r for r in scored if key in r.knobs]
        labels = [_cell(r.knobs[key]) for r in present]
        if len(set(labels)) < 2:  # a constant knob says nothing
            continue
        fig, ax = plt.subplots(figsize=(8, 5))
        values = [r.knobs[key] for r in present]
        if _numeric(values) and key not in discrete_keys:
            positions = values
            if key in log_keys:
                ax.set_xscale("log")
            else:
                ax.ticklabel_format(axis="x", useOffset=False)
        else:
            order = sorted(set(labels), key=lambda label: values[labels.index(label)]) if _numeric(values) \
                else list(dict.fromkeys(labels))
            positions = [order.index(label) for label in labels]
            ax.set_xticks(range(len(order)), order, rotation=30 if max(map(len, order)) > 6 else 0)
        _scatter_states(ax, [(x, r.value(metric), r.state) for x, r in zip(positions, present)])
        for index, group in enumerate(g for g in groups if key in g.knobs):
            x = positions[labels.index(_cell(group.knobs[key]))]
            ax.errorbar([x], [group.mean(metric)], yerr=[group.spread(metric)], fmt="D", color="C3", capsize=6,
                        label=f"mean ± sd over seeds (n = {group.n(metric)})" if index == 0 else None)
        written.append(_finish(fig, ax, key, metric, directory / f"{metric}_vs_{name}.png"))

    sizes = [(r.params_m, r.gflops) for r in scored if r.params_m and r.gflops]
    if len(set(sizes)) < 2:  # every trial the same size: no trade-off to draw
        return written
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, (cost, label) in zip(axes, [("params_m", "parameters (M)"), ("gflops", "GFLOPs")]):
        _scatter_states(ax, [(getattr(r, cost), r.value(metric), r.state) for r in scored if getattr(r, cost)])
        front = pareto_front([(getattr(r, cost), r.value(metric)) for r in scored
                              if r.state == COMPLETED and getattr(r, cost)], mode)
        if len(front) > 1:
            ax.step(*zip(*front), where="post", color="C3", label="Pareto front")
        ax.ticklabel_format(axis="x", useOffset=False)
        if ax is not axes[-1]:
            ax.set_xlabel(label)
            ax.set_ylabel(f"{metric} (last epoch)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    written.append(_finish(fig, axes[-1], "GFLOPs", metric, directory / f"{metric}_vs_params_and_gflops.png"))
    return written
