"""Which Ray a command runs on: a cluster it joins (``--address``, ``RAY_ADDRESS``) or a new local Ray,
checked before anything starts, started so that a signal stops it whole (``pipeline.interrupts``).

``vitsweep train``, ``tune`` and ``evaluate`` all start Ray through here.
"""
from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import ray

from pipeline import interrupts
from pipeline.console import active_console, quiet_environment
from pipeline.errors import InvalidInputError

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


def local_ray_resources(local_cpus: int | None = None) -> dict[str, float]:
    """What a new local Ray (``start_ray``) will advertise, counted as Ray counts it before it starts:
    the CPUs (``local_cpus``, else the cores this process may use, a container's quota included) and
    the GPUs it sees (CUDA_VISIBLE_DEVICES included), so that work too large for it is refused first."""
    from ray._private.accelerators import get_accelerator_manager_for_resource
    from ray._private.utils import get_num_cpus

    gpus = get_accelerator_manager_for_resource("GPU")
    count = gpus.get_current_node_num_accelerators()
    visible = gpus.get_current_process_visible_accelerator_ids()
    return {"CPU": float(local_cpus or get_num_cpus()),
            "GPU": float(count if visible is None else min(count, len(visible)))}
