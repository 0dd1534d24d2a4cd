"""`vitsweep doctor`: what this node has, the first thing to run on a new machine.

``--node`` says what the node is for, so each cluster file checks a node for its own job: a check
that cannot apply there is reported ``skip`` with the reason, never failed (a CPU head has no GPU;
a Kubernetes init container has no volume and no tracking URI).
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from pipeline.cli.config import add_config_arguments
from pipeline.config.schema import ExperimentConfig
from pipeline.config.loading import load_config

# What a node is for (`--node`); without it, every check the config calls for.
NODE_ROLES = {
    "head": "a Ray head node: job drivers and Ray Train's controllers, no GPU work",
    "gpu-worker": "a Ray GPU worker node: trains on its GPUs",
    "gpu-driver": "a GPU node before Ray starts (a Kubernetes init container): its NVIDIA driver against this torch",
}
GPU_ROLES = ("gpu-worker", "gpu-driver")  # the GPUs must be usable, whatever the config says


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "doctor", help="Check torch/CUDA (and the NVIDIA driver and GPU metrics when the config uses GPUs), DeepSpeed, FFCV, Ray, MLflow reachability and free disk."
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--node", choices=list(NODE_ROLES), default=None,
        help="what this node is for; checks that cannot apply there are skipped with the reason: "
             + "; ".join(f"{role}: {what}" for role, what in NODE_ROLES.items()),
    )
    parser.set_defaults(run=_run)


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[], str]
    skipped_on: dict[str, str] = field(default_factory=dict)  # node role -> why the check does not apply there


def _torch() -> str:
    import torch

    gpus = torch.cuda.device_count()
    names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(gpus)})) if gpus else "none"
    return (f"torch {torch.__version__}; CUDA build {torch.version.cuda or 'none'}; "
            f"CUDA available: {torch.cuda.is_available()}; GPUs: {gpus} ({names}); "
            f"CPU threads: {torch.get_num_threads()}")


def _needed_on_gpus(cfg: ExperimentConfig, node: str | None, check: Callable[[], str],
                    unavailable: type[Exception]) -> str:
    """``check``'s report; its failure fails the doctor only where GPUs are used (the config's or the node's)."""
    if cfg.scaling.use_gpu or node in GPU_ROLES:
        return check()
    try:
        return check()
    except unavailable as err:
        return f"not used by this config (scaling.use_gpu=false): {err}"


def _gpu(cfg: ExperimentConfig, node: str | None) -> str:
    from pipeline.components.accelerator import GpuUnavailableError, check_gpu_node

    # GPUs this torch cannot run: fail here, not at step 1
    return _needed_on_gpus(cfg, node, check_gpu_node, GpuUnavailableError)


def _gpu_metrics(cfg: ExperimentConfig, node: str | None) -> str:
    from pipeline.tracking.system_metrics import GpuMetricsUnavailable, gpu_metrics_source

    # a GPU run whose System metrics tab would lack its GPUs
    return _needed_on_gpus(cfg, node, gpu_metrics_source, GpuMetricsUnavailable)


def _deepspeed() -> str:
    import torch

    if not torch.cuda.is_available():
        # What DeepSpeed would pick anyway, said explicitly so it doesn't log a warning about it.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return (f"deepspeed {deepspeed.__version__}; accelerator {accelerator.device_name()}; "
            f"communication backend {accelerator.communication_backend_name()}")


def _ffcv() -> str:
    import torch

    threads = torch.get_num_threads()
    import ffcv  # noqa: F401  (sets torch's thread count to 1 on import; restored below)

    torch.set_num_threads(threads)
    return f"ffcv {version('ffcv')} imports"


def _ray() -> str:
    import ray

    return f"ray {ray.__version__}"


def _timm() -> str:
    import timm

    import models

    return f"timm {timm.__version__}; vitsweep variants registered: {len(models.VARIANTS)}"


def _mlflow(cfg: ExperimentConfig) -> str:
    import mlflow

    from pipeline.tracking.connection import check_reachable, resolve_tracking_uri

    return f"mlflow {mlflow.__version__}; {check_reachable(resolve_tracking_uri(cfg))}"


def _nccl_hangs(cfg: ExperimentConfig, node: str | None) -> str:
    """Whether Ray Train's NCCL hang detector can ask this node (``pipeline.training.nccl_hangs``): a missing
    client is reported, not failed (the run trains; a hang then waits for NCCL's own timeout)."""
    from pipeline.training.nccl_hangs import ras_client

    if not cfg.scaling.use_gpu and node not in GPU_ROLES:
        return "not used by this config (scaling.use_gpu=false: gloo, no NCCL)"
    return ras_client()


def _disk(cfg: ExperimentConfig) -> str:
    from pipeline.training.locations import check_can_create, run_directories

    check_can_create(run_directories(cfg))  # the run's storage and this node's caches can be written
    storage = Path(cfg.run.storage_path).expanduser().resolve()
    existing = next(p for p in [storage, *storage.parents] if p.exists())
    free_gb = shutil.disk_usage(existing).free / 1e9
    return f"{free_gb:.1f} GB free at {existing} (run storage: {storage})"


# Before Ray starts on a GPU node only its driver is checked: the image's build imported the libraries.
DRIVER_ONLY = {"gpu-driver": "only the NVIDIA driver is checked before Ray starts (the image's build imports the rest)"}


def checks(cfg: ExperimentConfig, node: str | None) -> list[Check]:
    return [
        Check("python", lambda: f"{platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs"),
        Check("torch", _torch),
        Check("gpu", lambda: _gpu(cfg, node),
              {"head": "the head runs no GPU work; each GPU node checks its own driver"}),
        Check("gpu_metrics", lambda: _gpu_metrics(cfg, node),
              {"head": "the head runs no GPU work; each GPU node reports its own", **DRIVER_ONLY}),
        Check("nccl_hangs", lambda: _nccl_hangs(cfg, node),
              {"head": "the head runs no collective; each GPU node has its own NCCL RAS client", **DRIVER_ONLY}),
        Check("timm", _timm, DRIVER_ONLY),
        Check("deepspeed", _deepspeed, DRIVER_ONLY),
        Check("ffcv", _ffcv, DRIVER_ONLY),
        Check("ray", _ray, DRIVER_ONLY),
        Check("mlflow", lambda: _mlflow(cfg),
              {"gpu-driver": "an init container has no tracking URI (runs get theirs from the job's runtime environment)"}),
        Check("disk", lambda: _disk(cfg),
              {"gpu-driver": "an init container mounts no volume (the run storage is the Ray container's)"}),
    ]


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # an invalid config exits 2 before any check
    failed = skipped = 0
    found = checks(cfg, args.node)
    width = max(len(check.name) for check in found)
    for check in found:
        if args.node in check.skipped_on:
            status, detail = "skip", f"not on a {args.node} node: {check.skipped_on[args.node]}"
            skipped += 1
        else:
            try:
                status, detail = "ok", check.run()
            except Exception as err:  # a doctor reports every failure, it does not stop at the first
                status, detail = "FAIL", f"{type(err).__name__}: {err}"
                failed += 1
        print(f"{status:>4}  {check.name:<{width}} {detail}")
    ran = len(found) - skipped
    print(f"\n{ran - failed}/{ran} checks passed" + (f", {skipped} skipped on a {args.node} node" if skipped else ""))
    return 1 if failed else 0
