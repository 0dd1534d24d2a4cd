"""Optimisation: AdamW parameter groups (weight decay, layer-wise lr decay) and the per-step warmup +
cosine schedule (DeiT recipe)."""
from __future__ import annotations

import math

import torch
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from timm.utils.model_ema import ModelEmaV3
from torch import nn

from pipeline.config.schema import OptimConfig

# Besides 1-D tensors (norms, biases, F-SNE codes) and what a model's no_weight_decay() names,
# these never decay: XCiT's per-head temperatures are [heads, 1, 1], so the 1-D rule misses them.
NO_WEIGHT_DECAY_PATTERNS = ("*temperature", "*pos_embed*", "*cls_token*", "*dist_token*")


def no_weight_decay_names(model: nn.Module) -> set[str]:
    declared = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    return set(declared) | set(NO_WEIGHT_DECAY_PATTERNS)


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.AdamW:
    """torch's AdamW at rate ``lr``, the run's effective rate (``pipeline.components.lr_scaling.effective_lr``;
    DeepSpeed's config optimizer would JIT-compile FusedAdam on CPU), over the trainable parameters;
    with ``layer_decay``, timm's layer groups (the model's ``group_matcher``), each at lr x its
    ``lr_scale`` (the schedule then scales every group alike)."""
    no_decay = no_weight_decay_names(model)
    if cfg.layer_decay is None:
        groups = param_groups_weight_decay(model, cfg.weight_decay, no_weight_decay_list=no_decay)
    else:
        groups = param_groups_layer_decay(model, cfg.weight_decay, no_weight_decay_list=no_decay,
                                          layer_decay=cfg.layer_decay)
        for group in groups:
            group["lr"] = lr * group["lr_scale"]
    return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, eps=cfg.eps)


def lr_at(step: int, total_steps: int, steps_per_epoch: int, cfg: OptimConfig, peak_lr: float) -> float:
    """Learning rate at optimizer step ``step``: linear warmup from warmup_lr to ``peak_lr``, then cosine to min_lr,
    reached ``cooldown_epochs`` before the end and held there."""
    schedule = cfg.schedule
    warmup_steps = round(schedule.warmup_epochs * steps_per_epoch)
    cosine_end = total_steps - round(schedule.cooldown_epochs * steps_per_epoch)
    if step < warmup_steps:
        return schedule.warmup_lr + (peak_lr - schedule.warmup_lr) * step / warmup_steps
    if schedule.name == "constant":
        return peak_lr
    progress = (step - warmup_steps) / max(1, cosine_end - warmup_steps)
    return schedule.min_lr + 0.5 * (peak_lr - schedule.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-step scheduler peaking at the optimizer's rate; its state (the step count) is checkpointed
    with the engine."""
    total_steps = cfg.epochs * steps_per_epoch
    peak_lr = optimizer.defaults["lr"]  # the effective rate the optimizer was built with: one source for both
    # LambdaLR scales each group's base lr (the peak, times its lr_scale under layer decay) by the returned factor.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, total_steps, steps_per_epoch, cfg, peak_lr) / peak_lr
    )


def build_ema(model: nn.Module, cfg: OptimConfig):
    """timm's EMA of ``model`` with an fp32 shadow (a bf16 shadow would lose decays near 1)."""
    ema = ModelEmaV3(model, decay=cfg.ema_decay)
    ema.module.float()
    return ema
