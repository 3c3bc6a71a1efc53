"""Weight-streaming GEMM for decode: ``y = x @ w.T`` with ``x [M, K]`` small (M = 1..256 rows), ``w [N, K]`` large.

A decode step's GEMMs are bound by reading ``w`` once from HBM. cuBLAS reaches 57% of the H200's copy bandwidth
on the 1.1B model's decode GEMMs (issue 38): at M = 1 its tiles leave most SMs idle or add a separate split-K
reduction kernel. Here each program streams one ``[BLOCK_N, K / SPLIT_K]`` slab of ``w`` with wide contiguous
loads, and the split count is chosen so the grid covers every SM about twice. The split-K partials are reduced
inside the same kernel, deterministically: every program writes its float32 partial to a workspace, then bumps a
per-tile counter (an acq_rel atomic after a CTA barrier, CUTLASS's semaphore pattern); the program that arrives
last sums the ``SPLIT_K`` partials in split order (so the result does not depend on which program was last),
runs the epilogue, and resets the counter to 0 for the next launch (also inside a CUDA graph: no memset).

Epilogues and prologue fused into the GEMM (each reproduces the eager model's rounding in the model dtype):
  * ``residual``: ``y + residual`` (the residual stream's add after o_proj and down_proj);
  * ``silu_mul``: ``w`` is gate|up ``[2N, K]``; each program reads both halves' rows and writes
    ``silu(gate) * up [M, N]`` (LLaMA's SwiGLU), so the ``[M, 2N]`` intermediate never reaches HBM;
  * ``norm_weight``: RMSNorm of ``x`` (the GEMM's input) as a prologue: each program first reads its rows of
    ``x`` whole (``M x K`` from L2) for the row's scale. Cheap at a few rows, costly at hundreds (every program
    re-reads all its rows), so the caller chooses by row count (``hpdl.serve.fused``).

Configs: ``BLOCK_M = 1`` uses a multiply-and-sum GEMV (no tensor cores, no padding; products accumulate in a
``[BLOCK_N, BLOCK_K]`` float32 tile, summed over K once at the end; most of its configs do not split K, since
N / BLOCK_N alone gives hundreds of programs on every decode shape); larger buckets use
``tl.dot`` (``input_precision="ieee"`` for float32: TF32 would change float32 greedy tokens). Every candidate is
fitted to the device's shared memory before it is ever launched (``fit_shared_memory``: fewer stages, then a
shorter ``BLOCK_K``; float32's 16-row configs asked for 265216 B of the H200's 232448). Candidates per M bucket
are timed once per (bucket, N, K, epilogue, prologue, dtype) on the device by ``time_config``: warm launches only,
in a CUDA graph that cycles through weight copies larger than L2 (as in a decode step, where no weight is cached),
and the fastest is kept (``tuned_configs``). ``triton.autotune`` is not used because the split count and the
workspace depend on the shape and must be known before launch. During CUDA-graph capture an untuned shape uses
its first candidate (no timing is possible there); ``ModelRunner`` runs each shape twice before capturing.

``CUBLAS_CANDIDATE = True`` (the default) adds cuBLAS to every tuned shape's candidates: ``F.linear`` with the
same prologue and epilogue as separate kernels (the cuBLAS fused step's RMSNorm and SiLU-mul kernels, the
residual add), timed the same way, so the tuner picks, shape by shape, whichever it measures faster on the device
(a shape where cuBLAS wins costs the ``gemm="stream"`` step what it costs the cuBLAS fused step). Its kernels
are the cuBLAS fused step's, whose float32 greedy tokens equal the eager step's.

``PDL = True`` launches with Programmatic Dependent Launch (sm_90+): each program asks for the next kernel's launch
at its start (``griddepcontrol.launch_dependents``) and loads its first weight tile, which no earlier kernel
writes, before waiting for the previous kernel (``griddepcontrol.wait``); only then does it read ``x``, the
residual or the split counters. Back-to-back stream GEMMs (o_proj -> gate_up -> down -> next qkv with the norm
prologue) thus overlap one kernel's weight reads with the previous one's tail and launch.

The counter buffer is shared by every launch on a device: launches must not run concurrently on two streams.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpdl.serve.epilogue import add_rmsnorm, silu_mul as _silu_mul, use_triton as _use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
try:  # Programmatic Dependent Launch's device side (Triton >= 3.4; SM90+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the install
    gdc_launch_dependents = gdc_wait = None

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MAX_TILES = 1 << 16
_TUNED: dict[tuple, dict] = {}


def stream_gemm_ref(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
                    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False):
    """The eager model's arithmetic, op for op: ``rmsnorm(x) * norm_weight`` (if given), ``F.linear``,
    ``silu(gate) * up`` (if ``silu_mul``), ``+ residual`` (if given); every op rounds to the model dtype."""
    if norm_weight is not None:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        x = norm_weight * h.to(x.dtype)
    y = F.linear(x, w)
    if silu_mul:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    return y if residual is None else y + residual


if triton is not None:
    @triton.jit
    def _epilogue(acc, acc2, rm, rn, mask, out_ptr, res_ptr, stride_om, stride_rm, EPI: tl.constexpr):
        dt = out_ptr.dtype.element_ty
        if EPI == 2:  # silu(gate) * up, each rounded as F.silu and the product are in eager
            g = acc.to(dt).to(tl.float32)
            u = acc2.to(dt).to(tl.float32)
            y = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
        elif EPI == 1:  # the GEMM's output rounds to the model dtype before the residual add (eager)
            r = tl.load(res_ptr + rm[:, None].to(tl.int64) * stride_rm + rn[None, :], mask=mask, other=0.0)
            y = acc.to(dt).to(tl.float32) + r.to(tl.float32)
        else:
            y = acc
        tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], y.to(dt), mask=mask)

    @triton.jit
    def _wtile(wrow, k0, k_hi, rk, nm, EVEN: tl.constexpr):
        """The ``[BLOCK_N, BLOCK_K]`` weight tile at K offset ``k0`` (masked unless ``EVEN``)."""
        kk = k0 + rk
        if EVEN:
            return tl.load(wrow + kk[None, :])
        return tl.load(wrow + kk[None, :], mask=nm[:, None] & (kk < k_hi)[None, :], other=0.0)

    @triton.jit
    def _mac(acc, acc2, xrow, nw_ptr, rs, wv, wv2, k0, k_hi, rk, mm,
             EPI: tl.constexpr, NORM: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
             EVEN: tl.constexpr):
        """One K step: ``acc += x[:, k0:k0+BK] @ wv.T`` (and ``acc2`` with the up half ``wv2``); the GEMV
        (``not DOT``) keeps ``acc`` as ``[BLOCK_N, BLOCK_K]`` elementwise sums."""
        dt = xrow.dtype.element_ty
        kk = k0 + rk
        km = kk < k_hi
        if EVEN:  # a row mask only: constant along K, so the loads stay vectorised
            xv = tl.load(xrow + kk[None, :], mask=mm[:, None], other=0.0)
        else:
            xv = tl.load(xrow + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        if NORM:  # eager: w * (x * rsqrt(...)).to(dtype), the product rounded to the dtype
            if EVEN:
                nw = tl.load(nw_ptr + kk).to(tl.float32)
            else:
                nw = tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)
            xv = (nw[None, :] * (xv.to(tl.float32) * rs[:, None]).to(dt).to(tl.float32)).to(dt)
        if UPCAST:  # the interpreter's bf16 tl.dot is wrong; bf16 products are exact in float32 anyway
            xv = xv.to(tl.float32)
            wv = wv.to(tl.float32)
            wv2 = wv2.to(tl.float32)
        if DOT:  # PREC is "ieee" for float32 inputs: TF32 would change float32 greedy tokens
            acc += tl.dot(xv, tl.trans(wv), input_precision=PREC)
        else:  # BLOCK_M == 1: a GEMV row, [1, BK] * [BN, BK] accumulated elementwise (summed after the loop)
            acc += xv.to(tl.float32) * wv.to(tl.float32)
        if EPI == 2:
            if DOT:
                acc2 += tl.dot(xv, tl.trans(wv2), input_precision=PREC)
            else:
                acc2 += xv.to(tl.float32) * wv2.to(tl.float32)
        return acc, acc2

    @triton.jit
    def _stream_gemm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, part_ptr, cnt_ptr,
                            M, N, K, stride_xm, stride_wn, stride_om, stride_rm, eps, SPLIT_K,
                            EPI: tl.constexpr, NORM: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                            UPCAST: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            EVEN: tl.constexpr = False, NORM_K: tl.constexpr = 16, PDL: tl.constexpr = False):
        if PDL:  # the next kernel (a PDL launch) may start now: its weight loads overlap this kernel's tail
            gdc_launch_dependents()
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_m = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mm = rm < M
        nm = rn < N
        xrow = x_ptr + rm[:, None].to(tl.int64) * stride_xm
        if EVEN:  # N % BLOCK_N == 0 and K % (SPLIT_K * BLOCK_K) == 0 (the host checks): no weight masks (no
            # predicate math per load; Triton 3.8's sm_90 PTX has 16-byte loads either way for N, K multiples of 16)
            k_per = K // SPLIT_K
        else:
            k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = tl.multiple_of(pid_s * k_per, BLOCK_K)  # the hint keeps each K offset's alignment known
        k_hi = tl.minimum(k_lo + k_per, K)
        n_it = tl.cdiv(k_hi - k_lo, BLOCK_K)
        wrow = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        wrow2 = w_ptr + (rn[:, None] + N).to(tl.int64) * stride_wn  # the up half (EPI == 2)
        # the first weight tile is read before anything a previous kernel writes (x, the residual, the split
        # counters): with PDL it is in flight while the previous kernel finishes
        wv0 = _wtile(wrow, k_lo, k_hi, rk, nm, EVEN)
        wv0b = wv0
        if EPI == 2:
            wv0b = _wtile(wrow2, k_lo, k_hi, rk, nm, EVEN)
        if PDL:  # everything below may read what the previous kernel wrote
            gdc_wait()
        rs = tl.zeros([BLOCK_M], tl.float32)
        if NORM:  # the row's RMS over all of K, in NORM_K-wide loads (all of K at once for one row: one L2 trip)
            ss = tl.zeros([BLOCK_M], tl.float32)
            rq = tl.arange(0, NORM_K)
            for k0 in range(0, K, NORM_K):
                kk = k0 + rq
                xv = tl.load(xrow + kk[None, :], mask=mm[:, None] & (kk[None, :] < K), other=0.0).to(tl.float32)
                ss += tl.sum(xv * xv, axis=1)
            rs = 1.0 / tl.sqrt_rn(ss / K + eps)
        if DOT:  # Triton's pipeliner stages the tiles of the loop through shared memory
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc, acc2 = _mac(acc, acc2, xrow, nw_ptr, rs, wv0, wv0b, k_lo, k_hi, rk, mm,
                             EPI, NORM, DOT, PREC, UPCAST, EVEN)
            for i in range(1, n_it):
                k0 = k_lo + i * BLOCK_K
                wv = _wtile(wrow, k0, k_hi, rk, nm, EVEN)
                wv2 = wv
                if EPI == 2:
                    wv2 = _wtile(wrow2, k0, k_hi, rk, nm, EVEN)
                acc, acc2 = _mac(acc, acc2, xrow, nw_ptr, rs, wv, wv2, k0, k_hi, rk, mm,
                                 EPI, NORM, DOT, PREC, UPCAST, EVEN)
        else:
            # GEMV (one row): products accumulate elementwise in a [BLOCK_N, BLOCK_K] float32 tile and are summed
            # over K once after the loop (not a cross-thread reduction at every K step); the
            # next weight tile is loaded into registers before the current one is used (Triton does not pipeline
            # loads that feed no tl.dot), so two tiles per program are in flight
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            wv, wv2 = wv0, wv0b
            for i in range(1, n_it):
                k0 = k_lo + i * BLOCK_K
                wn = _wtile(wrow, k0, k_hi, rk, nm, EVEN)
                wn2 = wn
                if EPI == 2:
                    wn2 = _wtile(wrow2, k0, k_hi, rk, nm, EVEN)
                acc, acc2 = _mac(acc, acc2, xrow, nw_ptr, rs, wv, wv2, k0 - BLOCK_K, k_hi, rk, mm,
                                 EPI, NORM, DOT, PREC, UPCAST, EVEN)
                wv, wv2 = wn, wn2
            acc, acc2 = _mac(acc, acc2, xrow, nw_ptr, rs, wv, wv2, k_lo + (n_it - 1) * BLOCK_K, k_hi, rk, mm,
                             EPI, NORM, DOT, PREC, UPCAST, EVEN)
            acc = tl.sum(acc, axis=1)[None, :]
            acc2 = tl.sum(acc2, axis=1)[None, :]
        mask = mm[:, None] & nm[None, :]
        if SPLIT_K == 1:
            _epilogue(acc, acc2, rm, rn, mask, out_ptr, res_ptr, stride_om, stride_rm, EPI)
        else:
            # partials [SPLIT_K, 2, M, N] float32; the last program of this tile reduces them in split order
            offs = rm[:, None].to(tl.int64) * N + rn[None, :]
            MN = M * N  # < 2^31: M <= a few hundred rows
            pbase = part_ptr + offs + pid_s * 2 * MN
            tl.store(pbase, acc, mask=mask)
            if EPI == 2:
                tl.store(pbase + MN, acc2, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the release below
            tile = pid_m * tl.num_programs(0) + pid_n
            done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if done == SPLIT_K - 1:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in range(0, SPLIT_K):
                    pbase = part_ptr + offs + s * 2 * MN  # offs is int64; s * 2 * MN < 2^31
                    acc += tl.load(pbase, mask=mask, other=0.0, cache_modifier=".cg")
                    if EPI == 2:
                        acc2 += tl.load(pbase + MN, mask=mask, other=0.0, cache_modifier=".cg")
                _epilogue(acc, acc2, rm, rn, mask, out_ptr, res_ptr, stride_om, stride_rm, EPI)
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch (and the next graph replay)


def m_bucket(m: int) -> int:
    """Rows -> the bucket that configs are tuned for: 1, 16, 32, 64, 128 or 256 (every M > 128)."""
    if m == 1:
        return 1
    for b in (16, 32, 64, 128):
        if m <= b:
            return b
    return 256


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, programs per SM for the split count; 0: no split) per M
# bucket; a small set, so tuning on the device (compile + time each) stays within seconds per shape. What the
# first version lacked (H200, 2026-12-04: slower than cuBLAS at every shape): its GEMV reduced its [BLOCK_N,
# BLOCK_K] products across threads at every K step; its M = 1 configs split K (partials, a counter atomic and a
# reduction) wherever N / BLOCK_N gave fewer than 2-8 programs per SM, into splits of 1-2 steps; and the 17:30
# run timed untuned first candidates (the benchmark's float32 part had switched TUNE off for the parts after
# it). Now the GEMV accumulates a [BLOCK_N, BLOCK_K] tile and sums once, most configs do not split, some read a
# program's whole K range in one or two steps of 1024-2048 columns (few rows per program, many programs: the
# loads are issued at once), the split counts prefer divisors of K / BLOCK_K (no weight masks: ``is_even``), and
# the tuner picks per shape, cuBLAS included (``CUBLAS_CANDIDATE``). The GEMV configs (BLOCK_M = 1) are not
# pipelined by Triton (no tl.dot) but load the next weight tile into registers before using the current one.
_CANDIDATES = {
    1: [(1, 8, 512, 4, 1, 0), (1, 4, 2048, 8, 1, 0), (1, 8, 1024, 8, 1, 0), (1, 16, 256, 4, 1, 0),
        (1, 4, 1024, 4, 1, 0), (1, 8, 256, 4, 1, 4), (1, 16, 256, 4, 1, 2), (1, 4, 512, 4, 1, 2),
        (1, 2, 2048, 4, 1, 0),
        (1, 16, 512, 8, 1, 8)],  # the last: K split until each program reads one 16 KB tile (down_proj's K)
    16: [(16, 32, 256, 4, 3, 2), (16, 16, 256, 4, 3, 0), (16, 32, 128, 4, 4, 0), (16, 64, 128, 4, 4, 2),
         (16, 32, 128, 4, 4, 2)],
    32: [(32, 32, 256, 4, 3, 2), (32, 64, 128, 4, 4, 2), (16, 64, 256, 4, 3, 2), (32, 32, 128, 4, 4, 0)],
    64: [(64, 32, 256, 4, 3, 2), (64, 64, 128, 4, 4, 2), (32, 64, 128, 4, 4, 2), (64, 64, 128, 4, 4, 0)],
    128: [(64, 64, 128, 4, 4, 2), (128, 64, 64, 4, 4, 2), (128, 32, 128, 4, 3, 2), (128, 64, 64, 4, 4, 0)],
    256: [(64, 64, 128, 4, 4, 2), (128, 64, 64, 4, 4, 2), (128, 64, 128, 8, 3, 2), (128, 64, 64, 4, 4, 0)],
}


def split_k(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, sms: int, per_sm: int = 2) -> int:
    """Split count: enough programs for about ``per_sm`` per SM (several resident programs per SM keep loads
    in flight), each split at least one ``block_k`` step long; ``per_sm = 0``: 1 (no split). Where ``block_k``
    divides ``k``, the divisor of ``k / block_k`` nearest the wanted count (by ratio) is taken, so every split
    has the same whole number of steps and the weight loads need no masks (``is_even``)."""
    if per_sm <= 0:
        return 1
    tiles = -(-n // block_n) * -(-m // block_m)
    want = max(1, min(-(-per_sm * sms // tiles), k // block_k))
    if k % block_k == 0 and want > 1:
        steps = k // block_k
        divs = [d for d in range(1, steps + 1) if steps % d == 0]
        want = min(divs, key=lambda d: (max(d / want, want / d), -d))
    return want


SHARED_MEMORY_H200 = 232448  # bytes a block may opt into on an H200 (sm_90), also the CPU default


def shared_memory_bytes(cfg: dict, itemsize: int, epi: int = 0, norm: bool = False) -> int:
    """An upper bound of the shared memory one program of ``cfg`` takes (bytes). The tl.dot path's pipeliner
    keeps up to ``num_stages + 1`` buffers of the x tile and the weight tile(s) (Triton 3.8's sm_90 compiles:
    64 x 32 x 256, 3 stages, SiLU-mul, bf16: 262144 B = 4 x 65536, the config that failed on the H200 at 64
    rows; 64 x 64 x 128, 4 stages: 163840 B = 5 x 32768); the normalised x tile of the prologue needs one more
    (float32 size, as a bound). The GEMV path (``BLOCK_M == 1``) is not pipelined through shared memory, only its
    reductions use some. Checked against ``triton.compile``'s ``shared`` for sm_90 in the tests."""
    if cfg["BLOCK_M"] == 1:
        return 8192 + 32 * cfg["BLOCK_N"] * cfg["num_warps"]  # the final cross-warp sums (8192 B compiled at 8 x 8)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles = (bm * bk + (2 if epi == 2 else 1) * bn * bk) * itemsize
    return (cfg["num_stages"] + 1) * tiles + (bm * bk * 4 + 4096 if norm else 0) + 4096


def shared_memory_limit(device: torch.device) -> int:
    """Bytes of shared memory a program may use on ``device`` (Triton's ``max_shared_mem``; the H200's off CUDA)."""
    if device.type != "cuda" or triton is None:
        return SHARED_MEMORY_H200
    props = triton.runtime.driver.active.utils.get_device_properties(
        device.index if device.index is not None else torch.cuda.current_device())
    return int(props["max_shared_mem"])


def fit_shared_memory(cfg: dict, itemsize: int, epi: int, norm: bool, limit: int) -> dict | None:
    """``cfg`` with fewer stages, then a shorter ``BLOCK_K``, until ``shared_memory_bytes`` fits ``limit``;
    None if nothing does. Float32 needs this on the H200: its 16-row configs asked for 265216 B of 232448."""
    cfg = dict(cfg)
    while shared_memory_bytes(cfg, itemsize, epi, norm) > limit:
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["BLOCK_K"] > 32:
            cfg["BLOCK_K"] //= 2
        else:
            return None
    return cfg


def candidates(m: int, n: int, k: int, sms: int, itemsize: int = 2, epi: int = 0, norm: bool = False,
               smem_limit: int = SHARED_MEMORY_H200) -> list[dict]:
    """Configs tried for an ``[m, k] x [n, k]`` GEMM (``n``: output columns) on a device with ``sms`` SMs, each
    fitted to ``smem_limit`` bytes of shared memory for elements of ``itemsize`` bytes, epilogue ``epi`` (0 none,
    1 residual, 2 SiLU-mul) and the norm prologue (``norm``); duplicates dropped, order kept."""
    out = []
    mb = m_bucket(m)
    for bm, bn, bk, warps, stages, per_sm in _CANDIDATES[mb]:
        bk = min(bk, max(16, triton.next_power_of_2(k)) if triton is not None else bk)
        while bk > 16 and k % 16 == 0 and k % bk:  # a divisor of K where one exists: no masks (``is_even``)
            bk //= 2
        cfg = fit_shared_memory(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages),
                                itemsize, epi, norm, smem_limit)
        if cfg is None:
            continue
        cfg["SPLIT_K"] = launch_split(k, cfg["BLOCK_K"], split_k(mb, n, k, bm, bn, cfg["BLOCK_K"], sms, per_sm))
        if cfg not in out:
            out.append(cfg)
    if not out:
        raise ValueError(f"stream_gemm: no config fits {smem_limit} B of shared memory for {m}x{n}x{k}")
    return out


def counters(device: torch.device) -> torch.Tensor:
    """The device's int32 counter buffer (``[65536]``, zeroed once) for in-kernel split reductions: a kernel
    that uses it leaves every counter it touched at 0 again (also ``fused.decode_attention(fuse_combine=True)``).
    Allocate it before a CUDA-graph capture (any launch does); kernels using it must not run concurrently."""
    c = _COUNTERS.get(device)
    if c is None:
        c = _COUNTERS[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return c


PDL = False  # launch with Programmatic Dependent Launch (sm_90+, CUDA): weight loads overlap the previous kernel


def pdl_supported(device: torch.device) -> bool:
    """Whether ``PDL = True`` takes effect on ``device``: CUDA, compute capability >= 9 and Triton's GDC ops."""
    return (triton is not None and gdc_wait is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_split(k: int, block_k: int, split: int) -> int:
    """The split count a launch uses: ``split`` lowered so that no split is empty (each covers
    ``ceil(ceil(k / split) / block_k)`` steps of ``block_k``; the last one may be shorter)."""
    per = -(-(-(-k // split)) // block_k) * block_k
    return -(-k // per)


def is_even(n: int, k: int, cfg: dict) -> bool:
    """Whether a launch of ``cfg`` needs no weight masks: ``n % BLOCK_N == 0`` and ``k % (SPLIT_K * BLOCK_K) == 0``
    (the kernel's ``EVEN``: no predicate per weight load)."""
    return n % cfg["BLOCK_N"] == 0 and k % (cfg["SPLIT_K"] * cfg["BLOCK_K"]) == 0


def norm_chunk(k: int, block_m: int) -> int:
    """Columns of ``x`` the RMSNorm prologue loads at once: all of ``k`` for one row (one L2 round trip), at most
    4096 elements of registers for a block of rows."""
    return max(16, min(triton.next_power_of_2(k), max(64, 4096 // block_m)))


def _launch(x, w, out, res, nw, eps, epi: int, cfg: dict, pdl: bool | None = None) -> None:
    M, K = x.shape
    N = out.shape[1]
    sk = launch_split(K, cfg["BLOCK_K"], cfg["SPLIT_K"])
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    if sk > 1 and tiles > _MAX_TILES:
        raise ValueError(f"stream_gemm: {tiles} output tiles exceed the counter buffer ({_MAX_TILES})")
    part = torch.empty(sk * 2 * M * N if sk > 1 else 1, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), sk, triton.cdiv(M, cfg["BLOCK_M"]))
    interp = not x.is_cuda
    pdl = (PDL if pdl is None else pdl) and pdl_supported(x.device)
    extra = dict(PDL=True, launch_pdl=True) if pdl else {}
    _stream_gemm_kernel[grid](
        x, w, out, res if res is not None else out, nw if nw is not None else x, part, counters(x.device),
        M, N, K, x.stride(0), w.stride(0), out.stride(0), res.stride(0) if res is not None else 0, eps, sk,
        EPI=epi, NORM=nw is not None, DOT=cfg["BLOCK_M"] > 1,
        PREC="ieee" if x.dtype == torch.float32 or interp else "tf32", UPCAST=interp and x.dtype != torch.float32,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        EVEN=is_even(N, K, dict(cfg, SPLIT_K=sk)), NORM_K=norm_chunk(K, cfg["BLOCK_M"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra)


TUNE = True  # False: always the first candidate (no timing; one compile per shape class)
TUNE_L2_MULTIPLE = 2.0  # the timed graph cycles through weight copies of at least this many times the L2 size


def time_config(run, w: torch.Tensor, reps: int = 5) -> float:
    """Microseconds of one warm ``run(w_i)`` launch with ``w_i`` read from HBM, as in a decode step.

    ``run`` is launched once first (compiles it, and raises here for a config that cannot launch); then one CUDA
    graph launches it over enough copies of ``w`` (the original, then uninitialised copies: values do not change
    the time) to exceed ``TUNE_L2_MULTIPLE`` x the L2 cache, is replayed twice to warm up and ``reps`` times
    between CUDA events. The previous tuner timed each call with ``do_bench`` and got the host's launch latency
    (52-56 us for a GEMM that runs in 7 us on the H200)."""
    run(w)
    torch.cuda.synchronize()
    l2 = torch.cuda.get_device_properties(w.device).L2_cache_size
    wb = w.numel() * w.element_size()
    n = int(min(64, max(2, -(-TUNE_L2_MULTIPLE * l2 // wb))))
    ws = [w] + [torch.empty_like(w) for _ in range(n - 1)]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for wi in ws:
            run(wi)
    g.replay()
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    us = a.elapsed_time(b) * 1e3 / (reps * n)
    del g, ws
    return us


def _tune(key, cands, run, w, known: list[float] | None = None) -> dict:
    """The tuned config of ``key``: every candidate timed by ``time_config`` (the first ``len(known)`` take their
    times from ``known``, e.g. the same shape tuned without the cuBLAS candidate), the fastest kept."""
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    if (not TUNE or len(cands) == 1 or not torch.cuda.is_available() or not w.is_cuda
            or torch.cuda.is_current_stream_capturing()):
        return cands[0]  # nothing to time here (CPU interpreter, or inside a graph capture)
    times = list(known or [])[:len(cands)]
    for c in cands[len(times):]:
        try:
            times.append(time_config(lambda wi, c=c: run(c, wi), w))
        except Exception as exc:  # noqa: BLE001 - a config this device cannot compile is skipped
            if isinstance(exc, (KeyboardInterrupt, torch.cuda.OutOfMemoryError)):
                raise
            times.append(float("inf"))
    best = min(range(len(cands)), key=times.__getitem__)
    if times[best] == float("inf"):
        raise RuntimeError(f"stream_gemm: no config of {cands} runs for shape key {key}")
    # every candidate's time (us, candidate order; inf: failed to run) is kept for the benchmark's record
    _TUNED[key] = dict(cands[best], us=round(times[best], 2), all_us=[round(t, 2) for t in times])
    return _TUNED[key]


def tuned_configs() -> dict[str, dict]:
    """Every tuned shape so far: ``"M-bucket x N x K epi/norm dtype"`` (`` +cublas`` where ``CUBLAS_CANDIDATE``
    was on) ``-> config`` (with its time ``us`` and every candidate's, ``all_us``)."""
    return {tuned_key(*k): v for k, v in _TUNED.items()}


def tuned_key(bucket: int, n: int, k: int, epi: int, norm: bool, dtype: str, with_cublas: bool = False) -> str:
    """The ``tuned_configs`` key of one tuned shape."""
    return f"{bucket}x{n}x{k} epi{epi} norm{int(norm)} {dtype}" + (" +cublas" if with_cublas else "")


CUBLAS_CANDIDATE = True  # the tuner also times cuBLAS (F.linear) with the same prologue/epilogue as own kernels
CUBLAS_CONFIG = {"BACKEND": "cublas"}


def _cublas_launch(x, w, res, nw, eps, epi: int) -> torch.Tensor:
    """The ``CUBLAS_CONFIG`` candidate: the cuBLAS fused step's kernels for one fused GEMM: the RMSNorm kernel
    (``hpdl.serve.epilogue.add_rmsnorm``), ``F.linear``, then the SiLU-mul kernel or the residual add, each
    rounding to the model dtype as eager does (without those two Triton kernels: ``stream_gemm_ref`` exactly)."""
    if nw is not None:
        x = add_rmsnorm(x, None, nw, eps)[1]
    y = F.linear(x, w)
    if epi == 2:
        return _silu_mul(y)
    return y + res if epi == 1 else y


def stream_gemm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
                norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False,
                config: dict | None = None, pdl: bool | None = None,
                cublas_candidate: bool | None = None) -> torch.Tensor:
    """``y = x @ w.T`` for decode-sized ``x``, with optional fused prologue and epilogues.

    Args:
        x: ``[M, K]`` (row stride free, unit column stride), float32 / bfloat16 / float16.
        w: ``[N, K]`` contiguous rows, same dtype; with ``silu_mul`` ``[2N, K]`` (gate rows, then up rows).
        residual: ``[M, N]``, added to the product (the product rounded to the dtype first, as eager does).
        norm_weight: ``[K]``: ``x`` is RMS-normalised (``eps``, float32 statistics) and scaled by it first.
        silu_mul: return ``silu(x @ gate.T) * (x @ up.T)`` ``[M, N]`` (not with ``residual``).
        config: a fixed config (keys of ``candidates``, or ``CUBLAS_CONFIG``); None = the tuned one on CUDA
            (with ``CUBLAS_CANDIDATE``, cuBLAS is one of the candidates), the first candidate elsewhere. The tests
            use it to cover every code path under TRITON_INTERPRET=1.
        pdl: launch with Programmatic Dependent Launch where ``pdl_supported``; None = the module's ``PDL``.
        cublas_candidate: whether the tuner also times cuBLAS for this shape; None = ``CUBLAS_CANDIDATE``. A
            caller that chains PDL launches passes False: a cuBLAS kernel between two stream GEMMs breaks the
            overlap, which the per-shape timing does not see.
    Returns:
        ``[M, N]`` in ``x``'s dtype, a new tensor. Off CUDA and without the interpreter: ``stream_gemm_ref``.
    Raises:
        ValueError: shapes, dtypes or layouts that do not fit, naming the argument.
    """
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x and w must be 2-D, got x {tuple(x.shape)} and w {tuple(w.shape)}")
    M, K = x.shape
    if w.shape[1] != K:
        raise ValueError(f"w must be [N, {K}] to match x [{M}, {K}], got {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise ValueError(f"w dtype must equal x dtype {x.dtype}, got {w.dtype}")
    if silu_mul and w.shape[0] % 2:
        raise ValueError(f"silu_mul needs w of 2N rows (gate | up), got {w.shape[0]} rows")
    if silu_mul and residual is not None:
        raise ValueError("silu_mul and residual cannot be combined (LLaMA adds the residual after down_proj)")
    N = w.shape[0] // 2 if silu_mul else w.shape[0]
    if residual is not None and (tuple(residual.shape) != (M, N) or residual.dtype != x.dtype):
        raise ValueError(f"residual must be [{M}, {N}] {x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
    if norm_weight is not None and tuple(norm_weight.shape) != (K,):
        raise ValueError(f"norm_weight must be [{K}], got {tuple(norm_weight.shape)}")
    if not _use_triton(x):
        return stream_gemm_ref(x, w, residual, norm_weight, eps, silu_mul)
    if x.stride(1) != 1 or w.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("x, w and residual need unit stride along their last dimension")
    epi = 2 if silu_mul else (1 if residual is not None else 0)
    if config is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        with_cublas = (CUBLAS_CANDIDATE if cublas_candidate is None else cublas_candidate) and x.is_cuda
        key = (m_bucket(M), N, K, epi, norm_weight is not None, str(x.dtype).split(".")[-1], with_cublas)
        cands = candidates(M, N, K, sms, x.element_size(), epi, norm_weight is not None,
                           shared_memory_limit(x.device)) + ([CUBLAS_CONFIG] if with_cublas else [])
        base = _TUNED.get(key[:-1] + (False,)) if with_cublas else None  # its Triton times, if tuned
        known = base["all_us"] if base is not None and len(base["all_us"]) == len(cands) - 1 else None
        config = _tune(key, cands, lambda c, wi: _run(x, wi, residual, norm_weight, eps, epi, c, pdl), w, known)
    return _run(x, w, residual, norm_weight, eps, epi, config, pdl)


def _run(x, w, res, nw, eps, epi: int, cfg: dict, pdl: bool | None = None) -> torch.Tensor:
    """One fused GEMM with ``cfg`` (a Triton config or ``CUBLAS_CONFIG``); returns the new ``[M, N]`` tensor."""
    if cfg.get("BACKEND") == "cublas":
        return _cublas_launch(x, w, res, nw, eps, epi)
    out = torch.empty(x.shape[0], w.shape[0] // 2 if epi == 2 else w.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, w, out, res, nw, eps, epi, cfg, pdl)
    return out


__all__ = ["CUBLAS_CANDIDATE", "CUBLAS_CONFIG", "PDL", "TUNE", "candidates", "counters", "fit_shared_memory",
           "is_even", "launch_split", "m_bucket", "norm_chunk", "pdl_supported", "shared_memory_bytes", "shared_memory_limit", "split_k", "stream_gemm",
           "stream_gemm_ref", "time_config", "tuned_configs", "tuned_key"]
