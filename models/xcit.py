"""XCiT (paper 003) on timm's Xcit, with vitsweep's QKV embeddings (papers 000, 002) and heads (paper 004).

Variants ``xcit_{nano_12,tiny_12,tiny_24,small_12,small_24,medium_24,large_24}_p{16,8}`` are the
architectures of paper 003 Table 1 (timm's ``xcit_*_224`` without the resolution in the name). With the
default ``qkv="linear", head="linear"`` a model is timm's XCiT, weight for weight; e.g. paper 000's
XCiT-N12 (F-SNE, 8*) is ``timm.create_model("xcit_nano_12_p16", qkv="fsne", code_size=8,
match_baseline_params=True)``.
"""
from __future__ import annotations

from timm.models.xcit import Xcit, checkpoint_filter_fn

from models._registry import PaperFacts, build_on_timm_architecture, register_variant
from models.layers.qkv import QKVOverrideMixin
from models.layers.heads import TokenHeadMixin

__all__ = ["XCiT"]


class XCiT(TokenHeadMixin, QKVOverrideMixin, Xcit):
    """timm's Xcit with a choice of Q/K/V embedding in its XCA blocks and of classification head.

    Takes ``qkv=`` and its options (``models.layers.qkv.QKVOverrideMixin``: every XCA block; the
    class-attention blocks keep their own q, k, v), ``head=`` and the SoT head's options
    (``models.layers.heads.TokenHeadMixin``; the SoT head reads the tokens that leave the class-attention blocks
    and the final norm), and the rest of timm's Xcit arguments (img_size, num_classes, patch_size, embed_dim,
    depth, num_heads, eta, tokens_norm, ...).
    """


def _create_xcit(variant: str, pretrained: bool, **kwargs) -> XCiT:
    # timm's data config (and, for the unmodified model, weights) of the same architecture at 224 px.
    return build_on_timm_architecture(
        XCiT, variant, pretrained, f"{variant}_224.fb_in1k", checkpoint_filter_fn, **kwargs)


# Paper 003 Table 1: depth, d, #heads. LayerScale init eta and class-attention token norm as in the
# official weights (timm): eta 1e-5 for the 24-layer models, all tokens normed in CA except for Nano.
_NANO_12 = dict(embed_dim=128, depth=12, num_heads=4, eta=1.0, tokens_norm=False)
_TINY_12 = dict(embed_dim=192, depth=12, num_heads=4, eta=1.0, tokens_norm=True)
_TINY_24 = dict(embed_dim=192, depth=24, num_heads=4, eta=1e-5, tokens_norm=True)
_SMALL_12 = dict(embed_dim=384, depth=12, num_heads=8, eta=1.0, tokens_norm=True)
_SMALL_24 = dict(embed_dim=384, depth=24, num_heads=8, eta=1e-5, tokens_norm=True)
_MEDIUM_24 = dict(embed_dim=512, depth=24, num_heads=8, eta=1e-5, tokens_norm=True)
_LARGE_24 = dict(embed_dim=768, depth=24, num_heads=16, eta=1e-5, tokens_norm=True)


def _facts(row: str, params: float, gflops: float, top1: float, img_size: int = 224) -> PaperFacts:
    return PaperFacts(paper="003", family="xcit", params=params, gflops=gflops, top1=top1, img_size=img_size, row=row)


# Patch 16: Table 1's @224/16 columns (top-1 without distillation).
@register_variant(_facts("XCiT-N12 @224/16", 3e6, 0.5, 69.9))
def xcit_nano_12_p16(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_nano_12_p16", pretrained, **{**_NANO_12, "patch_size": 16, **kwargs})


@register_variant(_facts("XCiT-T12 @224/16", 7e6, 1.2, 77.1))
def xcit_tiny_12_p16(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_tiny_12_p16", pretrained, **{**_TINY_12, "patch_size": 16, **kwargs})


@register_variant(_facts("XCiT-T24 @224/16", 12e6, 2.3, 79.4))
def xcit_tiny_24_p16(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_tiny_24_p16", pretrained, **{**_TINY_24, "patch_size": 16, **kwargs})


@register_variant(_facts("XCiT-S12 @224/16", 26e6, 4.8, 82.0))
def xcit_small_12_p16(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_small_12_p16", pretrained, **{**_SMALL_12, "patch_size": 16, **kwargs})


@register_variant(_facts("XCiT-S24 @224/16", 48e6, 9.1, 82.6))
def xcit_small_24_p16(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_small_24_p16", pretrained, **{**_SMALL_24, "patch_size": 16, **kwargs})


@register_variant(_facts("XCiT-M24 @224/16", 84e6, 16.2, 82.7))
def xcit_medium_24_p16(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_medium_24_p16", pretrained, **{**_MEDIUM_24, "patch_size": 16, **kwargs})


@register_variant(_facts("XCiT-L24 @224/16", 189e6, 36.1, 82.9))
def xcit_large_24_p16(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_large_24_p16", pretrained, **{**_LARGE_24, "patch_size": 16, **kwargs})


# Patch 8: Table 1's @384/8 columns (GFLOPs at 384 px; top-1 distilled and fine-tuned at 384, so not
# comparable with a from-scratch 224 px run).
@register_variant(_facts("XCiT-N12 @384/8", 3e6, 6.4, 77.8, img_size=384))
def xcit_nano_12_p8(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_nano_12_p8", pretrained, **{**_NANO_12, "patch_size": 8, **kwargs})


@register_variant(_facts("XCiT-T12 @384/8", 7e6, 14.3, 82.4, img_size=384))
def xcit_tiny_12_p8(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_tiny_12_p8", pretrained, **{**_TINY_12, "patch_size": 8, **kwargs})


@register_variant(_facts("XCiT-T24 @384/8", 12e6, 27.3, 83.7, img_size=384))
def xcit_tiny_24_p8(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_tiny_24_p8", pretrained, **{**_TINY_24, "patch_size": 8, **kwargs})


@register_variant(_facts("XCiT-S12 @384/8", 26e6, 55.6, 85.1, img_size=384))
def xcit_small_12_p8(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_small_12_p8", pretrained, **{**_SMALL_12, "patch_size": 8, **kwargs})


@register_variant(_facts("XCiT-S24 @384/8", 48e6, 106.0, 85.6, img_size=384))
def xcit_small_24_p8(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_small_24_p8", pretrained, **{**_SMALL_24, "patch_size": 8, **kwargs})


@register_variant(_facts("XCiT-M24 @384/8", 84e6, 188.0, 85.8, img_size=384))
def xcit_medium_24_p8(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_medium_24_p8", pretrained, **{**_MEDIUM_24, "patch_size": 8, **kwargs})


@register_variant(_facts("XCiT-L24 @384/8", 189e6, 417.9, 86.0, img_size=384))
def xcit_large_24_p8(pretrained: bool = False, **kwargs) -> XCiT:
    return _create_xcit("xcit_large_24_p8", pretrained, **{**_LARGE_24, "patch_size": 8, **kwargs})
