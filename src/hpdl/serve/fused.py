"""Fused decode step for LLaMA-architecture ``DecoderLM``s: ~9 kernels per layer instead of ~25.

A batch-1 decode step of a 1.1B model reads 2.2 GB of weights, about 0.5 ms at H200 bandwidth, but the eager
step launches ~25 kernels per layer (views, RoPE's chunk/neg/cat, index writes, mask, scale, softmax, casts,
residual adds); even replayed from a CUDA graph each costs a few microseconds, so the step was bound by kernel
count (issue 28). Here one layer is:

    GEMM qkv -> rope_kv (RoPE on q and k, k and v stored into the slot cache: one kernel)
    -> decode_attention (GQA-aware flash-decoding, split-K over the cache, FlashDecoding, Dao et al. 2023;
       one kernel, plus one combine kernel when the KV range is split)
    -> GEMM o -> add_rmsnorm (residual add fused with the next RMSNorm) -> GEMM gate|up -> silu_mul
    -> GEMM down -> add_rmsnorm (the next layer's input norm, or the final norm)

then the LM head GEMM and, for greedy rows, the argmax inside the same (CUDA-graph) step. With ``gemm="cublas"``
the GEMMs are cuBLAS's and every other op is one Triton kernel. cuBLAS reaches only 57% of copy bandwidth on these
decode GEMMs (issue 38), so ``gemm="stream"`` uses ``hpdl.serve.stream_gemm`` instead, with the residual adds,
the SiLU-mul and (for few rows) the RMSNorms fused into the GEMMs:

    GEMM qkv (RMSNorm prologue) -> rope_kv -> decode_attention (chunks combined in-kernel) -> GEMM o (+ residual)
    -> GEMM gate|up (RMSNorm prologue, SiLU-mul epilogue) -> GEMM down (+ residual)

With ``ROPE_IN_ATTENTION`` (the default, both GEMM choices) rope_kv is folded into the attention kernel
(``rope_decode_attention``): 5 kernels a layer on the stream path at few rows, 8 on the cuBLAS path.

Each kernel has a torch reference (``*_ref``) with the eager model's arithmetic; on CPU the references run
(the Triton kernels also run on CPU tensors under ``TRITON_INTERPRET=1``, which the tests use). Decode
attention reads only each row's written positions ``0..pos`` (the eager path reads the whole KV bucket).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpdl.models.gpt import DecoderLM, KVCache
from hpdl.serve import stream_gemm as sg
from hpdl.serve.epilogue import add_rmsnorm, add_rmsnorm_ref, silu_mul, silu_mul_ref, use_triton  # noqa: F401
from hpdl.serve.stream_gemm import counters, stream_gemm

try:  # Triton ships with CUDA builds of torch; CPU-only installs use the torch references
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
try:  # Programmatic Dependent Launch's device side (stream_gemm.PDL; Triton >= 3.4, sm_90+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the install
    gdc_launch_dependents = gdc_wait = None


# --- torch references (the eager model's arithmetic, op for op) -------------------------------------
def rope_kv_ref(qkv, cos, sin, pos, kc, vc, start: int, h: int, hkv: int):
    """qkv ``[n, (h + 2 hkv) d]`` -> q ``[n, h, d]`` rotated; rotated k and v stored at ``kc/vc[start + i, :,
    pos[i]]`` (kc, vc ``[S, hkv, L, d]``); cos/sin ``[max_pos, d]`` float32 (rotate-half convention)."""
    n = qkv.shape[0]
    d = kc.shape[-1]
    x = qkv.view(n, h + 2 * hkv, d)
    c, s = cos[pos].to(x.dtype)[:, None], sin[pos].to(x.dtype)[:, None]
    qk = x[:, : h + hkv]
    x1, x2 = qk.chunk(2, dim=-1)
    qk = qk * c + torch.cat((-x2, x1), dim=-1) * s
    rows = torch.arange(start, start + n, device=qkv.device)
    kc[rows, :, pos] = qk[:, h:]
    vc[rows, :, pos] = x[:, h + hkv:]
    return qk[:, :h]


def decode_attention_ref(q, kc, vc, pos, start: int):
    """q ``[n, h, d]``; row i attends to ``kc/vc[start + i, :, 0..pos[i]]`` (GQA: head j reads kv head
    j // (h / hkv)); returns ``[n, h, d]`` in q's dtype (softmax in float32, as the eager path)."""
    n, h, d = q.shape
    hkv = kc.shape[1]
    L = int(pos.max()) + 1
    K, V = kc[start:start + n, :, :L], vc[start:start + n, :, :L]
    qg = q.view(n, hkv, h // hkv, d)
    s = torch.matmul(qg, K.transpose(-1, -2)) * (d ** -0.5)
    mask = (torch.arange(L, device=q.device)[None, :] > pos[:, None])[:, None, None, :]
    p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1, dtype=torch.float32).to(V.dtype)
    return torch.matmul(p, V).view(n, h, d)


# --- Triton kernels ----------------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, start,
                        s_slot, s_head, s_pos, H, HKV, D: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # launched with PDL: wait for the qkv GEMM, then let the attention kernel launch
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        head = tl.program_id(1)  # 0..H-1: q heads, H..H+HKV-1: k heads, then v heads
        half = tl.arange(0, D // 2)
        p = tl.load(pos_ptr + row)
        base = qkv_ptr + (row * (H + 2 * HKV) + head) * D
        x1 = tl.load(base + half).to(tl.float32)
        x2 = tl.load(base + D // 2 + half).to(tl.float32)
        dt = qkv_ptr.dtype.element_ty
        if head < H + HKV:
            c = tl.load(cos_ptr + p * D + half).to(dt).to(tl.float32)  # the table in the model dtype (eager)
            s = tl.load(sin_ptr + p * D + half).to(dt).to(tl.float32)
            o1 = x1 * c - x2 * s
            o2 = x2 * c + x1 * s
            if head < H:
                dst = q_ptr + (row * H + head) * D
            else:
                dst = kc_ptr + (start + row).to(tl.int64) * s_slot + (head - H) * s_head + p * s_pos
        else:
            o1 = x1
            o2 = x2
            dst = vc_ptr + (start + row).to(tl.int64) * s_slot + (head - H - HKV) * s_head + p * s_pos
        tl.store(dst + half, o1.to(dt))
        tl.store(dst + D // 2 + half, o2.to(dt))

    @triton.jit
    def _decode_attn_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, part_acc_ptr, part_ml_ptr, cnt_ptr, start,
                            scale, s_slot, s_head, s_pos, H, HKV, CHUNK,
                            G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                            SPLIT: tl.constexpr, PREC: tl.constexpr, COMBINE: tl.constexpr = False,
                            PDL: tl.constexpr = False, ROPE: tl.constexpr = False, cos_ptr=None, sin_ptr=None,
                            SP: tl.constexpr = 0):
        if PDL:  # launched with PDL: wait for the previous kernel (rope_kv, or the qkv GEMM with ROPE), then let
            gdc_wait()  # the o GEMM launch and load its weights
            gdc_launch_dependents()
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        nsplit = tl.num_programs(2)
        p = tl.load(pos_ptr + row).to(tl.int32)
        length = p + 1
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, length)
        g = tl.arange(0, GP)
        dd = tl.arange(0, D)
        gm = g < G
        kbase = kc_ptr + (start + row).to(tl.int64) * s_slot + kvh * s_head  # int64: 7B caches pass 2^31
        vbase = vc_ptr + (start + row).to(tl.int64) * s_slot + kvh * s_head
        if ROPE:  # q_ptr is the qkv GEMM's output [n, (H + 2 HKV) D]: RoPE here, as _rope_kv_kernel computes it
            dt = q_ptr.dtype.element_ty
            rowb = q_ptr + row.to(tl.int64) * (H + 2 * HKV) * D
            partner = (dd + D // 2) % D  # rotate-half: -x2 in the first half, x1 in the second
            sgn = tl.where(dd < D // 2, -1.0, 1.0)
            c = tl.load(cos_ptr + p * D + dd % (D // 2)).to(dt).to(tl.float32)  # the table in the model dtype
            s_ = tl.load(sin_ptr + p * D + dd % (D // 2)).to(dt).to(tl.float32)  # (first half: halves repeat)
            qh = kvh * G + g
            xq = tl.load(rowb + qh[:, None] * D + dd[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
            xr = tl.load(rowb + qh[:, None] * D + partner[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
            q = (xq * c[None, :] + (sgn[None, :] * xr) * s_[None, :]).to(dt)
            xk = tl.load(rowb + (H + kvh) * D + dd).to(tl.float32)
            xkr = tl.load(rowb + (H + kvh) * D + partner).to(tl.float32)
            k_new = (xk * c + (sgn * xkr) * s_).to(dt)
            v_new = tl.load(rowb + (H + HKV + kvh) * D + dd)
            own = (dd >= 0) & (p >= lo) & (p < hi)  # the one split whose chunk holds position p writes K/V there
            tl.store(kbase + p * s_pos + dd, k_new.to(kc_ptr.dtype.element_ty), mask=own)
            tl.store(vbase + p * s_pos + dd, v_new.to(vc_ptr.dtype.element_ty), mask=own)
        else:
            q = tl.load(q_ptr + (row * H + kvh * G + g)[:, None] * D + dd[None, :], mask=gm[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):  # every group of G query heads shares one read of K and V
            nn = n0 + tl.arange(0, BLOCK_N)
            nm = nn < hi
            k = tl.load(kbase + nn[:, None] * s_pos + dd[None, :], mask=nm[:, None], other=0.0)
            v = tl.load(vbase + nn[:, None] * s_pos + dd[None, :], mask=nm[:, None], other=0.0)
            if ROPE:  # position p from registers: no read-after-write through memory within this program
                k = tl.where((nn == p)[:, None], k_new[None, :].to(k.dtype), k)
                v = tl.where((nn == p)[:, None], v_new[None, :].to(v.dtype), v)
            s = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale
            s = tl.where(nm[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=PREC).to(tl.float32)
            m_i = m_new
        oh = row * H + kvh * G + g  # output head index
        if SPLIT:  # partial results, combined by _combine_kernel; an empty split leaves m = -inf, l = 0
            pidx = oh * nsplit + split
            tl.store(part_acc_ptr + pidx[:, None] * D + dd[None, :], acc, mask=gm[:, None])
            tl.store(part_ml_ptr + pidx * 2, m_i, mask=gm)
            tl.store(part_ml_ptr + pidx * 2 + 1, l_i, mask=gm)
            if COMBINE:  # the last program of this (row, kv head) combines the splits (no second kernel)
                tl.debug_barrier()  # every thread's partial is written before the release below
                done = tl.atomic_add(cnt_ptr + row * HKV + kvh, 1, sem="acq_rel")
                if SP > 0:  # every split's partials in one load each ([GP, SP] and [GP, SP, D])
                    if done == nsplit - 1:
                        sp = tl.arange(0, SP)
                        pi = oh[:, None] * nsplit + sp[None, :]
                        pm = gm[:, None] & (sp < nsplit)[None, :]
                        m = tl.load(part_ml_ptr + pi * 2, mask=pm, other=float("-inf"), cache_modifier=".cg")
                        lv = tl.load(part_ml_ptr + pi * 2 + 1, mask=pm, other=0.0, cache_modifier=".cg")
                        mx = tl.max(m, axis=1)  # split 0 always holds position 0: finite for the real heads
                        w = tl.where(pm, tl.exp(m - mx[:, None]), 0.0)
                        den = tl.sum(lv * w, axis=1)
                        pa = tl.load(part_acc_ptr + pi[:, :, None] * D + dd[None, None, :], mask=pm[:, :, None],
                                     other=0.0, cache_modifier=".cg")
                        o = tl.sum(pa * w[:, :, None], axis=1) / tl.where(gm, den, 1.0)[:, None]
                        tl.store(out_ptr + oh[:, None] * D + dd[None, :], o.to(out_ptr.dtype.element_ty),
                                 mask=gm[:, None])
                        tl.atomic_xchg(cnt_ptr + row * HKV + kvh, 0)  # ready for the next launch
                else:  # one split after another (COMBINE_ONE_SHOT off): two L2 round trips per split
                    if done == nsplit - 1:
                        mx = tl.full([GP], float("-inf"), tl.float32)
                        for sp in range(0, nsplit):  # split 0 always holds position 0, so mx ends finite
                            mx = tl.maximum(mx, tl.load(part_ml_ptr + (oh * nsplit + sp) * 2, mask=gm,
                                                        other=float("-inf"), cache_modifier=".cg"))
                        num = tl.zeros([GP, D], tl.float32)
                        den = tl.zeros([GP], tl.float32)
                        for sp in range(0, nsplit):  # split order, as _combine_kernel sums
                            pi = oh * nsplit + sp
                            w = tl.exp(tl.load(part_ml_ptr + pi * 2, mask=gm, other=float("-inf"),
                                               cache_modifier=".cg") - mx)
                            w = tl.where(gm, w, 0.0)
                            den += tl.load(part_ml_ptr + pi * 2 + 1, mask=gm, other=0.0, cache_modifier=".cg") * w
                            num += tl.load(part_acc_ptr + pi[:, None] * D + dd[None, :], mask=gm[:, None], other=0.0,
                                           cache_modifier=".cg") * w[:, None]
                        o = num / tl.where(gm, den, 1.0)[:, None]
                        tl.store(out_ptr + oh[:, None] * D + dd[None, :], o.to(out_ptr.dtype.element_ty),
                                 mask=gm[:, None])
                        tl.atomic_xchg(cnt_ptr + row * HKV + kvh, 0)  # ready for the next launch
        else:
            o = acc / l_i[:, None]
            tl.store(out_ptr + oh[:, None] * D + dd[None, :], o.to(out_ptr.dtype.element_ty), mask=gm[:, None])

    @triton.jit
    def _combine_kernel(part_acc_ptr, part_ml_ptr, out_ptr, NSPLIT, SP: tl.constexpr, D: tl.constexpr):
        oh = tl.program_id(0)  # one (row, head)
        sp = tl.arange(0, SP)
        sm = sp < NSPLIT
        m = tl.load(part_ml_ptr + (oh * NSPLIT + sp) * 2, mask=sm, other=float("-inf"))
        l = tl.load(part_ml_ptr + (oh * NSPLIT + sp) * 2 + 1, mask=sm, other=0.0)
        mx = tl.max(m, axis=0)  # split 0 always holds position 0, so mx is finite
        w = tl.where(sm, tl.exp(m - mx), 0.0)
        dd = tl.arange(0, D)
        acc = tl.load(part_acc_ptr + (oh * NSPLIT + sp)[:, None] * D + dd[None, :], mask=sm[:, None], other=0.0)
        o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        tl.store(out_ptr + oh * D + dd, o.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _argmax_kernel(x_ptr, out_ptr, V, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row, tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64))  # float32: exact, same order

def _pdl_args(pdl: bool) -> dict:
    """Launch keywords for a kernel with a ``PDL`` constexpr: Programmatic Dependent Launch where
    ``hpdl.serve.stream_gemm.pdl_supported`` (see ``stream_gemm.PDL``), nothing otherwise."""
    return dict(PDL=True, launch_pdl=True) if pdl else {}


def rope_kv(qkv, cos, sin, pos, kc, vc, start: int, h: int, hkv: int, pdl: bool = False):
    """Triton ``rope_kv_ref`` (one kernel: q rotated, k rotated and stored, v stored). It reads the first half
    of each cos/sin row only: the tables must repeat their halves (``hpdl.models.gpt.rope_tables`` does).
    ``pdl``: launch with Programmatic Dependent Launch (callers check ``stream_gemm.pdl_supported``)."""
    if not use_triton(qkv):
        return rope_kv_ref(qkv, cos, sin, pos, kc, vc, start, h, hkv)
    n, d = qkv.shape[0], kc.shape[-1]
    q = torch.empty(n, h, d, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(n, h + 2 * hkv)](qkv, cos, sin, pos, q, kc, vc, start, kc.stride(0), kc.stride(1),
                                      kc.stride(2), h, hkv, D=d, **_pdl_args(pdl))
    return q


def attention_splits(n: int, hkv: int, kv_len: int, block_n: int = 64, target: int = 264) -> int:
    """How many KV chunks each (row, kv head) is split into: enough programs to fill an H200 twice
    (132 SMs), chunks of at least ``block_n`` positions. ``kv_len`` is the bound the step is built for."""
    want = max(1, -(-target // (n * hkv)))
    return max(1, min(want, -(-kv_len // block_n)))


COMBINE_ONE_SHOT = True  # fuse_combine loads every split's partials at once (where they fit COMBINE_MAX_ELEMS);
# False: a loop over the splits, two L2 round trips per split (5.9 us per attention at 1 row on the H200,
# 2026-12-04 19:32, against 2.6 us for the split kernel alone)
COMBINE_MAX_ELEMS = 16384  # float32 partials one program loads at once (GP x SP x D)


def decode_attention(q, kc, vc, pos, start: int, kv_len: int, splits: int | None = None, block_n: int = 64,
                     fuse_combine: bool = False, pdl: bool = False):
    """Triton ``decode_attention_ref``: each program reads one (row, kv head, KV chunk) and serves all
    ``h / hkv`` query heads of that kv head; chunks combine by their log-sum-exp (flash-decoding).
    ``kv_len``: an upper bound of ``pos + 1`` (fixed per CUDA graph), which sets the chunking.
    ``fuse_combine``: the last program of each (row, kv head) combines the chunks (a per-pair counter, as in
    ``hpdl.serve.stream_gemm``) instead of a second kernel; the same arithmetic, summed in split order.
    ``pdl``: launch with Programmatic Dependent Launch (with ``fuse_combine``: one kernel, so the next one may
    overlap it; callers check ``stream_gemm.pdl_supported``)."""
    if not use_triton(q):
        return decode_attention_ref(q, kc, vc, pos, start)
    return _attend(q, None, kc, vc, pos, start, kv_len, q.shape[1], splits, block_n, fuse_combine, pdl)


def rope_decode_attention(qkv, cos, sin, pos, kc, vc, start: int, h: int, hkv: int, kv_len: int,
                          splits: int | None = None, block_n: int = 64, fuse_combine: bool = False,
                          pdl: bool = False):
    """``rope_kv`` and ``decode_attention`` in one kernel (one launch a layer fewer): qkv ``[n, (h + 2 hkv) d]``
    (the qkv GEMM's output) -> attention output ``[n, h, d]``; the rotated k and v of each row's position
    ``pos[i]`` are stored into ``kc/vc[start + i, :, pos[i]]`` by the program whose KV chunk holds that position
    (and used from registers there). Every program rotates its own group of q heads (``h / hkv`` rows of ``d``,
    from L2). Same arithmetic as the two kernels (tests: bit-equal under the interpreter); reference
    ``decode_attention_ref(rope_kv_ref(...))``. cos/sin as ``rope_kv``; other arguments as ``decode_attention``."""
    if not use_triton(qkv):
        return decode_attention_ref(rope_kv_ref(qkv, cos, sin, pos, kc, vc, start, h, hkv), kc, vc, pos, start)
    return _attend(qkv, (cos, sin), kc, vc, pos, start, kv_len, h, splits, block_n, fuse_combine, pdl)


def _attend(src, rope, kc, vc, pos, start, kv_len, h, splits, block_n, fuse_combine, pdl):
    """Launch ``_decode_attn_kernel``: ``src`` is q ``[n, h, d]``, or with ``rope = (cos, sin)`` the qkv rows."""
    n, d = src.shape[0], kc.shape[-1]
    hkv = kc.shape[1]
    G = h // hkv
    splits = splits or attention_splits(n, hkv, kv_len, block_n)
    chunk = -(-kv_len // splits)
    chunk = -(-chunk // block_n) * block_n
    out = torch.empty(n, h, d, dtype=src.dtype, device=src.device)
    # float32 is exact float32 (no TF32), so the fused step gives the eager step's greedy tokens there
    args = dict(G=G, GP=max(16, triton.next_power_of_2(G)), D=d, BLOCK_N=block_n,
                PREC="ieee" if src.dtype == torch.float32 else "tf32", ROPE=rope is not None,
                cos_ptr=rope[0] if rope else src, sin_ptr=rope[1] if rope else src)
    if splits == 1:
        _decode_attn_kernel[(n, hkv, 1)](src, kc, vc, pos, out, out, out, out, start, d ** -0.5, kc.stride(0),
                                         kc.stride(1), kc.stride(2), h, hkv, chunk, SPLIT=False, **args,
                                         **_pdl_args(pdl))
        return out
    acc = torch.empty(n * h * splits, d, dtype=torch.float32, device=src.device)
    ml = torch.empty(n * h * splits, 2, dtype=torch.float32, device=src.device)
    if fuse_combine:
        if n * hkv > counters(src.device).numel():
            raise ValueError(f"fuse_combine: {n} rows x {hkv} kv heads exceed the counter buffer")
    cnt = counters(src.device) if fuse_combine else out
    sp = triton.next_power_of_2(splits)
    one_shot = fuse_combine and COMBINE_ONE_SHOT and args["GP"] * sp * d <= COMBINE_MAX_ELEMS
    _decode_attn_kernel[(n, hkv, splits)](src, kc, vc, pos, out, acc, ml, cnt, start, d ** -0.5, kc.stride(0),
                                          kc.stride(1), kc.stride(2), h, hkv, chunk, SPLIT=True,
                                          COMBINE=fuse_combine, SP=sp if one_shot else 0, **args,
                                          **_pdl_args(pdl and fuse_combine))
    if not fuse_combine:
        _combine_kernel[(n * h,)](acc, ml, out, splits, SP=triton.next_power_of_2(splits), D=d)
    return out


TRITON_ARGMAX = True  # False: torch's argmax in the step (as until 2026-12-04 19:32)
ARGMAX_MAX_BLOCK = 65536  # the widest row one program loads at once; wider vocabularies use torch's argmax


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``[n, V]`` logits (unit column stride) as one program per row that loads the
    whole row at once (one memory round trip; torch's reduction took 11.6 us for one 32000-wide bf16 row on the
    H200, 2026-12-04 19:32, 1.3% of the batch-1 step). Ties go to the first index, as torch's; NaN is not
    handled (torch would return its index). Returns int64 ``[n]``."""
    n, V = logits.shape
    if (not TRITON_ARGMAX or not use_triton(logits) or logits.stride(1) != 1
            or triton.next_power_of_2(V) > ARGMAX_MAX_BLOCK):
        return logits.argmax(dim=-1)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    block = triton.next_power_of_2(V)
    _argmax_kernel[(n,)](logits, out, V, logits.stride(0), BLOCK=block, num_warps=16 if block >= 16384 else 4)
    return out


# --- the fused decode step --------------------------------------------------------------------------
def supports(model: DecoderLM) -> str | None:
    """None if ``fused_decode`` can run ``model``, else why not (GPT-2, tensor parallelism, head_dim)."""
    cfg = model.cfg
    if cfg.arch != "llama":
        return f"arch {cfg.arch!r} (the fused step is LLaMA's: RMSNorm, RoPE, SwiGLU)"
    if model.group is not None:
        return "tensor parallelism (the fused step is single-device)"
    if cfg.head_dim & (cfg.head_dim - 1) or cfg.head_dim < 16:
        return f"head_dim {cfg.head_dim} (a power of two >= 16 is needed)"
    return None


GEMMS = ("cublas", "stream")
NORM_PROLOGUE_ROWS = 16  # provisional: benchmarks/serve_decode_kernels.py measures both sides of it
ROPE_IN_ATTENTION = True  # RoPE and the K/V write inside the attention kernel (rope_decode_attention): one launch
# a layer fewer; False: the separate rope_kv kernel (the arrangement measured on the H200 until 2026-12-04 19:32)


@torch.inference_mode()
def fused_decode(model: DecoderLM, cache: KVCache, tokens: torch.Tensor, pos: torch.Tensor, start: int,
                 kv_len: int, greedy: bool = True, gemm: str = "cublas", norm_prologue_rows: int | None = None,
                 pdl: bool | None = None, cublas_candidate: bool | None = None, rope_in_attention: bool | None = None):
    """One decode step of a LLaMA ``DecoderLM`` with the fused kernels; same contract as
    ``model(tokens[:, None], cache, Batch(positions=pos[:, None], start=start, kv_len=kv_len))``.

    Args:
        tokens, pos: ``[n]`` int64 on the model's device; row i is slot ``start + i`` at position ``pos[i]``.
        kv_len: an upper bound of ``pos + 1`` (sets the attention's KV chunking; fixed per CUDA graph).
        greedy: also return each row's argmax token (computed on the device, inside the same graph).
        gemm: "cublas" (``F.linear``, with separate add+RMSNorm and SiLU-mul kernels: 9 kernels a layer plus
            cuBLAS's split-K reductions) or "stream" (``hpdl.serve.stream_gemm``: residual add, SiLU-mul and,
            for up to ``norm_prologue_rows`` rows, the RMSNorm fused into the GEMMs; the attention's split
            combine in the attention kernel: 6 kernels a layer, 8 above ``norm_prologue_rows``).
        norm_prologue_rows: with "stream", the most rows for which the next RMSNorm runs inside the GEMM
            (each GEMM program re-reads its rows); above it one RMSNorm kernel runs first. None: the default.
        pdl: with "stream", launch every kernel with Programmatic Dependent Launch (where
            ``stream_gemm.pdl_supported``); None = ``stream_gemm.PDL``.
        cublas_candidate: with "stream", whether each GEMM shape's tuner may pick cuBLAS; None =
            ``stream_gemm.CUBLAS_CANDIDATE``. With ``pdl`` pass False (a cuBLAS kernel breaks the PDL chain).
        rope_in_attention: RoPE and the K/V write inside the attention kernel (``rope_decode_attention``); None =
            ``ROPE_IN_ATTENTION``.
    Returns:
        logits ``[n, vocab]`` in the model dtype, and the argmax ``[n]`` int64 (None unless ``greedy``).
    Raises:
        ValueError: ``supports(model)`` is not None, or ``gemm`` is not one of ``GEMMS``.
    """
    why = supports(model)
    if why is not None:
        raise ValueError(f"fused decode cannot run this model: {why}")
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
    rope = ROPE_IN_ATTENTION if rope_in_attention is None else rope_in_attention
    if gemm == "stream":
        rows = NORM_PROLOGUE_ROWS if norm_prologue_rows is None else norm_prologue_rows
        return _stream_decode(model, cache, tokens, pos, start, kv_len, greedy, tokens.shape[0] <= rows, pdl,
                              cublas_candidate, rope)
    cfg = model.cfg
    h, hkv = cfg.n_heads, cfg.n_kv_heads
    x = model.embed_tokens(tokens)  # [n, C]
    res, y = add_rmsnorm(x, None, model.layers[0].ln_1.weight, cfg.norm_eps)  # res is x: a fresh tensor,
    # so updating the residual stream in place (add_rmsnorm does) never touches the embedding table
    for i, layer in enumerate(model.layers):
        a = layer.attn
        qkv = F.linear(y, a.qkv_proj.weight)
        if rope:
            o = rope_decode_attention(qkv, model.cos, model.sin, pos, cache.k[i], cache.v[i], start, h, hkv, kv_len)
        else:
            q = rope_kv(qkv, model.cos, model.sin, pos, cache.k[i], cache.v[i], start, h, hkv)
            o = decode_attention(q, cache.k[i], cache.v[i], pos, start, kv_len)
        o = F.linear(o.view(o.shape[0], h * cfg.head_dim), a.o_proj.weight)
        res, y = add_rmsnorm(o, res, layer.ln_2.weight, cfg.norm_eps)
        mlp = layer.mlp
        d = F.linear(silu_mul(F.linear(y, mlp.up_proj.weight)), mlp.down_proj.weight)
        nxt = model.layers[i + 1].ln_1.weight if i + 1 < len(model.layers) else model.norm.weight
        res, y = add_rmsnorm(d, res, nxt, cfg.norm_eps)
    logits = F.linear(y, model.lm_head.weight)[:, : cfg.vocab_size]
    return logits, (argmax_rows(logits) if greedy else None)


def _stream_decode(model: DecoderLM, cache: KVCache, tokens, pos, start: int, kv_len: int, greedy: bool,
                   norm_in_gemm: bool, pdl: bool | None, cublas_candidate: bool | None, rope: bool):
    """``fused_decode`` with ``hpdl.serve.stream_gemm``: per layer qkv (+ RMSNorm prologue), rope_kv,
    attention (split chunks combined by the last program), o (+ residual), gate|up (+ RMSNorm prologue,
    SiLU-mul epilogue), down (+ residual). Without ``norm_in_gemm`` the RMSNorms run as their own kernel before
    qkv and gate|up."""
    cfg = model.cfg
    h, hkv, eps = cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps
    # with stream_gemm.PDL, rope_kv and the attention launch with PDL too: every kernel of a layer then overlaps
    # the previous one's tail (the o GEMM loads its weights while the attention runs)
    pdl = (sg.PDL if pdl is None else pdl) and sg.pdl_supported(tokens.device)
    gk = dict(pdl=pdl, cublas_candidate=cublas_candidate)

    def normed(x, w, weight, **kw):
        if norm_in_gemm:
            return stream_gemm(x, w, norm_weight=weight, eps=eps, **gk, **kw)
        return stream_gemm(add_rmsnorm(x, None, weight, eps)[1], w, **gk, **kw)

    res = model.embed_tokens(tokens)  # [n, C]; every GEMM writes a new tensor, so the table is never touched
    for i, layer in enumerate(model.layers):
        a, mlp = layer.attn, layer.mlp
        qkv = normed(res, a.qkv_proj.weight, layer.ln_1.weight)
        if rope:
            o = rope_decode_attention(qkv, model.cos, model.sin, pos, cache.k[i], cache.v[i], start, h, hkv, kv_len,
                                      fuse_combine=True, pdl=pdl)
        else:
            q = rope_kv(qkv, model.cos, model.sin, pos, cache.k[i], cache.v[i], start, h, hkv, pdl=pdl)
            o = decode_attention(q, cache.k[i], cache.v[i], pos, start, kv_len, fuse_combine=True, pdl=pdl)
        res = stream_gemm(o.view(o.shape[0], h * cfg.head_dim), a.o_proj.weight, residual=res, **gk)
        act = normed(res, mlp.up_proj.weight, layer.ln_2.weight, silu_mul=True)
        res = stream_gemm(act, mlp.down_proj.weight, residual=res, **gk)
    logits = normed(res, model.lm_head.weight, model.norm.weight)[:, : cfg.vocab_size]
    return logits, (argmax_rows(logits) if greedy else None)


def step_bytes(model: DecoderLM, cache: KVCache, n: int, mean_len: float) -> float:
    """HBM bytes one fused decode step must move at least: every weight once (the embedding: n rows), each row's
    K and V for its ``mean_len`` cached positions in every layer, and its new K/V written (the roofline)."""
    cfg = model.cfg
    el = next(model.parameters()).element_size()
    weights = sum(p.numel() for name, p in model.named_parameters() if name != "embed_tokens.weight") * el
    embed = n * cfg.hidden_size * el
    kv_el = cache.k.element_size()
    kv = 2 * cfg.n_layers * n * (cfg.n_kv_heads * cfg.head_dim) * (mean_len + 1) * kv_el
    return float(weights + embed + kv)


__all__ = ["COMBINE_ONE_SHOT", "GEMMS", "NORM_PROLOGUE_ROWS", "ROPE_IN_ATTENTION", "TRITON_ARGMAX", "add_rmsnorm",
           "add_rmsnorm_ref", "argmax_rows", "attention_splits", "decode_attention", "decode_attention_ref",
           "fused_decode", "rope_decode_attention", "rope_kv", "rope_kv_ref", "silu_mul", "silu_mul_ref", "step_bytes",
           "supports", "use_triton"]
