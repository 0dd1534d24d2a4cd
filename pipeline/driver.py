"""The Ray driver: which Ray a command runs on, and `vitsweep train`'s start-up sequence.

Everything that can be wrong with the input is checked before any worker starts (exit 2, nothing
written; ``pipeline.runs.check_run``). A new local Ray starts *while* those checks run (both mostly
wait) and is stopped again on bad input; a cluster is joined only after the checks passed.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import ray

from pipeline.config import ExperimentConfig, load_config
from pipeline.data.prepare import prepare_offline_data
from pipeline.errors import InvalidInputError

if TYPE_CHECKING:
    from pipeline.runs import CheckedRun, TrainingOutcome
    from pipeline.tracking import MlflowRun

# Slow 2-core machines need more than Ray's 60 s to start a worker group (import torch, DeepSpeed).
WORKER_GROUP_START_TIMEOUT_S = "600"


def ray_address(address: str | None) -> str:
    """--address, else RAY_ADDRESS (set for a `ray job submit` driver: the cluster it was submitted
    to), else a new local Ray in this process -- never a cluster that merely runs on this machine
    (a bare ray.init() would join one found through /tmp/ray)."""
    return address or os.environ.get("RAY_ADDRESS") or "local"


def start_ray(address: str | None, command: str = "train", local_cpus: int | None = None) -> None:
    """Join ``address`` (or RAY_ADDRESS), else start a local Ray advertising ``local_cpus`` (default: the cores)."""
    if ray.is_initialized():
        return
    if address and address.startswith(("http://", "https://")):
        raise InvalidInputError(
            f"--address {address} is a Ray Jobs API address: run `ray job submit --address {address} "
            f"--working-dir . -- vitsweep {command} ...` (see README) or pass a cluster address (auto, ray://...)"
        )
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", WORKER_GROUP_START_TIMEOUT_S)
    address = ray_address(address)
    local = {"num_cpus": local_cpus} if address == "local" and local_cpus else {}
    ray.init(address=address, logging_level="WARNING", configure_logging=True, log_to_driver=True, **local)


def train_from_config(config: str | None, overrides: list[str], address: str | None,
                      launched_at: float) -> TrainingOutcome:
    """`vitsweep train --config CONFIG --set OVERRIDE ... [--address ADDRESS]`."""
    return train(load_config(config, overrides), address, launched_at)


def train(cfg: ExperimentConfig, address: str | None = None, launched_at: float | None = None) -> TrainingOutcome:
    """Check the input and open the MLflow run on a thread while Ray starts, then train.

    A new local Ray (no --address, no RAY_ADDRESS) starts in the main thread, where Ray installs
    its SIGTERM handler (~5 s, mostly its own processes on the other core), side by side with the
    checks (~3 s); bad input stops that Ray again. A cluster is joined only after the checks passed.
    """
    launched_at = launched_at or time.time()
    local = ray_address(address) == "local"
    if local:
        # ffcv's writer forks worker processes and reports a dead one by interrupting the main
        # thread: a dataset to write (the first run only) is written before Ray starts.
        prepare_offline_data(cfg.with_absolute_paths())

    def prepare() -> tuple[CheckedRun, MlflowRun]:
        # Imported here, on the check thread: these imports (torch, timm, MLflow; seconds on a slow
        # machine) overlap Ray's start-up in the main thread.
        from pipeline.runs import check_run, open_tracking

        run = check_run(cfg, address)
        return run, open_tracking(run)

    with ThreadPoolExecutor(max_workers=1) as pool:
        preparing = pool.submit(prepare)
        if local:
            try:
                start_ray(address)
            except BaseException:
                _, tracking = preparing.result()  # bad input explains more than a failed Ray start
                tracking.finish("FAILED")
                raise
        try:
            run, tracking = preparing.result()
        except BaseException:
            if local:
                ray.shutdown()
            raise
    if not local:
        try:
            start_ray(address)
        except BaseException:
            tracking.finish("FAILED")
            raise
    from pipeline.runs import launch

    return launch(run, tracking, launched_at)
