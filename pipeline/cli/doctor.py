"""`vitsweep doctor`: what this node has, the first thing to run on a new machine."""
from __future__ import annotations

import argparse
import os
import platform
import shutil
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

from pipeline.cli.config import add_config_arguments
from pipeline.config import ExperimentConfig, load_config


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "doctor", help="Check torch/CUDA (and the NVIDIA driver when the config uses GPUs), DeepSpeed, FFCV, Ray, MLflow reachability and free disk."
    )
    add_config_arguments(parser)
    parser.set_defaults(run=_run)


def _torch() -> str:
    import torch

    gpus = torch.cuda.device_count()
    names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(gpus)})) if gpus else "none"
    return (f"torch {torch.__version__}; CUDA build {torch.version.cuda or 'none'}; "
            f"CUDA available: {torch.cuda.is_available()}; GPUs: {gpus} ({names}); "
            f"CPU threads: {torch.get_num_threads()}")


def _gpu(cfg: ExperimentConfig) -> str:
    from pipeline.accelerator import GpuUnavailableError, check_gpu_node

    if cfg.scaling.use_gpu:  # a GPU job on a node whose GPUs cannot run this torch: fail here, not at step 1
        return check_gpu_node()
    try:
        return check_gpu_node()
    except GpuUnavailableError as err:
        return f"not used by this config (scaling.use_gpu=false): {err}"


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

    from pipeline.tracking import check_reachable, resolve_tracking_uri

    return f"mlflow {mlflow.__version__}; {check_reachable(resolve_tracking_uri(cfg))}"


def _disk(cfg: ExperimentConfig) -> str:
    from pipeline.locations import check_can_create, run_directories

    check_can_create(run_directories(cfg))  # the run's storage and this node's caches can be written
    storage = Path(cfg.run.storage_path).expanduser().resolve()
    existing = next(p for p in [storage, *storage.parents] if p.exists())
    free_gb = shutil.disk_usage(existing).free / 1e9
    return f"{free_gb:.1f} GB free at {existing} (run storage: {storage})"


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # an invalid config exits 2 before any check
    checks: list[tuple[str, Callable[[], str]]] = [
        ("python", lambda: f"{platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs"),
        ("torch", _torch),
        ("gpu", lambda: _gpu(cfg)),
        ("timm", _timm),
        ("deepspeed", _deepspeed),
        ("ffcv", _ffcv),
        ("ray", _ray),
        ("mlflow", lambda: _mlflow(cfg)),
        ("disk", lambda: _disk(cfg)),
    ]
    failed = 0
    for name, check in checks:
        try:
            status, detail = "ok", check()
        except Exception as err:  # a doctor reports every failure, it does not stop at the first
            status, detail = "FAIL", f"{type(err).__name__}: {err}"
            failed += 1
        print(f"{status:>4}  {name:<10} {detail}")
    print(f"\n{len(checks) - failed}/{len(checks)} checks passed")
    return 1 if failed else 0
