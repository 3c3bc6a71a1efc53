"""SOFT's numerical core (hpdl.models.soft_ops) against closed forms: the spectral expression of the truncated
Newton-Raphson iteration, pinv, exact Gaussian-kernel attention, gradcheck in float64, Hugging Face's Nystrom."""

from __future__ import annotations

import pytest
import torch

from hpdl.models.soft_ops import gaussian_kernel, newton_pinv, norm_alpha_scale, nystrom_attention, soft_attention

torch.set_num_threads(1)
f64 = torch.float64


def _kernel(n=12, d=4, batch=(2, 3), spread=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = spread * torch.randn(*batch, n, d, generator=g, dtype=f64)
    return gaussian_kernel(x, x)


def _clustered(n=12, d=4, seed=0):
    """Landmarks in two tight clusters: A + 0.01*I has condition number ~6e2, 20 steps leave a residual ~1e-3."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(2, d, generator=g, dtype=f64)
    x = centers[torch.arange(n) % 2] + 0.05 * torch.randn(n, d, generator=g, dtype=f64)
    return gaussian_kernel(x, x)[None]


def _spectral(a, iters, reg, scale=1.8):
    """Closed form of the truncated iteration: mu -> (1 - (1 - alpha mu^2)^(2^k)) / mu on A + reg*I."""
    alpha = scale / a.sum(-1).amax(-1) ** 2
    lam, u = torch.linalg.eigh(a)
    mu = lam + reg
    f = (1 - (1 - alpha[..., None] * mu * mu) ** (2 ** iters)) / mu
    return u @ torch.diag_embed(f) @ u.transpose(-1, -2)


def test_gaussian_kernel_is_exp_of_half_squared_distance():
    x, y = torch.randn(3, 5, 4, dtype=f64), torch.randn(3, 7, 4, dtype=f64)
    ref = torch.exp(-0.5 * torch.cdist(x, y) ** 2)
    torch.testing.assert_close(gaussian_kernel(x, y), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("iters", [0, 1, 5, 20])
@pytest.mark.parametrize("case", ["random", "clustered"])
def test_newton_matches_spectral_expression_of_truncated_iteration(iters, case):
    a = _kernel() if case == "random" else _clustered()
    v = newton_pinv(a, iters, reg=0.01)
    if case == "clustered":  # truly not converged
        residual = torch.eye(12, dtype=f64) - (a + 0.01 * torch.eye(12, dtype=f64)) @ v
        assert residual.abs().max() > 1e-4
    ref = _spectral(a, iters, reg=0.01)
    torch.testing.assert_close(v, ref, rtol=1e-9, atol=1e-9 * ref.abs().max().item())


def test_newton_matches_inverse_and_pinv_when_well_conditioned():
    a = _kernel(spread=2.0)
    assert torch.linalg.cond(a).max() < 50
    eye = torch.eye(a.shape[-1], dtype=f64)
    torch.testing.assert_close(newton_pinv(a, 20, reg=0.01), torch.linalg.inv(a + 0.01 * eye), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(newton_pinv(a, 20, reg=0.0), torch.linalg.pinv(a), rtol=1e-10, atol=1e-10)


def test_newton_converges_to_pinv_of_rank_deficient_psd():
    """Duplicated landmarks make A singular (rank 6 of 12); NR's limit is then the Moore-Penrose inverse."""
    g = torch.Generator().manual_seed(3)
    x = 2.0 * torch.randn(6, 4, generator=g, dtype=f64)
    a = gaussian_kernel(x, x).repeat(2, 2)
    assert torch.linalg.matrix_rank(a) == 6
    torch.testing.assert_close(newton_pinv(a[None], 30, reg=0.0)[0], torch.linalg.pinv(a, hermitian=True),
                               rtol=1e-10, atol=1e-10)


def test_newton_is_per_matrix():
    a = torch.cat([_kernel(batch=(1,), seed=1), 5 * _clustered(seed=2)])  # very different row sums
    both = newton_pinv(a, 20)
    torch.testing.assert_close(both[0], newton_pinv(a[:1], 20)[0], rtol=0, atol=0)
    torch.testing.assert_close(both[1], newton_pinv(a[1:], 20)[0], rtol=0, atol=0)


@pytest.mark.parametrize("case,iters", [("random", 3), ("random", 20), ("clustered", 20)])
def test_newton_exact_backward_gradcheck(case, iters):
    a = (_kernel(n=6, batch=(2,)) if case == "random" else _clustered(n=6)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: newton_pinv(x, iters, 0.01, 1.8, "exact"), (a,))


def test_newton_backward_modes():
    """exact == autograd through the iterations; the paper's inverse formula agrees only once converged."""
    g = torch.randn(2, 3, 12, 12, dtype=f64)
    grads = {}
    for name, a0 in (("random", _kernel(spread=2.0)), ("clustered", _clustered().expand(2, 3, 12, 12))):
        for mode in ("exact", "autograd", "inverse"):
            a = a0.clone().requires_grad_()
            (newton_pinv(a, 20, 0.01, 1.8, mode) * g).sum().backward()
            grads[name, mode] = a.grad
    torch.testing.assert_close(grads["random", "exact"], grads["random", "autograd"], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grads["clustered", "exact"], grads["clustered", "autograd"], rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(grads["random", "inverse"], grads["random", "exact"], rtol=1e-8, atol=1e-8)
    err = (grads["clustered", "inverse"] - grads["clustered", "exact"]).abs().max()
    assert err > 1e-2 * grads["clustered", "exact"].abs().max()  # the inverse formula is wrong when unconverged


@pytest.mark.parametrize("case", ["random", "clustered"])
def test_symmetric_exact_backward_is_the_symmetric_part_of_the_general_one(case):
    """symmetric=True (5 products a step) returns sym(gradient) + alpha's row term: the general exact backward
    applied to a symmetrised upstream gradient; through a kernel of landmarks both give the same landmark grads."""
    a0 = _kernel(spread=2.0) if case == "random" else _clustered().expand(2, 3, 12, 12)
    g = torch.randn(2, 3, 12, 12, dtype=f64)
    sym_g = 0.5 * (g + g.transpose(-1, -2))
    grads = {}
    for name, sym, up in (("general", False, sym_g), ("symmetric", True, g)):
        a = a0.clone().requires_grad_()
        (newton_pinv(a, 20, 0.01, 1.8, "exact", symmetric=sym) * up).sum().backward()
        grads[name] = a.grad
    torch.testing.assert_close(grads["symmetric"], grads["general"], rtol=1e-9, atol=1e-9)
    torch.manual_seed(0)
    lm = (torch.randn(2, 2, 9, 4, dtype=f64) * (0.3 if case == "clustered" else 1.0)).requires_grad_()
    w = torch.randn(2, 2, 9, 9, dtype=f64)
    out = {}
    for sym in (False, True):
        (lg,) = torch.autograd.grad((newton_pinv(gaussian_kernel(lm, lm), 20, 0.01, 1.8, "exact", sym) * w).sum(), lm)
        out[sym] = lg
    torch.testing.assert_close(out[True], out[False], rtol=1e-9, atol=1e-9)


def test_soft_attention_gradcheck_through_landmarks_with_the_symmetric_backward():
    torch.manual_seed(1)
    q = torch.randn(1, 2, 10, 4, dtype=f64, requires_grad=True)
    v = torch.randn(1, 2, 10, 3, dtype=f64, requires_grad=True)
    lm = torch.randn(1, 2, 5, 4, dtype=f64, requires_grad=True)
    for variant in ("soft", "norm"):
        assert torch.autograd.gradcheck(lambda a, b, c: soft_attention(a, b, c, variant=variant, iters=8,
                                                                       backward="exact"), (q, v, lm))


def test_norm_alpha_scale_matches_official_loop_per_matrix():
    a = torch.cat([_kernel(batch=(2,), seed=4), _clustered(seed=5), 3 * _kernel(batch=(1,), seed=6)])
    got = norm_alpha_scale(a)
    eye = torch.eye(a.shape[-1], dtype=f64)
    for i in range(a.shape[0]):  # the official while-loop, one matrix at a time
        alpha, j = 2 / a[i].sum(-1).max() ** 2, 0
        while (eye - alpha * a[i] @ a[i]).abs().sum(-2).max() > 1.01 and j < 10:
            alpha, j = alpha * 0.5, j + 1
        assert got[i].item() == 2 * 0.5 ** j


def _exact(q, v):
    return gaussian_kernel(q, q) @ v


@pytest.mark.parametrize("variant", ["soft", "norm"])
def test_landmarks_equal_tokens_is_exact_kernel_attention(variant):
    g = torch.Generator().manual_seed(7)
    q = 1.5 * torch.randn(2, 2, 10, 4, generator=g, dtype=f64)
    v = torch.randn(2, 2, 10, 3, generator=g, dtype=f64)
    s = gaussian_kernel(q, q)
    assert torch.linalg.cond(s).max() < 50
    out = soft_attention(q, v, q, variant=variant, reg=0.0, iters=20)
    if variant == "soft":
        ref = s @ v
    else:  # SOFT++: P D^-1/2 A^+ D^-1/2 P^T v with P = A = S
        d = s.sum(-1).rsqrt()
        ref = s @ (d[..., :, None] * torch.linalg.inv(s) * d[..., None, :]) @ s @ v
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("variant", ["soft", "norm"])
def test_soft_attention_gradcheck(variant):
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 2, 8, 3, generator=g, dtype=f64, requires_grad=True)
    v = torch.randn(1, 2, 8, 2, generator=g, dtype=f64, requires_grad=True)
    lm = torch.randn(1, 2, 4, 3, generator=g, dtype=f64, requires_grad=True)
    for backward in ("exact", "inverse"):  # 20 steps converge here, so the paper's backward is exact too
        assert torch.autograd.gradcheck(lambda a, b, c: soft_attention(a, b, c, variant=variant, backward=backward),
                                        (q, v, lm))


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 8e-3), (torch.float16, 1e-3)])
def test_soft_attention_under_autocast_keeps_fp32_core(dtype, tol):
    g = torch.Generator().manual_seed(9)
    # a common offset leaves distances alone but makes |q|^2 ~ 300: |q|^2 + |l|^2 - 2 q.l cancels in 16 bits
    q = torch.randn(2, 2, 256, 32, generator=g) * 32 ** -0.25 + 3.0
    v = torch.randn(2, 2, 256, 32, generator=g)
    lm = q.reshape(2, 2, 16, 16, 32).mean(-2)
    q, v, lm = q.to(dtype), v.to(dtype), lm.to(dtype)
    ref = soft_attention(q.float(), v.float(), lm.float())  # the same (rounded) inputs in float32
    with torch.autocast("cpu", dtype=dtype):
        out = soft_attention(q, v, lm)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() < tol
    p16 = gaussian_kernel(q, lm).float()  # the same kernel in 16 bits is far off
    p32 = gaussian_kernel(q.float(), lm.float())
    assert ((p16 - p32).norm() / p32.norm()).item() > 10 * tol


def test_nystrom_matches_huggingface():
    transformers = pytest.importorskip("transformers")
    from transformers.models.nystromformer.modeling_nystromformer import NystromformerSelfAttention

    cfg = transformers.NystromformerConfig(hidden_size=16, num_attention_heads=1, num_landmarks=8,
                                           segment_means_seq_len=64)
    torch.manual_seed(0)
    hf = NystromformerSelfAttention(cfg).eval()
    hf.conv_kernel_size = None  # its depthwise conv on V is not part of the attention
    x = torch.randn(1, 64, 16)
    with torch.no_grad():
        ref = hf(x)[0]
        q, k, v = (lin(x).view(1, 64, 1, 16).transpose(1, 2) for lin in (hf.query, hf.key, hf.value))
        out = nystrom_attention(q, k, v, num_landmarks=8).transpose(1, 2).reshape(1, 64, 16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="backward"):
        newton_pinv(torch.eye(3), backward="magic")
    with pytest.raises(ValueError, match=r"\[\.\.\., n, n\]"):
        newton_pinv(torch.ones(3, 4))
    with pytest.raises(ValueError, match="variant"):
        soft_attention(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2), torch.ones(1, 1, 2, 2), variant="x")
    with pytest.raises(ValueError, match="multiple of num_landmarks"):
        nystrom_attention(*(torch.ones(1, 1, 10, 2),) * 3, num_landmarks=4)


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_bad_nr_tol_raises_on_the_torch_path_too(bad):
    # the torch path ignored tol: a value the Triton path refuses passed on CPU and failed only on CUDA
    from hpdl.models import soft_kernels as sk

    q = torch.randn(1, 2, 8, 4) * 0.5
    v, lm = torch.randn(1, 2, 8, 3), q[:, :, ::2]
    with pytest.raises(ValueError, match="nr_tol"):
        soft_attention(q, v, lm, impl="torch", nr_tol=bad)
    with pytest.raises(ValueError, match="tol"):
        newton_pinv(torch.eye(3), 5, 0.1, tol=bad)
    with pytest.raises(ValueError, match="reg"):
        newton_pinv(torch.eye(3), 5, float("nan"))
    l3 = lm.reshape(2, 4, 4) - lm.reshape(2, 4, 4).mean(1, keepdim=True)
    with pytest.raises(ValueError, match="tol"):
        sk.soft_core(q.reshape(2, 8, 4) - lm.reshape(2, 4, 4).mean(1, keepdim=True), l3, v.reshape(2, 8, 3),
                     kernels=False, tol=bad)
    with pytest.raises(ValueError, match="landmark"):
        soft_attention(q, v, lm[:, :, :0], impl="torch")
