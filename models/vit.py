"""DeiT (ViT) and Armour (paper 002) on timm's VisionTransformer, with vitsweep's QKV and head overrides.

- ``deit_{tiny,small,base}_p16``: DeiT-Ti/S/B, timm's ``deit_*_patch16_224`` architectures.
- ``armour_{tiny,small,base}``: the same with Armour attention, W_Q = W_V (paper 002 Eq. 2, Table 3).
- ``deit_tiny_distilled_p16``, ``armour_tiny_distilled``: the same with DeiT's distillation token and head
  (``DistilledViT``; paper 002 Table 1's "dist" rows), trained with a teacher (``distill.teacher``).
- ``vit_mini_p4``: the plain ViT that paper 001 Table 6 compares EIT3/1/4-Mini with on 32 px data.

Every variant takes the overrides of ``ViT`` (``qkv=``, ``head=`` and their options), e.g.
``timm.create_model("deit_tiny_p16", qkv="fsne", code_size=8)``.
"""
from __future__ import annotations

import dataclasses
from functools import partial

from timm.models import generate_default_cfgs, get_pretrained_cfg
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from models._registry import (
    PaperFacts,
    build_on_timm_architecture,
    build_without_weights,
    cfg_without_weights,
    register_variant,
)
from models.layers.qkv import QKVOverrideMixin
from models.layers.heads import DistillationHeadsMixin, TokenHeadMixin

__all__ = ["DistilledViT", "ViT"]


class ViT(TokenHeadMixin, QKVOverrideMixin, VisionTransformer):
    """timm's VisionTransformer with a choice of Q/K/V embedding and classification head.

    Takes ``qkv=`` and its options (``models.layers.qkv.QKVOverrideMixin``: every block's attention), ``head=``
    and the SoT head's options (``models.layers.heads.TokenHeadMixin``), and the rest of timm's
    VisionTransformer arguments (img_size, num_classes, embed_dim, depth, num_heads, drop_path_rate, ...).
    With the defaults ``qkv="linear", head="linear"`` it is timm's model, weight for weight.
    """


class DistilledViT(DistillationHeadsMixin, QKVOverrideMixin, VisionTransformerDistilled):
    """timm's VisionTransformerDistilled (DeiT's distillation token and head) with a choice of Q/K/V embedding.

    It always trains with its token: while its heads train it returns ``DistilledLogits`` (the class head's and
    the distillation head's logits, for the task loss and the teacher's), in eval mode their mean, as DeiT
    (``models.layers.heads.DistillationHeadsMixin``, in place of timm's ``distilled_training`` switch). With
    ``qkv="linear"`` it is timm's model, weight for weight. No ``head=`` override: the heads are DeiT's.
    """


def _create_vit(variant: str, timm_variant: str, pretrained: bool, model_cls: type = ViT,
                **kwargs) -> VisionTransformer:
    return build_on_timm_architecture(
        model_cls, variant, pretrained, timm_variant, partial(checkpoint_filter_fn, adapt_layer_scale=True), **kwargs)


def _create_armour(variant: str, timm_variant: str, pretrained: bool, model_cls: type = ViT,
                   **kwargs) -> VisionTransformer:
    if pretrained:
        raise ValueError(f"pretrained=True: there are no pretrained weights for {variant}")
    qkv = kwargs.setdefault("qkv", "armour")
    if qkv != "armour":
        raise ValueError(f"{variant} is DeiT with qkv='armour', got qkv={qkv!r}; build a deit_* model for that")
    if kwargs.get("pretrained_cfg") is None:
        # DeiT's data config, without its weights (they are not Armour's).
        kwargs["pretrained_cfg"] = dataclasses.replace(
            get_pretrained_cfg(timm_variant), url="", hf_hub_id=None, architecture=variant, tag=None)
    return _create_vit(variant, timm_variant, pretrained, model_cls, **kwargs)


_DEIT_TINY = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)
_DEIT_SMALL = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
_DEIT_BASE = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)


# DeiT's numbers as paper 002 reports them (Table 3 params; Table 1 top-1 as reproduced there).
@register_variant(PaperFacts(paper="002", family="vit", params=5.7e6, top1=72.1, row="DeiT-Ti"))
def deit_tiny_p16(pretrained: bool = False, **kwargs) -> ViT:
    """DeiT-Ti: 12 blocks, width 192, 3 heads."""
    return _create_vit("deit_tiny_p16", "deit_tiny_patch16_224.fb_in1k", pretrained, **dict(_DEIT_TINY, **kwargs))


@register_variant(PaperFacts(paper="002", family="vit", params=22.1e6, row="DeiT-S"))
def deit_small_p16(pretrained: bool = False, **kwargs) -> ViT:
    """DeiT-S: 12 blocks, width 384, 6 heads."""
    return _create_vit(
        "deit_small_p16", "deit_small_patch16_224.fb_in1k", pretrained, **dict(_DEIT_SMALL, **kwargs))


@register_variant(PaperFacts(paper="002", family="vit", params=86.6e6, row="DeiT-B"))
def deit_base_p16(pretrained: bool = False, **kwargs) -> ViT:
    """DeiT-B: 12 blocks, width 768, 12 heads."""
    return _create_vit("deit_base_p16", "deit_base_patch16_224.fb_in1k", pretrained, **dict(_DEIT_BASE, **kwargs))


@register_variant(PaperFacts(paper="002", family="vit", params=5.3e6, top1=72.0, row="Armour-Ti"))
def armour_tiny(pretrained: bool = False, **kwargs) -> ViT:
    """Armour-Ti: DeiT-Ti with W_Q = W_V in every block (paper 002 Tables 1, 3)."""
    return _create_armour("armour_tiny", "deit_tiny_patch16_224.fb_in1k", pretrained, **dict(_DEIT_TINY, **kwargs))


@register_variant(PaperFacts(paper="002", family="vit", params=20.3e6, row="Armour-S"))
def armour_small(pretrained: bool = False, **kwargs) -> ViT:
    """Armour-S: DeiT-S with W_Q = W_V in every block (paper 002 Table 3)."""
    return _create_armour(
        "armour_small", "deit_small_patch16_224.fb_in1k", pretrained, **dict(_DEIT_SMALL, **kwargs))


@register_variant(PaperFacts(paper="002", family="vit", params=79.5e6, row="Armour-B"))
def armour_base(pretrained: bool = False, **kwargs) -> ViT:
    """Armour-B: DeiT-B with W_Q = W_V in every block (paper 002 Table 3)."""
    return _create_armour("armour_base", "deit_base_patch16_224.fb_in1k", pretrained, **dict(_DEIT_BASE, **kwargs))


# Paper 002 Table 1's distilled rows: DeiT-Ti and Armour-Ti with DeiT's distillation token (300 epochs there).
@register_variant(PaperFacts(paper="002", family="vit", params=5.9e6, top1=73.8, row="DeiT-Ti dist",
                             distillation_token=True))
def deit_tiny_distilled_p16(pretrained: bool = False, **kwargs) -> DistilledViT:
    """DeiT-Ti with the distillation token: timm's ``deit_tiny_distilled_patch16_224``."""
    return _create_vit("deit_tiny_distilled_p16", "deit_tiny_distilled_patch16_224.fb_in1k", pretrained,
                       DistilledViT, **dict(_DEIT_TINY, **kwargs))


@register_variant(PaperFacts(paper="002", family="vit", params=5.5e6, top1=73.8, row="Armour-Ti dist",
                             distillation_token=True))
def armour_tiny_distilled(pretrained: bool = False, **kwargs) -> DistilledViT:
    """Armour-Ti with the distillation token (paper 002 Table 1)."""
    return _create_armour("armour_tiny_distilled", "deit_tiny_distilled_patch16_224.fb_in1k", pretrained,
                          model_cls=DistilledViT, **dict(_DEIT_TINY, **kwargs))


default_cfgs = generate_default_cfgs({
    # Table 6's counts are for CIFAR-10 (10 classes) at 32 x 32.
    "vit_mini_p4": cfg_without_weights(
        num_classes=10, input_size=(3, 32, 32), crop_pct=1.0, first_conv="patch_embed.proj"),
})


# Paper 001 Table 6, Idx 1.1: EIT3/1/4-Mini's structure (C = 250, 5 layers, 10 heads, MLP 4C) as a plain
# ViT with 4 x 4 patches (8 x 8 tokens + the class token at 32 px); FLOPs printed at 2 per multiply-add.
@register_variant(PaperFacts(
    paper="001", family="vit", params=3.798e6, gflops=0.515, flops_per_mac=2, img_size=32,
    row="ViT (Table 6, Idx 1.1)"))
def vit_mini_p4(pretrained: bool = False, **kwargs) -> ViT:
    """The ViT of paper 001 Table 6 (3.798M at 10 classes), the same size as ``eit3_1_4_mini``."""
    model_args = dict(img_size=32, patch_size=4, embed_dim=250, depth=5, num_heads=10, mlp_ratio=4.0)
    return build_without_weights(ViT, "vit_mini_p4", pretrained, model_args, **kwargs)
