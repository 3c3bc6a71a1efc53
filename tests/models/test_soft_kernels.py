"""SOFT's Triton kernels (hpdl.models.soft_kernels) against their torch references.

In-process: the autograd functions' backward formulas (run on the torch references) by float64 gradcheck, and the
references against closed forms. Subprocess under TRITON_INTERPRET=1 (the interpreter is chosen when kernels are
defined): every kernel on CPU at tiny shapes against its reference, the Newton kernels against the official
iteration on random and ill-conditioned landmark sets, and ``soft_attention(impl="triton")`` forward and backward
against ``impl="torch"``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hpdl.models import soft_kernels as sk
from hpdl.models.soft_ops import gaussian_kernel, newton_pinv, soft_attention

torch.set_num_threads(1)
f64 = torch.float64


def _landmarks(bh, m, d, spread, seed, dtype=torch.float32):
    """Random landmarks (spread 1: a well-conditioned kernel), or two tight clusters (spread 0.05: cond ~1e3)."""
    g = torch.Generator().manual_seed(seed)
    if spread >= 1:
        return torch.randn(bh, m, d, generator=g, dtype=dtype)
    centres = torch.randn(bh, 2, d, generator=g, dtype=dtype)
    return centres[:, torch.arange(m) % 2] + spread * torch.randn(bh, m, d, generator=g, dtype=dtype)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_pt_and_p_backward_formulas_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 3, generator=g, dtype=f64, requires_grad=True)
    lm = torch.randn(2, 4, 3, generator=g, dtype=f64, requires_grad=True)
    x = torch.randn(2, 7, 2, generator=g, dtype=f64, requires_grad=True)
    y = torch.randn(2, 4, 2, generator=g, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: sk.landmark_pt(a, b, c, kernels=False), (q, lm, x))
    assert torch.autograd.gradcheck(lambda a, b, c: sk.landmark_p(a, b, c, kernels=False), (q, lm, y))


def test_soft_core_gradcheck_and_equal_to_the_chained_torch_path_float64():
    """soft_core (one autograd node, dA = -dZ W^T) is the paper's inverse backward of the chained torch path:
    gradcheck where the iteration has converged (float64, 40 steps, spread landmarks), and equal to
    soft_attention(impl="torch") forward and backward to rounding."""
    g = torch.Generator().manual_seed(0)
    q = (0.5 * torch.randn(2, 12, 4, generator=g, dtype=f64)).requires_grad_()
    lm = (0.5 * torch.randn(2, 5, 4, generator=g, dtype=f64) + torch.arange(5, dtype=f64)[:, None]).requires_grad_()
    v = torch.randn(2, 12, 3, generator=g, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, l, v: sk.soft_core(q, l, v, iters=40, kernels=False), (q, lm, v))
    q4, l4, v4 = (t.detach().view(1, 2, *t.shape[1:]).requires_grad_() for t in (q, lm, v))
    ref = soft_attention(q4, v4, l4, impl="torch", iters=40)
    qc, lc = sk.centre(q4.view(2, 12, 4), l4.view(2, 5, 4))
    got = sk.soft_core(qc, lc, v4.view(2, 12, 3), iters=40, kernels=False).view(1, 2, 12, 3)
    up = torch.randn(ref.shape, generator=g, dtype=f64)
    assert _rel(got, ref) < 1e-12
    for a, b in zip(torch.autograd.grad((got * up).sum(), (q4, v4, l4)),
                    torch.autograd.grad((ref * up).sum(), (q4, v4, l4))):
        assert _rel(a, b) < 1e-12
    with pytest.raises(ValueError, match="v must be"):
        sk.soft_core(qc, lc, v4.view(2, 12, 3)[:, :5], kernels=False)
    with pytest.raises(ValueError, match="start"):
        sk.soft_core(qc, lc, v4.view(2, 12, 3), start="zero", kernels=False)


def test_references_are_the_products_they_claim():
    g = torch.Generator().manual_seed(1)
    q, lm, x = torch.randn(1, 6, 3, generator=g, dtype=f64), torch.randn(1, 4, 3, generator=g, dtype=f64), \
        torch.randn(1, 6, 2, generator=g, dtype=f64)
    p = gaussian_kernel(q, lm)
    torch.testing.assert_close(sk.landmark_cols_ref(q, lm, x)[0], p.transpose(-1, -2) @ x)
    torch.testing.assert_close(sk.landmark_rows_ref(q, lm, p.transpose(-1, -2) @ x)[0], p @ p.transpose(-1, -2) @ x)
    # dq of L = sum(P @ y) by autograd equals the reference's formula with a = 1, b = y
    y = torch.randn(1, 4, 2, generator=g, dtype=f64)
    qg = q.clone().requires_grad_()
    (gq,) = torch.autograd.grad((gaussian_kernel(qg, lm) @ y).sum(), qg)
    torch.testing.assert_close(sk.landmark_rows_ref(q, lm, None, torch.ones(1, 6, 2, dtype=f64), y)[1], gq)


@pytest.mark.parametrize("spread", [1.0, 0.05])
def test_identity_start_reference_matches_its_spectral_form(spread):
    """V_k = sum over eigenpairs of (1 - (1 - mu/(s+reg))^(2^k)) / mu (A + reg*I = U diag(mu) U^T)."""
    a = gaussian_kernel(*(2 * [_landmarks(2, 10, 4, spread, 2, f64)]))
    for k in (0, 3, 20):
        v = sk.newton_inverse_ref(a, k, 0.01, start="identity")
        s = a.sum(-1).amax(-1)[:, None] + 0.01
        lam, u = torch.linalg.eigh(a)
        mu = lam + 0.01
        f = (1 - (1 - mu / s) ** (2 ** k)) / mu
        torch.testing.assert_close(v, u @ torch.diag_embed(f) @ u.transpose(-1, -2), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(v, newton_pinv(a, k, 0.01, start="identity"), rtol=1e-12, atol=1e-12)


def test_identity_start_converges_where_the_official_start_does_not():
    """Clustered landmarks (cond ~1e3): 20 steps from I/(s+reg) reach the inverse; the official start is ~1% off."""
    a = gaussian_kernel(*(2 * [_landmarks(1, 16, 4, 0.05, 3, f64)]))
    exact = torch.linalg.inv(a + 0.01 * torch.eye(16, dtype=f64))
    assert torch.linalg.cond(a[0] + 0.01 * torch.eye(16, dtype=f64)) > 300
    ident = newton_pinv(a, 20, 0.01, start="identity")
    official = newton_pinv(a, 20, 0.01, start="official")
    assert _rel(ident, exact) < 1e-6 < 1e-3 < _rel(official, exact)


@pytest.mark.parametrize("start", ["identity", "official"])
def test_exact_backward_with_either_start_gradcheck(start):
    a = gaussian_kernel(*(2 * [_landmarks(2, 6, 3, 0.3, 4, f64)])).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: newton_pinv(x, 5, 0.01, 1.8, "exact", start=start), (a,))
    lm = _landmarks(1, 5, 3, 0.3, 5, f64).requires_grad_()  # symmetric mode: checked through the landmarks
    w = torch.randn(1, 5, 5, dtype=f64)
    assert torch.autograd.gradcheck(
        lambda x: (newton_pinv(gaussian_kernel(x, x), 5, 0.01, 1.8, "exact", True, start=start) * w).sum(), (lm,))


def test_impl_and_precision_arguments_are_checked():
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="float32/64"):
        sk.landmark_p(q[0].half(), q[0, :2].half(), q[0, :2])
    with pytest.raises(ValueError, match="impl"):
        soft_attention(q, q, q[:, :, :2], impl="cuda")
    if not sk.available(q):
        with pytest.raises(ValueError, match="impl='triton'"):
            soft_attention(q, q, q[:, :, :2], impl="triton")
    with pytest.raises(ValueError, match="start"):
        newton_pinv(torch.eye(3), start="zero")
    with pytest.raises(ValueError, match="reg > 0"):
        newton_pinv(torch.eye(3), reg=0.0, start="identity")
    with pytest.raises(ValueError, match="precision"):
        sk.landmark_p(q[0], q[0, :2], q[0, :2], precision="fp8")


# --------------------------------------------------------------------------------- interpreted Triton kernels

def test_triton_kernels_interpreted_match_references():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all kernels ok" in r.stdout


def _interpreted() -> None:
    """Run under TRITON_INTERPRET=1: each kernel against its reference (float32, tiny shapes)."""
    assert sk.available(torch.zeros(1)), "TRITON_INTERPRET=1 must be set before hpdl.models.soft_kernels is imported"
    g = torch.Generator().manual_seed(0)
    # landmark kernels: ragged N and m (masks), d below 16 (padding), both kernels with every output
    for bh, n, m, d, e in ((2, 70, 49, 32, 32), (1, 130, 20, 8, 4)):
        q, lm = 0.5 * torch.randn(bh, n, d, generator=g), 0.5 * torch.randn(bh, m, d, generator=g)
        x, a = torch.randn(bh, n, e, generator=g), torch.randn(bh, n, e, generator=g)
        y, b = torch.randn(bh, m, e, generator=g), torch.randn(bh, m, e, generator=g)
        for got, ref in zip(sk.landmark_rows(q, lm, y, a, b), sk.landmark_rows_ref(q, lm, y, a, b)):
            assert _rel(got, ref) < 1e-5, (bh, n, m, "rows", _rel(got, ref))
        for got, ref in zip(sk.landmark_cols(q, lm, x, a, b), sk.landmark_cols_ref(q, lm, x, a, b)):
            assert _rel(got, ref) < 1e-5, (bh, n, m, "cols", _rel(got, ref))
        # two gradients through P in one pass (soft_core's backward): ds = P * (a b^T + a2 b2^T), f2 != f
        # token-side operands read in their own strides (a head view of a [N, BH*F] projection: no copy)
        a2 = torch.randn(n, bh, e + 3, generator=g).transpose(0, 1)
        b2 = torch.randn(bh, m, e + 3, generator=g)
        xs = torch.randn(n, bh, e, generator=g).transpose(0, 1)
        assert bh == 1 or not (a2.is_contiguous() or xs.is_contiguous())
        qc, lc = sk.centre(q, lm)
        nq, nl = sk._norms(qc, lc)
        got_r = sk._rows(qc, lc, nq, nl, y, xs, b, "ieee", "float32", a2, b2)
        got_c = sk._cols(qc, lc, nq, nl, xs, xs, b, "ieee", a2, b2)
        a, x = xs, xs
        for got, ref in zip(got_r + got_c, sk.landmark_rows_ref(qc, lc, y, a, b, a2, b2)
                            + sk.landmark_cols_ref(qc, lc, x, a, b, a2, b2)):
            assert _rel(got, ref) < 1e-5, (bh, n, m, "ds2", _rel(got, ref))
        ds_sum = sk.landmark_rows_ref(qc, lc, None, torch.cat([a, a2], -1), torch.cat([b, b2], -1))[1]
        assert _rel(got_r[1], ds_sum) < 1e-5   # the reference's a2 term is the concatenated product
        # single outputs (the flags that skip work)
        assert _rel(sk.landmark_rows(q, lm, y)[0], sk.landmark_rows_ref(q, lm, y)[0]) < 1e-5
        assert sk.landmark_cols(q, lm, x)[1] is None
    # Newton: fused (m <= 64) and tiled (m > 64, few steps to keep the interpreter quick), both starts,
    # random and clustered landmark sets, against the official iteration run in torch
    for m, iters in ((12, 20), (49, 20), (80, 4)):
        for spread in (1.0, 0.05):
            a = gaussian_kernel(*(2 * [_landmarks(2, m, 8, spread, m)]))
            for start in ("identity", "official"):
                got = sk.newton_inverse(a, iters, 0.01, 1.8, start)
                ref = newton_pinv(a.double(), iters, 0.01, 1.8, start=start).float()
                assert _rel(got, ref) < 1e-3, (m, spread, start, _rel(got, ref))
    # early exit on the device: steps stop once the residual says converged, and only then. Far-apart landmarks
    # (A ~ I, the goal layer at random init) need 1-3 steps from the identity start (the official one, with
    # I - 1.8 A^2/s^2 ~ -0.8, about 7); clustered ones (cond ~1e3) most of the 20; the
    # result is the full iteration's to float32 rounding either way
    # (the tiled kernels on clustered landmarks: the goal suite's GPU check; interpreted they take too long)
    for m, cases in ((49, ((3.0, 3), (0.05, 20))), (80, ((3.0, 3),))):
        for spread, most in cases:
            lmk = _landmarks(2, m, 8, min(spread, 1.0), 7) * (spread if spread > 1 else 1.0)
            a = gaussian_kernel(lmk, lmk)
            for start in ("identity", "official"):
                got, steps = sk.newton_inverse(a, 20, 0.01, 1.8, start, return_steps=True)
                ref = newton_pinv(a.double(), 20, 0.01, 1.8, start=start).float()
                assert steps.dtype == torch.int32 and steps.shape == (2,)
                assert int(steps.max()) <= (most if start == "identity" else 2 * most + 2) and (spread > 1 or int(steps.min()) >= 10), (m, spread, steps)
                assert _rel(got, ref) < (1e-6 if spread > 1 else 1e-3), (m, spread, start, _rel(got, ref))
                if spread < 1 or m > sk.FUSED_MAX_M:
                    continue
                # tol=0: early exit off, every step runs
                _, all_steps = sk.newton_inverse(a, 20, 0.01, 1.8, start, tol=0.0, return_steps=True)
                assert all_steps.tolist() == [20, 20], all_steps
    # eager tiled Newton: the host reads the residuals back and stops launching once the device would skip every
    # remaining step: the same V and steps as launching all 2 x 20 products (gated), with far fewer launches
    launches = []
    bmm = sk._bmm

    def counted(*args, **kw):
        launches.append(kw.get("step"))
        return bmm(*args, **kw)

    a = gaussian_kernel(*(2 * [3.0 * _landmarks(2, 80, 8, 1.0, 7)]))
    sk._bmm = counted
    try:
        runs = {}
        for host_exit in (False, True):
            launches.clear()
            runs[host_exit] = (*sk._newton_inverse_impl(a, 20, 0.01, 1.8, "identity", "tf32x3", 2,
                                                        host_exit=host_exit), len(launches))
        # eager public calls take the direct path (no custom op) with the host exit on
        launches.clear()
        _, steps_pub = sk.newton_inverse(a, 20, return_steps=True)
        public_launches = len(launches)
    finally:
        sk._bmm = bmm
    (v_all, s_all, n_all), (v_host, s_host, n_host) = runs[False], runs[True]
    assert n_all == 40 and n_host < 10 and public_launches == n_host, (n_all, n_host, public_launches)
    assert torch.equal(v_all, v_host) and torch.equal(s_all, s_host) and torch.equal(steps_pub, s_host)
    assert sk._direct(a)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:   # traced calls keep the opaque custom op
        assert not sk._direct(mode.from_tensor(a))
    # the whole attention, forward and backward, Triton vs torch (same start, same backward)
    q = (0.5 * torch.randn(1, 2, 96, 16, generator=g)).requires_grad_()
    v = torch.randn(1, 2, 96, 16, generator=g).requires_grad_()
    lm = (0.5 * torch.randn(1, 2, 24, 16, generator=g)).requires_grad_()
    up = torch.randn(1, 2, 96, 16, generator=g)
    outs, grads = {}, {}
    for impl in ("torch", "triton"):
        out = soft_attention(q, v, lm, impl=impl)
        outs[impl] = out
        grads[impl] = torch.autograd.grad((out * up).sum(), (q, v, lm))
    assert _rel(outs["triton"], outs["torch"]) < 1e-5, _rel(outs["triton"], outs["torch"])
    for gt, gr in zip(grads["triton"], grads["torch"]):
        assert _rel(gt, gr) < 1e-4, _rel(gt, gr)
    # bfloat16 inputs (autocast's): v is read by the kernels in its own dtype, q and l are centred in float32
    qb, vb, lb = (t.detach().bfloat16().requires_grad_() for t in (q, v, lm))
    ref = soft_attention(qb, vb, lb, impl="torch")
    got = soft_attention(qb, vb, lb, impl="triton")
    assert got.dtype == torch.bfloat16 and _rel(got, ref) < 1e-2, _rel(got, ref)
    # q and v as head views of [B, N, H*d] projections (the layer's layout): read in their strides, centred on
    # chip; same result and gradients as contiguous inputs
    qs, vs = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (qb, vb))
    assert not qs.is_contiguous()
    got_s = soft_attention(qs, vs, lb, impl="triton")
    assert _rel(got_s, got) < 1e-6, _rel(got_s, got)
    gs = torch.autograd.grad(got_s.float().sum(), (qs, vs))
    gc = torch.autograd.grad(soft_attention(qb, vb, lb, impl="triton").float().sum(), (qb, vb))
    assert all(_rel(a_, b_) < 1e-6 for a_, b_ in zip(gs, gc))
    for gt, gr in zip(torch.autograd.grad(got.float().sum(), (qb, vb, lb)),
                      torch.autograd.grad(ref.float().sum(), (qb, vb, lb))):
        assert gt.dtype == torch.bfloat16 and _rel(gt, gr) < 2e-2, _rel(gt, gr)
    # the goal suite's report of the Newton steps a layer runs (early exit on, and off with nr_tol=0)
    from hpdl.models.soft import SoftAttention
    from hpdl.vision.soft_goal import _newton_steps

    x = torch.randn(1, 256, 32, generator=g)
    assert 1 <= _newton_steps(SoftAttention(32, 2, 4), x, 16, 16, torch.float32) < 20
    assert _newton_steps(SoftAttention(32, 2, 4, nr_tol=0.0), x, 16, 16, torch.float32) == 20
    assert _newton_steps(SoftAttention(32, 2, 4, impl="torch"), x, 16, 16, torch.float32) is None
    # torch.compile traces the model with the custom ops and autograd functions in one graph (no breaks)
    from hpdl.models.soft import SoftConfig, SoftViT

    torch.manual_seed(0)
    model = SoftViT(SoftConfig(img_size=64, num_classes=3, embed_dims=(16, 32, 48, 64), num_heads=(2, 2, 3, 4),
                               depths=(1, 1, 1, 1), stem_channels=8))
    x = torch.randn(2, 3, 64, 64)
    ref = model(x)
    (gref,) = torch.autograd.grad(ref.sum(), model.block1[0].mha.W_q.weight)
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    (gout,) = torch.autograd.grad(out.sum(), model.block1[0].mha.W_q.weight)
    assert _rel(out, ref) < 1e-5 and _rel(gout, gref) < 1e-4, (_rel(out, ref), _rel(gout, gref))
    print("all kernels ok")


if __name__ == "__main__":
    _interpreted()
