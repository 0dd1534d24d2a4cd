"""The DeepSpeed engine: its JSON config, derived from ours in this one place, and what the worker
applies to the model and engine around ``deepspeed.initialize`` (BatchNorm in fp32, compile; on CPU,
the ``ninja`` its comm op is built with)."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.config.schema import ExperimentConfig
from pipeline.components.lr_scaling import global_batch_size

# BatchNorm's running statistics: fp32 under bf16/fp16 (keep_batchnorm_in_fp32).
BATCHNORM_STATISTICS = ("running_mean", "running_var")
# ZeRO's gradient reduce / parameter all-gather bucket, in elements: PyTorch DDP's 25 MB of fp32.
# A 5-90 M parameter model then reduces in 1-15 buckets, each sent while backward computes the next.
ZERO_BUCKET_ELEMENTS = 25 * 2**20 // 4


def use_the_environments_ninja() -> None:
    """Put this Python environment's ``ninja`` (pip's, installed with DeepSpeed) first on PATH.

    On CPU, DeepSpeed JIT-builds its shared-memory comm op with the first ``ninja`` on PATH, into one
    cache every process shares. pip's ninja (1.13) and a system one (Debian's 1.11) hash the build log
    differently and read each other's entries as stale, so each switch between them (a shell with the
    venv activated, then one without) rebuilt the op: ~40 s on 2 cores, under a lock every starting
    worker waits on. Called before the op loads (each CPU worker, ``make setup``), it is built once."""
    ninja = Path(sys.executable).parent / "ninja"
    if ninja.exists() and shutil.which("ninja") != str(ninja):
        os.environ["PATH"] = os.pathsep.join(filter(None, (str(ninja.parent), os.environ.get("PATH"))))


def deepspeed_config(cfg: ExperimentConfig, world_size: int) -> dict[str, Any]:
    """DeepSpeed's JSON for ``world_size`` data-parallel workers.

    The optimizer and scheduler are ours (torch AdamW with per-group weight decay, a per-step
    lambda schedule), passed to ``deepspeed.initialize``; ZeRO then needs
    ``zero_allow_untested_optimizer``.
    """
    precision = cfg.deepspeed.precision
    zero: dict[str, Any] = {"stage": cfg.deepspeed.zero_stage}
    if cfg.scaling.use_gpu and cfg.deepspeed.zero_stage > 0:
        # DeepSpeed's defaults reduce every gradient after backward in one 5e8 bucket (bigger than
        # the models here): overlap the reduction with backward in DDP-sized buckets instead.
        zero.update(overlap_comm=True, contiguous_gradients=True,
                    reduce_bucket_size=ZERO_BUCKET_ELEMENTS, allgather_bucket_size=ZERO_BUCKET_ELEMENTS)
    if cfg.deepspeed.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cfg.scaling.use_gpu}
    return {
        "train_batch_size": global_batch_size(cfg.optim, world_size),
        "train_micro_batch_size_per_gpu": cfg.optim.micro_batch_size,
        "gradient_accumulation_steps": cfg.optim.grad_accum_steps,
        "gradient_clipping": cfg.optim.grad_clip or 0.0,  # 0: DeepSpeed does not clip
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0},  # 0: dynamic scaling
        **({"communication_data_type": "fp32"} if precision != "fp32" and cfg.deepspeed.reduce_in_fp32 else {}),
        # DeepSpeed >= 0.19 casts parameters only: cast floating buffers with them (a bf16 model
        # meets no fp32 buffer); keep_batchnorm_in_fp32 then returns BN's running statistics to fp32.
        **({"data_types": {"buffer_dtype": precision}} if precision != "fp32" else {}),
        "steps_per_print": 10**9,  # progress is ours to report, once per epoch
        "wall_clock_breakdown": False,
    }


PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def input_dtype(cfg: ExperimentConfig) -> torch.dtype:
    """The dtype the engine's model computes in, so the input batch must be cast to it."""
    return PRECISION_DTYPES[cfg.deepspeed.precision]


def keep_batchnorm_in_fp32(model: nn.Module) -> int:
    """Run every BatchNorm of ``model`` in fp32 inside a bf16/fp16 model, as autocast training does;
    returns how many. Call on ``engine.module`` after ``deepspeed.initialize`` (any precision).

    In bf16 a running variance near 1 moves in steps of 2^-7, larger than a momentum-0.1 update, so
    it stops short of the batch statistics (XCiT's conv stem and LPI, SoT's DenseNet embedding).
    The running statistics go back to fp32 (DeepSpeed cast them with the buffers; their initial 0 and
    1 are exact in bf16, and a checkpoint loaded afterwards fills the fp32 tensors). Each forward casts
    the input up, reads weight and bias as fp32 (their master copies are fp32 in DeepSpeed's optimizer
    anyway) and casts the output back.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            for name in BATCHNORM_STATISTICS:
                statistic = getattr(module, name)
                if statistic is not None and statistic.dtype != torch.float32:
                    statistic.data = statistic.data.float()
            module.register_forward_pre_hook(_batchnorm_enter_fp32)
            module.register_forward_hook(_batchnorm_leave_fp32, always_call=True)
            count += 1
    return count


def _batchnorm_enter_fp32(module: nn.Module, args: tuple) -> tuple:
    (features, *rest) = args
    # The bf16 Parameters, restored after forward; the fp32 copies carry their gradients back.
    module.__dict__["_low_precision"] = (features.dtype, module.weight, module.bias)
    for name in ("weight", "bias"):
        if module._parameters[name] is not None:
            module._parameters[name] = module._parameters[name].float()
    return (features.float(), *rest)


def _batchnorm_leave_fp32(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    entered = module.__dict__.pop("_low_precision", None)
    if entered is None:  # an earlier pre-hook failed before ours ran: nothing to restore
        return output
    dtype, weight, bias = entered
    module._parameters["weight"], module._parameters["bias"] = weight, bias
    return output.to(dtype)


def compile_engine(engine, cfg: ExperimentConfig) -> bool:
    """``torch.compile`` the engine's model (DeepSpeed's ``engine.compile()``, ``deepspeed.compile_backend``)
    when ``deepspeed.compile`` asks for it; True when compiled. Call after ``deepspeed.initialize`` and
    ``keep_batchnorm_in_fp32``; the first steps then pay the compile (benchmarks/RESULTS.md)."""
    if not cfg.deepspeed.compile:
        return False
    engine.compile(backend=cfg.deepspeed.compile_backend)
    return True


def low_precision_autocast(cfg: ExperimentConfig, device: torch.device):
    """Autocast to the training precision, for fp32 modules run beside the engine (the EMA shadow,
    the distillation teacher); a no-op context for fp32 runs. Re-entrant: one object serves every epoch."""
    if cfg.deepspeed.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=PRECISION_DTYPES[cfg.deepspeed.precision])
