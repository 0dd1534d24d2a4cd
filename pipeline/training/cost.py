"""What a run costs: its accelerator-hours, counting restarts, and what reaching ``run.target_metric`` took.

A run holds ``scaling.num_workers x gpus_per_worker`` GPUs (``x cpus_per_worker`` CPU cores on CPU) from
the moment its trainer starts until it ends, whatever they do meanwhile (starting, restarting a lost
worker group, validating, checkpointing): that is what a cluster bills. So an attempt costs its wall
time times what it holds, and a run continued by the same command after a kill (or a sweep trial by
``--resume``) adds its attempt to what its MLflow run had recorded.

Logged as MLflow step metrics beside each epoch's (the ``cost/`` section of the UI's charts), and once
more when the attempt ends, at its last epoch's step: ``cost/accelerator_hours`` and
``cost/wall_hours``, running totals; at the first epoch that reaches the target, ``cost/target_epoch``,
``cost/wall_hours_to_target`` and ``cost/accelerator_hours_to_target``. The tag ``cost.unit`` says
which hours they are (GPU-hours or CPU-core-hours).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pipeline.config.schema import ExperimentConfig
from pipeline.config.specs import MetricTarget
from pipeline.console import duration

ACCELERATOR_HOURS = "cost/accelerator_hours"
WALL_HOURS = "cost/wall_hours"
TARGET_EPOCH = "cost/target_epoch"
WALL_HOURS_TO_TARGET = "cost/wall_hours_to_target"
ACCELERATOR_HOURS_TO_TARGET = "cost/accelerator_hours_to_target"
UNIT_TAG = "cost.unit"
GPU_HOURS, CPU_CORE_HOURS = "GPU-hours", "CPU-core-hours"


def accelerators_held(cfg: ExperimentConfig) -> float:
    """The GPUs (on CPU: cores) a run's workers hold together."""
    scaling = cfg.scaling
    return scaling.num_workers * (scaling.gpus_per_worker if scaling.use_gpu else scaling.cpus_per_worker)


def cost_unit(cfg: ExperimentConfig) -> str:
    return GPU_HOURS if cfg.scaling.use_gpu else CPU_CORE_HOURS


@dataclass
class RunCost:
    """The spend of one attempt of a run, on top of what earlier attempts recorded, and its target."""

    accelerators: float
    unit: str  # GPU_HOURS or CPU_CORE_HOURS
    started: float  # time.time() when this attempt's trainer was built
    earlier_wall_hours: float = 0.0
    earlier_accelerator_hours: float = 0.0
    target: MetricTarget | None = None
    target_reached: bool = False  # by this attempt or an earlier one: logged once

    @classmethod
    def begin(cls, cfg: ExperimentConfig, recorded: dict[str, float]) -> RunCost:
        """This attempt starts now; ``recorded``: the run's MLflow metrics so far (earlier attempts')."""
        return cls(accelerators_held(cfg), cost_unit(cfg), time.time(), recorded.get(WALL_HOURS, 0.0),
                   recorded.get(ACCELERATOR_HOURS, 0.0), cfg.run.target, TARGET_EPOCH in recorded)

    def so_far(self, now: float | None = None) -> dict[str, float]:
        """The run's running totals: its earlier attempts' and this one's until ``now``."""
        hours = ((time.time() if now is None else now) - self.started) / 3600
        return {WALL_HOURS: self.earlier_wall_hours + hours,
                ACCELERATOR_HOURS: self.earlier_accelerator_hours + hours * self.accelerators}

    def at_epoch(self, reported: dict[str, Any]) -> dict[str, float]:
        """The cost metrics to log beside an epoch's report: the totals, and, the first time the report
        reaches the target, the epoch and what it took."""
        totals = self.so_far()
        if self.target is None or self.target_reached or not self.target.reached(reported):
            return totals
        self.target_reached = True
        return {**totals, TARGET_EPOCH: int(reported["epoch"]), WALL_HOURS_TO_TARGET: totals[WALL_HOURS],
                ACCELERATOR_HOURS_TO_TARGET: totals[ACCELERATOR_HOURS]}


    def describe_target_reached(self, cost: dict[str, float]) -> str:
        """The console's line for the epoch that reached the target (``cost``: ``at_epoch``'s)."""
        return (f"reached {self.target} at epoch {int(cost[TARGET_EPOCH])}, after "
                f"{duration(cost[WALL_HOURS_TO_TARGET] * 3600)} and {cost[ACCELERATOR_HOURS_TO_TARGET]:.3g} {self.unit}")
