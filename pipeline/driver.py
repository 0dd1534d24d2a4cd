"""The Ray driver: which Ray a command runs on, and `vitsweep train`'s start-up sequence.

Everything that can be wrong with the input is checked before any worker starts (exit 2, nothing
written; ``pipeline.runs.check_run``). A new local Ray starts *while* those checks run (both mostly
wait) and is stopped again on bad input; a cluster is joined only after the checks passed.
"""
from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import ray

from pipeline.config import ExperimentConfig, load_config
from pipeline.console import LOG_FILE_NAME, active_console, quiet_environment
from pipeline.data.prepare import prepare_offline_data
from pipeline.errors import InvalidInputError
from pipeline.jobs import check_paths_outlive_job

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
    """Join ``address`` (or RAY_ADDRESS), else start a local Ray advertising ``local_cpus`` (default: the cores)."""
    if ray.is_initialized():
        return
    check_address(address)
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", WORKER_GROUP_START_TIMEOUT_S)
    address = ray_address(address)
    local = {"num_cpus": local_cpus} if address == "local" and local_cpus else {}
    quiet_environment()
    active_console().capture_libraries()  # again: importing Ray set up its own handlers
    try:
        # Ray's own logging goes where the command's console puts library output (its log file).
        ray.init(address=address, logging_level="WARNING", configure_logging=False, log_to_driver=True, **local)
    except ConnectionError as err:  # `auto` with no cluster on this machine
        raise InvalidInputError(f"--address {address}: {err}") from None
    active_console().route_ray_output()


def train_from_config(config: str | None, overrides: list[str], address: str | None,
                      launched_at: float) -> TrainingOutcome:
    """`vitsweep train --config CONFIG --set OVERRIDE ... [--address ADDRESS]`."""
    return train(load_config(config, overrides), address, launched_at)


def train(cfg: ExperimentConfig, address: str | None = None, launched_at: float | None = None) -> TrainingOutcome:
    """Check everything, start or join Ray, then open the MLflow run and train.

    A new local Ray (no --address, no RAY_ADDRESS) starts in the main thread, where Ray installs
    its signal handlers (~5 s, mostly its own processes on the other core), side by side with the
    input checks on a thread (~3 s); bad input stops that Ray again. A cluster is joined only after
    the checks passed. The MLflow run (which may be an earlier run continued) is touched only once
    every check passed, the cluster's resources included.
    """
    launched_at = launched_at or time.time()
    check_address(address)
    local = ray_address(address) == "local"
    # A dataset to write (the first run only) is written here, before Ray starts or the checks'
    # thread: ffcv's writer forks its worker processes, best from a process with no other threads.
    check_paths_outlive_job(cfg)  # not into a Ray job's temporary working directory
    prepare_offline_data(cfg.with_absolute_paths())

    def check() -> CheckedRun:
        # Imported here, on the check thread: these imports (torch, timm, MLflow; seconds on a slow
        # machine) overlap Ray's start-up in the main thread.
        from pipeline.runs import check_run

        return check_run(cfg, address)

    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            checking = pool.submit(check)
            if local:
                try:
                    start_ray(address)
                except BaseException:
                    checking.result()  # bad input explains more than a failed Ray start
                    raise
            run = checking.result()
        if not local:
            start_ray(address)
        from pipeline.runs import check_resources, launch, open_tracking

        check_resources(run.cfg, local)
        console = active_console()
        console.open_log(run.run_dir / LOG_FILE_NAME)
        console.line(f"training {run.run_name}: library output in {console.log_path}")
        if run.init is not None:
            run.init.save()  # into the run directory, where every worker reads it
            console.line(f"  starting from {run.init.plan.summary()}")
        tracking = open_tracking(run)
        return launch(run, tracking, launched_at)
    except BaseException:
        ray.shutdown()  # bad input, a failed start, a failed or interrupted run: the workers go too
        raise
