"""The short text specs some config values hold, parsed: ``run.profile``'s ``steps:N``,
``run.target_metric``'s ``METRIC>=VALUE`` and ``run.checkpoint_score``'s metric. Each parser's
ValueError says what is accepted; the schema (``pipeline.config.schema``) turns it into the config
error naming the key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator

# A trace holds every op with its shapes and memory events: a ZeRO-2 step of the smoke model on CPU is
# ~23 MB of JSON (DeepSpeed's per-parameter copies); past a few hundred MB, Perfetto in a browser tab struggles.
MAX_PROFILED_STEPS = 20


def profiled_steps(spec: str) -> int:
    """N of a ``run.profile`` spec ``steps:N``; a ValueError saying what is accepted."""
    kind, _, count = spec.partition(":")
    if kind != "steps" or not count.isdigit() or not 1 <= int(count) <= MAX_PROFILED_STEPS:
        raise ValueError(f"{spec!r} is not a profile: give steps:N, N training steps to trace on rank 0 "
                         f"(1 to {MAX_PROFILED_STEPS}; e.g. steps:5), or null for none")
    return int(count)


# The epoch metrics a run reports that a target or a checkpoint's score may name (the EMA's beside them where
# there is one).
TARGET_METRICS = ("val_top1", "val_top5", "val_loss", "train_loss")
REPORTED_METRICS = (*TARGET_METRICS, *(f"{name}_ema" for name in TARGET_METRICS if name.startswith("val_")))
# What else every epoch reports (pipeline.training.worker), by which a checkpoint may be scored too
OTHER_EPOCH_METRICS = ("lr", "epoch", "images_per_sec", "tflops_per_sec", "epoch_time_s")
TARGET_OPERATORS = (">=", "<=")


def check_reported_metric(name: str) -> str:
    """A metric each epoch reports (``run.checkpoint_score``: Ray would score every checkpoint -inf, unsaid)."""
    if name not in (*REPORTED_METRICS, *OTHER_EPOCH_METRICS):
        raise ValueError(f"{name!r} is no metric an epoch reports; give one of "
                         f"{', '.join((*REPORTED_METRICS, *OTHER_EPOCH_METRICS))}")
    return name


ReportedMetric = Annotated[str, AfterValidator(check_reported_metric)]


@dataclass(frozen=True)
class MetricTarget:
    """``run.target_metric`` parsed: ``val_top1>=75`` is reached by the first epoch whose val_top1 is 75 or more."""

    metric: str
    operator: str  # ">=" or "<="
    value: float

    @classmethod
    def parse(cls, spec: str) -> MetricTarget:
        """A ValueError saying what is accepted."""
        for operator in TARGET_OPERATORS:
            metric, found, number = spec.partition(operator)
            if found:
                break
        metric = metric.strip()
        known = REPORTED_METRICS
        try:
            value = float(number) if found else math.nan
        except ValueError:
            value = math.nan
        if not found or metric not in known or not math.isfinite(value):
            raise ValueError(f"{spec!r} is not a target: give METRIC>=VALUE or METRIC<=VALUE, METRIC one of "
                             f"{', '.join(known)} (e.g. val_top1>=75, val_loss<=0.9), or null for none")
        return cls(metric, operator, value)

    def reached(self, metrics: dict[str, Any]) -> bool:
        value = metrics.get(self.metric)
        if value is None:
            return False
        return value >= self.value if self.operator == ">=" else value <= self.value

    def __str__(self) -> str:
        return f"{self.metric}{self.operator}{self.value:g}"
