"""Classification heads over a token sequence [B, T, C] -> [B, num_classes] (SoT, paper 004 §3.2).

Any backbone that hands over its final normalised tokens can use them, via ``create_classifier_head``;
a timm model class gets the ``head=`` constructor argument by mixing in ``TokenHeadMixin`` (ViT, XCiT,
EIT and SoT here), the twin of ``models.layers.qkv.QKVOverrideMixin``:

* 'linear': the conventional classifier on the class token (or on the token mean without one);
* 'sot': the SoT head, the class token and the pooled word tokens fused by one of four schemes (sum,
  concat, aggr_all, late; Eq. 1), word tokens pooled by GAP, GCP (iSQRT matrix square root) or MGCrP
  (multi-headed cross-covariance + svPN, ``models.layers.mgcrp``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import nn

from models.layers.mgcrp import CROSS_COV_NORMS, MGCrP

__all__ = [
    "SOT_HEAD_KWARGS",
    "SOT_FUSIONS",
    "SOT_POOLINGS",
    "SOT_LATE_SCHEMES",
    "GCP_SCALES",
    "CLASSIFIER_HEADS",
    "create_classifier_head",
    "LinearTokenHead",
    "TokenHeadMixin",
    "SoTHead",
    "GlobalCovariancePooling",
    "TokenMean",
    "isqrt_newton_schulz",
]


CLASSIFIER_HEADS = ("linear", "sot")
SOT_FUSIONS = ("sum", "concat", "aggr_all", "late")
SOT_POOLINGS = ("mgcrp", "gcp", "gap")
# What GCP divides Xᵀ X by: the covariance size d (released code) or the token count q (printed).
GCP_SCALES = ("dim", "tokens")
# How 'late' fusion trains and predicts (SoTHead): the released code's two losses, or the printed score mixture.
SOT_LATE_SCHEMES = ("two_losses", "mixture")
# Keyword arguments SoTHead accepts (beyond embed_dim, num_classes, has_class_token); stable API.
SOT_HEAD_KWARGS = frozenset({
    "fusion",
    "late_scheme",
    "pooling",
    "mgcrp_heads",
    "mgcrp_m",
    "mgcrp_n",
    "repr_size",
    "mgcrp_norm",
    "mgcrp_centre",
    "svpn_alpha",
    "svpn_num_sv",
    "svpn_iters",
    "mgcrp_dropout",
    "gcp_iters",
    "gcp_centre",
    "gcp_scale",
})


class LinearTokenHead(nn.Module):
    """The conventional head: a linear classifier on the class token, or on the mean of the tokens
    when the backbone has no class token. Takes [B, T, C] tokens, returns [B, num_classes] logits."""

    def __init__(self, embed_dim: int, num_classes: int, *, has_class_token: bool = True):
        super().__init__()
        self.has_class_token = has_class_token
        self.num_features = embed_dim
        self.fc = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def forward(self, tokens: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = tokens[:, 0] if self.has_class_token else tokens.mean(dim=1)
        return x if pre_logits else self.fc(x)


class TokenMean(nn.Module):
    """GAP over tokens, (1/q) Z 1 (Table 2)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens.mean(dim=1)


def isqrt_newton_schulz(cov: torch.Tensor, iters: int) -> torch.Tensor:
    """Matrix square root of SPD ``cov`` [B, d, d] by iSQRT (Li et al. 2018, ref. [23]).

    Pre-normalise by the trace so the coupled Newton-Schulz iteration converges, iterate
    Y ← ½Y(3I - ZY), Z ← ½(3I - ZY)Z, then post-compensate by √trace.
    """
    eye = torch.eye(cov.shape[-1], device=cov.device, dtype=cov.dtype).expand_as(cov)
    trace = cov.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(1e-12)[:, None, None]
    y, z = cov / trace, eye
    for _ in range(iters):
        t = 0.5 * (3.0 * eye - z @ y)
        y, z = y @ t, t @ z
    return y * trace.sqrt()


class GlobalCovariancePooling(nn.Module):
    """GCP with matrix power normalisation (Table 2): reduce the q tokens to d dims (X, q x d), covariance,
    iSQRT square root, upper triangle as a d(d+1)/2 vector (the covariance is symmetric).

    The defaults follow the authors' released SoT code (its ``Covariance(remove_mean=True)`` and ``MPN``):
    X minus the mean of all its q·d entries (one scalar per image), Xᵀ X divided by d, 3 Newton-Schulz
    iterations. ``centre=False, scale="tokens", iters=5`` is the printed (1/q) X Xᵀ with iSQRT-COV's 5.

    Args:
        dim: token dimension.
        cov_dim: d, the reduced dimension.
        iters: Newton-Schulz iterations of iSQRT.
        centre: subtract the mean of X's entries first.
        scale: divide Xᵀ X by 'dim' (d) or 'tokens' (q), one of GCP_SCALES. The square root scales with
            √ of it (iSQRT post-compensates by √trace), so this sets the pooled values' magnitude.
    """

    def __init__(self, dim: int, cov_dim: int, iters: int = 3, centre: bool = True, scale: str = "dim"):
        super().__init__()
        if scale not in GCP_SCALES:
            raise ValueError(f"unknown GCP scale={scale!r}; valid: {', '.join(GCP_SCALES)}")
        self.reduce = nn.Linear(dim, cov_dim)
        self.iters, self.centre, self.scale = iters, centre, scale
        self.repr_size = cov_dim * (cov_dim + 1) // 2
        self.register_buffer("triu", torch.triu_indices(cov_dim, cov_dim).flatten(), persistent=False)
        self.cov_dim = cov_dim

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.reduce(tokens).float()  # Newton-Schulz needs full precision
        if self.centre:
            x = x - x.mean(dim=(1, 2), keepdim=True)
        cov = x.mT @ x / (self.cov_dim if self.scale == "dim" else x.shape[1])
        root = isqrt_newton_schulz(cov, self.iters)
        rows, cols = self.triu.view(2, -1)
        return root[:, rows, cols].to(tokens.dtype)


def _resolve_mgcrp_shape(heads: int, m: int | None, n: int | None, repr_size: int | None) -> tuple[int, int]:
    """(m, n) of MGCrP from whichever of m, n, repr_size = heads·m·n were given (paper: m = n)."""
    if heads < 1:
        raise ValueError(f"mgcrp_heads={heads!r} is invalid; it must be >= 1")
    if m is None and n is None:
        if repr_size is None:
            return 14, 14  # 6·14·14 = 1176, the 7-layer / SoT-Tiny choice (Tables 4a, S-1)
        side = math.isqrt(repr_size // heads) if repr_size > 0 else 0
        if side < 1 or heads * side * side != repr_size:
            raise ValueError(
                f"repr_size={repr_size!r} is not mgcrp_heads·m·m for mgcrp_heads={heads} and an integer m "
                f"(paper: m = n); pass mgcrp_m/mgcrp_n or a repr_size such as {heads * 14 * 14}"
            )
        return side, side
    m = n if m is None else m
    n = m if n is None else n
    if repr_size is not None and heads * m * n != repr_size:
        raise ValueError(
            f"repr_size={repr_size!r} does not match mgcrp_heads·mgcrp_m·mgcrp_n = {heads}·{m}·{n} = {heads * m * n}"
        )
    return m, n


class SoTHead(nn.Module):
    """SoT classification head (§3.2): class token + pooled word tokens, fused (Eq. 1).

    Takes the backbone's final normalised tokens [B, T, C] (class token first when
    ``has_class_token``) and returns [B, num_classes] logits, except for 'late' fusion in training mode
    (below).

    Where the authors' released code (jiangtaoxie/SoT, ``sot_src/``) and the printed paper differ, the
    default follows the code and an argument gives the printed form: MGCrP centring (``mgcrp_centre``),
    'late' fusion (``late_scheme``) and the GCP baseline (``gcp_iters``, ``gcp_centre``, ``gcp_scale``).

    'late' fusion, ``late_scheme='two_losses'`` (default, the released ``sum_loss`` classifier): in training
    mode the head, and so the model's forward, returns the tuple ``(class_token_logits, word_token_logits)``,
    each [B, num_classes]; in eval mode it returns their sum, the released prediction. The contract for the
    training loop: the loss of a tuple output is the sum over its elements of the loss a single logits
    tensor would get, with the same targets, i.e. ``criterion(a, targets) + criterion(b, targets)`` (hard
    labels, or Mixup/CutMix soft targets with their label smoothing) and, with distillation, the whole
    distillation loss per element, ``distill(a, targets, images) + distill(b, targets, images)`` (one teacher
    pass serves both). Each branch then gets the gradient plain cross-entropy on it would give.
    ``late_scheme='mixture'`` is the printed form, one output log(½(softmax(a) + softmax(b))) in both modes:
    the log of the averaged scores, which keeps the logits contract (argmax = argmax of the summed scores;
    softmax of it = the averaged scores) but gives each branch less than half of that gradient at
    initialisation.

    Args:
        embed_dim: C, the token dimension.
        num_classes: classes; 0 returns the pre-logits representation instead.
        has_class_token: whether tokens[:, 0] is a class token. Without one (e.g. Swin) every token
            is a word token and the head is FC(pool(tokens)) (the paper's "MGCrP in place of GAP").
        fusion: how class token z₀ and word tokens Z meet (Eq. 1, Table 3b): 'sum' FC(z₀) + FC(pool(Z))
            (the paper's choice), 'concat' FC([z₀, pool(Z)]), 'aggr_all' FC(pool([z₀, Z])),
            'late' FC(z₀) and FC(pool(Z)) as two classifiers (see above). Default: 'sum' with a class
            token, 'aggr_all' without.
        late_scheme: how 'late' fusion trains and predicts, one of SOT_LATE_SCHEMES (see above); unused by
            the other fusions.
        pooling: word-token pooling (Table 2): 'mgcrp' (paper's), 'gcp' (iSQRT-normalised covariance)
            or 'gap'.
        mgcrp_heads: h, MGCrP heads; paper default 6 (Table 4a).
        mgcrp_m, mgcrp_n: m x n of each head's cross-covariance; default 14 x 14 (SoT-Tiny), 24 for
            SoT-Small, 38 for SoT-Base (Table S-1). Either alone sets both (the paper uses m = n).
        repr_size: pooled size h·m·n for MGCrP; an alternative to mgcrp_m/n (must agree when both are
            given). For GCP it sets the covariance dim d = ⌊√(2·repr_size)⌋ (d(d+1)/2 values, 1176
            for d = 48 as in Table 3b); it defaults to h·m·n so GCP and MGCrP match in size. For GAP
            it can only be embed_dim.
        mgcrp_norm: normalisation of each MGCrP matrix: 'svpn_approx' (Eq. 8, default), 'svpn'
            (exact Eq. 5), or Table 4d's 'none', 'scale' (learned 1/τ), 'epn', 'ln'.
        mgcrp_centre: centre each head's projections before the cross-covariance product, as the
            released code does (True, default; see ``MGCrP``); False gives Eq. 2 as printed.
        svpn_alpha: α of svPN (Eq. 5), in (0, 1]; default 0.5 (Table 4c).
        svpn_num_sv: #sv of the approximate svPN; default 1 (Table 4c).
        svpn_iters: #iter of the approximate svPN; default 1 (Table 4c).
        mgcrp_dropout: dropout on the pooled word-token representation ("MGCrP dropout", Table S-3:
            0.0 SoT-Tiny, 0.5 Small, 0.7 Base).
        gcp_iters: Newton-Schulz iterations of GCP's iSQRT; default 3 as released (iSQRT-COV used 5).
        gcp_centre: centre GCP's reduced tokens, as released (True, default); see ``GlobalCovariancePooling``.
        gcp_scale: divide GCP's Xᵀ X by 'dim' (d, as released; default) or 'tokens' (q, the printed 1/q).
    """

    def __init__(
        self,
        embed_dim: int,
        num_classes: int,
        *,
        has_class_token: bool = True,
        fusion: str | None = None,
        late_scheme: str = "two_losses",
        pooling: str = "mgcrp",
        mgcrp_heads: int = 6,
        mgcrp_m: int | None = None,
        mgcrp_n: int | None = None,
        repr_size: int | None = None,
        mgcrp_norm: str = "svpn_approx",
        mgcrp_centre: bool = True,
        svpn_alpha: float = 0.5,
        svpn_num_sv: int = 1,
        svpn_iters: int = 1,
        mgcrp_dropout: float = 0.0,
        gcp_iters: int = 3,
        gcp_centre: bool = True,
        gcp_scale: str = "dim",
    ):
        super().__init__()
        if fusion is None:
            fusion = "sum" if has_class_token else "aggr_all"
        if fusion not in SOT_FUSIONS:
            raise ValueError(f"unknown fusion={fusion!r}; valid: {', '.join(SOT_FUSIONS)}")
        if not has_class_token and fusion != "aggr_all":
            raise ValueError(
                f"fusion={fusion!r} needs a class token, but has_class_token=False; "
                "without one only 'aggr_all' (pool every token) applies"
            )
        if late_scheme not in SOT_LATE_SCHEMES:
            raise ValueError(f"unknown late_scheme={late_scheme!r}; valid: {', '.join(SOT_LATE_SCHEMES)}")
        if gcp_scale not in GCP_SCALES:
            raise ValueError(f"unknown gcp_scale={gcp_scale!r}; valid: {', '.join(GCP_SCALES)}")
        if pooling not in SOT_POOLINGS:
            raise ValueError(f"unknown pooling={pooling!r}; valid: {', '.join(SOT_POOLINGS)}")
        if not 0.0 <= mgcrp_dropout < 1.0:
            raise ValueError(f"mgcrp_dropout={mgcrp_dropout!r} is invalid; it must lie in [0, 1)")
        if not 0.0 < svpn_alpha <= 1.0:
            raise ValueError(f"svpn_alpha={svpn_alpha!r} is invalid; it must lie in (0, 1] (paper Eq. 5)")
        if mgcrp_norm not in CROSS_COV_NORMS:
            raise ValueError(f"unknown mgcrp_norm={mgcrp_norm!r}; valid: {', '.join(CROSS_COV_NORMS)}")
        for name, value in (("svpn_num_sv", svpn_num_sv), ("svpn_iters", svpn_iters), ("gcp_iters", gcp_iters)):
            if value < 1:
                raise ValueError(f"{name}={value!r} is invalid; it must be >= 1")
        self.fusion, self.late_scheme, self.pooling_name = fusion, late_scheme, pooling
        self.has_class_token = has_class_token

        if pooling == "mgcrp":
            m, n = _resolve_mgcrp_shape(mgcrp_heads, mgcrp_m, mgcrp_n, repr_size)
            self.pool = MGCrP(
                embed_dim, num_heads=mgcrp_heads, m=m, n=n, norm=mgcrp_norm,
                alpha=svpn_alpha, num_sv=svpn_num_sv, iters=svpn_iters, centre=mgcrp_centre,
            )
        elif pooling == "gcp":
            if repr_size is None:
                m, n = _resolve_mgcrp_shape(mgcrp_heads, mgcrp_m, mgcrp_n, None)
                repr_size = mgcrp_heads * m * n
            if repr_size < 1:
                raise ValueError(f"repr_size={repr_size!r} is invalid for pooling='gcp'; it must be >= 1")
            self.pool = GlobalCovariancePooling(
                embed_dim, math.isqrt(2 * repr_size), iters=gcp_iters, centre=gcp_centre, scale=gcp_scale)
        else:
            if repr_size is not None and repr_size != embed_dim:
                raise ValueError(
                    f"repr_size={repr_size!r} is invalid for pooling='gap': GAP keeps embed_dim={embed_dim} values"
                )
            self.pool = TokenMean()
            self.pool.repr_size = embed_dim
        self.repr_size = self.pool.repr_size
        self.repr_drop = nn.Dropout(mgcrp_dropout)

        def linear(in_features: int) -> nn.Module:
            return nn.Linear(in_features, num_classes) if num_classes > 0 else nn.Identity()

        if fusion in ("sum", "late"):
            self.cls_fc, self.word_fc = linear(embed_dim), linear(self.repr_size)
            self.num_features = embed_dim + self.repr_size
        elif fusion == "concat":
            self.fc = linear(embed_dim + self.repr_size)
            self.num_features = embed_dim + self.repr_size
        else:
            self.fc = linear(self.repr_size)
            self.num_features = self.repr_size
        self.num_classes = num_classes

    def forward(
        self, tokens: torch.Tensor, pre_logits: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fusion == "aggr_all":
            pooled = self.repr_drop(self.pool(tokens))
            return pooled if pre_logits else self.fc(pooled)
        cls_token = tokens[:, 0]
        pooled = self.repr_drop(self.pool(tokens[:, 1:]))
        if pre_logits or self.num_classes == 0:
            return torch.cat([cls_token, pooled], dim=-1)
        if self.fusion == "sum":
            return self.cls_fc(cls_token) + self.word_fc(pooled)
        if self.fusion == "concat":
            return self.fc(torch.cat([cls_token, pooled], dim=-1))
        cls_logits, word_logits = self.cls_fc(cls_token), self.word_fc(pooled)
        if self.late_scheme == "mixture":
            log_probs = torch.stack([F.log_softmax(cls_logits, dim=-1), F.log_softmax(word_logits, dim=-1)])
            return torch.logsumexp(log_probs, dim=0) - math.log(2.0)
        # Released 'sum_loss': each classifier trained by its own loss; predict with the summed logits.
        return (cls_logits, word_logits) if self.training else cls_logits + word_logits


def create_classifier_head(
    head: str,
    embed_dim: int,
    num_classes: int,
    *,
    has_class_token: bool = True,
    **head_kwargs,
) -> nn.Module:
    """Build a classifier head taking the final normalised tokens [B, T, C] to [B, num_classes] logits.

    ``head``: 'linear' (class token, or GAP without one) or 'sot' (SoTHead; ``head_kwargs`` from
    SOT_HEAD_KWARGS).
    """
    if head == "linear":
        if head_kwargs:
            raise ValueError(f"head='linear' takes no head kwargs, got {sorted(head_kwargs)}")
        return LinearTokenHead(embed_dim, num_classes, has_class_token=has_class_token)
    if head == "sot":
        unknown = set(head_kwargs) - SOT_HEAD_KWARGS
        if unknown:
            raise ValueError(f"unknown SoT head kwargs {sorted(unknown)}; valid: {sorted(SOT_HEAD_KWARGS)}")
        return SoTHead(embed_dim, num_classes, has_class_token=has_class_token, **head_kwargs)
    raise ValueError(f"unknown classifier head={head!r}; valid: {', '.join(CLASSIFIER_HEADS)}")


class TokenHeadMixin:
    """The ``head=`` override of a timm classifier whose ``forward_features`` returns the final normalised tokens.

    Mixed in before the timm model class (ViT, XCiT, EIT and SoT here); the model is built first, then its head
    is replaced. ``reset_classifier`` keeps the chosen head.

    Args:
        head: 'linear' keeps the model's own head untouched (pooling, ``reset_classifier``, ``forward_head``),
            so the model computes exactly what timm's does; 'sot' hands the whole token sequence [B, T, C]
            (class token first) to ``create_classifier_head("sot", ...)`` (paper 004). With 'sot' the model
            is built with ``global_pool=""`` so that it does no pooling of its own.
        **kwargs: ``SOT_HEAD_KWARGS`` go to the SoT head (head='sot' only), the rest to the next class in the
            MRO (the timm model).
    """

    head_name: str = "linear"  # until the model is built: timm's behaviour

    def __init__(self, *, head: str = "linear", **kwargs):
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
        super().__init__(**kwargs)
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
            self.head_name, self.embed_dim, num_classes, has_class_token=getattr(self, "has_class_token", True),
            **self.head_kwargs)
        self.head_hidden_size = self.head.num_features  # pre-logits size; num_features stays embed_dim (timm)
        for module in self.head.modules():
            if isinstance(module, nn.Linear):  # timm's ViT/XCiT init, as the head it replaces had
                trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.head_name == "linear":
            return super().forward_head(x, pre_logits=pre_logits)
        return self.head(self.head_drop(x), pre_logits=pre_logits)


class DistilledLogits(NamedTuple):
    """A distillation-token model's training output (DeiT §4): the class head's logits, trained on the
    labels, and the distillation head's, trained on the teacher. At inference the model returns their mean."""

    cls: torch.Tensor
    dist: torch.Tensor


class DistillationHeadsMixin:
    """DeiT's two heads (``head``, ``head_dist``) over the class token (first) and the distillation token
    (second), for a timm model with both: ``DistilledLogits`` while the heads train, their mean otherwise.
    The heads' mode decides, not the model's: a linear probe trains them under a backbone in eval mode."""

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor | DistilledLogits:
        x_cls, x_dist = self.head_drop(x[:, 0]), self.head_drop(x[:, 1])
        if pre_logits:
            return (x_cls + x_dist) / 2
        logits = DistilledLogits(self.head(x_cls), self.head_dist(x_dist))
        return logits if self.head.training else (logits.cls + logits.dist) / 2
