"""Triton kernels for SOFT (:mod:`hpdl.models.soft_ops`): a fused Newton-Raphson inverse and flash-style landmark
products that never hold the ``[N, m]`` kernel matrix in memory.

Lu et al., "SOFT: Softmax-free Transformer with Linear Complexity", NeurIPS 2021 (arXiv 2110.11945). The layout
of the landmark kernels follows FlashAttention (Dao et al. 2022, arXiv 2205.14135): tiles of
``P = exp(-|q_i - l_j|^2 / 2)`` are recomputed on chip from ``q`` and ``l`` whenever they are needed.

Kernels (each has a torch reference ``*_ref`` of the same arithmetic; CI runs the kernels on CPU under
``TRITON_INTERPRET=1`` against them, ``tests/models/test_soft_kernels.py``):

- :func:`newton_inverse`: ``iters`` steps of ``V <- 2V - V A_r V`` with ``A_r = A + reg*I``, from ``V0 = I/(s+reg)``
  (``start="identity"``, for SPD ``A_r``: the residual's eigenvalues are ``1 - mu/(s+reg)``, so the condition
  number enters linearly) or the official ``V0 = (scale/s^2) A_r`` (``start="official"``), s the largest row sum
  of A. ``m <= 64``: one program per matrix, every step on chip in float32. Larger ``m``: one tiled batched
  matmul kernel per product, tensor cores (3xTF32 by default, plain TF32 on request: fine for condition numbers
  up to ~1e2) for ``iters - 2`` steps and two float32 steps (a Newton step squares the residual, so they
  square away what the tensor-core rounding left).
- :func:`landmark_rows`: per block of tokens, ``P @ Y`` and/or ``dq = (P * (a b^T)) l - q rowsum(P * (a b^T))``.
- :func:`landmark_cols`: per block of landmarks (tokens split over programs, partial sums added in torch),
  ``P^T @ X`` and/or ``dl = (P * (a b^T))^T q - l colsum(P * (a b^T))``.

The exponent ``q.l - |q|^2/2 - |l|^2/2`` is formed from *centred* q and l (the landmarks' mean subtracted: distances
unchanged, magnitudes small) with TF32 products and float32 accumulation: the cancellation that makes a 16-bit
exponent ~10% wrong is gone before the product. Inputs are float32 ``[BH, N, D]`` contiguous; the ops are
``torch.library`` custom ops, so ``torch.compile`` treats them as opaque nodes and CUDA graphs capture them
(no host synchronisation).
"""

from __future__ import annotations

import functools
import os

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    triton = None

__all__ = ["FUSED_MAX_M", "PRECISIONS", "available", "centre", "landmark_cols", "landmark_cols_ref", "landmark_p",
           "landmark_pt", "landmark_rows", "landmark_rows_ref", "neg_vgv", "newton_inverse", "newton_inverse_ref",
           "soft_core"]

PRECISIONS = ("tf32", "tf32x3", "ieee")
FUSED_MAX_M = 64  # largest landmark count whose whole Newton iteration runs in one program's registers


# read once: Triton picks the interpreter when kernels are defined (at import), and a constant keeps
# torch.compile free of environment guards
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``t``'s device (CUDA, or any device under TRITON_INTERPRET=1)."""
    return triton is not None and (t.is_cuda or _INTERPRET)


def _direct(t: torch.Tensor) -> bool:
    """An eager call on a plain tensor: the launchers run as Python functions, not through their
    ``torch.library`` custom ops. In eager mode the op only adds host time (dispatcher -> Python autograd shim ->
    redispatch -> Python backend -> a dynamo-disable wrapper: 20-35 us a call on a busy CPU, measured, against
    ~3 us for the direct call); traced or compiled calls (dynamo, fake or functional tensors, a dispatch mode)
    keep the opaque op, so ``torch.compile`` sees the same graph as before."""
    return (type(t) is torch.Tensor and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and not torch.jit.is_tracing())


# ------------------------------------------------------------------------------------------------ torch references

def newton_inverse_ref(a: torch.Tensor, iters: int, reg: float, scale: float = 1.8, start: str = "identity"
                       ) -> torch.Tensor:
    """The iteration of :func:`newton_inverse` in plain torch: ``a [BH, m, m]`` -> ``[BH, m, m]``."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    s = a.sum(-1).amax(-1)[:, None, None]
    a_r = a + reg * eye
    v = eye / (s + reg) if start == "identity" else (scale / (s * s)) * a_r
    for _ in range(iters):
        v = 2 * v - (v @ a_r) @ v
    return v


def _p_ref(q, l):
    d = (q.pow(2).sum(-1)[..., :, None] + l.pow(2).sum(-1)[..., None, :] - 2 * q @ l.transpose(-1, -2))
    return torch.exp(-0.5 * d)


def _ab(q, a, b, a2, b2):
    """``a b^T (+ a2 b2^T)`` in q's dtype."""
    a, b = a.to(q.dtype), b.to(q.dtype)
    ab = a @ b.transpose(-1, -2)
    return ab if a2 is None else ab + a2.to(q.dtype) @ b2.to(q.dtype).transpose(-1, -2)


def landmark_rows_ref(q, l, y=None, a=None, b=None, a2=None, b2=None):
    """``(P @ y, (P * (a b^T)) l - q rowsum(P * (a b^T)))`` with P = exp(-|q_i - l_j|^2/2); None where not asked;
    ``a2 b2^T`` is added to ``a b^T`` where given. y, a, b, a2, b2 are read in q's dtype."""
    p = _p_ref(q, l)
    out = p @ y.to(q.dtype) if y is not None else None
    dq = None
    if a is not None:
        ds = p * _ab(q, a, b, a2, b2)
        dq = ds @ l - q * ds.sum(-1, keepdim=True)
    return out, dq


def landmark_cols_ref(q, l, x=None, a=None, b=None, a2=None, b2=None):
    """``(P^T @ x, (P * (a b^T))^T q - l colsum(P * (a b^T)))``; None where not asked; ``a2 b2^T`` added as in
    :func:`landmark_rows_ref`."""
    p = _p_ref(q, l)
    out = p.transpose(-1, -2) @ x.to(q.dtype) if x is not None else None
    dl = None
    if a is not None:
        ds = p * _ab(q, a, b, a2, b2)
        dl = ds.transpose(-1, -2) @ q - l * ds.sum(-2)[..., None]
    return out, dl


# ---------------------------------------------------------------------------------------------------- kernels

if triton is not None:
    @triton.jit
    def _nr_done(r1, r2, tol, stall):
        """Newton can stop: the residual ``r1 = ||I - V_k A_r||_F^2`` of the last step is below ``tol`` (V_{k+1}'s
        is below r1^2 <= tol), or (``stall``) r1 is small yet fell less than 4x since ``r2``: the products'
        rounding floor, where more steps change nothing."""
        return (r1 <= tol) | (stall & (r1 <= 1e-3) & (r1 >= 0.25 * r2))

    @triton.jit
    def _nr_fused_kernel(a_ptr, v_ptr, steps_ptr, m, reg, scale, tol, fast_iters, exact_iters, stall_fast,
                         stall_exact, IDENTITY: tl.constexpr, PREC: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, BLOCK)
        inside = (r[:, None] < m) & (r[None, :] < m)
        offs = pid * m * m + r[:, None] * m + r[None, :]
        a = tl.load(a_ptr + offs, mask=inside, other=0.0)
        s = tl.max(tl.sum(a, 1), 0)
        eye = tl.where((r[:, None] == r[None, :]) & inside, 1.0, 0.0).to(a.dtype)
        ar = a + reg * eye
        if IDENTITY:
            v = eye / (s + reg)
        else:
            v = ar * (scale / (s * s))
        # steps until the residual says converged (no host sync: the loop condition lives on chip)
        k = tl.full((), 0, tl.int32)
        r1 = s * 0.0 + float("inf")
        r2 = r1
        done = r1 < 0.0
        while (k < fast_iters + exact_iters) & (done == 0):
            if k < fast_iters:
                t = tl.dot(v, ar, input_precision=PREC)
                v = 2.0 * v - tl.dot(t, v, input_precision=PREC)
            else:
                t = tl.dot(v, ar, input_precision="ieee")
                v = 2.0 * v - tl.dot(t, v, input_precision="ieee")
            res = tl.where(inside, eye - t, 0.0)
            r2 = r1
            r1 = tl.sum(tl.sum(res * res, 1), 0)
            k += 1
            # a stall compares two float32 steps' residuals, never a TF32 one with the first float32 one
            done = _nr_done(r1, r2, tol, (k > fast_iters + 1) & (stall_exact != 0) | (stall_fast != 0))
        tl.store(v_ptr + offs, v, mask=inside)
        tl.store(steps_ptr + pid, k)

    @triton.jit(do_not_specialize=["step"])  # one compiled variant for every Newton step, not one per 1 / 16k
    def _bmm_kernel(x_ptr, y_ptr, z_ptr, o_ptr, res_ptr, n, alpha, beta, step, res_stride, tol, stall,
                    sxb, sxr, sxc, syb, syr, syc, szb, szr, szc,
                    HAS_Z: tl.constexpr, RESID: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """o = alpha * x @ y + beta * z for square n x n matrices (any strides; o contiguous).

        Newton steps: ``RESID`` adds ``||I - o||_F^2`` of this tile to ``res[b, step]`` (atomics, zero-initialised);
        ``GATE`` reads ``res[b, step-1]``, ``res[b, step-2]`` and, where :func:`_nr_done` says the iteration has
        converged, skips the product (o = z copied when HAS_Z: the iterate passes through unchanged)."""
        b = tl.program_id(0).to(tl.int64)
        rm = tl.program_id(1) * BM + tl.arange(0, BM)
        rn = tl.program_id(2) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        inside = (rm[:, None] < n) & (rn[None, :] < n)
        done = step < 0
        if GATE:  # step 0 never skips (a runtime test: the same variant serves every step)
            r1 = tl.load(res_ptr + b * res_stride + tl.maximum(step - 1, 0))
            r2 = tl.load(res_ptr + b * res_stride + tl.maximum(step - 2, 0))
            r2 = tl.where(step >= 2, r2, float("inf"))
            done = (step > 0) & _nr_done(r1, r2, tol, stall != 0)
        if done:
            if HAS_Z:
                zt = tl.load(z_ptr + b * szb + rm[:, None] * szr + rn[None, :] * szc, mask=inside, other=0.0)
                tl.store(o_ptr + b * n * n + rm[:, None] * n + rn[None, :], zt, mask=inside)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, n, BK):
                kk = k0 + rk
                xt = tl.load(x_ptr + b * sxb + rm[:, None] * sxr + kk[None, :] * sxc,
                             mask=(rm[:, None] < n) & (kk[None, :] < n), other=0.0).to(tl.float32)
                yt = tl.load(y_ptr + b * syb + kk[:, None] * syr + rn[None, :] * syc,
                             mask=(kk[:, None] < n) & (rn[None, :] < n), other=0.0).to(tl.float32)
                acc += tl.dot(xt, yt, input_precision=PREC)
            acc = alpha * acc
            if HAS_Z:
                acc += beta * tl.load(z_ptr + b * szb + rm[:, None] * szr + rn[None, :] * szc, mask=inside,
                                      other=0.0)
            tl.store(o_ptr + b * n * n + rm[:, None] * n + rn[None, :], acc, mask=inside)
            if RESID:
                e = tl.where(inside, tl.where(rm[:, None] == rn[None, :], 1.0, 0.0) - acc, 0.0)
                tl.atomic_add(res_ptr + b * res_stride + step, tl.sum(tl.sum(e * e, 1), 0))

    @triton.jit
    def _q_tile(q_ptr, qn_ptr, c_ptr, bh, rn, rd, N, D, sqb, sqn, CENTRE: tl.constexpr):
        """A tile of queries in float32 and its ``-|q|^2/2``: centred on chip (``q - c``, from q in its own dtype
        and strides: no float32 copy in memory) with CENTRE, else read centred with its norms."""
        inside = (rn[:, None] < N) & (rd[None, :] < D)
        q = tl.load(q_ptr + bh * sqb + rn[:, None] * sqn + rd[None, :], mask=inside, other=0.0).to(tl.float32)
        if CENTRE:
            c = tl.load(c_ptr + bh * D + rd, mask=rd < D, other=0.0)
            q = tl.where(inside, q - c[None, :], 0.0)
            qn = -0.5 * tl.sum(q * q, 1)
        else:
            qn = tl.load(qn_ptr + bh * N + rn, mask=rn < N, other=0.0)
        return q, qn

    @triton.jit
    def _rows_kernel(q_ptr, l_ptr, qn_ptr, ln_ptr, c_ptr, y_ptr, a_ptr, b_ptr, a2_ptr, b2_ptr, oy_ptr, dq_ptr, N,
                     M, D, E, F, F2, sqb, sqn, sab, san, sa2b, sa2n, CENTRE: tl.constexpr, HAS_Y: tl.constexpr, HAS_DS: tl.constexpr, HAS_DS2: tl.constexpr, PREC: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                     BF: tl.constexpr, BF2: tl.constexpr):
        """One block of tokens: loop over landmark blocks, P tile on chip; P @ y and/or dq (ds = P * (a b^T), plus
        a2 b2^T with HAS_DS2: two gradients through P in one pass)."""
        bh = tl.program_id(0).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rd, re, rf = tl.arange(0, BD), tl.arange(0, BE), tl.arange(0, BF)
        nin = rn < N
        q, qn = _q_tile(q_ptr, qn_ptr, c_ptr, bh, rn, rd, N, D, sqb, sqn, CENTRE)
        if HAS_Y:
            acc_y = tl.zeros((BLOCK_N, BE), dtype=tl.float32)
        if HAS_DS:
            av = tl.load(a_ptr + bh * sab + rn[:, None] * san + rf[None, :], mask=nin[:, None] & (rf[None, :] < F),
                         other=0.0).to(tl.float32)
            acc_dq = tl.zeros((BLOCK_N, BD), dtype=tl.float32)
            rs = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if HAS_DS2:
            rf2 = tl.arange(0, BF2)
            av2 = tl.load(a2_ptr + bh * sa2b + rn[:, None] * sa2n + rf2[None, :],
                          mask=nin[:, None] & (rf2[None, :] < F2), other=0.0).to(tl.float32)
        for m0 in range(0, M, BLOCK_M):
            rm = m0 + tl.arange(0, BLOCK_M)
            min_ = rm < M
            lt = tl.load(l_ptr + bh * M * D + rm[:, None] * D + rd[None, :], mask=min_[:, None] & (rd[None, :] < D),
                         other=0.0)
            ln = tl.load(ln_ptr + bh * M + rm, mask=min_, other=0.0)
            s = tl.dot(q, tl.trans(lt), input_precision=PREC) + qn[:, None] + ln[None, :]
            p = tl.where(min_[None, :], tl.exp(s), 0.0)
            if HAS_Y:
                yt = tl.load(y_ptr + bh * M * E + rm[:, None] * E + re[None, :],
                             mask=min_[:, None] & (re[None, :] < E), other=0.0).to(tl.float32)
                acc_y += tl.dot(p, yt, input_precision=PREC)
            if HAS_DS:
                bt = tl.load(b_ptr + bh * M * F + rm[:, None] * F + rf[None, :],
                             mask=min_[:, None] & (rf[None, :] < F), other=0.0).to(tl.float32)
                ab = tl.dot(av, tl.trans(bt), input_precision=PREC)
                if HAS_DS2:
                    bt2 = tl.load(b2_ptr + bh * M * F2 + rm[:, None] * F2 + rf2[None, :],
                                  mask=min_[:, None] & (rf2[None, :] < F2), other=0.0).to(tl.float32)
                    ab += tl.dot(av2, tl.trans(bt2), input_precision=PREC)
                ds = p * ab
                acc_dq += tl.dot(ds, lt, input_precision=PREC)
                rs += tl.sum(ds, 1)
        if HAS_Y:
            tl.store(oy_ptr + bh * N * E + rn[:, None] * E + re[None, :], acc_y,
                     mask=nin[:, None] & (re[None, :] < E))
        if HAS_DS:
            tl.store(dq_ptr + bh * N * D + rn[:, None] * D + rd[None, :], acc_dq - q * rs[:, None],
                     mask=nin[:, None] & (rd[None, :] < D))

    @triton.jit
    def _cols_kernel(q_ptr, l_ptr, qn_ptr, ln_ptr, c_ptr, x_ptr, a_ptr, b_ptr, a2_ptr, b2_ptr, ox_ptr, dl_ptr, N,
                     M, D, E, F, F2, sqb, sqn, sxb, sxn, sab, san, sa2b, sa2n, BH, chunk, CENTRE: tl.constexpr,
                     HAS_X: tl.constexpr, HAS_DS: tl.constexpr, HAS_DS2: tl.constexpr,
                     PREC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BD: tl.constexpr,
                     BE: tl.constexpr, BF: tl.constexpr, BF2: tl.constexpr):
        """One block of landmarks and one chunk of tokens: P^T @ x and/or dl, partial sums per chunk."""
        bh = tl.program_id(0).to(tl.int64)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        split = tl.program_id(2)
        rd, re, rf = tl.arange(0, BD), tl.arange(0, BE), tl.arange(0, BF)
        min_ = rm < M
        lt = tl.load(l_ptr + bh * M * D + rm[:, None] * D + rd[None, :], mask=min_[:, None] & (rd[None, :] < D),
                     other=0.0)
        ln = tl.load(ln_ptr + bh * M + rm, mask=min_, other=0.0)
        if HAS_X:
            acc_x = tl.zeros((BLOCK_M, BE), dtype=tl.float32)
        if HAS_DS:
            bt = tl.load(b_ptr + bh * M * F + rm[:, None] * F + rf[None, :], mask=min_[:, None] & (rf[None, :] < F),
                         other=0.0).to(tl.float32)
            acc_dl = tl.zeros((BLOCK_M, BD), dtype=tl.float32)
            cs = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if HAS_DS2:
            rf2 = tl.arange(0, BF2)
            bt2 = tl.load(b2_ptr + bh * M * F2 + rm[:, None] * F2 + rf2[None, :],
                          mask=min_[:, None] & (rf2[None, :] < F2), other=0.0).to(tl.float32)
        start = split * chunk
        for n0 in range(start, start + chunk, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            nin = rn < N
            q, qn = _q_tile(q_ptr, qn_ptr, c_ptr, bh, rn, rd, N, D, sqb, sqn, CENTRE)
            s = tl.dot(q, tl.trans(lt), input_precision=PREC) + qn[:, None] + ln[None, :]
            p = tl.where(nin[:, None], tl.exp(s), 0.0)  # [BLOCK_N, BLOCK_M]
            if HAS_X:
                xt = tl.load(x_ptr + bh * sxb + rn[:, None] * sxn + re[None, :],
                             mask=nin[:, None] & (re[None, :] < E), other=0.0).to(tl.float32)
                acc_x += tl.dot(tl.trans(p), xt, input_precision=PREC)
            if HAS_DS:
                av = tl.load(a_ptr + bh * sab + rn[:, None] * san + rf[None, :],
                             mask=nin[:, None] & (rf[None, :] < F), other=0.0).to(tl.float32)
                ab = tl.dot(av, tl.trans(bt), input_precision=PREC)
                if HAS_DS2:
                    av2 = tl.load(a2_ptr + bh * sa2b + rn[:, None] * sa2n + rf2[None, :],
                                  mask=nin[:, None] & (rf2[None, :] < F2), other=0.0).to(tl.float32)
                    ab += tl.dot(av2, tl.trans(bt2), input_precision=PREC)
                ds = p * ab
                acc_dl += tl.dot(tl.trans(ds), q, input_precision=PREC)
                cs += tl.sum(ds, 0)
        part = split.to(tl.int64) * BH + bh
        if HAS_X:
            tl.store(ox_ptr + part * M * E + rm[:, None] * E + re[None, :], acc_x,
                     mask=min_[:, None] & (re[None, :] < E))
        if HAS_DS:
            tl.store(dl_ptr + part * M * D + rm[:, None] * D + rd[None, :], acc_dl - lt * cs[:, None],
                     mask=min_[:, None] & (rd[None, :] < D))


def _p2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


def _check_prec(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


# ------------------------------------------------------------------------------------------------ launchers

def _bmm(x, y, z=None, alpha=1.0, beta=0.0, precision="tf32", res=None, step=0, resid=False, gate=False,
         tol=0.0, stall=False):
    bh, n = x.shape[0], x.shape[-1]
    out = torch.empty(bh, n, n, device=x.device, dtype=torch.float32)
    blk = 64 if n > 32 else max(16, triton.next_power_of_2(n))
    zz = z if z is not None else x
    rr = res if res is not None else out
    _bmm_kernel[(bh, triton.cdiv(n, blk), triton.cdiv(n, blk))](
        x, y, zz, out, rr, n, alpha, beta, step, rr.shape[-1] if res is not None else 0, tol, int(stall),
        *x.stride(), *y.stride(), *zz.stride(), HAS_Z=z is not None, RESID=resid, GATE=gate,
        PREC=precision, BM=blk, BN=blk, BK=min(blk, 32))
    return out


NR_TOL = 1e-8  # stop once ||I - V_k A_r||_F^2 <= NR_TOL: V_{k+1}'s residual is then below 1e-8 (float32: converged)


HOST_EXIT_AFTER = frozenset({1, 2, 3, 5, 7, 10, 13, 16})  # eager tiled Newton: steps (0-based) after which it looks


def _host_exit_allowed(a: torch.Tensor) -> bool:
    """A host look at the residuals may synchronise: not while a CUDA graph captures, not under
    ``torch.cuda.set_sync_debug_mode`` (a user asking to find syncs gets none from here)."""
    if not a.is_cuda:
        return True
    return not torch.cuda.is_current_stream_capturing() and torch.cuda.get_sync_debug_mode() == 0


def _all_done(res: torch.Tensor, k: int, tol: float, stall: bool) -> bool:
    """Whether step ``k + 1``'s gate (:func:`_nr_done` in :func:`_bmm_kernel`) skips every matrix: then every later
    step is skipped too (a skipped step leaves its residual 0 <= tol), so no more launches are needed."""
    r1 = res[:, k]
    done = r1 <= tol
    if stall:
        done |= (r1 <= 1e-3) & (r1 >= 0.25 * res[:, k - 1])
    return bool(done.all())


def _newton_inverse_impl(a: torch.Tensor, iters: int, reg: float, scale: float, start: str, precision: str,
                         refine: int, tol: float = NR_TOL, host_exit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``iters - refine`` steps with ``precision`` products, then ``refine`` float32 steps (each squares the
    residual the faster steps leave, down to float32's floor); steps after convergence (:func:`_nr_done`) are
    skipped on the device. Returns (V, steps taken [BH] int32).

    ``host_exit`` (eager calls only, never inside a compiled graph or a CUDA-graph capture): the tiled path reads
    the residuals back after the steps in ``HOST_EXIT_AFTER`` (one host synchronisation each) and stops launching
    once the device would skip every remaining step, the same result without ~2 launches a skipped step (36 of
    the 40 at SOFT's random-init spectrum, which converges in 2). Eager SOFT is host-bound below ~32k tokens, so
    the sync costs less than the launches it saves."""
    a = a.contiguous()
    bh, m = a.shape[0], a.shape[-1]
    exact = iters if precision == "ieee" else min(refine, iters)
    fast = iters - exact
    # plain TF32 stalls far above float32 (the fp32 steps remove that floor); tol = 0: no early exit at all
    fast_stall, exact_stall = tol > 0 and precision != "tf32", tol > 0
    if m <= FUSED_MAX_M:
        v = torch.empty_like(a)
        steps = torch.empty(bh, device=a.device, dtype=torch.int32)
        _nr_fused_kernel[(bh,)](a, v, steps, m, float(reg), float(scale), float(tol), fast, exact,
                                int(fast_stall), int(exact_stall), IDENTITY=start == "identity", PREC=precision,
                                BLOCK=_p2(m), num_warps=4)
        return v, steps
    eye = torch.eye(m, device=a.device, dtype=a.dtype)
    s = a.sum(-1).amax(-1)[:, None, None]
    a_r = a + reg * eye
    v = eye / (s + reg) if start == "identity" else (scale / (s * s)) * a_r
    res = torch.zeros(bh, max(iters, 1), device=a.device, dtype=torch.float32)
    look = host_exit and tol > 0 and _host_exit_allowed(a)
    for k in range(iters):
        prec = precision if k < fast else "ieee"
        stall = fast_stall or (exact_stall and k >= fast + 2)  # as in the fused kernel
        t = _bmm(v, a_r, precision=prec, res=res, step=k, resid=True, gate=True, tol=tol, stall=stall)
        v = _bmm(t, v, v, -1.0, 2.0, precision=prec, res=res, step=k, gate=True, tol=tol, stall=stall)
        if look and k in HOST_EXIT_AFTER and k + 1 < iters and _all_done(
                res, k, tol, fast_stall or (exact_stall and k + 1 >= fast + 2)):
            break
    # a step ran iff its residual was written (skipped steps leave 0; a converged residual is never exactly 0
    # before the step that finds it below tol, after which the rest are skipped)
    steps = torch.zeros(bh, device=a.device, dtype=torch.int32) if iters == 0 else _steps_taken(res, tol)
    return v.contiguous(), steps


def _vgv_impl(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """-V^T G V^T (the paper's backward) on 3xTF32 tensor cores (2 products: accuracy is cheap here)."""
    vt = v.transpose(-1, -2)
    return _bmm(_bmm(vt, g.contiguous(), precision="tf32x3"), vt, alpha=-1.0, precision="tf32x3")


def _steps_taken(res: torch.Tensor, tol: float) -> torch.Tensor:
    """Steps run, from the per-step residuals (0 where skipped)."""
    return (res != 0).sum(-1).to(torch.int32).clamp_min(1)


if triton is not None:
    @torch.library.custom_op("hpdl::soft_newton_inverse", mutates_args=())
    def _newton_inverse_op(a: torch.Tensor, iters: int, reg: float, scale: float, start: str, precision: str,
                           refine: int, tol: float) -> tuple[torch.Tensor, torch.Tensor]:
        return _newton_inverse_impl(a, iters, reg, scale, start, precision, refine, tol)

    @_newton_inverse_op.register_fake
    def _(a, iters, reg, scale, start, precision, refine, tol):
        return (torch.empty_like(a, memory_format=torch.contiguous_format),
                a.new_empty(a.shape[0], dtype=torch.int32))

    @torch.library.custom_op("hpdl::soft_vgv", mutates_args=())
    def _vgv_op(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return _vgv_impl(v, g)

    @_vgv_op.register_fake
    def _(v, g):
        return torch.empty_like(v, memory_format=torch.contiguous_format)


def newton_inverse(a: torch.Tensor, iters: int = 20, reg: float = 0.01, scale: float = 1.8,
                   start: str = "identity", precision: str | None = None, refine: int = 2, tol: float = NR_TOL,
                   return_steps: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Truncated Newton-Raphson inverse of ``a + reg*I`` for a batch ``[BH, m, m]`` float32 (no autograd).

    At most ``iters`` steps; each matrix stops early, on the device (no host synchronisation: the skipped steps
    are launched and exit at once, so CUDA graphs capture a fixed launch sequence), once the residual
    ``r_k = ||I - V_k A_r||_F^2`` of a step (a by-product of its first product) is ``<= tol`` (then
    ``||I - V_{k+1} A_r||_2 <= r_k``: a Newton step squares the residual) or has stalled at the products'
    rounding floor (``r_k <= 1e-3`` but not 4x below ``r_{k-1}``; never in the plain-TF32 steps, whose floor the
    float32 steps remove). Until convergence the steps are those of the full iteration, so the result agrees
    with it to float32 rounding; ``tol=0`` turns the early exit off (every step runs unless a residual is
    exactly 0, after which steps change nothing). Quadratic convergence: from the
    identity start about ``log2(cond * ln(1/tol))`` steps (cond ~1: 1-2 steps; cond 2e4: ~19).
    ``return_steps``: also return the steps each matrix ran (``[BH]`` int32, a diagnostic).

    ``start``: ``"identity"`` (V0 = I/(s+reg); needs reg > 0) or ``"official"`` (V0 = scale/s^2 (A + reg*I)).
    ``precision`` of the products of the first ``iters - refine`` steps; the last ``refine`` steps run in
    float32. None: ``"ieee"`` (float32 throughout) where ``m <= FUSED_MAX_M`` (one program per matrix, all steps
    on chip), ``"tf32x3"`` above (tiled tensor-core products, about float32's accuracy). ``"tf32"`` is ~3x
    faster but its rounding (u ~ 5e-4) stalls the iteration unless cond(A + reg I) is below ~1e2; SOFT's own
    landmark kernels reach 2e4 at 512 px. Raises ValueError on a bad shape, dtype, start or precision.
    """
    if a.dim() != 3 or a.shape[-1] != a.shape[-2] or a.dtype != torch.float32:
        raise ValueError(f"a must be float32 [BH, m, m], got {a.dtype} {tuple(a.shape)}")
    if start not in ("identity", "official"):
        raise ValueError(f"start must be 'identity' or 'official', got {start!r}")
    if precision is None:
        precision = "ieee" if a.shape[-1] <= FUSED_MAX_M else "tf32x3"
    _check_prec(precision)
    if refine < 0:
        raise ValueError(f"refine must be >= 0, got {refine}")
    if not tol >= 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    if _direct(a):
        v, steps = _newton_inverse_impl(a, int(iters), float(reg), float(scale), start, precision, int(refine),
                                        float(tol), host_exit=True)
    else:
        v, steps = _newton_inverse_op(a, int(iters), float(reg), float(scale), start, precision, int(refine),
                                      float(tol))
    return (v, steps) if return_steps else v


def neg_vgv(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``-V^T G V^T`` for ``[BH, m, m]`` float32 with 3xTF32 tensor cores (the paper's inverse backward)."""
    return _vgv_impl(v, g) if _direct(v) else _vgv_op(v, g)


def _contig(*ts):
    """Contiguous copies where needed (a compiled graph may hand a custom op other strides than eager)."""
    return tuple(t.contiguous() if t is not None else None for t in ts)


def _warps(d: int, grads: bool) -> int:
    """8 warps where a program holds several 64 x 64 float32 tiles (wide heads, gradient passes): fewer
    registers per thread, no spills. Those passes also pipeline 2 stages, not 3: three float32 64 x 64 tiles
    loaded per step would need ~150 KB of shared memory at 3 stages."""
    return 8 if d > 32 or grads else 4


def _tokens_side(t, dummy):
    """A ``[BH, N, F]`` operand read with its own batch and token strides (a transposed head view of a
    ``[B, N, H*F]`` projection needs no copy); a copy only where the last dimension is strided."""
    if t is None:
        return dummy, 0, 0
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0), t.stride(1)


def _rows_impl(q, l, qn, ln, y, a, b, precision, out_dtype="float32", a2=None, b2=None, dq_dtype="float32",
               c=None):
    l, ln, y, b, b2, c = _contig(l, ln, y, b, b2, c)
    q, sqb, sqn = _tokens_side(q, None)
    qn = qn.contiguous() if qn is not None else ln   # c given: norms formed on chip, qn unused
    bh, n, d = q.shape
    m = l.shape[1]
    e = y.shape[-1] if y is not None else 1
    f = a.shape[-1] if a is not None else 1
    f2 = a2.shape[-1] if a2 is not None else 1
    ds2 = a is not None and a2 is not None
    oy = (torch.empty(bh, n, e, device=q.device, dtype=getattr(torch, out_dtype)) if y is not None
          else q.new_empty(0))   # P @ y stored in out_dtype (the store rounds the float32 accumulator)
    # dq stored in dq_dtype (the store rounds the float32 accumulator): bf16 where the gradient goes to a bf16 q
    dq = (torch.empty(bh, n, d, device=q.device, dtype=getattr(torch, dq_dtype)) if a is not None
          else q.new_empty(0))
    block_n = 64
    block_m = 64 if m > 32 else 32
    has_ds = a is not None
    a, sab, san = _tokens_side(a, q)
    a2, sa2b, sa2n = _tokens_side(a2 if ds2 else None, q)
    _rows_kernel[(bh, triton.cdiv(n, block_n))](
        q, l, qn, ln, c if c is not None else ln, y if y is not None else q, a, b if b is not None else q,
        a2, b2 if ds2 else q, oy, dq, n, m, d, e, f, f2, sqb, sqn, sab, san, sa2b, sa2n, CENTRE=c is not None, HAS_Y=y is not None, HAS_DS=has_ds,
        HAS_DS2=ds2, PREC=precision, BLOCK_N=block_n,
        BLOCK_M=block_m, BD=_p2(d), BE=_p2(e), BF=_p2(f), BF2=_p2(f2), num_warps=_warps(d, has_ds),
        num_stages=2 if has_ds or d > 32 else 3)
    return oy, dq


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _splits(bh: int, mblocks: int, n: int, block_n: int, device: torch.device) -> int:
    """Token chunks per landmark block: about 4 programs per SM (waves balance), at least 4 token blocks each."""
    sms = _sm_count(device)
    want = max(1, (4 * sms) // max(1, bh * mblocks))
    return max(1, min(want, triton.cdiv(n, 4 * block_n)))


def _cols_impl(q, l, qn, ln, x, a, b, precision, a2=None, b2=None, c=None):
    l, ln, b, b2, c = _contig(l, ln, b, b2, c)
    q, sqb, sqn = _tokens_side(q, None)
    qn = qn.contiguous() if qn is not None else ln   # c given: norms formed on chip, qn unused
    bh, n, d = q.shape
    m = l.shape[1]
    e = x.shape[-1] if x is not None else 1
    f = a.shape[-1] if a is not None else 1
    f2 = a2.shape[-1] if a2 is not None else 1
    ds2 = a is not None and a2 is not None
    block_n, block_m = 64, 64 if m > 32 else 32
    mblocks = triton.cdiv(m, block_m)
    splits = _splits(bh, mblocks, n, block_n, q.device)
    chunk = triton.cdiv(triton.cdiv(n, splits), block_n) * block_n
    splits = triton.cdiv(n, chunk)
    ox = torch.empty(splits, bh, m, e, device=q.device, dtype=torch.float32) if x is not None else q.new_empty(0)
    dl = torch.empty(splits, bh, m, d, device=q.device, dtype=torch.float32) if a is not None else q.new_empty(0)
    has_ds = a is not None
    xs, sxb, sxn = _tokens_side(x, q)
    a, sab, san = _tokens_side(a, q)
    a2, sa2b, sa2n = _tokens_side(a2 if ds2 else None, q)
    _cols_kernel[(bh, mblocks, splits)](
        q, l, qn, ln, c if c is not None else ln, xs, a, b if b is not None else q,
        a2, b2 if ds2 else q, ox, dl, n, m, d, e, f, f2, sqb, sqn, sxb, sxn, sab, san, sa2b, sa2n, bh, chunk, CENTRE=c is not None,
        HAS_X=x is not None,
        HAS_DS=has_ds, HAS_DS2=ds2, PREC=precision, BLOCK_N=block_n,
        BLOCK_M=block_m, BD=_p2(d), BE=_p2(e), BF=_p2(f), BF2=_p2(f2), num_warps=_warps(d, has_ds),
        num_stages=2 if has_ds or d > 32 else 3)
    return (ox.sum(0) if x is not None else ox), (dl.sum(0) if has_ds else dl)


if triton is not None:
    @torch.library.custom_op("hpdl::soft_landmark_rows", mutates_args=())
    def _rows_op(q: torch.Tensor, l: torch.Tensor, qn: torch.Tensor | None, ln: torch.Tensor, y: torch.Tensor | None,
                 a: torch.Tensor | None, b: torch.Tensor | None, precision: str, out_dtype: str = "float32",
                 a2: torch.Tensor | None = None, b2: torch.Tensor | None = None, dq_dtype: str = "float32",
                 c: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return _rows_impl(q, l, qn, ln, y, a, b, precision, out_dtype, a2, b2, dq_dtype, c)

    @_rows_op.register_fake
    def _(q, l, qn, ln, y, a, b, precision, out_dtype="float32", a2=None, b2=None, dq_dtype="float32", c=None):
        bh, n, d = q.shape
        oy = q.new_empty(bh, n, y.shape[-1], dtype=getattr(torch, out_dtype)) if y is not None else q.new_empty(0)
        return oy, (q.new_empty(bh, n, d, dtype=getattr(torch, dq_dtype)) if a is not None else q.new_empty(0))

    @torch.library.custom_op("hpdl::soft_landmark_cols", mutates_args=())
    def _cols_op(q: torch.Tensor, l: torch.Tensor, qn: torch.Tensor | None, ln: torch.Tensor, x: torch.Tensor | None,
                 a: torch.Tensor | None, b: torch.Tensor | None, precision: str, a2: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None, c: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return _cols_impl(q, l, qn, ln, x, a, b, precision, a2, b2, c)

    @_cols_op.register_fake
    def _(q, l, qn, ln, x, a, b, precision, a2=None, b2=None, c=None):
        bh, m, d = l.shape
        ox = q.new_empty(bh, m, x.shape[-1]) if x is not None else q.new_empty(0)
        return ox, (q.new_empty(bh, m, d) if a is not None else q.new_empty(0))


def _rows(q, l, qn, ln, y, a, b, precision, out_dtype="float32", a2=None, b2=None, dq_dtype="float32", c=None):
    """:func:`_rows_impl` directly in eager mode (:func:`_direct`), else through its custom op."""
    if _direct(q):
        return _rows_impl(q, l, qn, ln, y, a, b, precision, out_dtype, a2, b2, dq_dtype, c)
    return _rows_op(q, l, qn, ln, y, a, b, precision, out_dtype, a2, b2, dq_dtype, c)


def _cols(q, l, qn, ln, x, a, b, precision, a2=None, b2=None, c=None):
    """:func:`_cols_impl` directly in eager mode (:func:`_direct`), else through its custom op."""
    if _direct(q):
        return _cols_impl(q, l, qn, ln, x, a, b, precision, a2, b2, c)
    return _cols_op(q, l, qn, ln, x, a, b, precision, a2, b2, c)


def centre(q: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q - c, l - c)`` in float32 (float64 stays), contiguous, c the landmarks' mean (detached: distances,
    hence P, do not depend on it). Differentiable; the products below take centred inputs."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    c = l.detach().to(dtype).mean(-2, keepdim=True)
    # contiguous in q's own dtype first, then one promoting subtraction: the float32 copy is written once
    # (q.to(float32) - c of a transposed bf16 q would write a strided float32 copy, then a contiguous one)
    return torch.sub(q.contiguous(), c).contiguous(), torch.sub(l.contiguous(), c).contiguous()


def _norms(q: torch.Tensor, l: torch.Tensor):
    return -0.5 * q.pow(2).sum(-1), -0.5 * l.pow(2).sum(-1)


def landmark_rows(q, l, y=None, a=None, b=None, precision: str = "tf32"):
    """Triton :func:`landmark_rows_ref`: ``q [BH, N, D]``, ``l [BH, M, D]`` (centred first here), ``y [BH, M, E]``,
    ``a [BH, N, F]``, ``b [BH, M, F]`` (any float dtype, read as float32) ->
    ``(P @ y [BH, N, E] | None, dq [BH, N, D] | None)`` in float32."""
    _check_prec(precision)
    qc, lc = centre(q, l)
    c = lambda t: t.contiguous() if t is not None else None  # noqa: E731
    oy, dq = _rows(qc, lc, *_norms(qc, lc), c(y), c(a), c(b), precision)
    return (oy if y is not None else None), (dq if a is not None else None)


def landmark_cols(q, l, x=None, a=None, b=None, precision: str = "tf32"):
    """Triton :func:`landmark_cols_ref`: ``x [BH, N, E]``, ``a [BH, N, F]``, ``b [BH, M, F]`` ->
    ``(P^T @ x [BH, M, E] | None, dl [BH, M, D] | None)`` in float32."""
    _check_prec(precision)
    qc, lc = centre(q, l)
    c = lambda t: t.contiguous() if t is not None else None  # noqa: E731
    ox, dl = _cols(qc, lc, *_norms(qc, lc), c(x), c(a), c(b), precision)
    return (ox if x is not None else None), (dl if a is not None else None)


# ------------------------------------------------------------------------------------ differentiable products

def _ops(kernels: bool, precision: str):
    """(rows, cols) on centred inputs with their norms: the Triton custom ops, or the torch references."""
    if kernels:
        return (lambda q, l, qn, ln, y, a, b, out_dtype="float32", a2=None, b2=None, dq_dtype="float32", c=None:
                _rows(q, l, qn, ln, y, a, b, precision, out_dtype, a2, b2, dq_dtype, c),
                lambda q, l, qn, ln, x, a, b, a2=None, b2=None, c=None: _cols(q, l, qn, ln, x, a, b, precision,
                                                                             a2, b2, c))
    # the references take centred q (soft_core centres it for them: c is always None here)
    return (lambda q, l, qn, ln, y, a, b, out_dtype=None, a2=None, b2=None, dq_dtype=None, c=None: landmark_rows_ref(
                q, l, y, a, b, a2, b2),
            lambda q, l, qn, ln, x, a, b, a2=None, b2=None, c=None: landmark_cols_ref(q, l, x, a, b, a2, b2))


class _PT(torch.autograd.Function):
    """Z = P^T x, P = exp(-|q_i - l_j|^2/2) never stored. dL/dP_ij = x_i . dZ_j, so dx = P dZ and
    ds = P * (x dZ^T) gives dq, dl (both recomputed tile by tile). x is saved in its own dtype."""

    @staticmethod
    def forward(ctx, q, l, x, kernels, precision):
        qn, ln = _norms(q, l)
        x = x.contiguous()
        z, _ = _ops(kernels, precision)[1](q, l, qn, ln, x, None, None)
        ctx.save_for_backward(q, l, qn, ln, x)
        ctx.cfg = kernels, precision
        return z

    @staticmethod
    def backward(ctx, dz):
        q, l, qn, ln, x = ctx.saved_tensors
        rows, cols = _ops(*ctx.cfg)
        dz = dz.contiguous()
        dx, dq = rows(q, l, qn, ln, dz, x, dz)
        _, dl = cols(q, l, qn, ln, None, x, dz)
        return dq, dl, dx.to(x.dtype), None, None


class _P(torch.autograd.Function):
    """out = P y. dL/dP_ij = dout_i . y_j, so dy = P^T dout and ds = P * (dout y^T) gives dq, dl."""

    @staticmethod
    def forward(ctx, q, l, y, kernels, precision):
        qn, ln = _norms(q, l)
        y = y.contiguous()
        out, _ = _ops(kernels, precision)[0](q, l, qn, ln, y, None, None)
        ctx.save_for_backward(q, l, qn, ln, y)
        ctx.cfg = kernels, precision
        return out

    @staticmethod
    def backward(ctx, dout):
        q, l, qn, ln, y = ctx.saved_tensors
        rows, cols = _ops(*ctx.cfg)
        dout = dout.contiguous()
        _, dq = rows(q, l, qn, ln, None, dout, y)
        dy, dl = cols(q, l, qn, ln, dout, dout, y)
        return dq, dl, dy.to(y.dtype), None, None


def _check_centred(q, l):
    if q.dim() != 3 or l.dim() != 3 or q.shape[0] != l.shape[0] or q.shape[2] != l.shape[2] \
            or q.dtype != l.dtype or q.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"q and l must be float32/64 [BH, N, D] and [BH, M, D] (see centre()), got "
                         f"{q.dtype} {tuple(q.shape)} and {l.dtype} {tuple(l.shape)}")


def landmark_pt(q, l, x, *, kernels: bool = True, precision: str = "tf32"):
    """Differentiable ``P^T @ x`` (``[BH, M, E]`` float32) for centred ``q [BH, N, D]``, ``l [BH, M, D]``
    (:func:`centre`) and ``x [BH, N, E]`` (any float dtype), P = exp(-|q_i - l_j|^2/2), without an ``[N, M]``
    tensor forward or backward. ``kernels=False`` runs the same autograd function on the torch references
    (float64 gradcheck). Raises ValueError on bad shapes/dtypes or precision."""
    _check_prec(precision)
    _check_centred(q, l)
    return _PT.apply(q, l, x, kernels, precision)


def landmark_p(q, l, y, *, kernels: bool = True, precision: str = "tf32"):
    """Differentiable ``P @ y`` (``[BH, N, E]`` float32) for ``y [BH, M, E]``; see :func:`landmark_pt`."""
    _check_prec(precision)
    _check_centred(q, l)
    return _P.apply(q, l, y, kernels, precision)


class _SoftCore(torch.autograd.Function):
    """``out = P (NR(A + reg I) (P^T v))`` as one autograd node (fewer host-side ops than the chain of
    :func:`landmark_pt`, the Newton function and :func:`landmark_p`). The backward is the paper's derivative of
    an exact inverse, ``dA = -V^T dV V^T``; with ``W = V Z``, ``dV = dW Z^T``, so ``dA = -(V^T dW)(V Z)^T =
    -dZ W^T``: a rank-``dv`` outer product instead of two ``m x m x m`` products."""

    @staticmethod
    def forward(ctx, q, l, v, iters, reg, start, precision, nr_precision, tol, kernels, centre=None):
        with torch.autocast(q.device.type, enabled=False):   # l l^T in float32 even when called under autocast
            return _SoftCore._forward(ctx, q, l, v, iters, reg, start, precision, nr_precision, tol, kernels,
                                      centre)

    @staticmethod
    def _forward(ctx, q, l, v, iters, reg, start, precision, nr_precision, tol, kernels, centre):
        ctx.q_dtype = q.dtype
        c = None
        if centre is not None and kernels:   # the kernels centre each q tile on chip: no float32 copy of q
            c = centre
            qn, ln = None, -0.5 * l.pow(2).sum(-1)
        else:
            if centre is not None:   # the references: q - c, once, in l's dtype
                q = torch.sub(q, centre, out=torch.empty(q.shape, dtype=l.dtype, device=q.device))
            qn, ln = _norms(q, l)
        rows, cols = _ops(kernels, precision)
        # v and (backward) dout are read by the kernels in their own strides: no contiguous copies held
        z, _ = cols(q, l, qn, ln, v, None, None, c=c)                          # [BH, m, dv] = P^T v
        a = torch.baddbmm(ln[..., :, None] + ln[..., None, :], l, l.transpose(-1, -2)).exp_()  # [BH, m, m], centred l
        if kernels:
            vinv = newton_inverse(a, iters, reg, 1.8, start, nr_precision, tol=tol)
        else:
            vinv = newton_inverse_ref(a, iters, reg, 1.8, start)
        w = torch.bmm(vinv, z)                                                 # [BH, m, dv]
        # P W stored in v's dtype (bf16 under autocast): no float32 [N, dv] copy, forward or (dout) backward
        out, _ = rows(q, l, qn, ln, w, None, None, _dtype_name(v), c=c)        # [BH, N, dv] = P W
        ctx.save_for_backward(q, l, qn, ln, v, a, vinv, w, c)
        ctx.cfg = kernels, precision
        return out

    @staticmethod
    def backward(ctx, dout):
        q, l, qn, ln, v, a, vinv, w, c = ctx.saved_tensors
        rows, cols = _ops(*ctx.cfg)
        # out = P W: dW = P^T dout, dS1 = P * (dout W^T); Z = P^T v: dv = P dZ, dS2 = P * (v dZ^T). dS1 and dS2
        # reach q and l through the same P tiles, so each of dq, dl is one pass over dS1 + dS2 (3 passes, not 4,
        # and one float32 [N, d] gradient held, not two)
        dw, _ = cols(q, l, qn, ln, dout, None, None, c=c)
        dz = torch.bmm(vinv.transpose(-1, -2), dw)          # W = V Z
        # dq stored in q's dtype (bf16 under autocast: half the float32 [N, d] at the backward's peak)
        dv, dq = rows(q, l, qn, ln, dz, dout, w, _dtype_name(v), a2=v, b2=dz, dq_dtype=_dtype_name(ctx.q_dtype),
                      c=c)
        _, dl = cols(q, l, qn, ln, None, dout, w, a2=v, b2=dz, c=c)
        # A = exp(-|l_i - l_j|^2 / 2), dA = -dZ W^T, dS = A * dA: dl += S l - l rowsum(S) with S = dS + dS^T;
        # g = -S formed in place (6 small ops instead of 12: the layer is host-bound at small N)
        g = torch.bmm(dz, w.transpose(-1, -2)).mul_(a)
        g = g + g.transpose(-1, -2)
        dl.baddbmm_(g, l, alpha=-1.0).addcmul_(l, g.sum(-1, keepdim=True))
        return (dq.to(ctx.q_dtype), dl, dv.to(v.dtype)) + (None,) * 8


def _dtype_name(t: torch.Tensor | torch.dtype) -> str:
    dtype = t if isinstance(t, torch.dtype) else t.dtype
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def soft_core(q, l, v, *, iters: int = 20, reg: float = 0.01, start: str = "identity", precision: str = "tf32",
              nr_precision: str | None = None, tol: float = NR_TOL, kernels: bool = True,
              centre: torch.Tensor | None = None):
    """SOFT's landmark attention ``P @ NR(A + reg I) @ (P^T @ v)`` for centred ``q [BH, N, D]``, ``l [BH, M, D]``
    (:func:`centre`, float32; float64 with ``kernels=False``) and ``v [BH, N, E]`` (any float dtype) ->
    ``[BH, N, E]`` (kernels: in v's dtype if bf16/fp16, else float32; the references: q's dtype),
    differentiable in q, l and v with the paper's inverse backward. P and A are never
    stored as ``[N, M]``; the Newton inverse is :func:`newton_inverse` (early exit ``tol``; ``kernels=False``:
    the torch references, all ``iters`` steps).

    ``centre`` (``[BH, 1, D]`` in l's dtype, the centre already subtracted from l, treated as a constant): q is
    then the uncentred queries in any float dtype and layout; ``q - centre`` is formed inside (one float32 copy,
    contiguous) and q's gradient is returned in q's dtype straight from the kernel (bf16 under autocast: no
    float32 ``[N, D]`` gradient held). Raises ValueError on bad shapes, dtypes, start or precision."""
    _check_prec(precision)
    if centre is not None:
        if centre.dtype != l.dtype or centre.shape != (l.shape[0], 1, l.shape[2]) or q.dim() != 3 \
                or not q.is_floating_point() or q.shape[0] != l.shape[0] or q.shape[2] != l.shape[2]:
            raise ValueError(f"with centre, q must be float [BH, N, D] and centre {l.dtype} [BH, 1, D] for l "
                             f"{tuple(l.shape)}, got q {q.dtype} {tuple(q.shape)}, centre {centre.dtype} "
                             f"{tuple(centre.shape)}")
        _check_centred(l.new_empty(q.shape[0], 0, q.shape[2]), l)
        centre = centre.detach()
    else:
        _check_centred(q, l)
    if v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [BH, N, E] with q's BH and N {tuple(q.shape[:2])}, got {tuple(v.shape)}")
    if start not in ("identity", "official"):
        raise ValueError(f"start must be 'identity' or 'official', got {start!r}")
    if nr_precision is not None:
        _check_prec(nr_precision)
    if not tol >= 0:   # the references (kernels=False) ignore it: checked here so both paths agree
        raise ValueError(f"tol must be >= 0, got {tol}")
    return _SoftCore.apply(q, l, v, int(iters), float(reg), start, precision, nr_precision, float(tol), kernels,
                           centre)
