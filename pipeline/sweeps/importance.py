"""Which knob mattered: each searched knob's share of the sweep metric's variance (fANOVA).

Optuna's ``FanovaImportanceEvaluator`` (Hutter et al., ICML 2014: a random forest fitted to the
configurations, each knob's main-effect variance over the searched space) runs over the completed
trials, rebuilt as Optuna trials. Seeds are repeats, not a knob: the trials of one configuration are
averaged over ``run.seed`` first (``report.seed_groups``), so the seed gets no share. The space a
knob was searched over is the one fANOVA integrates over: a choice or any grid point is a category
(each value weighs the same, as the design sampled them); a uniform range is a number; a log-uniform
range is its log10 (sampled uniformly there).

Below ``needed`` configurations (``CONFIGURATIONS_PER_KNOB`` per assessed knob, at least
``MIN_CONFIGURATIONS``) the answer is "too few trials to say": on synthetic sweeps where one of the
knobs drives the metric, fANOVA names it reliably only from about that many configurations on
(``benchmarks/bench_importance_min_trials.py``, ``benchmarks/RESULTS.md``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution

from pipeline.sweeps.report import SEED_KEY, TrialRow, cell, seed_groups
from pipeline.sweeps.spaces import Dimension, short_keys

# Measured (benchmarks/RESULTS.md, "Knob importance"): from 4 configurations per knob, at least 8, fANOVA
# names the one knob that drives the metric in 95-100 % of random sweeps whose noise is half its effect
# (78-85 % when the noise is as large); below, it degrades fast (3 knobs, 6 configurations: 70 %).
CONFIGURATIONS_PER_KNOB = 4
MIN_CONFIGURATIONS = 8
FANOVA_SEED = 0  # the forest is random: a fixed seed gives the same answer for the same trials


@dataclass(frozen=True)
class KnobImportance:
    """The importances of a sweep's knobs for ``metric``, or why there are none."""

    metric: str
    importances: dict[str, float]  # dotted key -> share of the explained variance, most important first
    configurations: int  # completed configurations, seeds averaged
    needed: int
    varying: tuple[str, ...] = ()  # the knobs that vary over every configuration: the ones fANOVA ranks
    not_assessed: dict[str, str] = field(default_factory=dict)  # dotted key -> why not

    @property
    def assessed(self) -> bool:
        return bool(self.importances)


def _configurations(rows: list[TrialRow], metric: str) -> list[tuple[dict[str, Any], float]]:
    """(knobs without the seed, the metric's mean over seeds) of each completed configuration."""
    return [(group.knobs, group.mean(metric)) for group in seed_groups(rows) if group.n(metric)]


def _distribution(dim: Dimension, grid: bool, values: list[Any]):
    """The space fANOVA integrates ``dim`` over, and how a trial's value is written in it. A range also
    spans every value its trials ran with: a ``derive`` rule may have moved one out of it (``mgcrp_square``
    rounds the repr size to its m), as may the 4-significant-digit rounding of a sample near a bound."""
    if grid or dim.kind == "values":
        return CategoricalDistribution(sorted({cell(v) for v in values})), cell
    write = math.log10 if dim.kind == "loguniform" else float
    written = [write(v) for v in values]
    return FloatDistribution(min(write(dim.low), *written), max(write(dim.high), *written)), write


def knob_importance(rows: list[TrialRow], metric: str, dims: tuple[Dimension, ...] | list[Dimension],
                    searcher: str, needed: int | None = None) -> KnobImportance:
    """fANOVA importance of each searched knob over the completed trials (seeds averaged out), given at
    least ``needed`` configurations (default: ``CONFIGURATIONS_PER_KNOB`` per knob, ``MIN_CONFIGURATIONS``)."""
    configurations = _configurations(rows, metric)
    not_assessed: dict[str, str] = {}
    assessed = []
    for dim in dims:
        values = [knobs.get(dim.key) for knobs, _ in configurations]
        if dim.key == SEED_KEY:
            not_assessed[dim.key] = "averaged out (repeats of one configuration, not a knob)"
        elif any(dim.key not in knobs for knobs, _ in configurations):
            not_assessed[dim.key] = "not assessed (applies to some trials only)"
        elif len({cell(v) for v in values}) < 2:
            not_assessed[dim.key] = "not assessed (one value in the completed trials)"
        else:
            assessed.append(dim)
    if needed is None:
        needed = max(MIN_CONFIGURATIONS, CONFIGURATIONS_PER_KNOB * len(assessed))
    varying = tuple(dim.key for dim in assessed)
    if len(assessed) < 2 or len(configurations) < needed:
        return KnobImportance(metric, {}, len(configurations), needed, varying, not_assessed)

    spaces = {dim.key: _distribution(dim, searcher == "grid", [k[dim.key] for k, _ in configurations])
              for dim in assessed}
    trials = [optuna.trial.create_trial(
        params={key: write(knobs[key]) for key, (_, write) in spaces.items()},
        distributions={key: distribution for key, (distribution, _) in spaces.items()}, value=value)
        for knobs, value in configurations]
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "study created" line on the sweep's console
    try:
        study = optuna.create_study()
        study.add_trials(trials)
        importances = optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=FANOVA_SEED))
    finally:
        optuna.logging.set_verbosity(verbosity)
    return KnobImportance(metric, {key: float(share) for key, share in importances.items()}, len(configurations),
                          needed, varying, not_assessed)


def format_importance(found: KnobImportance, bars: bool = True) -> str:
    """The console's lines: one per knob with its share (and a bar), then the knobs not assessed."""
    names = short_keys([*found.varying, *found.not_assessed])
    if found.assessed:
        head = (f"knob importance for {found.metric} (fANOVA over {found.configurations} configurations; "
                "shares sum to 1):")
        width = max(len(names[key]) for key in found.varying)
        lines = [f"  {names[key].ljust(width)}  {share:.2f}  {'#' * round(40 * share) if bars else ''}".rstrip()
                 for key, share in found.importances.items()]
    else:
        head = f"knob importance for {found.metric}: {_why_none(found, names)}"
        lines = []
    lines += [f"  {names[key]}: {reason}" for key, reason in found.not_assessed.items()]
    return "\n".join([head, *lines])


def _why_none(found: KnobImportance, names: dict[str, str]) -> str:
    if len(found.varying) == 1:
        return f"only {names[found.varying[0]]} varies: nothing to rank it against"
    if not found.varying:
        return "no knob varies over the completed trials"
    return (f"too few trials to say ({found.configurations} configurations; fANOVA needs at least {found.needed}: "
            f"{CONFIGURATIONS_PER_KNOB} per knob, at least {MIN_CONFIGURATIONS})")
