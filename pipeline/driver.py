"""The Ray driver: which Ray a command runs on, and `vitsweep train`'s start-up sequence.

Everything that can be wrong with the input is checked before any worker starts (exit 2, nothing
written; ``pipeline.runs.check_run``). A new local Ray starts *while* those checks run (both mostly
wait) and is stopped again on bad input; a cluster is joined only after the checks passed.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import ray

from pipeline import interrupts
from pipeline.config.schema import ExperimentConfig
from pipeline.config.loading import load_config
from pipeline.console import LOG_FILE_NAME, active_console, quiet_environment
from pipeline.data.prepare import prepare_offline_data
from pipeline.errors import Interrupted, InvalidInputError
from pipeline.jobs import check_paths_outlive_job
from pipeline.locations import check_can_create, run_directories
from pipeline.components.lr_scaling import describe_lr

if TYPE_CHECKING:
    from pipeline.runs import CheckedRun, TrainingOutcome

# Slow 2-core machines need more than Ray's 60 s to start a worker group (import torch, DeepSpeed).
WORKER_GROUP_START_TIMEOUT_S = "600"
ADDRESS_PROBE_TIMEOUT_S = 5.0


def ray_address(address: str | None) -> str:
    """--address, else RAY_ADDRESS (set for a `ray job submit` driver: the cluster it was submitted
    to), else a new local Ray in this process -- never a cluster that merely runs on this machine
    (a bare ray.init() would join one found through /tmp/ray)."""
    return address or os.environ.get("RAY_ADDRESS") or "local"


def check_address(address: str | None) -> None:
    """Refuse an address no driver can join, before anything starts: a Jobs API URL, or a cluster
    address where nothing answers (``ray.init`` would retry it for minutes)."""
    if address and address.startswith(("http://", "https://")):
        raise InvalidInputError(
            f"--address {address} is a Ray Jobs API address: run `ray job submit --address {address} "
            f"--working-dir . -- vitsweep ...` (see README) or pass a cluster address (auto, ray://...)"
        )
    target = ray_address(address)
    if target in ("local", "auto"):
        return
    host, _, port = target.removeprefix("ray://").rpartition(":")
    if not port.isdigit():
        raise InvalidInputError(f"Ray address {target!r} must be auto, host:port or ray://host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=ADDRESS_PROBE_TIMEOUT_S).close()
    except OSError as err:
        raise InvalidInputError(
            f"no Ray cluster answers at {target} ({err.strerror or err}); start one (`ray start --head`) or check "
            "the address (RAY_ADDRESS, --address)"
        ) from None


def start_ray(address: str | None, command: str = "train", local_cpus: int | None = None) -> None:
    """Join ``address`` (or RAY_ADDRESS), else start a local Ray advertising ``local_cpus`` (default: the cores).

    A local Ray's start is not interrupted in place: a signal is held until Ray is up and then raised,
    so that the caller shuts a whole Ray down (``pipeline.interrupts``). Joining a cluster starts
    nothing here and stays interruptible (it may wait long for an unreachable head)."""
    if ray.is_initialized():
        return
    check_address(address)
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", WORKER_GROUP_START_TIMEOUT_S)
    address = ray_address(address)
    local = {"num_cpus": local_cpus} if address == "local" and local_cpus else {}
    quiet_environment()
    active_console().capture_libraries()  # again: importing Ray set up its own handlers
    starting = interrupts.held() if address == "local" else interrupts.raised()
    try:
        with starting, _ray_leaves_signals_to_vitsweep():
            # Ray's own logging goes where the command's console puts library output (its log file).
            ray.init(address=address, logging_level="WARNING", configure_logging=False, log_to_driver=True, **local)
    except ConnectionError as err:  # `auto` with no cluster on this machine
        raise InvalidInputError(f"--address {address}: {err}") from None
    active_console().route_ray_output()


@contextlib.contextmanager
def _ray_leaves_signals_to_vitsweep() -> Iterator[None]:
    """``ray.init`` in the main thread installs a SIGTERM handler that exits without stopping what it
    started, and the driver's C++ core worker a failure handler that turns SIGTERM into an abort with
    a stack dump; the command's own handlers (``pipeline.interrupts``) stop Ray instead. Ray 2.60 has
    no option for the first: its installer is skipped for the call; the second is Ray's
    RAY_DISABLE_FAILURE_SIGNAL_HANDLER, read from ``ray_constants`` when the core worker starts, set
    for this process only (workers keep their crash dumps)."""
    from ray._private import ray_constants, utils

    installer, failure_handler_off = utils.set_sigterm_handler, ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    utils.set_sigterm_handler = lambda handler: None
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        yield
    finally:
        utils.set_sigterm_handler, ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = installer, failure_handler_off


def train_from_config(config: str | None, overrides: list[str], address: str | None,
                      launched_at: float) -> TrainingOutcome:
    """`vitsweep train --config CONFIG --set OVERRIDE ... [--address ADDRESS]`."""
    return train(load_config(config, overrides), address, launched_at)


def train(cfg: ExperimentConfig, address: str | None = None, launched_at: float | None = None) -> TrainingOutcome:
    """Check everything, start or join Ray, then open the MLflow run and train.

    A new local Ray (no --address, no RAY_ADDRESS) starts in the main thread (~5 s, mostly its own
    processes on the other core; the processes it starts share the fate of the thread that started
    them) side by side with the input checks on a daemon thread (~3 s); bad input stops that Ray
    again. A signal stops everything at once, but for Ray's start, which ends first so that Ray is
    stopped whole (``start_ray``). A cluster is joined only after the checks passed. The MLflow run
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
        # Imported here, on the check thread: these imports (torch, timm, MLflow; seconds on a slow
        # machine) overlap Ray's start-up in the main thread.
        from pipeline.runs import check_run

        return check_run(cfg, address)

    tracking = None
    try:
        checking = interrupts.OnThread(check, "vitsweep-checks")
        if local:
            try:
                start_ray(address)
            except Interrupted:
                raise  # at once: the checks' thread ends with the process
            except BaseException:
                checking.result()  # bad input explains more than a failed Ray start
                raise
        run = checking.result()
        if not local:
            start_ray(address)
        from pipeline.runs import check_resources, launch, open_tracking, record_interrupt

        check_resources(run.cfg, local)
        console = active_console()
        console.open_log(run.run_dir / LOG_FILE_NAME)
        console.line(f"training {run.run_name}: library output in {console.log_path}")
        if run.init is not None:
            run.init.save()  # into the run directory, where every worker reads it
            console.line(f"  starting from {run.init.plan.summary()}")
        console.line(f"  {describe_lr(run.cfg.optim, run.cfg.scaling.num_workers)}")
        with interrupts.held():  # the MLflow run is opened whole: a signal meanwhile ends it KILLED below
            tracking = open_tracking(run)
        return launch(run, tracking, launched_at)
    except BaseException as err:
        # Bad input, a failed start, a failed or interrupted run: Ray's processes and the workers go too.
        with interrupts.ignored():
            ray.shutdown(wait_for_processes=True)
        if isinstance(err, Interrupted) and not err.outcome:  # not recorded by the fit
            if tracking is None:
                err.outcome = "stopped before training started; nothing was recorded"
            else:
                record_interrupt(tracking, err)
        raise
