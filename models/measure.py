"""Parameter and FLOP counts, measured the way the papers report them.

The papers' "FLOPs" are multiply-adds (MACs), but they do not all count the same operations:

* ``ops="all"``: every multiply-add of the forward pass, attention's QKᵀ and AV products included
  (XCiT, paper 003 Table 1; EIT, paper 001 Tables 5-6; DeiT's own 1.3G);
* ``ops="conv_linear"``: convolutions and linear layers only (SoT, paper 004 Tables 3a, 5, S-1: the
  authors' ``thop`` profile does not see attention's matmuls, nor MGCrP's cross-covariance products).

``torch.utils.flop_counter`` counts a multiply-add as 2 FLOPs, so GMACs = its count / 2 / 1e9; a paper
that prints 2 FLOPs per multiply-add (EIT Table 6) records ``flops_per_mac=2`` in its ``PaperFacts``.
Models are built on the meta device, so counting the largest variants costs no memory and no compute.
"""
from __future__ import annotations

from collections import defaultdict

import timm
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from models._registry import PaperFacts

__all__ = ["FLOP_OPS", "build_on_meta", "count_gmacs", "count_params", "count_reported_gflops", "params_by_module"]

FLOP_OPS = ("all", "conv_linear")

# What thop sees of nn.Conv2d / nn.Linear: a Linear reaches aten as mm (no bias) or addmm (bias);
# attention's products and MGCrP's X Yᵀ are bmm, so they stay out.
_CONV_LINEAR_OPS = frozenset({"aten.convolution", "aten.mm", "aten.addmm"})


def build_on_meta(name: str, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return timm.create_model(name, **kwargs)


def count_params(model: nn.Module) -> int:
    """Unique trainable-or-not parameters (shared tensors count once, as in the papers)."""
    return sum(p.numel() for p in model.parameters())


def count_gmacs(model: nn.Module, img_size: int, batch_size: int = 1, *, ops: str = "all") -> float:
    """Multiply-adds of one forward pass per image, in G, counting the operations ``ops`` (``FLOP_OPS``)."""
    if ops not in FLOP_OPS:
        raise ValueError(f"ops={ops!r} is not a FLOP-counting convention; valid: {FLOP_OPS}")
    device = next(model.parameters()).device
    images = torch.zeros(batch_size, 3, img_size, img_size, device=device)
    was_training = model.training
    model.eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(images)
    model.train(was_training)
    if ops == "all":
        flops = counter.get_total_flops()
    else:
        flops = sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op) in _CONV_LINEAR_OPS)
    return flops / 2 / batch_size / 1e9


def count_reported_gflops(model: nn.Module, facts: PaperFacts) -> float:
    """``model``'s GFLOPs at ``facts.img_size`` as its paper counts them, comparable with ``facts.gflops``."""
    return count_gmacs(model, facts.img_size, ops=facts.flop_ops) * facts.flops_per_mac


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
