"""Multi-headed global cross-covariance pooling (MGCrP) of a token sequence (SoT, paper 004 §3.2).

Each head i projects the tokens Z (p x q) twice, X = W_i Z (m x q) and Y = R_i Z (n x q), and pools
them into the normalised cross-covariance GCrP_i(Z) = norm((1/q) X Yᵀ) (Eq. 2); MGCrP concatenates
the h heads into an h·m·n vector (Eq. 3). By default X and Y are centred first, as in the authors'
released code (see ``MGCrP``). The normalisation defaults to the fast svPN (Eq. 8); the
alternatives of Table 4d are available for ablations.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.svpn import SvPN

__all__ = ["MGCrP", "CROSS_COV_NORMS", "create_cross_cov_norm"]

# Normalisations of a cross-covariance matrix compared in Table 4d (plus exact svPN, Table 4c).
CROSS_COV_NORMS = ("svpn_approx", "svpn", "none", "scale", "epn", "ln")


class LearnedScale(nn.Module):
    """Adaptive scaling Q / τ with a learned scalar 1/τ > 0 (Table 4d, '1/τ'); kept positive via its log."""

    def __init__(self, init: float):
        super().__init__()
        self.log_inv_tau = nn.Parameter(torch.tensor(math.log(init)))

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return q * self.log_inv_tau.exp()


class ElementwisePowerNorm(nn.Module):
    """EPN (Table 4d, ref. [28]): signed square root of every entry, then ℓ2 normalisation per matrix."""

    def __init__(self, eps: float = 1e-8):
        super().__init__()
        self.eps = eps  # keeps the square root's gradient finite at 0

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        q = torch.sign(q) * torch.sqrt(q.abs() + self.eps)
        return F.normalize(q.flatten(-2), dim=-1).view_as(q)


class MatrixLayerNorm(nn.LayerNorm):
    """LN (Table 4d, ref. [18]) over all m·n entries of each head's cross-covariance matrix."""

    def __init__(self, m: int, n: int):
        super().__init__((m, n))


def create_cross_cov_norm(
    norm: str,
    m: int,
    n: int,
    *,
    alpha: float = 0.5,
    num_sv: int = 1,
    iters: int = 1,
) -> nn.Module:
    """Build the normalisation of [B, m, n] cross-covariance matrices named ``norm`` (CROSS_COV_NORMS)."""
    if norm == "svpn_approx":
        return SvPN(n, alpha=alpha, exact=False, num_sv=num_sv, iters=iters)
    if norm == "svpn":
        return SvPN(n, alpha=alpha, exact=True)
    if norm == "none":
        return nn.Identity()
    if norm == "scale":
        return LearnedScale(init=m**-0.5)  # authors' initial value 1/sqrt(m)
    if norm == "epn":
        return ElementwisePowerNorm()
    if norm == "ln":
        return MatrixLayerNorm(m, n)
    raise ValueError(f"unknown cross-covariance normalisation norm={norm!r}; valid: {', '.join(CROSS_COV_NORMS)}")


class MGCrP(nn.Module):
    """Multi-headed global cross-covariance pooling, [B, q, p] tokens -> [B, h·m·n] (SoT Eq. 3).

    Args:
        dim: p, the token dimension.
        num_heads: h, number of heads; paper default 6 (Table 4a).
        m: rows of each head's cross-covariance (output dim of W_i); SoT-Tiny 14, Small 24, Base 38.
        n: columns (output dim of R_i); the paper always uses n = m.
        norm: normalisation of each head's matrix, one of CROSS_COV_NORMS; 'svpn_approx' (Eq. 8) is
            the paper's default, 'svpn' the exact Eq. 5, the rest the Table 4d alternatives.
        alpha: svPN exponent α (Eq. 5), default 0.5 (Table 4c).
        num_sv: #sv of the approximate svPN (Eq. 8), default 1.
        iters: #iter of the approximate svPN (Eq. 6), default 1.
        bias: whether the W_i / R_i projections carry a bias (Eq. 2 has none).
        centre: subtract from each head's X_i the mean of all its m·q entries, and from Y_i the mean of
            its n·q entries, before the product (True, default), as the authors' released ``Covariance``
            does (``remove_mean=True``: one scalar per head and image, not the per-row mean of a textbook
            covariance); False computes Eq. 2 as printed, (1/q) X_i Y_iᵀ of the uncentred projections.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 6,
        m: int = 14,
        n: int = 14,
        norm: str = "svpn_approx",
        alpha: float = 0.5,
        num_sv: int = 1,
        iters: int = 1,
        bias: bool = False,
        centre: bool = True,
    ):
        super().__init__()
        for name, value in (("num_heads", num_heads), ("m", m), ("n", n)):
            if value < 1:
                raise ValueError(f"MGCrP {name}={value!r} is invalid; it must be >= 1")
        self.num_heads, self.m, self.n, self.centre = num_heads, m, n, centre
        self.repr_size = num_heads * m * n
        # W_1..W_h and R_1..R_h as one projection: a single matmul over the tokens.
        self.proj = nn.Linear(dim, num_heads * (m + n), bias=bias)
        self.norm = create_cross_cov_norm(norm, m, n, alpha=alpha, num_sv=num_sv, iters=iters)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, q, _ = tokens.shape
        h, m, n = self.num_heads, self.m, self.n
        x, y = self.proj(tokens).split([h * m, h * n], dim=-1)
        x = x.reshape(batch, q, h, m).permute(0, 2, 3, 1)  # X_i = W_i Z: [B, h, m, q]
        y = y.reshape(batch, q, h, n).transpose(1, 2)  # Y_iᵀ = (R_i Z)ᵀ: [B, h, q, n]
        if self.centre:
            x = x - x.mean(dim=(-2, -1), keepdim=True)
            y = y - y.mean(dim=(-2, -1), keepdim=True)
        cross_cov = (x @ y) / q  # (1/q) X_i Y_iᵀ (Eq. 2)
        normed = self.norm(cross_cov.reshape(batch * h, m, n))
        return normed.reshape(batch, self.repr_size)
