"""The DeepSpeed engine: its JSON config, derived from ours in this one place."""
from __future__ import annotations

from typing import Any

import torch

from pipeline.config import ExperimentConfig


def global_batch_size(cfg: ExperimentConfig, world_size: int) -> int:
    return cfg.optim.micro_batch_size * cfg.optim.grad_accum_steps * world_size


def deepspeed_config(cfg: ExperimentConfig, world_size: int) -> dict[str, Any]:
    """DeepSpeed's JSON for ``world_size`` data-parallel workers.

    The optimizer and scheduler are ours (torch AdamW with per-group weight decay, a per-step
    lambda schedule), passed to ``deepspeed.initialize``; ZeRO then needs
    ``zero_allow_untested_optimizer``.
    """
    precision = cfg.deepspeed.precision
    zero: dict[str, Any] = {"stage": cfg.deepspeed.zero_stage}
    if cfg.deepspeed.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cfg.scaling.use_gpu}
    return {
        "train_batch_size": global_batch_size(cfg, world_size),
        "train_micro_batch_size_per_gpu": cfg.optim.micro_batch_size,
        "gradient_accumulation_steps": cfg.optim.grad_accum_steps,
        "gradient_clipping": cfg.optim.grad_clip or 0.0,  # 0: DeepSpeed does not clip
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0},  # 0: dynamic scaling
        # DeepSpeed >= 0.19 casts parameters only; BatchNorm (XCiT's conv stem, SoT's DenseNet
        # embedding) then meets fp32 running stats and fails. Cast floating buffers with the params.
        **({"data_types": {"buffer_dtype": precision}} if precision != "fp32" else {}),
        "steps_per_print": 10**9,  # progress is ours to report, once per epoch
        "wall_clock_breakdown": False,
    }


PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def input_dtype(cfg: ExperimentConfig) -> torch.dtype:
    """The dtype the engine's model computes in, so the input batch must be cast to it."""
    return PRECISION_DTYPES[cfg.deepspeed.precision]
