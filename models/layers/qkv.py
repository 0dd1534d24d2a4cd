"""Q/K/V embeddings: modules mapping tokens ``[B, N, C] -> [B, N, 3C]`` (q, k, v concatenated).

Each is a drop-in for the ``qkv`` Linear of timm's ``XCA`` (XCiT) and ``Attention`` (ViT/DeiT), which split
the output as ``reshape(B, N, 3, heads, C // heads)``, i.e. ``[q | k | v]`` along the last dimension.

Kinds (``QKV_KINDS``):

- ``"linear"``: the original separate projections, Q = XW_q, K = XW_k, V = XW_v (paper 000 Eq. 2).
- ``"sne"``: separate non-linear embedding, Q = σ(XW_q⁽¹⁾)W_q⁽²⁾, ... (paper 000 Eq. 4).
- ``"psne"``: partially-shared non-linear embedding, the second layer W_s⁽²⁾ is shared (paper 000 Eq. 5).
- ``"fsne"``: fully-shared non-linear embedding, both layers shared, trainable codes Cq/Ck/Cv concatenated
  to the input tell the branches apart (paper 000 Eq. 6); codes shared by all blocks by default (Table 5).
- ``"armour"``: W_Q = W_V, so attention is softmax(QKᵀ/√d)·Q (paper 002 Eq. 2).

``build_qkv_embeddings`` builds one module per block with the sharing the kind dictates;
``replace_qkv_embeddings`` installs them into the attention modules of a timm model, and
``QKVOverrideMixin`` gives a timm model class the ``qkv=`` constructor argument that does so.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention, maybe_add_mask, resolve_self_attn_mask, trunc_normal_
from timm.models.xcit import XCA

__all__ = [
    "QKV_KINDS",
    "ArmourAttention",
    "ArmourQKV",
    "ArmourXCA",
    "FullySharedNonLinearQKV",
    "LinearQKV",
    "PartiallySharedNonLinearQKV",
    "QKVCodes",
    "QKVOverrideMixin",
    "SeparateNonLinearQKV",
    "build_qkv_embeddings",
    "default_hidden_dim",
    "replace_qkv_embeddings",
]

QKV_KINDS = ("linear", "sne", "psne", "fsne", "armour")

# Kinds with a hidden width (the only ones hidden_dim / match_baseline_params apply to).
_HIDDEN_KINDS = ("sne", "psne", "fsne")

# Default hidden width as a fraction of the token dim, paper 000 Table 1: Nano (d=128) 64/96/128 and
# Tiny (d=192) 96/144/192 for SNE/P-SNE/F-SNE are d/2, 3d/4 and d.
_HIDDEN_RATIO = {"sne": (1, 2), "psne": (3, 4), "fsne": (1, 1)}


def _init_linear_(linear: nn.Linear) -> None:
    # timm's ViT/XCiT convention; our modules are swapped in after the model's own init has run.
    trunc_normal_(linear.weight, std=0.02)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


class LinearQKV(nn.Linear):
    """The original embedding, Q = XW_q, K = XW_k, V = XW_v (paper 000 Eq. 2), as one ``dim -> 3 dim`` Linear.

    A plain ``nn.Linear`` (same state-dict keys as timm's ``qkv``), initialised like timm's.
    """

    value_is_query = False

    def __init__(self, dim: int, bias: bool = True):
        super().__init__(dim, 3 * dim, bias=bias)
        _init_linear_(self)

    def forward_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self(x).chunk(3, dim=-1)


class SeparateNonLinearQKV(nn.Module):
    """SNE: each of Q, K, V is its own MLP with ReLU (paper 000 Eq. 4, Fig. 2b).

    Q = σ(XW_q⁽¹⁾)W_q⁽²⁾, K = σ(XW_k⁽¹⁾)W_k⁽²⁾, V = σ(XW_v⁽¹⁾)W_v⁽²⁾, W⁽¹⁾ ∈ R^{d×h}, W⁽²⁾ ∈ R^{h×d}.

    Args:
        dim: token dim d (input and per-branch output).
        hidden_dim: hidden width h of each branch (paper 000 Table 1: d/2, i.e. 64 for Nano, 96 for Tiny).
        bias: biases in every layer (XCiT/DeiT use ``qkv_bias=True``).
        num_layers: layers per branch, ≥ 2 (paper 000 Eq. 4 uses 2; Sec. 6.1 / Fig. 3 ablates 1-4, 2 is best).
        act_layer: σ (paper 000: ReLU).

    The three branches run as one batched computation: the first layers are stacked into one
    ``d -> 3h`` Linear, later layers are per-branch weight stacks applied with one einsum.
    """

    value_is_query = False

    def __init__(
            self,
            dim: int,
            hidden_dim: int,
            bias: bool = True,
            num_layers: int = 2,
            act_layer: type[nn.Module] = nn.ReLU,
    ):
        super().__init__()
        if num_layers < 2:
            raise ValueError(
                f"num_layers={num_layers!r} is invalid for SNE: need >= 2 (one layer is the linear embedding, "
                f"qkv='linear')")
        self.dim, self.hidden_dim, self.num_layers = dim, hidden_dim, num_layers
        self.fc1 = nn.Linear(dim, 3 * hidden_dim, bias=bias)  # [W_q⁽¹⁾ | W_k⁽¹⁾ | W_v⁽¹⁾]
        self.act = act_layer()
        # Layers 2..L, one [3, out, in] stack each; the last maps back to d.
        widths = [hidden_dim] * (num_layers - 2) + [dim]
        self.weights = nn.ParameterList([nn.Parameter(torch.empty(3, w, hidden_dim)) for w in widths])
        self.biases = nn.ParameterList([nn.Parameter(torch.zeros(3, w)) for w in widths]) if bias else None
        _init_linear_(self.fc1)
        for w in self.weights:
            trunc_normal_(w, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x).unflatten(-1, (3, self.hidden_dim))  # [..., 3, h]
        for i, w in enumerate(self.weights):
            h = torch.einsum("...ti,toi->...to", self.act(h), w)
            if self.biases is not None:
                h = h + self.biases[i]
        return h.flatten(-2)


class PartiallySharedNonLinearQKV(nn.Module):
    """P-SNE: separate first layers, one shared second layer (paper 000 Eq. 5, Fig. 2c).

    Q = σ(XW_q⁽¹⁾)W_s⁽²⁾, K = σ(XW_k⁽¹⁾)W_s⁽²⁾, V = σ(XW_v⁽¹⁾)W_s⁽²⁾. The second layer is the shared one
    because a shared first layer would give Q = K = V (same input, same weights; paper 000 Sec. 4.2).

    Args:
        dim: token dim d.
        hidden_dim: hidden width d_s (paper 000 Table 1: 3d/4, i.e. 96 for Nano, 144 for Tiny).
        bias: biases in both layers.
        act_layer: σ (paper 000: ReLU).
    """

    value_is_query = False

    def __init__(self, dim: int, hidden_dim: int, bias: bool = True, act_layer: type[nn.Module] = nn.ReLU):
        super().__init__()
        self.dim, self.hidden_dim = dim, hidden_dim
        self.fc1 = nn.Linear(dim, 3 * hidden_dim, bias=bias)  # [W_q⁽¹⁾ | W_k⁽¹⁾ | W_v⁽¹⁾]
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_dim, dim, bias=bias)  # W_s⁽²⁾
        _init_linear_(self.fc1)
        _init_linear_(self.fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x).unflatten(-1, (3, self.hidden_dim)))  # [..., 3, h]
        return self.fc2(h).flatten(-2)


class QKVCodes(nn.Module):
    """The trainable codes Cq, Ck, Cv ∈ R^{1×c} of F-SNE (paper 000 Eq. 6), shareable by all blocks.

    Each code is a 1-D parameter: paper 000 Eq. 7 regularises only the network weights θ, not the codes, and
    timm's optimizer factory leaves 1-D parameters out of weight decay. Initialised N(0, 1), the scale of the
    LayerNorm-ed tokens they are concatenated to, so Q, K and V differ from the first step.

    Args:
        code_size: c (paper 000 uses 8, 16, 32, 64; best 8 for Nano, 16 for Tiny, Sec. 6.5).
    """

    def __init__(self, code_size: int):
        super().__init__()
        self.code_size = code_size
        self.q = nn.Parameter(torch.randn(code_size))
        self.k = nn.Parameter(torch.randn(code_size))
        self.v = nn.Parameter(torch.randn(code_size))

    def forward(self) -> torch.Tensor:
        return torch.stack([self.q, self.k, self.v])  # [3, c]


class FullySharedNonLinearQKV(nn.Module):
    """F-SNE: both layers shared by Q, K and V, told apart by codes (paper 000 Eq. 6, Fig. 2d).

    Q = σ((X ⊕ Cq)W_s⁽¹⁾)W_s⁽²⁾, K = σ((X ⊕ Ck)W_s⁽¹⁾)W_s⁽²⁾, V = σ((X ⊕ Cv)W_s⁽¹⁾)W_s⁽²⁾,
    W_s⁽¹⁾ ∈ R^{(d+c)×h}, W_s⁽²⁾ ∈ R^{h×d}. ``fc1`` holds W_s⁽¹⁾ with its (d + c) inputs as the paper has it;
    the forward uses (X ⊕ C)W = XW_X + CW_C so the token part is computed once, not three times.

    Args:
        dim: token dim d.
        hidden_dim: hidden width h (paper 000 Table 1: d; starred variants 8*/16* widen it to match the
            linear baseline's parameter count: 186/182 for Nano, 282/276 for Tiny).
        codes: the ``QKVCodes`` (shared by all blocks of a model by default, paper 000 Sec. 4.3 and Table 5).
        bias: biases in both layers.
        act_layer: σ (paper 000: ReLU).
    """

    value_is_query = False

    def __init__(
            self,
            dim: int,
            hidden_dim: int,
            codes: QKVCodes,
            bias: bool = True,
            act_layer: type[nn.Module] = nn.ReLU,
    ):
        super().__init__()
        self.dim, self.hidden_dim = dim, hidden_dim
        self.codes = codes
        self.fc1 = nn.Linear(dim + codes.code_size, hidden_dim, bias=bias)  # W_s⁽¹⁾ on X ⊕ C
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_dim, dim, bias=bias)  # W_s⁽²⁾
        _init_linear_(self.fc1)
        _init_linear_(self.fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_x, w_c = self.fc1.weight.split([self.dim, self.codes.code_size], dim=1)
        token_part = F.linear(x, w_x, self.fc1.bias)  # [..., h]
        code_part = F.linear(self.codes(), w_c)  # [3, h], one row per code
        h = self.act(token_part.unsqueeze(-2) + code_part)  # [..., 3, h]
        return self.fc2(h).flatten(-2)


class ArmourQKV(nn.Module):
    """Armour: W_Q = W_V, so attention is softmax(QKᵀ/√d)·Q (paper 002 Eq. 2).

    Projects to [q | k] with one ``dim -> 2 dim`` Linear and emits [q | k | q], so any timm attention uses Q as
    its values unchanged; ``ArmourAttention`` / ``ArmourXCA`` call ``forward_qkv`` (whose v *is* q) and skip
    that copy. ``value_is_query`` and ``forward_qkv`` make it checkable.

    Args:
        dim: token dim d.
        bias: bias on the projection (V shares Q's bias with its weight).
    """

    value_is_query = True

    def __init__(self, dim: int, bias: bool = True):
        super().__init__()
        self.dim = dim
        self.qk = nn.Linear(dim, 2 * dim, bias=bias)  # [W_Q | W_K]
        _init_linear_(self.qk)

    def forward_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k = self.qk(x).chunk(2, dim=-1)
        return q, k, q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.forward_qkv(x), dim=-1)


# With ArmourQKV alone any timm attention is Armour, through the [q | k | q] it emits; but copying q into
# the value slot (and summing the value's gradient back into q) costs about what dropping W_V saves (on
# CPU it left DeiT-Ti's training throughput at +2%, against +7% without the copy; benchmarks/bench_armour.py).
# So for timm's two attentions, replace_qkv_embeddings installs a forward that feeds Q to the values directly.


class ArmourAttention(Attention):
    """timm's multi-head ``Attention`` (ViT/DeiT, EIT) with ``ArmourQKV``: softmax(QKᵀ/√d)·Q, Q used as V as is.

    The forward is timm's, except that V is the raw Q (before ``q_norm``, when there is one).
    """

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: torch.Tensor | None = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, _ = self.qkv.forward_qkv(x)
        q, k = (t.reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k))
        v = q
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop.p if self.training else 0.,
                is_causal=is_causal)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            attn = maybe_add_mask(attn, resolve_self_attn_mask(N, attn, attn_mask, is_causal))
            x = self.attn_drop(attn.softmax(dim=-1)) @ v
        x = self.norm(x.transpose(1, 2).reshape(B, N, self.attn_dim))
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


class ArmourXCA(XCA):
    """timm's cross-covariance attention (XCiT) with ``ArmourQKV``: V is the raw Q (before XCA's L2 norm).

    The forward is timm's otherwise: attention over channels, [B, heads, C/heads, N] layout.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, _ = self.qkv.forward_qkv(x)
        q, k = (t.reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 3, 1) for t in (q, k))
        v = q
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)  # XCiT §3.2
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q * self.temperature, k, v, scale=1.0)
        else:
            attn = (q @ k.transpose(-2, -1)) * self.temperature
            x = self.attn_drop(attn.softmax(dim=-1)) @ v
        x = x.permute(0, 3, 1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


_ARMOUR_ATTENTIONS: dict[type[nn.Module], type[nn.Module]] = {Attention: ArmourAttention, XCA: ArmourXCA}


def default_hidden_dim(kind: str, dim: int) -> int:
    """Hidden width of ``kind`` for token dim ``dim``, paper 000 Table 1 (d/2 SNE, 3d/4 P-SNE, d F-SNE)."""
    if kind not in _HIDDEN_KINDS:
        raise ValueError(f"qkv kind {kind!r} has no hidden width; kinds with one: {_HIDDEN_KINDS}")
    num, den = _HIDDEN_RATIO[kind]
    return max(1, dim * num // den)


def _make_embedding(
        kind: str,
        dim: int,
        hidden_dim: int | None,
        codes: QKVCodes | None,
        bias: bool,
        num_layers: int,
        act_layer: type[nn.Module],
) -> nn.Module:
    if kind == "linear":
        return LinearQKV(dim, bias=bias)
    if kind == "armour":
        return ArmourQKV(dim, bias=bias)
    if kind == "sne":
        return SeparateNonLinearQKV(dim, hidden_dim, bias=bias, num_layers=num_layers, act_layer=act_layer)
    if kind == "psne":
        return PartiallySharedNonLinearQKV(dim, hidden_dim, bias=bias, act_layer=act_layer)
    return FullySharedNonLinearQKV(dim, hidden_dim, codes, bias=bias, act_layer=act_layer)


def _num_own_params(module: nn.Module) -> int:
    """Parameters of one embedding, without the codes (accounted for separately: they may be shared)."""
    return sum(p.numel() for name, p in module.named_parameters() if not name.startswith("codes."))


def _solve_hidden_dim(
        kind: str,
        dim: int,
        budget: float,
        code_size: int | None,
        bias: bool,
        num_layers: int,
        act_layer: type[nn.Module],
) -> int:
    """Largest hidden width whose embedding has at most ``budget`` parameters (counted on the real modules)."""

    def count(h: int) -> int:
        with torch.device("meta"):
            codes = QKVCodes(code_size) if kind == "fsne" else None
            return _num_own_params(_make_embedding(kind, dim, h, codes, bias, num_layers, act_layer))

    if count(1) > budget:
        raise ValueError(
            f"match_baseline_params: no hidden width of qkv={kind!r} fits the linear baseline's parameters at "
            f"dim={dim} (code_size={code_size}); use a smaller code_size or give hidden_dim")
    lo, hi = 1, 2
    while count(hi) <= budget:  # count grows with h: double, then bisect
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= budget else (lo, mid)
    return lo


def _as_per_block(name: str, value: int | Sequence[int], depth: int) -> list[int]:
    values = [value] * depth if isinstance(value, int) else list(value)
    if len(values) != depth:
        raise ValueError(f"{name}={value!r} has {len(values)} entries, expected one per block ({depth})")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}={value!r} is invalid: need positive ints, got {v!r}")
    return values


def build_qkv_embeddings(
        kind: str,
        dim: int | Sequence[int],
        depth: int | None = None,
        *,
        qkv_bias: bool = True,
        code_size: int | None = None,
        hidden_dim: int | Sequence[int] | None = None,
        share_codes: bool = True,
        match_baseline_params: bool = False,
        num_layers: int = 2,
        act_layer: type[nn.Module] = nn.ReLU,
) -> list[nn.Module]:
    """One Q/K/V embedding per block of a model, sharing parameters as ``kind`` dictates.

    Args:
        kind: one of ``QKV_KINDS``.
        dim: token dim of every block, or one dim per block (e.g. EIT, whose width varies with depth).
        depth: number of blocks; required with an int ``dim``, must equal ``len(dim)`` otherwise.
        qkv_bias: biases in the embedding's layers (XCiT/DeiT: True).
        code_size: c of F-SNE's codes (required for ``"fsne"``, invalid for other kinds).
        hidden_dim: hidden width(s) for SNE/P-SNE/F-SNE, one int or one per block; default paper 000 Table 1.
        share_codes: F-SNE codes shared by all blocks (paper 000 default) or one set per block (Table 5).
        match_baseline_params: widen/narrow the hidden width to the largest one at which the model has no
            more parameters than with the linear baseline (paper 000's starred variants, e.g. F-SNE 8*).
        num_layers: layers per branch for SNE (paper 000 Fig. 3 ablation; 2 = Eq. 4).
        act_layer: σ of the non-linear kinds (paper 000: ReLU).

    Returns:
        ``depth`` modules, each mapping ``[B, N, dim_i] -> [B, N, 3 dim_i]``; F-SNE modules share one
        ``QKVCodes`` module when ``share_codes`` (so ``model.parameters()`` counts the codes once).
    """
    if kind not in QKV_KINDS:
        raise ValueError(f"qkv={kind!r} is not a known QKV embedding; valid: {QKV_KINDS}")
    if isinstance(dim, int):
        if depth is None:
            raise ValueError(f"depth is required with an int dim={dim!r} (or pass one dim per block)")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth <= 0:
            raise ValueError(f"depth={depth!r} is invalid: need a positive int")
    else:
        depth = len(dim) if depth is None else depth
    dims = _as_per_block("dim", dim, depth)

    if kind == "fsne":
        if isinstance(code_size, bool) or not isinstance(code_size, int) or code_size <= 0:
            raise ValueError(
                f"code_size={code_size!r} is invalid for qkv='fsne': need a positive int "
                f"(paper 000 uses 8, 16, 32, 64)")
    else:
        if code_size is not None:
            raise ValueError(f"code_size={code_size!r} applies only to qkv='fsne', not qkv={kind!r}")
        if not share_codes:
            raise ValueError(f"share_codes=False applies only to qkv='fsne', not qkv={kind!r}")
    if kind not in _HIDDEN_KINDS:
        if hidden_dim is not None:
            raise ValueError(f"hidden_dim={hidden_dim!r} applies only to qkv in {_HIDDEN_KINDS}, not {kind!r}")
        if match_baseline_params:
            raise ValueError(
                f"match_baseline_params=True applies only to qkv in {_HIDDEN_KINDS} (they have a hidden width "
                f"to solve for), not {kind!r}")
    if kind != "sne" and num_layers != 2:
        raise ValueError(f"num_layers={num_layers!r} applies only to qkv='sne', not qkv={kind!r}")
    if hidden_dim is not None and match_baseline_params:
        raise ValueError(
            f"hidden_dim={hidden_dim!r} and match_baseline_params=True both set the hidden width; give one")

    if kind in _HIDDEN_KINDS:
        if hidden_dim is not None:
            hiddens = _as_per_block("hidden_dim", hidden_dim, depth)
        elif match_baseline_params:
            # Per block: its linear baseline's parameters, less its share of the codes.
            code_params = 3 * code_size if kind == "fsne" else 0
            code_share = code_params / depth if (kind == "fsne" and share_codes) else code_params
            solved = {}  # per distinct dim: blocks of equal width get equal hidden widths
            for d in dict.fromkeys(dims):
                with torch.device("meta"):
                    baseline = _num_own_params(LinearQKV(d, bias=qkv_bias))
                solved[d] = _solve_hidden_dim(
                    kind, d, baseline - code_share, code_size, qkv_bias, num_layers, act_layer)
            hiddens = [solved[d] for d in dims]
        else:
            hiddens = [default_hidden_dim(kind, d) for d in dims]
    else:
        hiddens = [None] * depth

    shared_codes = QKVCodes(code_size) if kind == "fsne" and share_codes else None
    embeddings = []
    for d, h in zip(dims, hiddens):
        codes = shared_codes if shared_codes is not None else (QKVCodes(code_size) if kind == "fsne" else None)
        embeddings.append(_make_embedding(kind, d, h, codes, qkv_bias, num_layers, act_layer))
    return embeddings


def replace_qkv_embeddings(attentions: Sequence[nn.Module], kind: str, **builder_kwargs) -> None:
    """Swap the ``qkv`` Linear of each attention module (timm ``XCA`` / ``Attention``) for a ``kind`` embedding.

    With ``kind="armour"`` timm's ``Attention`` and ``XCA`` also become ``ArmourAttention`` / ``ArmourXCA``,
    which use Q as the values without copying it; other attention modules get Armour through the
    [q | k | q] the embedding emits. Dims, ``qkv_bias``, device and dtype are taken from the Linears being replaced; ``builder_kwargs`` go to
    ``build_qkv_embeddings``. With ``kind="linear"`` timm's own Linears (and the initialisation they got)
    are kept.
    """
    if not attentions:
        raise ValueError("replace_qkv_embeddings needs at least one attention module, got none")
    dims, biases = [], set()
    for i, attn in enumerate(attentions):
        qkv = getattr(attn, "qkv", None)
        if not isinstance(qkv, nn.Linear) or qkv.out_features != 3 * qkv.in_features:
            raise ValueError(
                f"attention #{i} ({type(attn).__name__}) has no dim -> 3*dim `qkv` Linear to replace "
                f"(found {qkv!r})")
        dims.append(qkv.in_features)
        biases.add(qkv.bias is not None)
    if len(biases) > 1:
        raise ValueError("the attention modules disagree on qkv_bias; replace them in separate calls")
    weight = attentions[0].qkv.weight
    if kind == "linear":
        with torch.device("meta"):  # only validates the options: timm's Linears are this embedding already
            build_qkv_embeddings(kind, dims, qkv_bias=biases.pop(), **builder_kwargs)
        return
    with torch.device(weight.device):
        embeddings = build_qkv_embeddings(kind, dims, qkv_bias=biases.pop(), **builder_kwargs)
    for attn, embedding in zip(attentions, embeddings):
        attn.qkv = embedding.to(weight.dtype)
        if kind == "armour" and type(attn) in _ARMOUR_ATTENTIONS:
            # Same parameters and state-dict keys, only the forward changes: swap the class in place.
            attn.__class__ = _ARMOUR_ATTENTIONS[type(attn)]


class QKVOverrideMixin:
    """The ``qkv=`` override of a timm model: its attention modules get a ``QKV_KINDS`` embedding.

    Mixed in before the timm model class (after ``models.layers.heads.TokenHeadMixin`` where both are used); the model
    is built first, then the ``qkv`` Linear of every module ``qkv_attentions()`` returns is replaced.

    Args:
        qkv: the Q/K/V embedding, one of ``QKV_KINDS``: 'linear' (timm's own, the default), 'sne', 'psne',
            'fsne' (paper 000 Eqs. 4-6) or 'armour' (W_Q = W_V, paper 002 Eq. 2).
        code_size: c of F-SNE's codes Cq/Ck/Cv (required with qkv='fsne'; paper 000 uses 8, 16, 32, 64).
        qkv_hidden_dim: hidden width of SNE/P-SNE/F-SNE, one int or one per attention (default paper 000
            Table 1 relative to each attention's width d: d/2, 3d/4, d).
        qkv_num_layers: layers per SNE branch (paper 000 Fig. 3; default 2 as in Eq. 4).
        share_codes: F-SNE codes shared by all attentions (paper 000 default) or one set per attention (Table 5).
        match_baseline_params: per attention, the largest hidden width with no more parameters than the linear
            embedding it replaces, as paper 000's starred variants (F-SNE 8*, 16*).
        **kwargs: to the next class in the MRO (the timm model).
    """

    qkv_kind: str = "linear"

    def __init__(
            self,
            *,
            qkv: str = "linear",
            code_size: int | None = None,
            qkv_hidden_dim: int | Sequence[int] | None = None,
            qkv_num_layers: int = 2,
            share_codes: bool = True,
            match_baseline_params: bool = False,
            **kwargs,
    ):
        super().__init__(**kwargs)
        attentions = self.qkv_attentions()
        if attentions:
            replace_qkv_embeddings(
                attentions, qkv, code_size=code_size, hidden_dim=qkv_hidden_dim, num_layers=qkv_num_layers,
                share_codes=share_codes, match_baseline_params=match_baseline_params)
        elif qkv != "linear":
            raise ValueError(
                f"qkv={qkv!r} needs an attention module with a qkv projection, but this {type(self).__name__} "
                f"has none: use qkv='linear'")
        self.qkv_kind = qkv

    def qkv_attentions(self) -> list[nn.Module]:
        """The attention modules whose ``qkv`` Linear the override replaces: every block's ``attn``."""
        return [block.attn for block in self.blocks]
