"""A sweep's results: one row per trial from MLflow, as CSV and a terminal table.

The same rows feed the parent run's ``results.csv``, `vitsweep compare`, the plots (``plots``)
and the knob importances (``importance``).
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from typing import Any

from pipeline.components.lr_scaling import EFFECTIVE_LR_PARAM, RATE_INPUTS
from pipeline.training.cost import ACCELERATOR_HOURS, UNIT_TAG
from pipeline.training.oom import SPLIT_TAG
from pipeline.sweeps.spaces import short_keys
from pipeline.sweeps.tracking import COMPLETED, KNOBS_TAG, PRUNED, STOP_REASON_TAG, TRIAL_TAG, child_runs
from pipeline.tracking.store import MlflowRun

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
    accelerator_hours: float | None = None  # what it spent (pipeline.training.cost); None: it never trained
    cost_unit: str = ""  # GPU-hours or CPU-core-hours
    split: str = ""  # micro-batch x accumulation steps it trained at after running out of memory ("16x4")

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
            accelerator_hours=run.data.metrics.get(ACCELERATOR_HOURS), cost_unit=tags.get(UNIT_TAG, ""),
            split=tags.get(SPLIT_TAG, ""),
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


def cell(value: Any) -> str:
    """A value as the tables and plots show it (4 significant digits; lists in brackets)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(cell(v) for v in value) + "]"
    return str(value)


def knobs_text(knobs: dict[str, Any]) -> str:
    """A trial's knobs as its console lines and run name show them: ``lr_per_512=0.00655 weight_decay=0.03217``."""
    return " ".join(f"{name}={'None' if knobs[key] is None else cell(knobs[key])}"
                    for key, name in short_keys(knobs).items())


def spend_column(rows: list[TrialRow]) -> str:
    """The table's column of what each trial spent, named by its unit: ``CPU_core_hours``, ``GPU_hours``."""
    units = {row.cost_unit for row in rows if row.cost_unit}
    return (units.pop() if len(units) == 1 else "accelerator-hours").replace("-", "_")


def table(rows: list[TrialRow], metric: str, mode: str) -> tuple[list[str], list[list[str]]]:
    keys = knob_keys(rows)
    # A searched per-batch rate or batch: the rate each trial trained at, beside its knobs.
    rates = ["lr_effective"] if set(keys) & set(RATE_INPUTS) else []
    # A trial that ran out of memory trained at a smaller micro-batch (pipeline.training.oom).
    splits = ["oom_split"] if any(row.split for row in rows) else []
    header = ["trial", "state", *short_keys(keys).values(), *rates, *splits, "epochs", metric,
              *[m for m in REPORTED if m != metric], "params_M", "gflops", spend_column(rows), "reason", "mlflow_run"]
    body = []
    for row in ranked(rows, metric, mode):
        body.append([row.trial_id or "-", row.state, *[cell(row.knobs.get(k)) for k in keys],
                     *[cell(row.lr_effective) for _ in rates], *[row.split for _ in splits], str(row.epochs),
                     cell(row.value(metric)), *[cell(row.value(m)) for m in REPORTED if m != metric],
                     cell(row.params_m), cell(row.gflops), cell(row.accelerator_hours), row.reason, row.run_id])
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
EPOCHS_KEY = "optim.epochs"  # searchable with fifo: a trial then trains its own number of epochs


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


def seed_table(rows: list[TrialRow], metric: str, mode: str) -> tuple[list[str], list[list[str]]]:
    """One line per configuration: its knobs, n seeds, the metric's mean ± standard deviation and range, best first."""
    groups = sorted(seed_groups(rows), key=lambda g: -g.mean(metric) if mode == "max" else g.mean(metric))
    keys = list(dict.fromkeys(key for group in groups for key in group.knobs))
    header = [*short_keys(keys).values(), "n", f"{metric} mean ± sd", "min", "max",
              *[f"{m} mean" for m in REPORTED if m != metric]]
    body = [[*[cell(group.knobs.get(key)) for key in keys], str(group.n(metric)),
             f"{group.mean(metric):.2f} ± {group.spread(metric):.2f}", cell(min(group.values[metric], default=None)),
             cell(max(group.values[metric], default=None)), *[cell(group.mean(m)) for m in REPORTED if m != metric]]
            for group in groups]
    return header, body


def format_seed_table(rows: list[TrialRow], metric: str, mode: str) -> str:
    return _aligned(*seed_table(rows, metric, mode))
