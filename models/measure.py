"""Parameter and FLOP counts, measured the way the papers report them.

The papers' "FLOPs" are multiply-adds (MACs): ``torch.utils.flop_counter`` counts a
multiply-add as 2 FLOPs, so GFLOPs here = FlopCounterMode total / 2 / 1e9. Models are built on
the meta device, so counting the largest variants costs no memory and no compute.
"""
from __future__ import annotations

from collections import defaultdict

import timm
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def build_on_meta(name: str, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return timm.create_model(name, **kwargs)


def count_params(model: nn.Module) -> int:
    """Unique trainable-or-not parameters (shared tensors count once, as in the papers)."""
    return sum(p.numel() for p in model.parameters())


def count_gmacs(model: nn.Module, img_size: int, batch_size: int = 1) -> float:
    """Multiply-adds of one forward pass per image, in G (the papers' 'GFLOPs')."""
    device = next(model.parameters()).device
    images = torch.zeros(batch_size, 3, img_size, img_size, device=device)
    was_training = model.training
    model.eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(images)
    model.train(was_training)
    return counter.get_total_flops() / 2 / batch_size / 1e9


def params_by_module(model: nn.Module, depth: int = 2) -> list[tuple[str, int]]:
    """Parameter count per module prefix of ``depth`` dotted parts (shared tensors count once)."""
    seen: set[int] = set()
    totals: dict[str, int] = defaultdict(int)
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        totals[".".join(name.split(".")[:depth])] += param.numel()
    return list(totals.items())
