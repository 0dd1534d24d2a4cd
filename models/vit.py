"""DeiT (ViT) and Armour (paper 002) on timm's VisionTransformer, with vitsweep's QKV and head overrides.

- ``deit_{tiny,small,base}_p16``: DeiT-Ti/S/B, timm's ``deit_*_patch16_224`` architectures.
- ``armour_{tiny,small,base}``: the same with Armour attention, W_Q = W_V (paper 002 Eq. 2, Table 3).

Every variant takes the overrides of ``ViT`` (``qkv=``, ``head=`` and their options), e.g.
``timm.create_model("deit_tiny_p16", qkv="fsne", code_size=8)``. ``TokenHeadMixin`` carries the
``head=`` override and is shared with XCiT (``models/xcit.py``).
"""
from __future__ import annotations

import dataclasses
from functools import partial

import torch
from timm.layers import trunc_normal_
from timm.models import build_model_with_cfg, get_pretrained_cfg
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn
from torch import nn

from models._registry import PaperFacts, register_variant
from models.layers.qkv import replace_qkv_embeddings
from models.sot import CLASSIFIER_HEADS, SOT_HEAD_KWARGS, create_classifier_head

__all__ = ["TokenHeadMixin", "ViT", "check_pretrained_overrides"]


class TokenHeadMixin:
    """The ``head=`` override of a timm classifier whose ``forward_features`` returns the normalised tokens.

    ``head="linear"`` keeps timm's own head untouched (pooling, ``reset_classifier``, ``forward_head``), so
    such a model computes exactly what timm's does. ``head="sot"`` hands the whole final-norm token sequence
    [B, T, C] (class token first) to ``models.sot.create_classifier_head("sot", ...)`` (paper 004); the model
    must have been built with ``global_pool=""`` so timm does no pooling of its own.
    """

    head_name: str = "linear"  # until _set_head: timm's behaviour

    @staticmethod
    def _pop_head_kwargs(head: str, kwargs: dict) -> dict:
        """Validate ``head`` and move the SoT head's keyword arguments out of ``kwargs``."""
        if head not in CLASSIFIER_HEADS:
            raise ValueError(f"head={head!r} is not a classifier head; valid: {CLASSIFIER_HEADS}")
        head_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in SOT_HEAD_KWARGS}
        if head != "sot" and head_kwargs:
            raise ValueError(f"{sorted(head_kwargs)} apply only to head='sot', not head={head!r}")
        if head == "sot":
            global_pool = kwargs.pop("global_pool", "")
            if global_pool != "":
                raise ValueError(
                    f"global_pool={global_pool!r} is invalid with head='sot': the SoT head pools the tokens "
                    f"itself; use ''")
            kwargs["global_pool"] = ""
        return head_kwargs

    def _set_head(self, head: str, head_kwargs: dict) -> None:
        self.head_name, self.head_kwargs = head, head_kwargs
        if head != "linear":
            self.reset_classifier(self.num_classes)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if self.head_name == "linear":
            return super().reset_classifier(num_classes, global_pool)
        if global_pool not in (None, ""):
            raise ValueError(f"global_pool={global_pool!r} is invalid with head={self.head_name!r}; use ''")
        self.num_classes = num_classes
        self.head = create_classifier_head(
            self.head_name, self.embed_dim, num_classes, has_class_token=True, **self.head_kwargs)
        self.head_hidden_size = self.head.num_features
        for module in self.head.modules():
            if isinstance(module, nn.Linear):  # timm's ViT/XCiT init, as the head it replaces had
                trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.head_name == "linear":
            return super().forward_head(x, pre_logits=pre_logits)
        return self.head(self.head_drop(x), pre_logits=pre_logits)


class ViT(TokenHeadMixin, VisionTransformer):
    """timm's VisionTransformer with a choice of Q/K/V embedding and classification head.

    Args:
        qkv: Q/K/V embedding of every block, one of ``models.layers.qkv.QKV_KINDS``: 'linear' (timm's own,
            the default), 'sne', 'psne', 'fsne' (paper 000 Eqs. 4-6) or 'armour' (W_Q = W_V, paper 002 Eq. 2).
        code_size: c of F-SNE's codes Cq/Ck/Cv (required with qkv='fsne'; paper 000 uses 8, 16, 32, 64).
        qkv_hidden_dim: hidden width of SNE/P-SNE/F-SNE (default paper 000 Table 1: d/2, 3d/4, d).
        qkv_num_layers: layers per SNE branch (paper 000 Fig. 3; default 2 as in Eq. 4).
        share_codes: F-SNE codes shared by all blocks (paper 000 default) or one set per block (Table 5).
        match_baseline_params: solve the hidden width so the model has (at most) the parameters of the
            qkv='linear' model, as paper 000's starred variants (F-SNE 8*, 16*).
        head: 'linear' (timm's class-token head, default) or 'sot' (paper 004's head on all tokens).
        **kwargs: ``models.sot.SOT_HEAD_KWARGS`` go to the SoT head (head='sot' only), the rest to timm's
            VisionTransformer (img_size, num_classes, embed_dim, depth, num_heads, drop_path_rate, ...).
    """

    def __init__(
            self,
            *,
            qkv: str = "linear",
            code_size: int | None = None,
            qkv_hidden_dim: int | None = None,
            qkv_num_layers: int = 2,
            share_codes: bool = True,
            match_baseline_params: bool = False,
            head: str = "linear",
            **kwargs,
    ):
        head_kwargs = self._pop_head_kwargs(head, kwargs)
        super().__init__(**kwargs)
        replace_qkv_embeddings(
            [block.attn for block in self.blocks], qkv, code_size=code_size, hidden_dim=qkv_hidden_dim,
            num_layers=qkv_num_layers, share_codes=share_codes, match_baseline_params=match_baseline_params)
        self.qkv_kind = qkv
        self._set_head(head, head_kwargs)


def check_pretrained_overrides(variant: str, pretrained: bool, kwargs: dict) -> None:
    """Pretrained weights are timm's: they fit only the unmodified architecture."""
    if not pretrained:
        return
    qkv, head = kwargs.get("qkv", "linear"), kwargs.get("head", "linear")
    if qkv != "linear" or head != "linear":
        raise ValueError(
            f"pretrained=True for {variant} loads timm's weights, which exist only for qkv='linear' and "
            f"head='linear', not qkv={qkv!r}, head={head!r}")


def _create_vit(variant: str, timm_variant: str, pretrained: bool, **kwargs) -> ViT:
    check_pretrained_overrides(variant, pretrained, kwargs)
    if kwargs.get("pretrained_cfg") is None:
        # timm's data config (and, for qkv='linear', weights) of the architecture we build on.
        kwargs["pretrained_cfg"] = get_pretrained_cfg(timm_variant)
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        ViT,
        variant,
        pretrained,
        pretrained_filter_fn=partial(checkpoint_filter_fn, adapt_layer_scale=True),
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs,
    )


def _create_armour(variant: str, timm_variant: str, pretrained: bool, **kwargs) -> ViT:
    if pretrained:
        raise ValueError(f"pretrained=True: there are no pretrained weights for {variant}")
    qkv = kwargs.setdefault("qkv", "armour")
    if qkv != "armour":
        raise ValueError(f"{variant} is DeiT with qkv='armour', got qkv={qkv!r}; build a deit_* model for that")
    if kwargs.get("pretrained_cfg") is None:
        # DeiT's data config, without its weights (they are not Armour's).
        kwargs["pretrained_cfg"] = dataclasses.replace(
            get_pretrained_cfg(timm_variant), url="", hf_hub_id=None, architecture=variant, tag=None)
    return _create_vit(variant, timm_variant, pretrained, **kwargs)


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
