"""The GPU a node trains on: is it usable with this torch, how fast can it be, and its math settings.

- ``check_gpu_node()``: torch's CUDA build against the installed NVIDIA driver, then the GPUs torch
  sees; a clear ``GpuUnavailableError`` naming both versions and the fix, before any work starts
  (``vitsweep doctor`` and every GPU worker call it). A CUDA wheel on a too-old driver otherwise
  fails at the first allocation, deep inside FFCV or DeepSpeed, and Ray restarts the group in vain.
- ``PEAK_TFLOPS`` / ``peak_tflops``: dense peak of each GPU per math mode, for model FLOPs
  utilisation (``training_tflops``, ``mfu``).
- ``configure_gpu_math``: TF32 matmuls/convolutions (when fp32 runs may use them) and cuDNN autotuning.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import torch

# Oldest Linux driver each CUDA major runs on (minor version compatibility: a CUDA 13.2 build runs
# on any R580+ driver). NVIDIA "CUDA Compatibility", Table "CUDA Toolkit 11.x, 12.x, and 13.x
# Driver Version Ranges"; 11.x and 12.x need these exact releases of their branch.
MIN_DRIVER_FOR_CUDA: dict[int, tuple[int, ...]] = {
    11: (450, 80, 2),
    12: (525, 60, 13),
    13: (580,),
}

PROC_DRIVER_VERSION = Path("/proc/driver/nvidia/version")  # the loaded kernel module, also inside containers
GKE_NVIDIA_BIN = "/usr/local/nvidia/bin"  # where GKE's device plugin mounts nvidia-smi (not on PATH)

# Dense (no 2:4 sparsity) peak TFLOP/s per math mode, from NVIDIA's datasheets. Keys are matched
# against torch.cuda.get_device_name() in order, so the specific names come before the general ones.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM5 (HBM3)
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM: H100's compute, more HBM
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},  # SXM4 and PCIe, 40 and 80 GB
}


class GpuUnavailableError(RuntimeError):
    """The node cannot train on its GPUs with this torch (no driver, an old driver, no GPU)."""


def parse_driver_version(text: str) -> tuple[int, ...]:
    """``580.65.06`` from nvidia-smi's ``driver_version`` or the first line of /proc/driver/nvidia/version."""
    match = re.search(r"(?<![\d.])(\d{3,4})\.(\d+)(?:\.(\d+))?(?![\d.])", text)
    if match is None:
        raise ValueError(f"no NVIDIA driver version (like 580.65.06) in {text.strip()[:200]!r}")
    return tuple(int(part) for part in match.groups() if part is not None)


def installed_driver_version() -> str | None:
    """The loaded NVIDIA kernel driver's version, or None where there is none.

    /proc first (no process to start; present wherever the driver is loaded, containers included),
    then nvidia-smi (NVML) where /proc is hidden."""
    if PROC_DRIVER_VERSION.is_file():
        first_line = PROC_DRIVER_VERSION.read_text().splitlines()[0]
        return ".".join(map(str, parse_driver_version(first_line)))
    nvidia_smi = shutil.which("nvidia-smi") or shutil.which("nvidia-smi", path=GKE_NVIDIA_BIN)
    if nvidia_smi:
        result = subprocess.run([nvidia_smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=60)
        if result.returncode == 0 and result.stdout.strip():
            return ".".join(map(str, parse_driver_version(result.stdout.splitlines()[0])))
    return None


def minimum_driver(cuda: str) -> tuple[int, ...]:
    """The oldest NVIDIA driver that runs a CUDA ``cuda`` (e.g. "13.2") build."""
    major = int(cuda.split(".")[0])
    if major not in MIN_DRIVER_FOR_CUDA:
        raise GpuUnavailableError(
            f"torch's CUDA {cuda} has no known minimum driver (known: CUDA {sorted(MIN_DRIVER_FOR_CUDA)}); "
            "add it to pipeline/components/accelerator.py MIN_DRIVER_FOR_CUDA from NVIDIA's CUDA compatibility table")
    return MIN_DRIVER_FOR_CUDA[major]


def check_driver_supports(cuda: str, driver: str) -> None:
    """Raise ``GpuUnavailableError`` when NVIDIA driver ``driver`` cannot run a CUDA ``cuda`` build."""
    minimum = minimum_driver(cuda)
    if parse_driver_version(driver) < minimum:
        raise GpuUnavailableError(
            f"NVIDIA driver {driver} is too old for torch {torch.__version__}'s CUDA {cuda}: CUDA {cuda.split('.')[0]}.x "
            f"needs driver >= {'.'.join(map(str, minimum))} (the R{minimum[0]} branch or newer). "
            f"Fix: boot the GPU nodes with an R{minimum[0]}+ "
            f"driver (the images named in cluster/*.yaml), or install a torch built for the node's CUDA "
            f"(`pip install torch --index-url https://download.pytorch.org/whl/cuXXX` with XXX <= the driver's CUDA)")


def check_gpu_node() -> str:
    """Check that this process can train on CUDA GPUs; a one-line summary, else ``GpuUnavailableError``.

    Creates no CUDA context (NVML/device queries only), so it is safe before ``torch.cuda.set_device``."""
    cuda = torch.version.cuda
    if cuda is None:
        raise GpuUnavailableError(
            f"torch {torch.__version__} is a CPU-only build; install the CUDA wheel (constraints.txt's torch)")
    driver = installed_driver_version()
    if driver is not None:
        check_driver_supports(cuda, driver)
    if not torch.cuda.is_available():
        if driver is None:
            raise GpuUnavailableError(
                f"CUDA available: False and no NVIDIA driver found (no {PROC_DRIVER_VERSION}, no nvidia-smi) for "
                f"torch's CUDA {cuda}; GPU nodes need driver >= {'.'.join(map(str, minimum_driver(cuda)))} and "
                "the container started with the GPUs (`--gpus all`, or a nvidia.com/gpu resource on Kubernetes)")
        raise GpuUnavailableError(
            f"CUDA available: False with NVIDIA driver {driver} and torch's CUDA {cuda}: no GPU is visible to this "
            "process (CUDA_VISIBLE_DEVICES, or the container was started without its GPUs)")
    # No readable version but CUDA initialises (a driver too old for the runtime would not): usable.
    count = torch.cuda.device_count()
    names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(count)}))
    return f"NVIDIA driver {driver or '(version unreadable)'} runs torch's CUDA {cuda}; {count} GPU(s): {names}"


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of ``device_name`` (torch.cuda.get_device_name) in ``precision`` (bf16, fp16,
    tf32, fp32), or None for a GPU not in ``PEAK_TFLOPS``."""
    for key, peaks in PEAK_TFLOPS.items():
        if key in device_name:
            if precision not in peaks:
                raise ValueError(f"precision={precision!r} is not a math mode; valid: {sorted(peaks)}")
            return peaks[precision]
    return None


def math_mode(precision: str, tf32: bool) -> str:
    """The peak that bounds a run: its half precision, or fp32 through TF32 tensor cores when allowed."""
    return "tf32" if precision == "fp32" and tf32 else precision


def training_tflops(gmacs_per_image: float, images_per_sec: float) -> float:
    """Achieved model TFLOP/s of training: forward + backward = 3 forwards, 2 FLOPs per multiply-add
    (``models.measure.count_gmacs`` counts multiply-adds)."""
    return 3 * 2 * gmacs_per_image * images_per_sec / 1e3


def mfu(gmacs_per_image: float, images_per_sec: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved training TFLOP/s over the device's peak TFLOP/s (0..1)."""
    return training_tflops(gmacs_per_image, images_per_sec) / peak


def configure_gpu_math(tf32: bool) -> None:
    """TF32 for fp32 matmuls and convolutions (``tf32``: ~8x A100's IEEE fp32 throughput, 10-bit
    mantissa) or IEEE fp32 everywhere; cuDNN autotuning for the fixed image size. Process-wide."""
    precision = "tf32" if tf32 else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision
    torch.backends.cudnn.benchmark = True  # every batch has the same shape: tune each conv once


def prepare_gpu_worker(tf32: bool) -> str:
    """What each GPU worker runs first, before any CUDA allocation: ``check_gpu_node()`` (fails with
    the versions and the fix) and ``configure_gpu_math(tf32)``. Returns the node's summary line."""
    summary = check_gpu_node()
    configure_gpu_math(tf32)
    return summary
