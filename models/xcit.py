"""XCiT (paper 003) on timm's Xcit, with vitsweep's QKV embeddings (papers 000, 002) and heads (paper 004).

Variants ``xcit_{nano_12,tiny_12,tiny_24,small_12,small_24,medium_24,large_24}_p{16,8}`` are the
architectures of paper 003 Table 1 (timm's ``xcit_*_224`` without the resolution in the name). With the
default ``qkv="linear", head="linear"`` a model is timm's XCiT, weight for weight; e.g. paper 000's
XCiT-N12 (F-SNE, 8*) is ``timm.create_model("xcit_nano_12_p16", qkv="fsne", code_size=8,
match_baseline_params=True)``.
"""
from __future__ import annotations

from timm.models import build_model_with_cfg, get_pretrained_cfg
from timm.models.xcit import Xcit, checkpoint_filter_fn

from models._registry import PaperFacts, register_variant
from models.layers.qkv import replace_qkv_embeddings
from models.vit import TokenHeadMixin, check_pretrained_overrides

__all__ = ["XCiT"]


class XCiT(TokenHeadMixin, Xcit):
    """timm's Xcit with a choice of Q/K/V embedding in its XCA blocks and of classification head.

    Args:
        qkv: Q/K/V embedding of every XCA block (the class-attention blocks keep theirs), one of
            ``models.layers.qkv.QKV_KINDS``: 'linear' (timm's own, the default), 'sne', 'psne', 'fsne'
            (paper 000 Eqs. 4-6) or 'armour' (W_Q = W_V, paper 002 Eq. 2).
        code_size: c of F-SNE's codes Cq/Ck/Cv (required with qkv='fsne'; paper 000 uses 8, 16, 32, 64).
        qkv_hidden_dim: hidden width of SNE/P-SNE/F-SNE (default paper 000 Table 1: d/2, 3d/4, d).
        qkv_num_layers: layers per SNE branch (paper 000 Fig. 3; default 2 as in Eq. 4).
        share_codes: F-SNE codes shared by all blocks (paper 000 default) or one set per block (Table 5).
        match_baseline_params: solve the hidden width so the model has (at most) the parameters of the
            qkv='linear' model, as paper 000's starred variants (F-SNE 8*, 16*).
        head: 'linear' (timm's class-token head, default) or 'sot' (paper 004's head on the tokens that
            leave the class-attention blocks and the final norm).
        **kwargs: ``models.sot.SOT_HEAD_KWARGS`` go to the SoT head (head='sot' only), the rest to timm's
            Xcit (img_size, num_classes, patch_size, embed_dim, depth, num_heads, eta, tokens_norm, ...).
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


def _create_xcit(variant: str, pretrained: bool, **kwargs) -> XCiT:
    check_pretrained_overrides(variant, pretrained, kwargs)
    if kwargs.get("pretrained_cfg") is None:
        # timm's data config (and, for qkv='linear', weights) of the same architecture at 224 px.
        kwargs["pretrained_cfg"] = get_pretrained_cfg(f"{variant}_224.fb_in1k")
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        XCiT,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs,
    )


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
