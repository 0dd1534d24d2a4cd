"""XCiT (paper 003) on timm's Xcit, with vitsweep's QKV embeddings (papers 000, 002) and heads (paper 004).

Variants ``xcit_{nano_12,tiny_12,tiny_24,small_12,small_24,medium_24,large_24}_p{16,8}`` are the
architectures of paper 003 Table 1 (timm's ``xcit_*_224`` without the resolution in the name). With the
default ``qkv="linear", head="linear"`` a model is timm's XCiT, weight for weight; e.g. paper 000's
XCiT-N12 (F-SNE, 8*) is ``timm.create_model("xcit_nano_12_p16", qkv="fsne", code_size=8,
match_baseline_params=True)``.

``xcit_{size}_distilled_p16`` add DeiT's distillation token and head (``DistilledXCiT``), for the rows
Table 1 marks as distilled.
"""
from __future__ import annotations

import dataclasses

import torch
from timm.layers import get_device_dtype, trunc_normal_
from timm.models import get_pretrained_cfg
from timm.models.xcit import Xcit, checkpoint_filter_fn
from torch import nn

from models._registry import PaperFacts, build_on_timm_architecture, register_variant
from models.layers.class_attention import attend_from_prefix_tokens
from models.layers.heads import DistillationHeadsMixin, TokenHeadMixin
from models.layers.qkv import QKVOverrideMixin

__all__ = ["DistilledXCiT", "XCiT"]


class XCiT(TokenHeadMixin, QKVOverrideMixin, Xcit):
    """timm's Xcit with a choice of Q/K/V embedding in its XCA blocks and of classification head.

    Takes ``qkv=`` and its options (``models.layers.qkv.QKVOverrideMixin``: every XCA block; the
    class-attention blocks keep their own q, k, v), ``head=`` and the SoT head's options
    (``models.layers.heads.TokenHeadMixin``; the SoT head reads the tokens that leave the class-attention blocks
    and the final norm), and the rest of timm's Xcit arguments (img_size, num_classes, patch_size, embed_dim,
    depth, num_heads, eta, tokens_norm, ...).
    """


class DistilledXCiT(DistillationHeadsMixin, QKVOverrideMixin, Xcit):
    """timm's Xcit with DeiT's distillation token and head (DeiT §4), and a choice of Q/K/V embedding.

    The token joins the class token where XCiT's class token enters, before the class-attention blocks, which
    then update both (``models.layers.class_attention``); the XCA blocks never see it, as they never see the
    class token. While its heads train it returns ``DistilledLogits`` (the class head's and the distillation
    head's logits, for the task loss and the teacher's), in eval mode their mean, as DeiT
    (``models.layers.heads.DistillationHeadsMixin``). ``features_only`` drops the token with the class token.
    Paper 003 distils "as proposed by Touvron et al." without saying how; its authors' code trains the class
    head on the teacher instead (``distill`` on an ``xcit_*`` model). No ``head=`` override: the heads are
    DeiT's.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.cls_attn_blocks is None or self.global_pool != "token":
            raise ValueError("the distillation token is read after the class-attention blocks: "
                             "keep cls_attn_layers >= 1 and global_pool='token'")
        self.num_prefix_tokens = 2
        self.dist_token = nn.Parameter(torch.zeros(1, 1, self.embed_dim))
        trunc_normal_(self.dist_token, std=0.02)  # as Xcit's class token and timm's distilled DeiT's token
        self.head_dist = self._distillation_head(self.num_classes)
        self._init_weights(self.head_dist)
        attend_from_prefix_tokens(self.cls_attn_blocks, self.num_prefix_tokens)

    def _distillation_head(self, num_classes: int) -> nn.Module:
        return (nn.Linear(self.embed_dim, num_classes, **get_device_dtype(self)) if num_classes > 0
                else nn.Identity())

    @torch.jit.ignore
    def no_weight_decay(self):
        return {*super().no_weight_decay(), "dist_token"}

    @torch.jit.ignore
    def group_matcher(self, coarse=False):
        return {**super().group_matcher(coarse), "stem": r"^cls_token|dist_token|pos_embed|patch_embed"}

    @torch.jit.ignore
    def get_classifier(self) -> tuple[nn.Module, nn.Module]:
        return self.head, self.head_dist

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        features_only = global_pool == "" and num_classes == 0  # timm's prune_intermediate_layers
        if global_pool not in (None, "token") and not features_only:
            raise ValueError(f"global_pool={global_pool!r}: the distilled XCiT reads its two tokens ('token')")
        super().reset_classifier(num_classes, "" if features_only else None)
        self.head_dist = self._distillation_head(num_classes)
        self.head_dist.train(self.training)

    def prune_intermediate_layers(self, indices=1, prune_norm: bool = False, prune_head: bool = True):
        if prune_head:  # the distillation token goes with the class token and the class-attention blocks
            self.dist_token = None
        return super().prune_intermediate_layers(indices, prune_norm, prune_head)

    def forward_cls(self, x: torch.Tensor) -> torch.Tensor:
        # timm's forward_cls prepends the class token and runs the blocks: [cls, dist, patches]
        return super().forward_cls(torch.cat((self.dist_token.expand(x.shape[0], -1, -1), x), dim=1))


def _create_xcit(variant: str, pretrained: bool, **kwargs) -> XCiT:
    # timm's data config (and, for the unmodified model, weights) of the same architecture at 224 px.
    return build_on_timm_architecture(
        XCiT, variant, pretrained, f"{variant}_224.fb_in1k", checkpoint_filter_fn, **kwargs)


def _create_distilled_xcit(variant: str, architecture: str, pretrained: bool, **kwargs) -> DistilledXCiT:
    if pretrained:
        raise ValueError(f"pretrained=True: there are no weights with a distillation token for {variant} (timm's "
                         f"distilled XCiT weights are for {architecture}, without one)")
    if kwargs.get("pretrained_cfg") is None:  # the data config of timm's distilled weights, without the weights
        kwargs["pretrained_cfg"] = dataclasses.replace(get_pretrained_cfg(f"{architecture}_224.fb_dist_in1k"),
                                                       url="", hf_hub_id=None, architecture=variant, tag=None,
                                                       classifier=("head", "head_dist"))
    return build_on_timm_architecture(
        DistilledXCiT, variant, pretrained, f"{architecture}_224.fb_dist_in1k", checkpoint_filter_fn, **kwargs)


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


# Table 1's @224/16⌥ column: distilled from a convolutional teacher. Its #params column counts each
# architecture once, so the count is the undistilled row's (the authors' models have no token); GFLOPs: the
# token adds one query per class-attention block and a head.
def _distilled_facts(size: str, gflops: float, top1: float) -> PaperFacts:
    return PaperFacts(paper="003", family="xcit", gflops=gflops, top1=top1, row=f"XCiT-{size} @224/16 distilled",
                      distillation_token=True)


@register_variant(_distilled_facts("N12", 0.5, 72.2))
def xcit_nano_12_distilled_p16(pretrained: bool = False, **kwargs) -> DistilledXCiT:
    return _create_distilled_xcit("xcit_nano_12_distilled_p16", "xcit_nano_12_p16", pretrained,
                                  **{**_NANO_12, "patch_size": 16, **kwargs})


@register_variant(_distilled_facts("T12", 1.2, 78.6))
def xcit_tiny_12_distilled_p16(pretrained: bool = False, **kwargs) -> DistilledXCiT:
    return _create_distilled_xcit("xcit_tiny_12_distilled_p16", "xcit_tiny_12_p16", pretrained,
                                  **{**_TINY_12, "patch_size": 16, **kwargs})


@register_variant(_distilled_facts("T24", 2.3, 80.4))
def xcit_tiny_24_distilled_p16(pretrained: bool = False, **kwargs) -> DistilledXCiT:
    return _create_distilled_xcit("xcit_tiny_24_distilled_p16", "xcit_tiny_24_p16", pretrained,
                                  **{**_TINY_24, "patch_size": 16, **kwargs})


@register_variant(_distilled_facts("S12", 4.8, 83.3))
def xcit_small_12_distilled_p16(pretrained: bool = False, **kwargs) -> DistilledXCiT:
    return _create_distilled_xcit("xcit_small_12_distilled_p16", "xcit_small_12_p16", pretrained,
                                  **{**_SMALL_12, "patch_size": 16, **kwargs})


@register_variant(_distilled_facts("S24", 9.1, 83.9))
def xcit_small_24_distilled_p16(pretrained: bool = False, **kwargs) -> DistilledXCiT:
    return _create_distilled_xcit("xcit_small_24_distilled_p16", "xcit_small_24_p16", pretrained,
                                  **{**_SMALL_24, "patch_size": 16, **kwargs})


@register_variant(_distilled_facts("M24", 16.2, 84.3))
def xcit_medium_24_distilled_p16(pretrained: bool = False, **kwargs) -> DistilledXCiT:
    return _create_distilled_xcit("xcit_medium_24_distilled_p16", "xcit_medium_24_p16", pretrained,
                                  **{**_MEDIUM_24, "patch_size": 16, **kwargs})


@register_variant(_distilled_facts("L24", 36.1, 84.9))
def xcit_large_24_distilled_p16(pretrained: bool = False, **kwargs) -> DistilledXCiT:
    return _create_distilled_xcit("xcit_large_24_distilled_p16", "xcit_large_24_p16", pretrained,
                                  **{**_LARGE_24, "patch_size": 16, **kwargs})
