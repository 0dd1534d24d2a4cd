"""The Tune trainable: one trial is one `vitsweep train` run, reporting each epoch to Tune.

Ray 2.60 (Train V2) cannot hand a ``TorchTrainer`` to ``tune.Tuner``; the pattern that works is a
plain function trainable that builds the trainer and calls ``fit()``. The trial function holds
``tune.trial_cpus`` and mostly waits; its ``TorchTrainer`` asks Ray for its own workers.

A trial gets the same MLflow record as a training run (``pipeline.training.runs``: params, per-epoch
metrics, artifacts, the final model, FAILED on divergence), nested under the sweep's parent run
and keyed by its trial id, so a trial restarted by ``--resume`` continues its run and its Ray
Train checkpoint instead of starting another.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

from ray import tune

from pipeline.ray_connection import WORKER_GROUP_START_TIMEOUT_S
from pipeline.errors import ConfigError, InvalidInputError
from pipeline.training.runs import (CheckedRun, ModelFacts, ResolvedData, begin_attempt, build_trainer, fit_and_record,
                                    open_mlflow_run)
from pipeline.sweeps.planning import crop_sizes, resolve_trial
from pipeline.sweeps.report import knobs_text
from pipeline.sweeps.tune_callback import SweepReportCallback
from pipeline.sweeps.spaces import SearchSpace, log10_param, short_keys
from pipeline.sweeps.tracking import PRUNED, open_child_run
from pipeline.sweeps.trial_stop import TrialStopWatch
from pipeline.trained.teacher import saved_teacher
from pipeline.trained.transfer import saved_initial_weights, sweep_source_location
from pipeline.tracking.store import MlflowRun
from pipeline.training.oom import (OOM, RETRIES_TAG, SPLIT_TAG, ran_out_of_memory, smaller_micro_batch, split,
                                   split_params)


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
    source: str = "vitsweep tune"  # the sweep's command line (MLflow's Source of each trial)
    init_sources: str = ""  # where the sweep saved its trials' model sources (pipeline.trained.transfer)


def trial_run_name(trial_id: str, knobs: dict[str, Any]) -> str:
    return f"{trial_id} {knobs_text(knobs)}"


def knob_params(knobs: dict[str, Any], log_keys: Collection[str] = ()) -> dict[str, Any]:
    """Each searched or derived knob under its short name (``code_size``), beside its dotted param
    (``model.args.code_size``): the runs table shows short, distinct columns (a config param's name
    always has a dot, so a short name never collides with one). A log-uniform knob (``log_keys``) also
    gets its log10, which the sweep's charts plot (``spaces.log10_param``)."""
    names = short_keys(knobs)
    return {**{name: knobs[key] for key, name in names.items()},
            **{log10_param(names[key]): round(math.log10(knobs[key]), 6) for key in log_keys if key in knobs}}


def run_trial(config: dict[str, Any], plan: SweepPlan) -> None:
    launched_at = time.time()
    trial_id = tune.get_context().get_trial_id()
    # Grid and random trials were checked before the sweep; a TPE sample is checked here. An invalid
    # one ends at once without a result and without workers: the sweep records it as pruned.
    try:
        cfg, knobs = resolve_trial(plan.space, plan.base_tree, config["knobs"])
    except ConfigError:
        return
    try:
        sizes = crop_sizes(cfg)  # data.progressive's, each run on the meta device
        facts = ModelFacts.measure(cfg.model, plan.data.num_classes, sizes if cfg.data.progressive else ())
        init = (saved_initial_weights(sweep_source_location(plan.init_sources, cfg.model.init_from,
                                                            cfg.model.init_ema), cfg.model, plan.data.num_classes)
                if cfg.model.init_from else None)
        teacher = (saved_teacher(sweep_source_location(plan.init_sources, cfg.distill.teacher_from,
                                                       cfg.distill.teacher_ema), plan.data.num_classes,
                                 cfg.model.img_size, sizes)
                   if cfg.distill.teacher_from else None)
    except InvalidInputError:
        return
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": trial_id})})
    run = CheckedRun(cfg, plan.data, facts, trial_id, plan.trial_storage, plan.tracking_uri, init, teacher)

    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", WORKER_GROUP_START_TIMEOUT_S)
    mlflow_run = open_child_run(plan.tracking_uri, plan.experiment, plan.parent_run_id, plan.sweep_name, trial_id,
                                trial_run_name(trial_id, knobs), knobs)
    open_mlflow_run(run, mlflow_run, source=f"{plan.source} (trial {trial_id})")
    mlflow_run.log_params(knob_params(knobs, {dim.key for dim in plan.space.dims if dim.is_log}))
    with TrialStopWatch() as stop:
        train_fitting_memory(run, mlflow_run, launched_at, stop)


def train_fitting_memory(run: CheckedRun, mlflow_run: MlflowRun, launched_at: float, stop: TrialStopWatch) -> None:
    """Fit the trial; one whose workers run out of memory goes on at a smaller micro-batch (the same global
    batch: ``pipeline.training.oom``), and one that does not fit at micro-batch 1 ends pruned as ``oom``."""
    asked, retries = run.cfg, 0
    while True:
        cost = begin_attempt(run, mlflow_run)
        trainer = build_trainer(run, mlflow_run, launched_at, cost, callbacks=(SweepReportCallback(), stop.callback),
                                announce=False)
        # An error here may be ASHA stopping the trial: the sweep's TrialRecorder, which knows, records it.
        try:
            fit_and_record(trainer, run, mlflow_run, cost, record_failure=False)
            break
        except Exception as err:
            if stop.requested:  # Tune stopped it and its run was aborted: the function ends, its process takes the next
                break
            if not ran_out_of_memory(err):
                raise
        smaller = smaller_micro_batch(run.cfg)
        if smaller is None:
            mlflow_run.end("FINISHED", f"{PRUNED}: {OOM}: out of memory at micro-batch 1 (asked {split(asked)}: "
                                       "micro-batch x accumulation steps)")
            return
        retries += 1
        print(f"trial {run.run_name}: out of memory at micro-batch {run.cfg.optim.micro_batch_size}; again at "
              f"{smaller.optim.micro_batch_size} x {smaller.optim.grad_accum_steps} accumulation steps (the same "
              "global batch)", flush=True)  # the sweep's log
        mlflow_run.set_tags({SPLIT_TAG: split(smaller), RETRIES_TAG: str(retries)})
        run = replace(run, cfg=smaller)
    if retries:
        mlflow_run.log_params(split_params(run.cfg))
