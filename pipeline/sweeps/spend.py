"""What a sweep spent, from its trials' accelerator-hours (``pipeline.training.cost``): the whole sweep's,
by how each trial ended (a pruned sample never trained and spent nothing), its best trial's alone, and
the completed trials that no other beats for less (the Pareto front of the metric over accelerator-hours).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.sweeps.report import TrialRow, cell
from pipeline.sweeps.tracking import COMPLETED, PRUNED


def pareto_front(points: list[tuple[float, float]], mode: str) -> list[tuple[float, float]]:
    """(cost, metric) points no other point beats with less or equal cost, sorted by cost."""
    better = (lambda a, b: a > b) if mode == "max" else (lambda a, b: a < b)  # noqa: E731
    front: list[tuple[float, float]] = []
    for cost, value in sorted(points, key=lambda p: (p[0], -p[1] if mode == "max" else p[1])):
        if not front or better(value, front[-1][1]):
            front.append((cost, value))
    return front


@dataclass(frozen=True)
class SweepSpend:
    unit: str  # GPU-hours or CPU-core-hours
    by_state: dict[str, float]  # accelerator-hours of the trials that ended each way
    pruned: int  # samples pruned before they trained: nothing spent (not a trial pruned out of memory)
    best: TrialRow | None
    front: list[TrialRow]  # the completed trials on the Pareto front, cheapest first

    @property
    def total(self) -> float:
        return sum(self.by_state.values())


def spent_trials(rows: list[TrialRow]) -> list[TrialRow]:
    return [row for row in rows if row.accelerator_hours is not None]


def front_trials(rows: list[TrialRow], metric: str, mode: str) -> list[TrialRow]:
    """The completed trials no other completed trial beats at less or equal spend, cheapest first (an
    early-stopped trial's metric is from fewer epochs: no comparison)."""
    scored = [row for row in spent_trials(rows) if row.state == COMPLETED and not math.isnan(row.value(metric))]
    front = set(pareto_front([(row.accelerator_hours, row.value(metric)) for row in scored], mode))
    return sorted((row for row in scored if (row.accelerator_hours, row.value(metric)) in front),
                  key=lambda row: (row.accelerator_hours, row.trial_id))


def sweep_spend(rows: list[TrialRow], metric: str, mode: str, best: TrialRow | None) -> SweepSpend:
    """``rows``: every trial and pruned sample (``report.sweep_rows`` + ``report.pruned_rows``)."""
    by_state: dict[str, float] = {}
    for row in spent_trials(rows):
        by_state[row.state] = by_state.get(row.state, 0.0) + row.accelerator_hours
    units = {row.cost_unit for row in rows if row.cost_unit}
    unit = units.pop() if len(units) == 1 else "accelerator-hours"
    # a trial pruned as out of memory trained and spent: it counts with the pruned hours, not as a sample
    never_trained = sum(row.state == PRUNED and row.accelerator_hours is None for row in rows)
    return SweepSpend(unit, by_state, never_trained, best, front_trials(rows, metric, mode))


def format_spend(spend: SweepSpend, metric: str) -> str:
    """The sweep's spend in two or three lines, for the console, `vitsweep compare` and the summary."""
    if not spend.by_state:
        return "spend: no trial has recorded any yet"
    parts = ", ".join(f"{state.replace('_', ' ')} {cell(hours)}" for state, hours in sorted(spend.by_state.items()))
    pruned = f"; {spend.pruned} pruned sample{'s' if spend.pruned != 1 else ''} spent nothing" if spend.pruned else ""
    lines = [f"spend: {cell(spend.total)} {spend.unit} in all ({parts}){pruned}"]
    if spend.best is not None and spend.best.accelerator_hours is not None:
        lines.append(f"  the best trial, {spend.best.trial_id}, alone: {cell(spend.best.accelerator_hours)} {spend.unit}")
    if spend.front:
        lines.append(f"  cheapest for their {metric} (Pareto front over {spend.unit}): " + "; ".join(
            f"{row.trial_id} {metric} {cell(row.value(metric))} at {cell(row.accelerator_hours)}" for row in spend.front))
    return "\n".join(lines)
