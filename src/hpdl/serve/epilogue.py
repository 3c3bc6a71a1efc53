"""The decode step's elementwise kernels, shared by ``hpdl.serve.fused`` and ``hpdl.serve.stream_gemm``.

``add_rmsnorm`` (the residual add fused with the next RMSNorm, Zhang & Sennrich 2019) and ``silu_mul``
(SwiGLU's ``silu(gate) * up``, Shazeer 2020): the cuBLAS fused decode step runs them as kernels of their own, and
the stream GEMM's cuBLAS candidate runs them around ``F.linear``. Each has a torch reference (``*_ref``) with the
eager model's arithmetic, which runs where Triton does not (CPU tensors without ``TRITON_INTERPRET=1``).

This module imports nothing of hpdl: both users import it at top level (it was a function-local import of
``fused`` inside ``stream_gemm``, while ``fused`` imported ``stream_gemm``: an import circle).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch; CPU-only installs use the torch references
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["add_rmsnorm", "add_rmsnorm_ref", "silu_mul", "silu_mul_ref", "use_triton"]


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors like ``t``: on CUDA, or anywhere under ``TRITON_INTERPRET=1``
    (read at each call, so a test may set it after import)."""
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1")


# --- torch references (the eager model's arithmetic, op for op) -------------------------------------
def add_rmsnorm_ref(x: torch.Tensor, res: torch.Tensor | None, w: torch.Tensor, eps: float):
    """``res = x + res`` (in the model dtype, as the eager residual add); returns ``(res, rmsnorm(res) * w)``.
    ``res`` None: no add, ``res = x``. Shapes ``[n, C]``; the norm is computed in float32 (HF Llama)."""
    r = x if res is None else x + res
    h = r.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return r, w * h.to(r.dtype)


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """gu ``[n, 2I]`` (gate | up) -> ``silu(gate) * up`` ``[n, I]``."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


# --- Triton kernels ----------------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, C, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < C
        x = tl.load(x_ptr + row * C + offs, mask=m, other=0.0)
        if HAS_RES:  # the residual add rounds to the model dtype, as eager does, before the norm reads it
            x = (x.to(tl.float32) + tl.load(res_ptr + row * C + offs, mask=m, other=0.0).to(tl.float32)).to(
                x.dtype)
            tl.store(res_ptr + row * C + offs, x, mask=m)
        h = x.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / C + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0)
        y = w.to(tl.float32) * (h * r).to(x.dtype).to(tl.float32)
        tl.store(y_ptr + row * C + offs, y.to(x.dtype), mask=m)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < I
        g = tl.load(gu_ptr + row * 2 * I + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * I + I + offs, mask=m, other=0.0)
        y = (g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32) * u.to(tl.float32)  # silu rounds, as F.silu
        tl.store(out_ptr + row * I + offs, y.to(u.dtype), mask=m)


def add_rmsnorm(x, res, w, eps, out=None):
    """Triton ``add_rmsnorm_ref``: ``res`` is updated in place (``res += x``); returns ``(res, y)``."""
    if not use_triton(x):
        r, y = add_rmsnorm_ref(x, res, w, eps)
        if res is not None:
            res.copy_(r)
            r = res
        return r, y
    n, C = x.shape
    y = torch.empty_like(x) if out is None else out
    _add_rmsnorm_kernel[(n,)](x, res if res is not None else x, w, y, C, eps, HAS_RES=res is not None,
                              BLOCK=triton.next_power_of_2(C))
    return (res if res is not None else x), y


def silu_mul(gu):
    """Triton ``silu_mul_ref``."""
    if not use_triton(gu):
        return silu_mul_ref(gu)
    n, I2 = gu.shape
    out = torch.empty(n, I2 // 2, dtype=gu.dtype, device=gu.device)
    _silu_mul_kernel[(n, triton.cdiv(I2 // 2, 1024))](gu, out, I2 // 2, BLOCK=1024)
    return out
