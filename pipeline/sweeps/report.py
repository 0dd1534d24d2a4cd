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

from pipeline.sweeps.spaces import short_key  # noqa: E402
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
            gflops=_float(params.get("model_facts.gflops")),
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
    header = ["trial", "state", *[short_key(k) for k in keys], "epochs", metric,
              *[m for m in REPORTED if m != metric], "params_M", "gflops", "reason", "mlflow_run"]
    body = []
    for row in ranked(rows, metric, mode):
        body.append([row.trial_id or "-", row.state, *[_cell(row.knobs.get(k)) for k in keys], str(row.epochs),
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


def format_table(rows: list[TrialRow], metric: str, mode: str, max_reason: int = 60) -> str:
    header, body = table(rows, metric, mode)
    body = [[*line[:-2], line[-2][:max_reason], line[-1]] for line in body]
    widths = [max(len(str(c)) for c in column) for column in zip(header, *body)]
    render = (lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())  # noqa: E731
    return "\n".join([render(header), render(["-" * w for w in widths]), *[render(line) for line in body]])


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


def plot_sweep(rows: list[TrialRow], metric: str, mode: str, directory: Path, log_keys: set[str]) -> list[Path]:
    """One PNG per searched knob (metric vs knob) and one Pareto plot; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    scored = [r for r in rows if not math.isnan(r.value(metric))]
    styles = {COMPLETED: dict(color="C0", label="completed"),
              EARLY_STOPPED: dict(color="C7", marker="x", label="stopped early")}
    written = []
    for key in knob_keys(scored):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        present = [r for r in scored if key in r.knobs]
        values = [r.knobs[key] for r in present]
        if _numeric(values):
            positions, ticks = values, None
        else:
            ticks = list(dict.fromkeys(_cell(v) for v in values))
            positions = [ticks.index(_cell(v)) for v in values]
        for state, style in styles.items():
            chosen = [(x, r.value(metric)) for x, r in zip(positions, present) if r.state == state]
            if chosen:
                ax.scatter(*zip(*chosen), **style)
        if ticks is not None:
            ax.set_xticks(range(len(ticks)), ticks, rotation=30 if max(map(len, ticks)) > 6 else 0)
        elif key in log_keys:
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(f"{metric} (last epoch)")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = directory / f"{metric}_vs_{short_key(key)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (cost, label) in zip(axes, [("params_m", "parameters (M)"), ("gflops", "GFLOPs")]):
        for state, style in styles.items():
            chosen = [(getattr(r, cost), r.value(metric)) for r in scored if r.state == state and getattr(r, cost)]
            if chosen:
                ax.scatter(*zip(*chosen), **style)
        front = pareto_front([(getattr(r, cost), r.value(metric)) for r in scored
                              if r.state == COMPLETED and getattr(r, cost)], mode)
        if front:
            ax.step(*zip(*front), where="post", color="C3", label="Pareto front")
        ax.set_xlabel(label)
        ax.set_ylabel(f"{metric} (last epoch)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = directory / f"{metric}_vs_params_and_gflops.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written
