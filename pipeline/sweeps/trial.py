"""The Tune trainable: one trial is one `vitsweep train` run, reporting each epoch to Tune.

Ray 2.60 (Train V2) cannot hand a ``TorchTrainer`` to ``tune.Tuner``; the pattern that works is a
plain function trainable that builds the trainer and calls ``fit()``. The trial function holds
``tune.trial_cpus`` and mostly waits; its ``TorchTrainer`` asks Ray for its own workers.

A trial gets the same MLflow record as a training run (``pipeline.driver``: params, per-epoch
metrics, artifacts, the final model, FAILED on divergence), nested under the sweep's parent run
and keyed by its trial id, so a trial restarted by ``--resume`` continues its run and its Ray
Train checkpoint instead of starting another.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray.tune.integration.ray_train import TuneReportCallback

from pipeline.driver import ResolvedData
from pipeline.sweeps.spaces import SearchSpace
from pipeline.tracking import DIVERGED_TAG

TIME_ATTR = "epochs_done"  # what ASHA's grace period and rungs count: epochs completed (1-based)


@dataclass(frozen=True)
class SweepPlan:
    """What every trial needs, resolved once by the sweep's driver (sent via tune.with_parameters)."""

    sweep_name: str
    space: SearchSpace
    base_tree: dict[str, Any]  # the resolved base config (preset, fixed, --set; absolute paths)
    data: ResolvedData
    tracking_uri: str
    experiment: str
    parent_run_id: str
    trial_storage: str  # where each trial's Ray Train run lives (local path or URI), one dir per trial id


class SweepReportCallback(TuneReportCallback):
    """Ray Train -> Tune, adding ``epochs_done``; a divergence report is not a result.

    The diverged worker reports no metrics (Tune would reject the result); the trial then fails
    through ``fit_and_record`` (MLflow FAILED) and Tune records the error, the sweep goes on.
    """

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        reported = metrics[0]
        if reported.get(DIVERGED_TAG):
            return
        super().after_report(run_context, [{**reported, TIME_ATTR: int(reported["epoch"]) + 1}, *metrics[1:]],
                             checkpoint)


def short_key(key: str) -> str:
    """``model.args.code_size`` -> ``code_size``; ``model.args.mha_ratio_range.0`` -> ``mha_ratio_range.0``."""
    parts = key.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]


def trial_run_name(trial_id: str, knobs: dict[str, Any]) -> str:
    return f"{trial_id} " + " ".join(f"{short_key(k)}={v}" for k, v in knobs.items())


def run_trial(config: dict[str, Any], plan: SweepPlan) -> None:
    from ray import tune

    from pipeline.driver import WORKER_GROUP_START_TIMEOUT_S, build_trainer, fit_and_record, open_mlflow_run
    from pipeline.errors import ConfigError
    from pipeline.sweeps.planning import model_problem, resolve_trial
    from pipeline.sweeps.tracking import open_child_run

    launched_at = time.time()
    trial_id = tune.get_context().get_trial_id()
    # Grid and random trials were checked before the sweep; a TPE sample is checked here. An invalid
    # one ends at once without a result and without workers: the sweep records it as pruned.
    try:
        cfg, knobs = resolve_trial(plan.space, plan.base_tree, config["knobs"])
    except ConfigError:
        return
    if model_problem(cfg.model) is not None:
        return
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": trial_id})})

    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", WORKER_GROUP_START_TIMEOUT_S)
    run_id = open_child_run(plan.tracking_uri, plan.experiment, plan.parent_run_id, plan.sweep_name, trial_id,
                            trial_run_name(trial_id, knobs), knobs)
    open_mlflow_run(cfg, plan.data, trial_id, Path(trial_id), plan.tracking_uri, run_id=run_id)
    trainer = build_trainer(cfg, plan.data, trial_id, plan.trial_storage, plan.tracking_uri, run_id, launched_at,
                            callbacks=(SweepReportCallback(),))
    # An error here may be ASHA stopping the trial: the sweep's TrialRecorder, which knows, records it.
    fit_and_record(trainer, cfg, plan.data, plan.tracking_uri, run_id, record_failure=False)
