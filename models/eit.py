"""EIT: efficiently introducing inductive bias to ViT (paper 001: Xia et al., arXiv:2203.07116).

EIT keeps ViT's pyramid-free backbone (class token, pre-norm blocks, MLP 4C, linear classifier) and
changes two things:

* EIT_P (§3.5.2, App. A, Eq. 3): the patch embedding is an *overlapping* convolution (stride s < kernel
  k) followed by a k_m x k_m / stride k_m max-pool that throws the redundant patches away again.
  "EIT16/4/3" reads conv kernel 16, conv stride 4, max-pool kernel = stride 3 (Table 2 caption).
* EIT_T (§3.5.3, App. B, Eqs. 4-6, 11-13): in layer i a depth-wise k x k convolution runs on the first
  C_T_i channels of the patch tokens while standard MHA runs on the remaining C_M_i channels of all
  tokens; the two outputs are concatenated along channels.  C_T_i decreases with depth (Eq. 13).

Variants (Table 2): Mini/Tiny/Base/Large at 16/4/3 for 224 px ImageNet (Table 5) and 3/1/4-Mini for
32 px images (Table 6).  Build any of them with ``timm.create_model(name, **overrides)``.
"""
from __future__ import annotations

import math
from fractions import Fraction
from functools import partial
from typing import Callable, Sequence

import torch
from torch import nn
from timm.layers import Attention, DropPath, Mlp, to_2tuple, trunc_normal_
from timm.models import generate_default_cfgs

from models._registry import PaperFacts, build_without_weights, cfg_without_weights, register_variant
from models.layers.qkv import QKVOverrideMixin
from models.layers.heads import TokenHeadMixin

__all__ = [
    "CHANNEL_SCHEDULES",
    "POS_EMBEDS",
    "EIT",
    "EITBlock",
    "EITVisionTransformer",
    "EITPatchEmbed",
    "ParallelConvAttention",
    "eit_channel_split",
]

CHANNEL_SCHEDULES = ("decreasing", "increasing", "invariant", "linear")
POS_EMBEDS = ("none", "learn")


# --------------------------------------------------------------------------------------------------
# Channel split between EIT_T (conv) and MHA, Eq. 13
# --------------------------------------------------------------------------------------------------

def _exact(value: float | int | Fraction) -> Fraction:
    # Ratios are kept exact so floor((C // h) * r_i) in Eq. 13 never loses a head to float error (in floats
    # 55 * (3 / 11) and 100 * 0.29 are 14.999... and 28.999...).  str() gives the decimal the user wrote.
    return Fraction(str(value)) if isinstance(value, float) else Fraction(value)


def _schedule_ratios(
        channel_schedule: str | Sequence[float],
        depth: int,
        mha_ratio_range: tuple[float, float] | None,
) -> list[Fraction]:
    """The MHA share r_i of layer i = 1..L (schedules documented at ``EITVisionTransformer``)."""
    if isinstance(channel_schedule, str):
        if channel_schedule not in CHANNEL_SCHEDULES:
            raise ValueError(
                f"channel_schedule={channel_schedule!r} is not valid: use one of {CHANNEL_SCHEDULES} "
                f"or a sequence of {depth} per-layer MHA ratios r_i in [0, 1]")
        if (channel_schedule == "linear") != (mha_ratio_range is not None):
            raise ValueError(
                f"mha_ratio_range={mha_ratio_range!r} with channel_schedule={channel_schedule!r}: "
                "mha_ratio_range=(r_1, r_L) is required by, and only valid with, channel_schedule='linear'")
        layers = range(1, depth + 1)
        if channel_schedule == "decreasing":  # the paper's default, r_i = i / L (Eq. 13)
            return [Fraction(i, depth) for i in layers]
        if channel_schedule == "increasing":  # Table 9: the mirror image, conv share grows with depth
            return [Fraction(depth + 1 - i, depth) for i in layers]
        if channel_schedule == "invariant":  # Table 9 / LSRA: conv and MHA each take half (§3.2)
            return [Fraction(1, 2)] * depth
        if len(mha_ratio_range) != 2:
            raise ValueError(f"mha_ratio_range={mha_ratio_range!r} is not valid: give two ratios (r_1, r_L)")
        start, end = (_exact(r) for r in mha_ratio_range)
        step = (end - start) / (depth - 1) if depth > 1 else Fraction(0)
        ratios = [start + step * (i - 1) for i in layers]
    else:
        if mha_ratio_range is not None:
            raise ValueError(
                f"mha_ratio_range={mha_ratio_range!r} is only valid with channel_schedule='linear', "
                "not with an explicit list of per-layer ratios")
        ratios = [_exact(r) for r in channel_schedule]
        if len(ratios) != depth:
            raise ValueError(
                f"channel_schedule={list(channel_schedule)!r} has {len(ratios)} ratios: "
                f"give exactly one MHA ratio r_i per layer (depth={depth})")
    bad = [float(r) for r in ratios if not 0 <= r <= 1]
    if bad:
        raise ValueError(f"MHA ratios {bad} are outside [0, 1]: r_i is the MHA share of the channels")
    return ratios


def eit_channel_split(
        embed_dim: int,
        num_heads: int,
        depth: int,
        channel_schedule: str | Sequence[float] = "decreasing",
        mha_ratio_range: tuple[float, float] | None = None,
        conv_channels: Sequence[int] | None = None,
) -> list[int]:
    """C_T_i, the channels EIT_T's convolution takes in layer i = 1..L; MHA takes C - C_T_i.

    Eq. 13: C_T_i = C - floor((C // h) * r_i) * h, i.e. the MHA width C_M_i = C - C_T_i is rounded
    *down* to a multiple of the head count h (so every head has C_M_i / h channels) and the conv gets
    the rest, including C mod h when C is not a multiple of h.  ``conv_channels`` gives C_T_i directly.
    """
    if embed_dim < num_heads:
        raise ValueError(
            f"embed_dim={embed_dim} < num_heads={num_heads}: MHA needs at least one channel per head")
    if conv_channels is None:
        ratios = _schedule_ratios(channel_schedule, depth, mha_ratio_range)
        q = embed_dim // num_heads
        return [embed_dim - math.floor(q * r) * num_heads for r in ratios]  # Eq. 13

    if not (isinstance(channel_schedule, str) and channel_schedule == "decreasing") or mha_ratio_range is not None:
        raise ValueError(
            f"conv_channels={list(conv_channels)!r} fixes C_T per layer, so channel_schedule="
            f"{channel_schedule!r} / mha_ratio_range={mha_ratio_range!r} cannot also apply: leave them "
            "at their defaults")
    conv_channels = list(conv_channels)
    if len(conv_channels) != depth:
        raise ValueError(
            f"conv_channels={conv_channels!r} has {len(conv_channels)} entries: give exactly one C_T per "
            f"layer (depth={depth})")
    for c_t in conv_channels:
        if isinstance(c_t, bool) or not isinstance(c_t, int) or not 0 <= c_t <= embed_dim \
                or (embed_dim - c_t) % num_heads:
            first = embed_dim % num_heads
            raise ValueError(
                f"conv_channels entry {c_t!r} is not valid for embed_dim={embed_dim}, num_heads={num_heads}: "
                f"C_T must be an int leaving the MHA width embed_dim - C_T a multiple of {num_heads}, i.e. one "
                f"of {first}, {first + num_heads}, ..., {embed_dim}")
    return conv_channels


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------

class EITPatchEmbed(nn.Module):
    """EIT_P: overlapping convolution, then max-pool, then flatten to tokens (App. A, Eqs. 2-3).

    Args:
        img_size: input resolution the model is built for (sets the token grid of a position embedding).
        in_chans: image channels.
        embed_dim: C, the conv's output channels.
        kernel_size: conv kernel k (first number of "EIT16/4/3").
        stride: conv stride s < k (second number).
        pool_size: max-pool kernel = stride k_m (third number).
        padding: conv padding p; ``None`` = (k - s) // 2, which makes the conv grid exactly H / s
            (224 -> 56 for 16/4, 32 -> 32 for 3/1).  The paper does not state p: with p = 0 EIT16/4/3 gets a
            17 x 17 token grid and ~10% fewer multiply-adds than Table 5 lists, with (k - s) // 2 an 18 x 18
            grid within 1.4% (Mini); EIT3/1/4 gets 8 x 8, the grid of the patch-4 ViT Table 6 compares it to.
    """

    def __init__(
            self,
            img_size: int | tuple[int, int] = 224,
            in_chans: int = 3,
            embed_dim: int = 250,
            kernel_size: int = 16,
            stride: int = 4,
            pool_size: int = 3,
            padding: int | None = None,
    ) -> None:
        super().__init__()
        if not 0 < stride <= kernel_size:
            raise ValueError(
                f"patch stride={stride} is not valid for patch kernel={kernel_size}: EIT_P needs "
                "0 < stride <= kernel (stride < kernel gives the overlapping patches of §3.5.2)")
        if pool_size < 1:
            raise ValueError(f"pool_size={pool_size} is not valid: the max-pool kernel/stride must be >= 1")
        padding = (kernel_size - stride) // 2 if padding is None else padding
        if padding < 0:
            raise ValueError(f"patch padding={padding} is not valid: it must be >= 0")
        self.img_size = to_2tuple(img_size)
        self.grid_size = tuple(self._grid(n, kernel_size, stride, padding, pool_size) for n in self.img_size)
        if min(self.grid_size) < 1:
            smallest = (pool_size - 1) * stride + kernel_size - 2 * padding
            raise ValueError(
                f"img_size={img_size} is too small for EIT_P (conv kernel {kernel_size}, stride {stride}, "
                f"padding {padding}, max-pool {pool_size}): the token grid would be "
                f"{self.grid_size[0]}x{self.grid_size[1]}; each side must be >= {smallest} px")
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size, stride, padding)  # standard conv, App. C
        self.pool = nn.MaxPool2d(pool_size, pool_size)

    @staticmethod
    def _grid(n: int, kernel_size: int, stride: int, padding: int, pool_size: int) -> int:
        conv = (n + 2 * padding - kernel_size) // stride + 1  # Eq. 2
        return max(conv, 0) // pool_size

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        x = self.pool(self.proj(x))
        grid = (x.shape[-2], x.shape[-1])
        return x.flatten(2).transpose(1, 2), grid  # ReShape1D, Eq. 3


class ParallelConvAttention(nn.Module):
    """EIT_T beside MHA: the token mixer of one EIT layer (App. B, Eqs. 4-6, 11-12).

    The first ``conv_dim`` channels of the patch tokens go through one depth-wise ``conv_kernel`` x
    ``conv_kernel`` convolution (stride 1, no bias: App. C counts k^2 C parameters, and with a bias Table 6's
    3.095M would round to 3.096M); the class token's share of those channels passes through unchanged
    (Eq. 11: a 2D conv cannot place it).  The other ``dim - conv_dim`` channels of all tokens go through
    MHA.  Either part may be empty (conv_dim = 0: plain ViT attention; conv_dim = dim: conv only).

    Args:
        dim: C_i, channels of the tokens.
        conv_dim: C_T_i, channels taken by the convolution.
        num_heads: h; dim - conv_dim must be a multiple of it.
        conv_kernel: EIT_T's kernel (3 in Table 2); odd, so the token grid keeps its size.
        attn_drop: dropout on the attention weights.
        proj_drop: dropout on the concatenated output.

    The MHA is timm's ``Attention`` with biased Q/K/V (the paper's 4 C_M^2 + 4 C_M parameters, App. C), so
    ``EIT`` can swap its ``qkv`` projection like any timm ViT's.
    """

    def __init__(
            self,
            dim: int,
            conv_dim: int,
            num_heads: int,
            conv_kernel: int = 3,
            attn_drop: float = 0.0,
            proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        mha_dim = dim - conv_dim
        if not 0 <= conv_dim <= dim or mha_dim % num_heads:
            raise ValueError(
                f"conv_dim={conv_dim} is not valid for dim={dim}, num_heads={num_heads}: it must be in "
                f"[0, {dim}] and leave dim - conv_dim divisible by {num_heads}")
        if conv_kernel < 1 or conv_kernel % 2 == 0:
            raise ValueError(f"conv_kernel={conv_kernel} is not valid: EIT_T needs an odd kernel >= 1")
        self.conv_dim = conv_dim
        self.mha_dim = mha_dim
        self.conv = nn.Conv2d(
            conv_dim, conv_dim, conv_kernel, 1, conv_kernel // 2, groups=conv_dim, bias=False,
        ) if conv_dim else None
        self.attn = Attention(mha_dim, num_heads, qkv_bias=True, attn_drop=attn_drop) if mha_dim else None
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        parts = []
        if self.conv is not None:
            x_t = x[..., :self.conv_dim]  # Eq. 4
            cls_t, patches = x_t[:, :1], x_t[:, 1:]
            batch, _, channels = patches.shape
            patches = patches.transpose(1, 2).reshape(batch, channels, *grid)  # Reshape2D, Eq. 12
            patches = self.conv(patches).flatten(2).transpose(1, 2)
            parts.append(torch.cat([cls_t, patches], dim=1))  # Eq. 11
        if self.attn is not None:
            parts.append(self.attn(x[..., self.conv_dim:]))  # Eq. 5
        return self.proj_drop(torch.cat(parts, dim=-1))  # Eq. 6


class EITBlock(nn.Module):
    """One EIT encoder layer: ViT's pre-norm block with the attention replaced by EIT_T + MHA.

    Args:
        dim: C.
        conv_dim: C_T_i of this layer.
        num_heads: h.
        mlp_ratio: MLP hidden size / C (Table 2: 4).
        conv_kernel: EIT_T's kernel.
        proj_drop: dropout on the mixer and MLP outputs.
        attn_drop: dropout on attention weights.
        drop_path: stochastic depth rate of this layer.
        norm_layer: normalisation before the mixer and the MLP.
    """

    def __init__(
            self,
            dim: int,
            conv_dim: int,
            num_heads: int,
            mlp_ratio: float = 4.0,
            conv_kernel: int = 3,
            proj_drop: float = 0.0,
            attn_drop: float = 0.0,
            drop_path: float = 0.0,
            norm_layer: Callable[[int], nn.Module] = partial(nn.LayerNorm, eps=1e-6),
    ) -> None:
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.mixer = ParallelConvAttention(
            dim, conv_dim, num_heads, conv_kernel, attn_drop=attn_drop, proj_drop=proj_drop)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        x = x + self.drop_path1(self.mixer(self.norm1(x), grid))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------

class EITVisionTransformer(nn.Module):
    """EIT as the paper builds it: EIT_P, class token, L EIT layers, LayerNorm, linear classifier (Fig. 6).

    Args:
        img_size: input resolution (224 for Table 5, 32 for Table 6).
        in_chans: image channels.
        num_classes: classifier outputs.
        global_pool: "token" (classify the class token, as the paper) or "" (classify every token).
        embed_dim: C (Table 2: Mini 250, Tiny 330, Base 400, Large 464).
        depth: L, number of layers (Table 2: 5, 8, 10, 12).
        num_heads: h (Table 2: 10, 10, 16, 16).
        mlp_ratio: MLP hidden size / C (Table 2: 4).
        patch_kernel: EIT_P conv kernel k ("16" of 16/4/3).
        patch_stride: EIT_P conv stride s ("4").
        patch_pool: EIT_P max-pool kernel = stride ("3").
        patch_padding: EIT_P conv padding; ``None`` = (k - s) // 2 (see ``EITPatchEmbed``).
        conv_kernel: EIT_T depth-wise kernel (Table 2: 3, stride 1).
        channel_schedule: how the MHA share r_i of layer i = 1..L is chosen; Eq. 13 turns it into
            C_T_i = C - floor((C // h) r_i) h, so the MHA width is always a multiple of h.
            "decreasing" (the paper's EIT_T): r_i = i / L, conv share shrinks to 0 at the last layer.
            "increasing" (Table 9): r_i = (L + 1 - i) / L, the mirror image.
            "invariant" (Table 9, LSRA's half/half split of §3.2): r_i = 1/2.
            "linear": r_i goes linearly from ``mha_ratio_range[0]`` at layer 1 to ``[1]`` at layer L
            (decreasing = (1/L, 1), increasing = (1, 1/L), invariant = (1/2, 1/2)).
            A sequence of L floats in [0, 1]: r_i per layer.
        mha_ratio_range: (r_1, r_L) for channel_schedule="linear"; not valid otherwise.
        conv_channels: C_T_i per layer given directly (each leaving C - C_T_i divisible by h); replaces
            the schedule.
        pos_embed: "none" (the paper's EIT, Table 1) or "learn" (a trainable ViT position embedding,
            Table 10; the counts of Tables 6-8 include one).
        drop_rate: dropout before the classifier.
        pos_drop_rate: dropout after adding the position embedding.
        proj_drop_rate: dropout on the mixer and MLP outputs (Table 3 "Drop": 0.2 on small datasets).
        attn_drop_rate: dropout on attention weights (Table 3 "Att. Drop": 0.15).
        drop_path_rate: stochastic depth, linearly increasing over layers (Table 3 "Droppath": 0.2).
        norm_layer: normalisation layer.
    """

    def __init__(
            self,
            img_size: int | tuple[int, int] = 224,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = "token",
            embed_dim: int = 250,
            depth: int = 5,
            num_heads: int = 10,
            mlp_ratio: float = 4.0,
            patch_kernel: int = 16,
            patch_stride: int = 4,
            patch_pool: int = 3,
            patch_padding: int | None = None,
            conv_kernel: int = 3,
            channel_schedule: str | Sequence[float] = "decreasing",
            mha_ratio_range: tuple[float, float] | None = None,
            conv_channels: Sequence[int] | None = None,
            pos_embed: str = "none",
            drop_rate: float = 0.0,
            pos_drop_rate: float = 0.0,
            proj_drop_rate: float = 0.0,
            attn_drop_rate: float = 0.0,
            drop_path_rate: float = 0.0,
            norm_layer: Callable[[int], nn.Module] = partial(nn.LayerNorm, eps=1e-6),
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth={depth} is not valid: EIT needs at least one layer")
        if pos_embed not in POS_EMBEDS:
            raise ValueError(f"pos_embed={pos_embed!r} is not valid: use one of {POS_EMBEDS}")
        self.num_classes = num_classes
        self.global_pool = self._check_global_pool(global_pool)
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1
        self.conv_channels = eit_channel_split(
            embed_dim, num_heads, depth, channel_schedule, mha_ratio_range, conv_channels)

        self.patch_embed = EITPatchEmbed(
            img_size, in_chans, embed_dim, patch_kernel, patch_stride, patch_pool, patch_padding)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(
            torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim)) if pos_embed == "learn" else None
        self.pos_drop = nn.Dropout(pos_drop_rate)
        drop_path = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.ModuleList([
            EITBlock(
                embed_dim, c_t, num_heads, mlp_ratio, conv_kernel,
                proj_drop=proj_drop_rate, attn_drop=attn_drop_rate, drop_path=drop_path[i], norm_layer=norm_layer,
            )
            for i, c_t in enumerate(self.conv_channels)
        ])
        self.norm = norm_layer(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights()

    @staticmethod
    def _check_global_pool(global_pool: str) -> str:
        if global_pool not in ("token", ""):
            raise ValueError(
                f"global_pool={global_pool!r} is not valid: use 'token' (the class token, as the paper) or ''")
        return global_pool

    def _init_weights(self) -> None:
        # ViT/DeiT initialisation; convolutions keep PyTorch's, as timm's ViT patch embedding does.
        trunc_normal_(self.cls_token, std=0.02)
        if self.pos_embed is not None:
            trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"cls_token", "pos_embed"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups by depth, as timm's ViT: the stem (patch embedding, class token, position
        embedding), each layer, the final norm with the last layer; the head follows (layer-wise lr decay)."""
        return dict(stem=r"^cls_token|pos_embed|patch_embed", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if global_pool is not None:
            self.global_pool = self._check_global_pool(global_pool)
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x, grid = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        if self.pos_embed is not None:
            if x.shape[1] != self.pos_embed.shape[1]:
                raise ValueError(
                    f"input gives a {grid[0]}x{grid[1]} token grid but the learned position embedding was "
                    f"built for {self.patch_embed.grid_size[0]}x{self.patch_embed.grid_size[1]} "
                    f"(img_size={self.patch_embed.img_size}): feed that size or build with pos_embed='none'")
            x = x + self.pos_embed
        x = self.pos_drop(x)
        for block in self.blocks:
            x = block(x, grid)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "token":
            x = x[:, 0]
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


class EIT(TokenHeadMixin, QKVOverrideMixin, EITVisionTransformer):
    """``EITVisionTransformer`` with vitsweep's Q/K/V-embedding and classification-head overrides.

    With the defaults it is exactly the paper's EIT.  The overrides are those of every ViT-like family here:
    ``qkv=`` and its options (``models.layers.qkv.QKVOverrideMixin``) and ``head=``
    (``models.layers.heads.TokenHeadMixin``), e.g. ``timm.create_model("eit16_4_3_mini", qkv="fsne", code_size=8, head="sot")``.  Each layer's Q/K/V
    embedding has that layer's MHA width C_M_i (so ``qkv_hidden_dim`` may be one int per MHA layer, and its
    default is relative to C_M_i); F-SNE's codes (size c, independent of the width) are still shared by all
    layers.  Layers without MHA (C_M_i = 0) have no embedding.
    """

    def qkv_attentions(self) -> list[nn.Module]:
        return [block.mixer.attn for block in self.blocks if block.mixer.attn is not None]


# --------------------------------------------------------------------------------------------------
# Variants (Table 2)
# --------------------------------------------------------------------------------------------------

_cfg = partial(cfg_without_weights, crop_pct=0.9, first_conv="patch_embed.proj")
default_cfgs = generate_default_cfgs({
    "eit16_4_3_mini": _cfg(),
    "eit16_4_3_tiny": _cfg(),
    "eit16_4_3_base": _cfg(),
    "eit16_4_3_large": _cfg(),
    # Table 6's counts are for CIFAR-10 (10 classes) at 32 x 32.
    "eit3_1_4_mini": _cfg(num_classes=10, input_size=(3, 32, 32), crop_pct=1.0),
})

_MINI = dict(embed_dim=250, depth=5, num_heads=10)
_TINY = dict(embed_dim=330, depth=8, num_heads=10)
_BASE = dict(embed_dim=400, depth=10, num_heads=16)
_LARGE = dict(embed_dim=464, depth=12, num_heads=16)
_EIT16_4_3 = dict(patch_kernel=16, patch_stride=4, patch_pool=3)
_EIT3_1_4 = dict(patch_kernel=3, patch_stride=1, patch_pool=4)


# Table 5 reports multiply-adds (its DeiT-T row, 1.3G, is DeiT's MAC count); top-1 is ImageNet-1K.
@register_variant(PaperFacts(
    paper="001", family="eit", params=3.5e6, gflops=1.73, top1=70.0, img_size=224, row="EIT16/4/3-Mini"))
def eit16_4_3_mini(pretrained: bool = False, **kwargs) -> EIT:
    return build_without_weights(EIT, "eit16_4_3_mini", pretrained, dict(_MINI, **_EIT16_4_3), **kwargs)


@register_variant(PaperFacts(
    paper="001", family="eit", params=8.9e6, gflops=3.84, top1=78.1, img_size=224, row="EIT16/4/3-Tiny"))
def eit16_4_3_tiny(pretrained: bool = False, **kwargs) -> EIT:
    return build_without_weights(EIT, "eit16_4_3_tiny", pretrained, dict(_TINY, **_EIT16_4_3), **kwargs)


@register_variant(PaperFacts(
    paper="001", family="eit", params=16.0e6, gflops=6.52, top1=80.6, img_size=224, row="EIT16/4/3-Base"))
def eit16_4_3_base(pretrained: bool = False, **kwargs) -> EIT:
    return build_without_weights(EIT, "eit16_4_3_base", pretrained, dict(_BASE, **_EIT16_4_3), **kwargs)


@register_variant(PaperFacts(
    paper="001", family="eit", params=25.3e6, gflops=10.0, top1=81.8, img_size=224, row="EIT16/4/3-Large"))
def eit16_4_3_large(pretrained: bool = False, **kwargs) -> EIT:
    return build_without_weights(EIT, "eit16_4_3_large", pretrained, dict(_LARGE, **_EIT16_4_3), **kwargs)


# Table 6 (Idx 1.9) counts FLOPs as 2 per multiply-add (its patch-4 ViT, 0.255 GMACs, is listed as
# 0.515G), hence flops_per_mac=2 beside the printed 0.428G.  It reports CIFAR, not ImageNet.  Its models
# carry a trainable position embedding (3.095M with it; Table 10's "Trainable" row), so this variant does;
# pos_embed="none" gives the embedding-free EIT of Table 1.
@register_variant(PaperFacts(
    paper="001", family="eit", params=3.095e6, gflops=0.428, flops_per_mac=2, top1=None, img_size=32,
    row="EIT3/1/4-Mini (Table 6, Idx 1.9)"))
def eit3_1_4_mini(pretrained: bool = False, **kwargs) -> EIT:
    return build_without_weights(
        EIT, "eit3_1_4_mini", pretrained, dict(_MINI, img_size=32, pos_embed="learn", **_EIT3_1_4), **kwargs)
