"""Singular value power normalisation (svPN) of cross-covariance matrices (SoT, paper 004 §3.3).

A cross-covariance matrix Q = U diag(λ) Vᵀ (m x n, asymmetric) is normalised by shrinking its
singular values, svPN(Q) = Σ_i λ_i^α u_i v_iᵀ (Eq. 5). Two ways to compute it:

* ``svpn_exact``: via SVD, with a backward that stays finite when singular values repeat or
  nearly repeat (MGCrP matrices are often rank-deficient and identity-like at init);
* ``svpn_approx``: power iteration with deflation (Eqs. 6-7) for the r largest singular values,
  the remaining spectrum scaled by the r-th one (Eq. 8). With r = 1 this is Q / λ̂₁^(1-α), where
  λ̂₁ is the power-iteration *estimate* after #iter steps, not the exact σ₁. r ≥ 2 needs #iter ≥ 2
  (``SvPN`` refuses r ≥ 2 with one iteration; see there). As in the authors' released svPN, the r
  estimated components are removed exactly and eps guards only the division of the remainder.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["SvPN", "svpn_exact", "svpn_approx"]


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"svPN exponent alpha={alpha!r} is invalid; it must lie in (0, 1] (paper Eq. 5)")


def _full_precision(q: torch.Tensor) -> tuple[torch.Tensor, contextlib.AbstractContextManager]:
    """``q`` in float32 (or float64) and a context without autocast: SVD has no half-precision
    kernels, and power iteration / deflation lose the small singular directions in bf16."""
    work = q if q.dtype in (torch.float32, torch.float64) else q.float()
    if q.device.type in ("cpu", "cuda"):
        return work, torch.autocast(q.device.type, enabled=False)
    return work, contextlib.nullcontext()


def _power_divided_difference(t: torch.Tensor, p: float) -> torch.Tensor:
    """D_ij = (t_j^p - t_i^p) / (t_j - t_i) for t > 0, with the limit p t^(p-1) where t_i = t_j.

    Written as t_i^(p-1) (r^p - 1)/(r - 1), r = t_j/t_i, via expm1 so that nearly equal t's lose no
    precision; the second-order Taylor expansion in log r covers the (near-)equal case.
    """
    log_t = t.log()
    x = log_t.unsqueeze(-2) - log_t.unsqueeze(-1)  # x_ij = log(t_j / t_i)
    close = x.abs() < 1e-3
    x_safe = torch.where(close, torch.ones_like(x), x)
    ratio = torch.expm1(p * x_safe) / torch.expm1(x_safe)
    ratio = torch.where(close, p * (1.0 + 0.5 * (p - 1.0) * x), ratio)
    return t.unsqueeze(-1).pow(p - 1.0) * ratio


class _SvdPowerNorm(torch.autograd.Function):
    """svPN(Q) = U diag(λ^α) Vᵀ (Eq. 5) with a backward that has no 1/(λ_i² - λ_j²) singularity.

    The paper's backward (supplement C, Corollary 1) goes through ∂l/∂U, ∂l/∂V and
    K_ij = 1/(λ_i² - λ_j²), which blows up for close singular values and is patched to 0 for
    equal ones. Differentiating the composite map instead, with P = Uᵀ dQ V (k = min(m, n)):
        Uᵀ dF V = A ∘ P + B ∘ Pᵀ,
        A_ij = (λ_j^(1+α) - λ_i^(1+α)) / (λ_j² - λ_i²),   B_ij = λ_i λ_j (λ_j^(α-1) - λ_i^(α-1)) / (λ_j² - λ_i²),
    both divided differences of a power of t = λ², which have finite limits at λ_i = λ_j (their sum
    on the diagonal is α λ^(α-1), the scalar derivative). For m ≠ n the components of dQ outside
    span(U) / span(V) add (I - UUᵀ) dQ V Λ^(α-1) Vᵀ and U Λ^(α-1) Uᵀ dQ (I - VVᵀ).
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, alpha: float, eps: float) -> torch.Tensor:
        u, s, vh = torch.linalg.svd(q, full_matrices=False)
        ctx.save_for_backward(u, s, vh)
        ctx.alpha, ctx.eps = alpha, eps
        return (u * s.pow(alpha).unsqueeze(-2)) @ vh

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        u, s, vh = ctx.saved_tensors
        alpha, eps = ctx.alpha, ctx.eps
        v = vh.mT
        m, n = u.shape[-2], vh.shape[-1]
        # d(λ^α)/dλ is unbounded at λ = 0 (rank-deficient Q: fewer tokens than m or n): clamp.
        s = s.clamp_min(eps)
        t = s * s
        a = _power_divided_difference(t, 0.5 * (1.0 + alpha))
        b = s.unsqueeze(-1) * s.unsqueeze(-2) * _power_divided_difference(t, 0.5 * (alpha - 1.0))
        ut_g = u.mT @ grad
        g_hat = ut_g @ v
        dq = u @ (a * g_hat + b * g_hat.mT) @ vh
        s_pow = s.pow(alpha - 1.0)
        if m > n:  # (I - UUᵀ) G V Λ^(α-1) Vᵀ
            dq = dq + ((grad @ v - u @ g_hat) * s_pow.unsqueeze(-2)) @ vh
        elif n > m:  # U Λ^(α-1) Uᵀ G (I - VVᵀ)
            dq = dq + u @ (s_pow.unsqueeze(-1) * (ut_g - g_hat @ vh))
        return dq, None, None


def svpn_exact(q: torch.Tensor, alpha: float = 0.5, eps: float = 1e-5) -> torch.Tensor:
    """Exact svPN (Eq. 5) of a batch of matrices ``q`` [..., m, n] via SVD (computed in float32+).

    ``eps`` only bounds the backward's λ^(α-1) terms at (near-)zero singular values.
    """
    _check_alpha(alpha)
    work, precision = _full_precision(q)
    with precision:
        return _SvdPowerNorm.apply(work, alpha, eps).to(q.dtype)


def svpn_approx(
    q: torch.Tensor,
    v0: torch.Tensor,
    alpha: float = 0.5,
    num_sv: int = 1,
    iters: int = 1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Approximate svPN (Eq. 8) of ``q`` [B, m, n] from ``num_sv`` power-iteration singular triplets.

    ``v0`` [n] is the initial right vector v⁽⁰⁾ of Eq. 6, shared across the batch and restarted for
    every deflation step. ``eps`` keeps 1/λ̂_r^(1-α) finite for an all-zero residual; it divides only the
    remainder left after the r estimated components, as in the released svPN.
    """
    _check_alpha(alpha)
    work, precision = _full_precision(q)
    with precision:
        return _svpn_approx(work, v0.to(work.dtype), alpha, num_sv, iters, eps).to(q.dtype)


def _svpn_approx(q: torch.Tensor, v0: torch.Tensor, alpha: float, num_sv: int, iters: int, eps: float) -> torch.Tensor:
    residual = q  # Q - Σ_{i<k} λ̂_i û_i v̂_iᵀ, the deflated matrix of Eq. 7
    shrunk = None  # Σ_{i<k} λ̂_i^α û_i v̂_iᵀ
    for _ in range(num_sv - 1):
        lam, u, v = _leading_triplet(residual, v0, iters)
        rank_one = u * v  # û v̂ᵀ
        term = lam.pow(alpha) * rank_one
        shrunk = term if shrunk is None else shrunk + term
        residual = residual - lam * rank_one  # deflation (Eq. 7)
    lam, u, v = _leading_triplet(residual, v0, iters)
    # Eq. 8 with eps where the released svPN puts it: the r estimated components stay exactly λ̂^α û v̂ᵀ
    # and only the rest, Q minus them, is divided by λ̂_r^(1-α) + eps. The r-th component's removal and
    # its λ̂^α term are one rank-one update: residual / den + (λ̂^α - λ̂ / den) û v̂ᵀ.
    den = lam.pow(1.0 - alpha) + eps
    out = torch.addcmul(residual / den, u * (lam.pow(alpha) - lam / den), v)
    return out if shrunk is None else shrunk + out


def _leading_triplet(q: torch.Tensor, v0: torch.Tensor, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """λ̂ [B, 1, 1], û [B, m, 1] and v̂ᵀ [B, 1, n] after #iter power iterations (Eq. 6) from v⁽⁰⁾."""
    # Speed (benchmarks/bench_svpn.py): the shared v⁽⁰⁾ makes the first mat-vec one matrix-vector
    # product over all B x m rows; per-matrix mat-vecs are broadcast multiply + sum, because a batched
    # matmul of [B, m, n] by [B, n, 1] is dominated by per-matrix GEMM overhead at MGCrP's small m x n.
    # Each vector is normalised to a floor of 1e-12 as the released code's F.normalize does: u from Q v, then
    # v from Qᵀ u, whose norm is about λ̂ itself (normalising Qᵀ Q v instead would put the floor at ~λ̂²).
    qv = q @ v0  # every deflation step restarts from v⁽⁰⁾ (Eq. 6), [B, m]
    for step in range(iters):
        u = qv / qv.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # u⁽ʲ⁺¹⁾
        qt_u = (q * u.unsqueeze(-1)).sum(-2)  # Qᵀ u⁽ʲ⁺¹⁾, [B, n]
        v = qt_u / qt_u.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # v⁽ʲ⁺¹⁾
        if step + 1 < iters:
            qv = (q * v.unsqueeze(-2)).sum(-1)
    lam = (qt_u * v).sum(-1, keepdim=True)  # λ̂ = uᵀ Q v = ‖Qᵀ u‖ (Eq. 6), the released code's estimate
    return lam.unsqueeze(-1), u.unsqueeze(-1), v.unsqueeze(-2)


class SvPN(nn.Module):
    """Singular value power normalisation of [B, m, n] cross-covariance matrices (SoT §3.3).

    Args:
        num_cols: n, the column count of the matrices (size of the initial vector v⁽⁰⁾).
        alpha: exponent α of Eq. 5, in (0, 1]; the paper's best is 0.5 (Table 4c).
        exact: True for svPN via SVD (Eq. 5), False for the fast approximation (Eq. 8); the paper
            uses the approximation throughout (20x faster, Table 4c).
        num_sv: #sv, how many leading singular values the approximation estimates (r of Eq. 8);
            paper default 1.
        iters: #iter, power iterations (Eq. 6) per singular value; paper default 1. With num_sv >= 2 it
            must be >= 2: after one iteration from v⁽⁰⁾ the estimate is λ̂₁ û v̂ᵀ with û ∝ Q v⁽⁰⁾, and
            λ̂₁ û v̂ᵀ v⁽⁰⁾ = Q v⁽⁰⁾, so the deflated matrix maps v⁽⁰⁾ (the restart of every deflation step)
            to exactly zero: the second and later triplets would come from rounding noise (in the authors'
            code too). The constructor refuses that combination, and a sweep prunes it with this reason.
        eps: guard for divisions by (near-)zero singular values.

    The initial vector v⁽⁰⁾ is learned, as in the authors' released code: with a single iteration
    it decides which direction the estimate λ̂₁ favours.
    """

    def __init__(
        self,
        num_cols: int,
        alpha: float = 0.5,
        exact: bool = False,
        num_sv: int = 1,
        iters: int = 1,
        eps: float = 1e-5,
    ):
        super().__init__()
        _check_alpha(alpha)
        if num_sv < 1:
            raise ValueError(f"svPN num_sv={num_sv!r} is invalid; it must be >= 1")
        if iters < 1:
            raise ValueError(f"svPN iters={iters!r} is invalid; it must be >= 1")
        if not exact and num_sv >= 2 and iters == 1:
            raise ValueError(
                f"approximate svPN with num_sv={num_sv} (svpn_num_sv) and iters=1 (svpn_iters) is undefined: after "
                "one power iteration the deflated matrix maps v⁽⁰⁾ to exactly zero, so every singular value after "
                "the first would come from rounding noise; use iters >= 2, num_sv=1 or the exact svPN")
        self.alpha, self.exact, self.num_sv, self.iters, self.eps = alpha, exact, num_sv, iters, eps
        self.v0 = None if exact else nn.Parameter(torch.randn(num_cols))

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return svpn_exact(q, self.alpha, self.eps)
        if self.num_sv > min(q.shape[-2:]):
            raise ValueError(
                f"svPN num_sv={self.num_sv} exceeds min(m, n)={min(q.shape[-2:])} of the {tuple(q.shape[-2:])} input"
            )
        return svpn_approx(q, self.v0, self.alpha, self.num_sv, self.iters, self.eps)

    def extra_repr(self) -> str:
        if self.exact:
            return f"alpha={self.alpha}, exact=True"
        return f"alpha={self.alpha}, exact=False, num_sv={self.num_sv}, iters={self.iters}"
