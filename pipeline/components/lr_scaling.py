"""The learning rate from the global batch: the one place a run's rate is computed.

A config gives AdamW's rate one way (``pipeline.config.schema.OptimConfig``): absolutely (``optim.lr``),
or as DeiT writes it, per 512 images of global batch (``optim.lr_per_512``). The global batch is
micro batch x grad accumulation x world size, so a per-batch rate follows ``scaling.num_workers``
and ``optim.micro_batch_size`` without an edit, by ``optim.lr_scaling``:

- ``linear``: lr_per_512 x B / 512, the linear scaling rule (Goyal et al. 2017, "Accurate, Large
  Minibatch SGD": SGD on ResNet-50 up to B = 8,192 with 5 warmup epochs), as DeiT's and XCiT's
  ``main.py`` apply it to AdamW.
- ``sqrt``: linear up to B = 1,024, the global batch DeiT and XCiT trained at (so their recipe is
  reproduced exactly there), then x sqrt(B / 1,024): the square-root rule for Adam-type
  optimizers (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
  Algorithms"), for batches beyond those the linear rule was validated at with AdamW.

The optimizer and the peak of its warmup + cosine schedule use this rate (``pipeline.components.optim``);
``optim.schedule.warmup_lr`` and ``min_lr`` stay absolute, as in DeiT. The console prints it at
start, MLflow records it beside the knob the user gave (``recorded_params``), and
`vitsweep config show` shows it.
"""
from __future__ import annotations

import math
from typing import Any

from pipeline.config.schema import EFFECTIVE_LR_PARAM, GLOBAL_BATCH_PARAM, LR_REFERENCE_BATCH, OptimConfig

DEFAULT_LR = 5e-4  # the rate of a config giving neither optim.lr nor optim.lr_per_512: DeiT's, absolute
LINEAR_VALIDATED_BATCH = 1024  # DeiT's and XCiT's global batch: the sqrt rule is linear up to here
# The config keys a per-batch rate's effective value depends on, besides the world size.
RATE_INPUTS = ("optim.lr_per_512", "optim.lr_scaling", "optim.micro_batch_size", "optim.grad_accum_steps")


def global_batch_size(optim: OptimConfig, world_size: int) -> int:
    """Images per optimizer step (DeepSpeed's train_batch_size): micro batch x grad accumulation x workers."""
    return optim.micro_batch_size * optim.grad_accum_steps * world_size


def effective_lr(optim: OptimConfig, world_size: int) -> float:
    """The rate ``world_size`` workers train at: ``optim.lr``, or ``optim.lr_per_512`` scaled to the global
    batch, or with neither given DeiT's 5e-4 (absolute)."""
    if optim.lr_per_512 is None:
        return DEFAULT_LR if optim.lr is None else optim.lr
    batch = global_batch_size(optim, world_size)
    if optim.lr_scaling == "linear":
        return optim.lr_per_512 * batch / LR_REFERENCE_BATCH
    linear_part = min(batch, LINEAR_VALIDATED_BATCH)
    return optim.lr_per_512 * linear_part / LR_REFERENCE_BATCH * math.sqrt(batch / linear_part)


def describe_lr(optim: OptimConfig, world_size: int) -> str:
    """One line: the global batch as its factors, and the rate with the arithmetic that gave it."""
    batch = global_batch_size(optim, world_size)
    geometry = (f"global batch {batch} = {optim.micro_batch_size} per worker x {optim.grad_accum_steps} accumulation "
                f"step{'s' if optim.grad_accum_steps > 1 else ''} x {world_size} worker{'s' if world_size > 1 else ''}")
    rate = effective_lr(optim, world_size)
    if optim.lr_per_512 is None:
        given = "optim.lr" if optim.lr is not None else "no optim.lr or optim.lr_per_512 given: DeiT's default"
        return f"{geometry}; lr {rate:.3g} ({given}, absolute: the same at any batch)"
    if optim.lr_scaling == "linear" or batch <= LINEAR_VALIDATED_BATCH:
        arithmetic = f"{optim.lr_per_512:g} x {batch}/{LR_REFERENCE_BATCH}"
    else:
        arithmetic = (f"{optim.lr_per_512:g} x {LINEAR_VALIDATED_BATCH}/{LR_REFERENCE_BATCH} x "
                      f"sqrt({batch}/{LINEAR_VALIDATED_BATCH})")
    return f"{geometry}; lr {rate:.3g} = optim.lr_per_512 {arithmetic} ({optim.lr_scaling} scaling)"


def recorded_params(optim: OptimConfig, world_size: int) -> dict[str, Any]:
    """The derived values MLflow records beside the config's own keys (``optim.lr`` / ``optim.lr_per_512``)."""
    return {EFFECTIVE_LR_PARAM: effective_lr(optim, world_size),
            GLOBAL_BATCH_PARAM: global_batch_size(optim, world_size)}
