"""Registration of vitsweep variants: timm's registry plus the facts the papers report.

A variant registered here is buildable with ``timm.create_model(name, **overrides)`` (after
``import models``) and carries the paper's reported numbers, so ``vitsweep models list`` can put
our measured parameters/GFLOPs beside the paper's. The builders at the end are the two ways the family
files hand a variant to timm's ``build_model_with_cfg``: on a timm architecture (and its weights), or
without weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, get_pretrained_cfg, register_model


@dataclass(frozen=True)
class PaperFacts:
    """What a paper reports for one model row (``None`` where the paper is silent)."""

    paper: str  # the paper's id in README "Papers", e.g. "003" (XCiT)
    family: str  # architecture family, e.g. "xcit", "vit", "eit", "sot"
    params: float | None = None  # reported parameter count (absolute, e.g. 3.1e6)
    gflops: float | None = None  # reported GFLOPs as printed, counted as flop_ops / flops_per_mac say
    flop_ops: str = "all"  # operations the paper counts (models.measure.FLOP_OPS): "all" or "conv_linear"
    flops_per_mac: int = 1  # 1: the paper's FLOPs are multiply-adds; 2: it prints 2 FLOPs per multiply-add
    top1: float | None = None  # reported ImageNet top-1 (%)
    img_size: int = 224  # resolution the reported numbers refer to
    row: str = ""  # the row's label in the paper's table
    distillation_token: bool = False  # the row's model has DeiT's distillation token and head ("dist" rows)


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


def cfg_without_weights(**overrides) -> dict:
    """timm's pretrained_cfg of a variant whose paper released no weights: its ImageNet data config only."""
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None,
        "crop_pct": 0.875, "interpolation": "bicubic", "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "classifier": "head", **overrides,
    }


def check_depth(model_cls: type, variant: str, depth) -> None:
    """Every family stacks ``depth`` blocks: fewer than one would build a model without a transformer
    (timm builds that silently, with only embedding and head)."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth={depth!r} is out of range for {variant}: {model_cls.__name__} stacks `depth` "
                         "blocks, so depth must be an integer >= 1")


def build_without_weights(model_cls: type, variant: str, pretrained: bool, model_args: dict, **kwargs):
    """``model_cls(**model_args, **kwargs)`` by timm's builder, for a variant with no released weights."""
    if pretrained:
        raise ValueError(f"pretrained=True: the paper released no weights for {variant}; use pretrained=False")
    model_args = dict(model_args, **kwargs)
    check_depth(model_cls, variant, model_args.get("depth", 1))
    return build_model_with_cfg(model_cls, variant, pretrained=False, **model_args)


def build_on_timm_architecture(
        model_cls: type, variant: str, pretrained: bool, timm_variant: str, pretrained_filter_fn: Callable, **kwargs):
    """``model_cls`` by timm's builder with the data config of timm's ``timm_variant``, the same architecture.

    ``pretrained=True`` loads timm's weights, which fit only the unmodified model (qkv='linear', head='linear').
    """
    check_depth(model_cls, variant, kwargs.get("depth", 1))
    qkv, head = kwargs.get("qkv", "linear"), kwargs.get("head", "linear")
    if pretrained and (qkv != "linear" or head != "linear"):
        raise ValueError(
            f"pretrained=True for {variant} loads timm's weights, which exist only for qkv='linear' and "
            f"head='linear', not qkv={qkv!r}, head={head!r}")
    if kwargs.get("pretrained_cfg") is None:
        kwargs["pretrained_cfg"] = get_pretrained_cfg(timm_variant)
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        model_cls,
        variant,
        pretrained,
        pretrained_filter_fn=pretrained_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs,
    )
