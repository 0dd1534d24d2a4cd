"""`vitsweep train`'s start-up sequence: check, start or join Ray (``pipeline.ray_connection``), train.

Everything that can be wrong with the input is checked before Ray starts (exit 2, nothing written, no
Ray process; ``pipeline.training.runs.check_run``). Ray then starts (or is joined) while a new MLflow
store is created, and the run is opened and launched.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import ray

from pipeline import interrupts
from pipeline.config.schema import ExperimentConfig
from pipeline.config.loading import load_config
from pipeline.console import LOG_FILE_NAME, active_console
from pipeline.data.prepare import prepare_offline_data
from pipeline.errors import Interrupted
from pipeline.training.jobs import check_paths_outlive_job
from pipeline.training.locations import check_can_create, run_directories
from pipeline.components.lr_scaling import describe_lr
from pipeline.ray_connection import check_address, local_ray_resources, ray_address, start_ray

if TYPE_CHECKING:
    from pipeline.training.runs import CheckedRun, TrainingOutcome


def train_from_config(config: str | None, overrides: list[str], address: str | None,
                      launched_at: float) -> TrainingOutcome:
    """`vitsweep train --config CONFIG --set OVERRIDE ... [--address ADDRESS]`."""
    return train(load_config(config, overrides), address, launched_at)


def train(cfg: ExperimentConfig, address: str | None = None, launched_at: float | None = None) -> TrainingOutcome:
    """Check everything, start or join Ray, then open the MLflow run and train.

    The input checks (config, paths, datasets, the model built on the meta device, the MLflow store,
    a restarted run's checkpoint, the weights it starts from, whether the workers fit a local Ray) run
    first, the slow ones on a thread of their own so that a signal ends the command at once: bad input
    starts no Ray process. A new local Ray (no
    --address, no RAY_ADDRESS) then starts in the main thread (~5 s, mostly its own processes on the
    other core; the processes it starts share the fate of the thread that started them), side by side
    with the creation of a new local MLflow store (~4 s of schema migrations). Ray's start is not
    interrupted in place, but ends first so that Ray is stopped whole (``start_ray``). The MLflow run
    (which may be an earlier run continued) is touched only once every check passed, the cluster's
    resources included, and from then on every ending is recorded in it.
    """
    launched_at = launched_at or time.time()
    check_address(address)
    local = ray_address(address) == "local"
    # A dataset to write (the first run only) is written here, before Ray starts or the checks'
    # thread: ffcv's writer forks its worker processes, best from a process with no other threads.
    check_paths_outlive_job(cfg)  # not into a Ray job's temporary working directory
    check_can_create(run_directories(cfg))
    prepare_offline_data(cfg.with_absolute_paths())

    def check() -> CheckedRun:
        from pipeline.training.runs import check_run  # torch, timm, MLflow: seconds, on the checks' thread

        return check_run(cfg, address)

    mlflow_run = None
    try:
        run = interrupts.OnThread(check, "vitsweep-checks").result()
        from pipeline.training.runs import (check_resources, check_steps_per_epoch, create_store, launch,
                                            open_mlflow_run, record_interrupt)

        if local:
            check_resources(run.cfg, local, local_ray_resources())
            check_steps_per_epoch(run.cfg, run.data)
        creating = interrupts.OnThread(lambda: create_store(run), "vitsweep-store")
        start_ray(address)
        creating.result()
        if not local:
            check_resources(run.cfg, local, ray.cluster_resources())
            check_steps_per_epoch(run.cfg, run.data)
        console = active_console()
        console.open_log(run.run_dir / LOG_FILE_NAME)
        console.line(f"training {run.run_name}: library output in {console.log_path}")
        if run.init is not None:
            run.init.save()  # into the run directory, where every worker reads it
            console.line(f"  starting from {run.init.plan.summary()}")
        if run.teacher is not None:
            run.teacher.save()  # as the initial weights: where every worker reads it
            console.line(f"  distilling from {run.cfg.distill.teacher_from} ({run.cfg.distill.kind})")
        console.line(f"  {describe_lr(run.cfg.optim, run.cfg.scaling.num_workers)}")
        with interrupts.held():  # the MLflow run is opened whole: a signal meanwhile ends it KILLED below
            mlflow_run = open_mlflow_run(run)
        return launch(run, mlflow_run, launched_at)
    except BaseException as err:
        # Bad input, a failed start, a failed or interrupted run: Ray's processes and the workers go too.
        with interrupts.ignored():
            ray.shutdown(wait_for_processes=True)
        if isinstance(err, Interrupted) and not err.outcome:  # not recorded by the fit
            if mlflow_run is None:
                err.outcome = "stopped before training started; nothing was recorded"
            else:
                record_interrupt(mlflow_run, err)
        raise
