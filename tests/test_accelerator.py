"""pipeline/components/accelerator.py: the NVIDIA driver against torch's CUDA build (with the real strings
nvidia-smi and /proc print), `vitsweep doctor` failing a GPU config on a node without usable GPUs,
the peak TFLOP/s table and MFU, and the GPU math settings."""
import subprocess
import sys

import pytest
import torch

from pipeline.components.accelerator import (GpuUnavailableError, check_driver_supports, configure_gpu_math, mfu,
    parse_driver_version, peak_tflops, training_tflops)
from pipeline.cli import EXIT_OK, main
from conftest import VITSWEEP, vitsweep_env


@pytest.mark.parametrize("text,version", [
    ("580.65.06\n", (580, 65, 6)),  # nvidia-smi --query-gpu=driver_version --format=csv,noheader
    # /proc/driver/nvidia/version, proprietary and open kernel modules
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.133.20  Fri Mar 14 04:41:41 UTC 2025", (570, 133, 20)),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  "
     "(dvs-builder@U22-I3-AE18-09-2)  Thu Sep 25 23:18:38 UTC 2025", (580, 95, 5)),
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.54  Tue Jun  6 22:20:39 UTC 2023", (535, 54)),
], ids=["nvidia-smi", "proc-proprietary", "proc-open", "proc-no-patch"])  # ids without newlines: xdist cannot track one
def test_driver_versions_parse_from_nvidia_smi_and_proc(text, version):
    assert parse_driver_version(text) == version


def test_text_without_a_driver_version_is_an_error_quoting_it():
    with pytest.raises(ValueError, match="NVIDIA-SMI has failed"):
        parse_driver_version("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


@pytest.mark.parametrize("cuda,driver", [("13.2", "580.65.06"), ("13.0", "595.91.07"), ("12.8", "570.133.20"),
                                         ("12.1", "525.60.13"), ("11.8", "450.80.02")])
def test_a_driver_of_the_cuda_majors_branch_or_newer_runs_it(cuda, driver):
    check_driver_supports(cuda, driver)


def test_an_r570_driver_cannot_run_cuda_13_and_the_error_names_both_versions_and_the_fix():
    with pytest.raises(GpuUnavailableError) as error:
        check_driver_supports("13.2", "570.133.20")
    message = str(error.value)
    assert "570.133.20" in message and "CUDA 13.2" in message and ">= 580" in message and "R580" in message


def test_a_driver_just_below_the_cuda_12_minimum_is_refused():
    with pytest.raises(GpuUnavailableError, match="525.60.13"):
        check_driver_supports("12.4", "525.53")


def test_a_cuda_major_without_a_known_minimum_driver_is_refused_naming_the_known_ones():
    with pytest.raises(GpuUnavailableError, match=r"CUDA \[11, 12, 13\]"):
        check_driver_supports("14.0", "600.10")


def test_doctor_fails_a_gpu_config_on_a_node_whose_gpus_cannot_be_used(tmp_path):
    # No GPU visible to this process: here because there is none, on a GPU machine because it is hidden.
    result = subprocess.run(
        [VITSWEEP, "doctor", "--config", "cluster/jobs/a100_8x8.yaml", "--set", f"run.storage_path={tmp_path}"],
        capture_output=True, text=True, env={**vitsweep_env(), "CUDA_VISIBLE_DEVICES": ""}, timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = [line for line in result.stdout.splitlines() if " gpu " in line]
    assert line.startswith("FAIL  gpu") and "GpuUnavailableError" in line


def test_doctor_passes_a_cpu_config_and_says_the_gpus_are_not_used(tmp_path, capsys):
    assert main(["doctor", "--set", f"run.storage_path={tmp_path}", "--set", "tracking.mlflow_uri=null"]) == EXIT_OK
    (line,) = [line for line in capsys.readouterr().out.splitlines() if " gpu " in line]
    assert line.startswith("  ok  gpu")
    if not torch.cuda.is_available():
        assert "not used by this config (scaling.use_gpu=false)" in line


@pytest.mark.parametrize("name,precision,peak", [
    ("NVIDIA A100-SXM4-40GB", "bf16", 312.0), ("NVIDIA A100 80GB PCIe", "tf32", 156.0),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H200", "bf16", 989.4), ("NVIDIA H100 NVL", "fp16", 835.5),
])
def test_peak_tflops_per_gpu_name_and_math_mode(name, precision, peak):
    assert peak_tflops(name, precision) == peak


def test_a_gpu_without_a_known_peak_has_none_and_a_bad_mode_is_an_error():
    assert peak_tflops("Tesla T4", "bf16") is None
    with pytest.raises(ValueError, match="'int8'"):
        peak_tflops("NVIDIA A100-SXM4-40GB", "int8")


def test_training_flops_are_three_forwards_of_two_flops_per_multiply_add():
    # XCiT-S12/16: 4.8 GMACs per 224 px image; 1000 images/s on an A100 in bf16.
    assert training_tflops(4.8, 1000) == pytest.approx(28.8)
    assert mfu(4.8, 1000, 312.0) == pytest.approx(28.8 / 312.0)


@pytest.fixture
def restored_gpu_math():
    saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision,
             torch.backends.cudnn.benchmark)
    yield
    (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision,
     torch.backends.cudnn.benchmark) = saved


@pytest.mark.parametrize("tf32,mode", [(True, "tf32"), (False, "ieee")])
def test_gpu_math_sets_matmul_and_conv_fp32_precision_and_cudnn_autotuning(tf32, mode, restored_gpu_math):
    configure_gpu_math(tf32)
    assert torch.backends.cuda.matmul.fp32_precision == mode
    assert torch.backends.cudnn.conv.fp32_precision == mode
    assert torch.backends.cudnn.benchmark is True


def test_a_gpu_worker_without_usable_gpus_stops_before_changing_the_math_settings():
    # A fresh process with no GPU visible (none here; hidden on a GPU machine), as a worker starts.
    script = ("import torch\n"
              "from pipeline.components.accelerator import GpuUnavailableError, prepare_gpu_worker\n"
              "try:\n    prepare_gpu_worker(tf32=True)\n"
              "except GpuUnavailableError as err:\n    print('refused:', err)\n"
              "print('matmul', torch.backends.cuda.matmul.fp32_precision)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**vitsweep_env(), "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr
    assert "refused: " in result.stdout and "matmul none" in result.stdout
