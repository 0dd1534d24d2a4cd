"""SoT: second-order transformer (paper 004, "SoT: Delving Deeper into Classification Head for Transformer").

Everything SoT's backbone lives here; its classification head (the class token and the pooled word tokens
fused, §3.2 Eq. 1) is ``models.layers.heads.SoTHead``, shared with ViT, XCiT and EIT:

* the DenseNet-block token embedding (appendix A, Fig. S-1), a drop-in ``embed_layer`` for timm's
  ``VisionTransformer``;
* the SoT models (Table S-1): SoT-Tiny/Small/Base and the 7-layer model of the ablations (Tables 3-4),
  timm ``VisionTransformer`` blocks between the two.

Counting convention of the paper's FLOPs (Tables 3a, 5, S-1): multiply-adds of convolutions and
linear layers only, as the authors' ``thop`` profiling does; the attention's QKᵀ and AV products are
not counted (e.g. SoT-Tiny: 2.53 GMACs without them, 2.75 with; the paper says 2.5). The variants
record it as ``PaperFacts(flop_ops="conv_linear")``, ``models.measure.count_gmacs(..., ops="conv_linear")``.
"""
from __future__ import annotations

from functools import partial

import torch
from timm.layers import BatchNormAct2d, LayerNorm
from timm.models import generate_default_cfgs
from timm.models.densenet import DenseBlock, DenseTransition
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from models._registry import PaperFacts, build_without_weights, cfg_without_weights, register_variant
from models.layers.heads import TokenHeadMixin

__all__ = ["SOT_POS_EMBEDS", "DenseNetTokenEmbed", "SoT", "sinusoid_position_table"]

# Position embeddings of SoT: the released code's fixed sinusoids, or timm's learned table.
SOT_POS_EMBEDS = ("sincos", "learn")


# --------------------------------------------------------------------------------------------------
# Token embedding (appendix A, Fig. S-1)
# --------------------------------------------------------------------------------------------------

class DenseNetTokenEmbed(nn.Module):
    """SoT's token embedding: conv stem, three DenseNet blocks each halving the resolution, 1x1 conv
    to the token size; [B, 3, H, W] -> [B, (H/16)·(W/16), embed_dim] word tokens (14x14 at 224 px).

    Drop-in ``embed_layer`` for timm's VisionTransformer (same constructor arguments as PatchEmbed).

    Args:
        img_size: input resolution.
        patch_size: the embedding's total stride; must equal what the structure gives (16, or 8
            with ``last_downsample=False``) — it is not a free knob here.
        in_chans: input channels.
        embed_dim: token size.
        bias: bias of the final 1x1 projection.
        stem_dim: channels of the 3x3 stem conv (followed by a stride-2 max pool); 64.
        block_layers: layers per DenseNet block; 6.
        growth_rate: DenseNet growth rate k; 16.
        bn_size: DenseNet bottleneck multiplier (1x1 conv to bn_size·k); 2.
        transition_dim: channels after each transition; 128.
        transition_relu: whether each transition's BatchNorm is followed by a ReLU. False (default) as in the
            authors' released code, whose transitions are BN, 1x1 conv, average pool; True is timm's DenseNet
            transition (BN + ReLU). No parameter changes.
        last_downsample: whether the last block halves the resolution; the 7-layer ablation model
            drops it so its 112 px inputs still give 14x14 tokens (appendix A).
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int | tuple[int, int] | None = None,
        in_chans: int = 3,
        embed_dim: int = 240,
        bias: bool = True,
        dynamic_img_pad: bool = False,
        stem_dim: int = 64,
        block_layers: int = 6,
        growth_rate: int = 16,
        bn_size: int = 2,
        transition_dim: int = 128,
        transition_relu: bool = False,
        last_downsample: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        if dynamic_img_pad:
            raise ValueError("dynamic_img_pad=True is not supported by DenseNetTokenEmbed; its convolutions pad themselves")
        stride = 16 if last_downsample else 8
        patch = (patch_size, patch_size) if isinstance(patch_size, int) else patch_size
        if patch is not None and tuple(patch) != (stride, stride):
            raise ValueError(
                f"patch_size={patch_size!r} does not match DenseNetTokenEmbed's stride {stride} "
                f"(last_downsample={last_downsample})"
            )
        self.last_downsample = last_downsample
        self.patch_size = (stride, stride)
        self.set_input_size(img_size)

        self.stem = nn.Sequential(
            nn.Conv2d(in_chans, stem_dim, kernel_size=3, stride=1, padding=1, **dd),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
        stages, channels = [], stem_dim
        for i in range(3):
            stages.append(DenseBlock(block_layers, channels, bn_size=bn_size, growth_rate=growth_rate, **dd))
            transition = DenseTransition(
                channels + block_layers * growth_rate, transition_dim,
                norm_layer=BatchNormAct2d if transition_relu else nn.BatchNorm2d, **dd)
            if i == 2 and not last_downsample:
                transition.pool = nn.Identity()  # ablation model: keep the resolution in the last block
            stages.append(transition)
            channels = transition_dim
        self.stages = nn.Sequential(*stages)
        self.proj = nn.Conv2d(transition_dim, embed_dim, kernel_size=1, bias=bias, **dd)

    def dynamic_feat_size(self, img_size: tuple[int, int]) -> tuple[int, int]:
        """Token grid for an input of ``img_size``: the stem's max pool (k3, s2, p1) rounds up,
        each transition's average pool (k2, s2) rounds down."""
        def side(size: int) -> int:
            size = (size - 1) // 2 + 1
            for _ in range(3 if self.last_downsample else 2):
                size //= 2
            return size
        return side(img_size[0]), side(img_size[1])

    def set_input_size(self, img_size: int | tuple[int, int] | None = None, patch_size=None) -> None:
        """Resize the expected input (timm's VisionTransformer.set_input_size); the stride is fixed."""
        if patch_size is not None and tuple(patch_size) != self.patch_size:
            raise ValueError(f"patch_size={patch_size!r} cannot change: DenseNetTokenEmbed's stride is {self.patch_size}")
        if img_size is not None:
            self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
            self.grid_size = self.dynamic_feat_size(self.img_size)
            self.num_patches = self.grid_size[0] * self.grid_size[1]

    def feat_ratio(self, as_scalar: bool = True):
        return self.patch_size[0] if as_scalar else self.patch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.stages(self.stem(x)))
        return x.flatten(2).transpose(1, 2)  # [B, C, H, W] -> [B, HW, C]


# --------------------------------------------------------------------------------------------------
# SoT models (Table S-1)
# --------------------------------------------------------------------------------------------------

def sinusoid_position_table(num_positions: int, dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[1, num_positions, dim] fixed position embedding (Transformer sinusoids, as the released SoT uses):
    entry (p, j) is sin(p / 10000^(2⌊j/2⌋ / dim)) for even j and cos of it for odd j; position 0 is the
    class token's, the word tokens follow in raster order."""
    position = torch.arange(num_positions, dtype=torch.float64, device=device)[:, None]
    channel = torch.arange(dim, device=device)
    angle = position / torch.pow(10000.0, (2 * (channel // 2)).double() / dim)
    return torch.where(channel % 2 == 0, angle.sin(), angle.cos()).float().unsqueeze(0)


class SoT(TokenHeadMixin, VisionTransformer):
    """SoT network (Fig. 1): DenseNet token embedding, timm ViT blocks, SoT classification head.

    Where the authors' released code (jiangtaoxie/SoT, ``sot_src/``) and timm's ViT differ, the default
    follows the released code and an argument gives the timm form; no choice changes a parameter count:
    a fixed sinusoidal position embedding (``pos_embed``; kept as a frozen parameter, as released), DenseNet
    transitions with BatchNorm only (``embed_kwargs={"transition_relu": True}`` adds timm's ReLU) and
    LayerNorm eps 1e-5 (``norm_eps``; timm's ViT uses 1e-6).

    Args:
        img_size, in_chans, num_classes: as for timm's VisionTransformer.
        embed_dim: token size (Table S-1: 240 / 384 / 528).
        depth: transformer layers (12 / 14 / 24; 7 for the ablation model).
        num_heads: MSA heads (4 / 6 / 8).
        mlp_ratio: MLP size / token size (600/240, 1344/384, 1584/528).
        qkv_bias: the authors' blocks have no qkv bias.
        last_downsample: False for the 7-layer ablation model (appendix A).
        pos_embed: 'sincos' (default): fixed sinusoids, ``sinusoid_position_table``, rebuilt for a new
            input size; 'learn': timm's trained position embedding. One of SOT_POS_EMBEDS.
        norm_eps: eps of every LayerNorm (blocks and final norm); 1e-5 as released (PyTorch's default).
        embed_kwargs: further DenseNetTokenEmbed arguments (stem_dim, growth_rate, transition_relu, ...).
        head: 'sot' (default) or 'linear' (timm's class-token classifier: the baseline of Table 3a); see
            ``TokenHeadMixin``.
        head_defaults: the variant's SoT head settings (Table S-1 m, n; Table S-3 dropout), under any
            head kwargs given explicitly; unused by head='linear'.
        **kwargs: SOT_HEAD_KWARGS for the head (see SoTHead; defaults are the paper's, or the released
            code's where they differ), the rest to timm's VisionTransformer (drop_path_rate, ...).
    """

    def __init__(
        self,
        img_size: int = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 240,
        depth: int = 12,
        num_heads: int = 4,
        mlp_ratio: float = 2.5,
        qkv_bias: bool = False,
        last_downsample: bool = True,
        pos_embed: str = "sincos",
        norm_eps: float = 1e-5,
        embed_kwargs: dict | None = None,
        head: str = "sot",
        head_defaults: dict | None = None,
        **kwargs,
    ):
        if head == "sot" and head_defaults:
            defaults = dict(head_defaults)
            if kwargs.keys() & {"mgcrp_m", "mgcrp_n", "repr_size"}:  # an explicit shape replaces the variant's
                defaults = {k: v for k, v in defaults.items() if k not in ("mgcrp_m", "mgcrp_n")}
            kwargs = {**defaults, **kwargs}
        if pos_embed not in SOT_POS_EMBEDS:
            raise ValueError(f"pos_embed={pos_embed!r} is not a SoT position embedding; valid: {SOT_POS_EMBEDS}")
        kwargs.setdefault("norm_layer", partial(LayerNorm, eps=norm_eps))
        super().__init__(
            head=head,
            img_size=img_size,
            patch_size=16 if last_downsample else 8,
            in_chans=in_chans,
            num_classes=num_classes,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            qkv_bias=qkv_bias,
            embed_layer=partial(DenseNetTokenEmbed, last_downsample=last_downsample, **(embed_kwargs or {})),
            pos_embed="learn",
            **kwargs,
        )
        self.fixed_pos_embed = pos_embed == "sincos"
        if self.fixed_pos_embed:
            self._set_sinusoid_pos_embed()

    def _set_sinusoid_pos_embed(self) -> None:
        # A frozen Parameter, not a buffer: the released model counts it among its parameters.
        table = sinusoid_position_table(self.pos_embed.shape[1], self.embed_dim, device=self.pos_embed.device)
        self.pos_embed = nn.Parameter(table.to(self.pos_embed.dtype), requires_grad=False)

    def set_input_size(self, img_size=None, patch_size=None) -> None:
        """timm's resize; the fixed sinusoids are rebuilt for the new token count, not interpolated."""
        super().set_input_size(img_size=img_size, patch_size=patch_size)
        if self.fixed_pos_embed:
            self._set_sinusoid_pos_embed()


_cfg = partial(cfg_without_weights, first_conv="patch_embed.stem.0")
default_cfgs = generate_default_cfgs({
    "sot_tiny": _cfg(),
    "sot_small": _cfg(),
    "sot_base": _cfg(),
    # §4.2: ablations resize the short side to 128 and crop 112 x 112.
    "sot_7layer": _cfg(input_size=(3, 112, 112), crop_pct=112 / 128),
})

_SOT_TINY = dict(embed_dim=240, depth=12, num_heads=4, mlp_ratio=600 / 240,
                 head_defaults=dict(mgcrp_heads=6, mgcrp_m=14, mgcrp_n=14, mgcrp_dropout=0.0))
_SOT_SMALL = dict(embed_dim=384, depth=14, num_heads=6, mlp_ratio=1344 / 384,
                  head_defaults=dict(mgcrp_heads=6, mgcrp_m=24, mgcrp_n=24, mgcrp_dropout=0.5))
_SOT_BASE = dict(embed_dim=528, depth=24, num_heads=8, mlp_ratio=1584 / 528,
                 head_defaults=dict(mgcrp_heads=6, mgcrp_m=38, mgcrp_n=38, mgcrp_dropout=0.7))
# "Shares the same configuration with SoT-Tiny, but only has 7 layers and ... the downsampling of the
# last block in the token embedding module is removed" (appendix A).
_SOT_7LAYER = dict(_SOT_TINY, depth=7, img_size=112, last_downsample=False)


def _facts(row: str, params: float, gflops: float | None, top1: float, img_size: int = 224) -> PaperFacts:
    # The paper's FLOPs are multiply-adds of convolutions and linear layers only (see module docstring).
    return PaperFacts(paper="004", family="sot", params=params, gflops=gflops, flop_ops="conv_linear", top1=top1,
                      img_size=img_size, row=row)


# Table S-1 / 5.
@register_variant(_facts("SoT-Tiny", 7.7e6, 2.5, 80.3))
def sot_tiny(pretrained: bool = False, **kwargs) -> SoT:
    return build_without_weights(SoT, "sot_tiny", pretrained, _SOT_TINY, **kwargs)


@register_variant(_facts("SoT-Small", 26.9e6, 5.8, 82.7))
def sot_small(pretrained: bool = False, **kwargs) -> SoT:
    return build_without_weights(SoT, "sot_small", pretrained, _SOT_SMALL, **kwargs)


@register_variant(_facts("SoT-Base", 76.8e6, 14.5, 83.5))
def sot_base(pretrained: bool = False, **kwargs) -> SoT:
    return build_without_weights(SoT, "sot_base", pretrained, _SOT_BASE, **kwargs)


# Table 3b, sum + MGCrP (repr 1176): the ablations' reference model at 112 px. The paper gives no
# FLOPs for it; its class-token-only baseline (head='linear') is Table 3a's 4.23M / 1.06G row.
@register_variant(_facts("7-layer SoT, sum + MGCrP (Table 3b)", 5.44e6, None, 75.97, img_size=112))
def sot_7layer(pretrained: bool = False, **kwargs) -> SoT:
    return build_without_weights(SoT, "sot_7layer", pretrained, _SOT_7LAYER, **kwargs)
