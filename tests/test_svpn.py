"""svPN (SoT, paper 004 §3.3): exact via SVD (Eq. 5) and the power-iteration approximation (Eqs. 6-8)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.layers.svpn import SvPN, _power_divided_difference, svpn_approx, svpn_exact


def _random_orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q


def _matrix_with_singular_values(m: int, n: int, singular_values: list[float], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = _random_orthogonal(m, g)[:, : len(singular_values)]
    v = _random_orthogonal(n, g)[:, : len(singular_values)]
    return u @ torch.diag(torch.tensor(singular_values, dtype=torch.float64)) @ v.T


@pytest.mark.parametrize("shape", [(5, 5), (7, 4), (4, 7)], ids=["square", "tall", "wide"])
def test_exact_svpn_equals_svd_definition(shape):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, *shape, generator=g, dtype=torch.float64)
    alpha = 0.5
    expected = []
    for matrix in q.numpy():
        u, s, vt = np.linalg.svd(matrix, full_matrices=False)  # independent SVD (LAPACK via numpy)
        expected.append(u @ np.diag(s**alpha) @ vt)
    torch.testing.assert_close(svpn_exact(q, alpha), torch.from_numpy(np.stack(expected)))


@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (5, 5)], ids=["tall", "wide", "square"])
def test_approx_svpn_with_all_singular_values_converges_to_exact(shape):
    k = min(shape)
    q = _matrix_with_singular_values(*shape, [2.0 ** (k - i) for i in range(k)]).unsqueeze(0)
    v0 = torch.randn(shape[1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    approx = svpn_approx(q, v0, alpha=0.5, num_sv=k, iters=80, eps=0.0)
    torch.testing.assert_close(approx, svpn_exact(q, 0.5), atol=1e-9, rtol=1e-9)


def test_approx_svpn_with_one_singular_value_is_q_over_estimated_lambda1_power():
    # Eq. 8 with r = 1: Q / λ̂₁^(1-α), λ̂₁ the estimate after #iter steps of Eq. 6 from v⁽⁰⁾.
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 6, 5, generator=g, dtype=torch.float64)
    v0 = torch.randn(5, generator=g, dtype=torch.float64)
    alpha, iters = 0.5, 2
    v = v0.expand(4, 5)
    for _ in range(iters):
        u = torch.einsum("bmn,bn->bm", q, v)
        u = u / u.norm(dim=-1, keepdim=True)
        qt_u = torch.einsum("bmn,bm->bn", q, u)
        v = qt_u / qt_u.norm(dim=-1, keepdim=True)
    lambda1_hat = qt_u.norm(dim=-1)[:, None, None]
    expected = q / lambda1_hat ** (1 - alpha)
    got = svpn_approx(q, v0, alpha=alpha, num_sv=1, iters=iters, eps=0.0)
    torch.testing.assert_close(got, expected)


def _released_svpn_approx(q, v0, alpha, num_sv, iters, eps):
    """The authors' released svPN (SoT repository, ``svPN._singularValuePowerNorm``) in float64: each
    estimated component is removed exactly and kept as λ̂^α û v̂ᵀ; eps divides only the remainder."""
    residual, kept = q.clone(), torch.zeros_like(q)
    for _ in range(num_sv):
        v = v0.expand(q.shape[0], -1)
        for _ in range(iters):
            u = torch.nn.functional.normalize(torch.einsum("bmn,bn->bm", residual, v), dim=-1)
            v = torch.nn.functional.normalize(torch.einsum("bmn,bm->bn", residual, u), dim=-1)
        lam = torch.einsum("bm,bmn,bn->b", u, residual, v)[:, None, None]
        rank_one = u.unsqueeze(-1) * v.unsqueeze(-2)
        kept = kept + lam.pow(alpha) * rank_one
        residual = residual - lam * rank_one
    return kept + residual / (lam.pow(1 - alpha) + eps)


@pytest.mark.parametrize("num_sv, iters", [(1, 1), (1, 3), (2, 2), (3, 4)])
def test_approx_svpn_applies_eps_to_the_remainder_only_as_released(num_sv, iters):
    # Small singular values make eps = 1e-5 matter (relative effect about eps / λ̂^(1-α) = 3e-4 here).
    g = torch.Generator().manual_seed(10)
    q = torch.randn(3, 6, 5, generator=g, dtype=torch.float64) * 1e-3
    v0 = torch.randn(5, generator=g, dtype=torch.float64)
    q_ours, q_released = q.clone().requires_grad_(), q.clone().requires_grad_()
    ours = svpn_approx(q_ours, v0, alpha=0.5, num_sv=num_sv, iters=iters, eps=1e-5)
    released = _released_svpn_approx(q_released, v0, 0.5, num_sv, iters, 1e-5)
    torch.testing.assert_close(ours, released, rtol=1e-12, atol=0)
    upstream = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    ours.backward(upstream)
    released.backward(upstream)
    torch.testing.assert_close(q_ours.grad, q_released.grad, rtol=1e-9, atol=0)


@pytest.mark.parametrize("scale", [1e-6, 1e-8, 1e-10], ids=["1e-6", "1e-8", "1e-10"])
@pytest.mark.parametrize("num_sv, iters", [(1, 1), (2, 2)])
def test_approx_svpn_matches_the_released_code_at_tiny_scales(scale, num_sv, iters):
    # The released code normalises Q v and then Q^T u, each to a floor of 1e-12 (F.normalize): the second
    # norm is about the singular value itself, so the floor is reached only below sigma_1 = 1e-12.
    g = torch.Generator().manual_seed(11)
    q = torch.randn(3, 6, 5, generator=g, dtype=torch.float64) * scale
    v0 = torch.randn(5, generator=g, dtype=torch.float64)
    ours = svpn_approx(q, v0, alpha=0.5, num_sv=num_sv, iters=iters, eps=1e-5)
    torch.testing.assert_close(ours, _released_svpn_approx(q, v0, 0.5, num_sv, iters, 1e-5), rtol=1e-9, atol=0)


def test_exact_svpn_gradient_is_finite_for_repeated_singular_values():
    q = (torch.eye(6, dtype=torch.float64) * 2.0).repeat(3, 1, 1).requires_grad_()
    out = svpn_exact(q, 0.5)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(q.grad).all()


def test_exact_svpn_gradient_at_identity_is_the_analytic_derivative():
    # svPN(Q) = (QQᵀ)^((α-1)/2) Q, so at Q = I: dF = α sym(dQ) + skew(dQ); the adjoint has the same form.
    alpha = 0.3
    q = torch.eye(5, dtype=torch.float64).unsqueeze(0).requires_grad_()
    upstream = torch.randn(1, 5, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    svpn_exact(q, alpha).backward(upstream)
    sym, skew = 0.5 * (upstream + upstream.mT), 0.5 * (upstream - upstream.mT)
    torch.testing.assert_close(q.grad, alpha * sym + skew)


def test_exact_svpn_gradient_is_continuous_across_coinciding_singular_values():
    base = _matrix_with_singular_values(5, 5, [3.0, 2.0, 2.0, 1.0, 0.5], seed=4)
    nearly = _matrix_with_singular_values(5, 5, [3.0, 2.0 + 1e-7, 2.0, 1.0, 0.5], seed=4)
    upstream = torch.randn(5, 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = []
    for q in (base, nearly):
        q = q.clone().requires_grad_()
        svpn_exact(q, 0.5).backward(upstream)
        grads.append(q.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [(4, 4), (5, 3), (3, 5)], ids=["square", "tall", "wide"])
def test_exact_svpn_backward_matches_finite_differences(shape):
    q = torch.randn(2, *shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    q.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: svpn_exact(x, 0.5), (q,))


def test_exact_svpn_gradient_is_finite_for_rank_deficient_input():
    # Fewer tokens than m, n (e.g. 4 tokens at 32 px for 14 x 14 heads) gives zero singular values.
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(2, 14, 4, generator=g), torch.randn(2, 14, 4, generator=g)
    q = (x @ y.mT / 4).requires_grad_()
    out = svpn_exact(q, 0.5)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()


def test_approx_svpn_gradient_reaches_input_and_initial_vector():
    norm = SvPN(num_cols=5, alpha=0.5, exact=False, num_sv=2, iters=2)
    q = torch.randn(3, 5, 5, requires_grad=True)
    norm(q).pow(2).sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    assert norm.v0.grad is not None and torch.isfinite(norm.v0.grad).all()


@pytest.mark.parametrize("alpha", [0.0, -0.5, 1.5])
def test_svpn_rejects_alpha_outside_zero_one(alpha):
    with pytest.raises(ValueError, match="alpha"):
        SvPN(num_cols=4, alpha=alpha)


def test_svpn_accepts_alpha_one_the_identity_end_of_its_range():
    q = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(SvPN(num_cols=4, alpha=1.0, exact=True)(q), q, atol=1e-5, rtol=1e-5)


def test_svpn_defaults_are_the_papers_fast_form_one_singular_value_one_iteration():
    norm = SvPN(num_cols=4)
    assert (norm.alpha, norm.exact, norm.num_sv, norm.iters, norm.eps) == (0.5, False, 1, 1, 1e-5)
    assert list(SvPN(num_cols=4, exact=True).parameters()) == []  # only the fast form learns v⁽⁰⁾
    q, v0 = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(2)), norm.v0.detach()
    torch.testing.assert_close(svpn_approx(q, v0), svpn_approx(q, v0, 0.5, 1, 1, 1e-5))
    torch.testing.assert_close(svpn_exact(q), svpn_exact(q, 0.5, 1e-5))


def test_svpn_passes_its_eps_to_the_fast_forms_remainder():
    q = torch.diag(torch.tensor([1e-4, 5e-5, 0.0])).unsqueeze(0)  # a remainder beside λ₁: where eps divides
    norm = SvPN(num_cols=3, eps=1e-1)
    norm.v0.data = torch.tensor([1.0, 0.0, 0.0])
    reference = svpn_approx(q, norm.v0, 0.5, 1, 1, 1e-1)
    assert not torch.allclose(reference, svpn_approx(q, norm.v0, 0.5, 1, 1))  # eps matters here
    torch.testing.assert_close(norm(q), reference)


def test_svpn_passes_its_eps_to_the_exact_forms_backward():
    q = torch.diag(torch.tensor([1.0, 1e-3, 0.0], dtype=torch.float64)).unsqueeze(0)  # near-zero singular values
    cotangent = torch.randn(1, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def gradient(norm_or_eps):
        x = q.clone().requires_grad_()
        out = norm_or_eps(x) if callable(norm_or_eps) else svpn_exact(x, 0.5, norm_or_eps)
        (grad,) = torch.autograd.grad((out * cotangent).sum(), x)
        return grad

    assert not torch.allclose(gradient(1e-1), gradient(1e-5))  # eps matters here
    torch.testing.assert_close(gradient(SvPN(num_cols=3, exact=True, eps=1e-1)), gradient(1e-1))


@pytest.mark.parametrize("name", ["num_sv", "iters"])
def test_svpn_counts_below_one_are_refused_naming_them(name):
    with pytest.raises(ValueError, match=rf"^svPN {name}=0 is invalid; it must be >= 1$"):
        SvPN(num_cols=4, **{name: 0})


def test_svpn_rejects_more_singular_values_than_the_matrix_has():
    with pytest.raises(ValueError, match=r"^svPN num_sv=4 exceeds min\(m, n\)=3 of the \(3, 5\) input$"):
        SvPN(num_cols=5, num_sv=4, iters=2)(torch.randn(2, 3, 5))
    q = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(3))
    assert SvPN(num_cols=5, num_sv=3, iters=2)(q).shape == q.shape  # as many as it has: accepted


def test_the_divided_difference_of_nearly_equal_values_is_the_taylor_limit():
    t = torch.tensor([1.0, 1.0 + 5e-4, 2.0], dtype=torch.float64)  # 1 and 1+5e-4: the close branch
    for p in (0.25, 0.75, 1.5):
        expected = (t.unsqueeze(-2) ** p - t.unsqueeze(-1) ** p) / (t.unsqueeze(-2) - t.unsqueeze(-1))
        expected.diagonal().copy_(p * t ** (p - 1))  # the limit where t_i = t_j
        torch.testing.assert_close(_power_divided_difference(t, p), expected, rtol=1e-7, atol=1e-12)  # x² terms: ~1e-8


@pytest.mark.parametrize("num_sv", [2, 3])
def test_approx_svpn_refuses_several_singular_values_from_one_iteration(num_sv):
    # One iteration leaves a deflated matrix that maps v⁽⁰⁾ to zero: the later triplets would be noise.
    with pytest.raises(ValueError) as refused:
        SvPN(num_cols=5, num_sv=num_sv, iters=1)
    assert str(refused.value) == (
        f"approximate svPN with num_sv={num_sv} (svpn_num_sv) and iters=1 (svpn_iters) is undefined: after one power "
        "iteration the deflated matrix maps v⁽⁰⁾ to exactly zero, so every singular value after the first would come "
        "from rounding noise; use iters >= 2, num_sv=1 or the exact svPN")


def test_exact_svpn_does_not_refuse_the_approximation_knobs_it_ignores():
    q = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(SvPN(num_cols=5, exact=True, num_sv=2, iters=1)(q), svpn_exact(q, 0.5))


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "approx"])
def test_svpn_computes_in_float32_for_bfloat16_autocast(exact):
    q = torch.randn(4, 6, 6, generator=torch.Generator().manual_seed(8))
    norm = SvPN(num_cols=6, exact=exact)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = norm(q.bfloat16())
    assert low.dtype == torch.bfloat16
    # Exactly the float32 result rounded once to bfloat16: any step in bfloat16 would round earlier.
    assert torch.equal(low, norm(q.bfloat16().float()).bfloat16())


def test_fast_svpn_of_a_bfloat16_module_computes_in_float32_with_its_initial_vector_cast():
    # DeepSpeed's bf16 training holds the module itself in bfloat16, v⁽⁰⁾ included, without autocast.
    q = torch.randn(4, 6, 6, generator=torch.Generator().manual_seed(8))
    low = SvPN(num_cols=6).to(torch.bfloat16)
    reference = svpn_approx(q.bfloat16().float(), low.v0.float())
    assert torch.equal(low(q.bfloat16()), reference.bfloat16())
