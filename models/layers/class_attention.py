"""Class attention (CaiT, as XCiT's last blocks) for several prefix tokens: XCiT with DeiT's distillation token.

timm's ``ClassAttentionBlock`` updates the first token only: its query reads every token, its MLP runs on
it, and the other tokens pass through (``x + gamma1 * norm1(x)``). With ``num_prefix_tokens`` = P, each of
the first P tokens (the class token, then the distillation token) asks its own query of every token,
prefix tokens included, and gets the MLP; the patch tokens pass through as before. With P = 1 it is timm's
block, weight for weight, and it adds no parameter: the P tokens share the block's q, k, v, projection
and MLP, as DeiT's tokens share every block's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.models.cait import ClassAttn
from timm.models.xcit import ClassAttentionBlock
from torch import nn

__all__ = ["PrefixClassAttention", "PrefixClassAttentionBlock", "attend_from_prefix_tokens"]


class PrefixClassAttention(ClassAttn):
    """timm's ``ClassAttn`` with a query for each of the first ``num_prefix_tokens`` tokens."""

    num_prefix_tokens: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, channels = x.shape
        prefix, heads = self.num_prefix_tokens, self.num_heads

        def split_heads(projected: torch.Tensor) -> torch.Tensor:
            return projected.reshape(batch, -1, heads, channels // heads).transpose(1, 2)

        q, k, v = split_heads(self.q(x[:, :prefix])), split_heads(self.k(x)), split_heads(self.v(x))
        if self.fused_attn:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            attn = self.attn_drop(((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1))
            out = attn @ v
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(batch, prefix, channels)))


class PrefixClassAttentionBlock(ClassAttentionBlock):
    """timm's ``ClassAttentionBlock`` updating its first ``attn.num_prefix_tokens`` tokens."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prefix = self.attn.num_prefix_tokens
        x_norm1 = self.norm1(x)
        x_attn = torch.cat([self.attn(x_norm1), x_norm1[:, prefix:]], dim=1)
        x = x + self.drop_path1(self.gamma1 * x_attn)
        if self.tokens_norm:
            x = self.norm2(x)
        else:
            x = torch.cat([self.norm2(x[:, :prefix]), x[:, prefix:]], dim=1)
        x_res = x
        prefix_tokens = self.gamma2 * self.mlp(x[:, :prefix])
        x = torch.cat([prefix_tokens, x[:, prefix:]], dim=1)
        return x_res + self.drop_path2(x)


def attend_from_prefix_tokens(blocks: nn.ModuleList, num_prefix_tokens: int) -> None:
    """Make timm's class-attention ``blocks`` update their first ``num_prefix_tokens`` tokens, in place (the
    parameters stay as built: timm's Xcit constructs its blocks itself, so their class changes, as
    ``models.layers.qkv``'s Armour attention does)."""
    for block in blocks:
        if not isinstance(block, ClassAttentionBlock) or type(block.attn) is not ClassAttn:
            raise TypeError(f"{type(block).__name__} is not timm's ClassAttentionBlock with ClassAttn")
        block.__class__ = PrefixClassAttentionBlock
        block.attn.__class__ = PrefixClassAttention
        block.attn.num_prefix_tokens = num_prefix_tokens
