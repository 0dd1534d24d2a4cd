"""Registration of vitsweep variants: timm's registry plus the facts the papers report.

A variant registered here is buildable with ``timm.create_model(name, **overrides)`` (after
``import models``) and carries the paper's reported numbers, so ``vitsweep models list`` can put
our measured parameters/GFLOPs beside the paper's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from timm.models import register_model


@dataclass(frozen=True)
class PaperFacts:
    """What a paper reports for one model row (``None`` where the paper is silent)."""

    paper: str  # id of the paper in shared/papers, e.g. "003" (XCiT)
    family: str  # architecture family, e.g. "xcit", "vit", "eit", "sot"
    params: float | None = None  # reported parameter count (absolute, e.g. 3.1e6)
    gflops: float | None = None  # reported GFLOPs; the papers count multiply-adds
    top1: float | None = None  # reported ImageNet top-1 (%)
    img_size: int = 224  # resolution the reported numbers refer to
    row: str = ""  # the row's label in the paper's table


VARIANTS: dict[str, PaperFacts] = {}


def register_variant(facts: PaperFacts) -> Callable[[Callable], Callable]:
    """Register a model entrypoint with timm and record the paper's facts for it."""

    def wrap(entrypoint: Callable) -> Callable:
        name = entrypoint.__name__
        if name in VARIANTS:
            raise ValueError(f"model variant {name!r} is registered twice")
        VARIANTS[name] = facts
        return register_model(entrypoint)

    return wrap
