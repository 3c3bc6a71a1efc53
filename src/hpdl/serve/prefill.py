"""Packed variable-length prefill: prompts (or prompt chunks) concatenated with no padding, one attention
launch per layer, K/V written straight into the slot cache.

The eager prefill pads every prompt of a batch to the longest one (``[B, T_max]``); a batch of a 16-token and a
1000-token prompt computes 2000 positions for 1016 real ones. Here the tokens of every sequence are packed into
one ``[N]`` row (``N = sum of lengths``, cu_seqlens-style offsets, as FlashAttention-2's ``varlen`` API, Dao 2023)
and each layer runs its GEMMs on ``[N, C]`` and one attention kernel over all sequences.

A sequence may be a *chunk* of a prompt (chunked prefill, Sarathi-Serve, Agrawal et al., OSDI 2024): its queries
sit at positions ``ctx .. ctx + len - 1`` and attend to the ``ctx`` positions already in its slot's cache plus
the chunk itself (causal). The attention kernel therefore reads keys and values from the slot cache, after the
chunk's own K/V were written there, so a chunk and a whole prompt are the same case (``ctx = 0``).

``varlen_attention`` is a Triton kernel (FlashAttention-2's online softmax; one program per (query block of one
sequence, query head); GQA by indexing the KV head) on CUDA or under ``TRITON_INTERPRET=1``, and
``varlen_attention_ref`` (torch SDPA per sequence, the eager model's arithmetic) elsewhere.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hpdl.models.gpt import DecoderLM, KVCache
from hpdl.models.layers import rotate_half

try:  # Triton ships with CUDA builds of torch; CPU-only installs use the torch reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

log = logging.getLogger("hpdl.serve")

BLOCK_M = 64  # query rows per program
BLOCK_N = 64  # keys per inner iteration


def _interpret() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass
class PackedSeqs:
    """Host description of a packed batch of sequences (prompts or prompt chunks).

    ``slots[s]``: the KV slot of sequence s; ``starts[s]``: its first position (tokens already cached in the slot:
    0 for a whole prompt, > 0 for a later chunk); ``lens[s]``: its new tokens (>= 1). Sequence s's tokens are
    rows ``cu[s] .. cu[s + 1] - 1`` of the packed tensors, ``cu = [0, cumsum(lens)]``.
    """

    slots: list[int]
    starts: list[int]
    lens: list[int]

    def __post_init__(self):
        if not (len(self.slots) == len(self.starts) == len(self.lens)) or not self.slots:
            raise ValueError(f"slots, starts and lens must be non-empty lists of one length, got "
                             f"{len(self.slots)}, {len(self.starts)}, {len(self.lens)}")
        if min(self.lens) < 1 or min(self.starts) < 0:
            raise ValueError(f"lens must be >= 1 and starts >= 0, got lens={self.lens}, starts={self.starts}")

    @property
    def cu(self) -> list[int]:
        out = [0]
        for n in self.lens:
            out.append(out[-1] + n)
        return out

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)

    def positions(self) -> list[int]:
        return [p for s, n in zip(self.starts, self.lens) for p in range(s, s + n)]

    def token_slots(self) -> list[int]:
        return [sl for sl, n in zip(self.slots, self.lens) for _ in range(n)]

    def blocks(self, block_m: int = BLOCK_M) -> tuple[list[int], list[int]]:
        """(sequence, first query row within it) of every query block the kernel's grid covers."""
        seq, row = [], []
        for s, n in enumerate(self.lens):
            for m in range(0, n, block_m):
                seq.append(s)
                row.append(m)
        return seq, row


def padded_tokens(lens: list[int]) -> int:
    """Positions a right-padded batch of these lengths computes (rows x longest); packed computes ``sum(lens)``."""
    return len(lens) * max(lens) if lens else 0


# --- attention ------------------------------------------------------------------------------------
def varlen_attention_ref(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
    """Causal attention of packed queries over the slot cache (torch SDPA, one call per sequence).

    q ``[N, h, d]`` (after RoPE); kc, vc ``[S, hkv, L, d]`` one layer's cache, already holding every sequence's
    new K/V at ``starts[s] .. starts[s] + lens[s] - 1``. Query i of sequence s (position ``starts[s] + i``)
    attends to cache positions ``0 .. starts[s] + i``. Returns ``[N, h, d]`` in q's dtype.
    """
    h, hkv = q.shape[1], kc.shape[1]
    out = torch.empty_like(q)
    cu = seqs.cu
    for s, (slot, st, n) in enumerate(zip(seqs.slots, seqs.starts, seqs.lens)):
        qs = q[cu[s]:cu[s + 1]].transpose(0, 1)[None]  # (1, h, n, d)
        k = kc[slot, :, : st + n].repeat_interleave(h // hkv, 0)[None]  # (1, h, st + n, d)
        v = vc[slot, :, : st + n].repeat_interleave(h // hkv, 0)[None]
        if st == 0:  # a whole prompt: the eager prefill's own call
            y = F.scaled_dot_product_attention(qs, k, v, is_causal=True)
        else:  # a later chunk: query i sees keys 0 .. st + i
            mask = torch.arange(st + n, device=q.device)[None, :] <= torch.arange(st, st + n, device=q.device)[:, None]
            y = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask)
        out[cu[s]:cu[s + 1]] = y[0].transpose(0, 1)
    return out


if triton is not None:

    # MB, MS (the table's capacities) change with every batch when the table is exact: specialising on them
    # (Triton compiles a variant per "== 1" / "% 16 == 0" class of each int argument) would compile mid-serving
    @triton.jit(do_not_specialize=["MB", "MS"])
    def _varlen_attn_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, meta_ptr, MB, MS, sm_scale, GROUP,
                            s_qn, s_qh, s_ks, s_kh, s_kl, s_on, s_oh,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
        # meta (int64, see kernel_meta): [n_blocks, n_seqs, n_tokens, blk_seq (MB), blk_row (MB), cu (MS + 1),
        # slot (MS), start (MS)]; the grid may cover more than n_blocks blocks (a CUDA graph's fixed grid): the
        # extra programs store nothing
        b = tl.program_id(0)
        head = tl.program_id(1)
        live = b < tl.load(meta_ptr).to(tl.int32)
        s = tl.load(meta_ptr + 3 + b).to(tl.int32)
        m0 = tl.load(meta_ptr + 3 + MB + b).to(tl.int32)
        base = 3 + 2 * MB
        q0 = tl.load(meta_ptr + base + s).to(tl.int32)
        qlen = tl.where(live, tl.load(meta_ptr + base + s + 1).to(tl.int32) - q0, 0)
        slot = tl.load(meta_ptr + base + MS + 1 + s)  # int64: slot * s_ks can pass 2**31
        ctx = tl.load(meta_ptr + base + 2 * MS + 1 + s).to(tl.int32)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        mmask = offs_m < qlen
        rows = (q0 + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * s_qn + head * s_qh + offs_d[None, :], mask=mmask[:, None], other=0.0)
        qpos = ctx + offs_m
        kvh = head // GROUP
        kbase = kc_ptr + slot * s_ks + kvh * s_kh
        vbase = vc_ptr + slot * s_ks + kvh * s_kh
        end = tl.where(live, ctx + tl.minimum(m0 + BLOCK_M, qlen), 0)  # keys 0 .. end - 1: to this block's last query
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < end
            k = tl.load(kbase + offs_n[:, None] * s_kl + offs_d[None, :], mask=nmask[:, None], other=0.0)
            v = tl.load(vbase + offs_n[:, None] * s_kl + offs_d[None, :], mask=nmask[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * sm_scale
            sc = tl.where((offs_n[None, :] <= qpos[:, None]) & nmask[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC).to(tl.float32)
            m_i = m_new
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i = 0 only in rows that store nothing
        tl.store(out_ptr + rows[:, None] * s_on + head * s_oh + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mmask[:, None])

    @triton.jit
    def _rope_kv_packed_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, meta_ptr, q_ptr, kc_ptr, vc_ptr,
                               s_slot, s_head, s_pos, H, HKV, D: tl.constexpr, ROPE: tl.constexpr):
        # one program per (packed row, head of q | k | v); rows >= n_tokens (meta[2]: a CUDA graph's padding) store
        # nothing. The rotation rounds as the eager model does: each product, then the sum, in the model dtype.
        row = tl.program_id(0)
        head = tl.program_id(1)
        live = row < tl.load(meta_ptr + 2)
        half = tl.arange(0, D // 2)
        p = tl.load(pos_ptr + row)
        base = qkv_ptr + (row.to(tl.int64) * (H + 2 * HKV) + head) * D
        dt = qkv_ptr.dtype.element_ty
        x1 = tl.load(base + half)
        x2 = tl.load(base + D // 2 + half)
        o1 = x1
        o2 = x2
        if ROPE:
            if head < H + HKV:
                # products of two model-dtype values are exact in float32: rounding each once is the eager op
                c = tl.load(cos_ptr + p * D + half).to(dt).to(tl.float32)
                s = tl.load(sin_ptr + p * D + half).to(dt).to(tl.float32)
                a1 = x1.to(tl.float32)
                a2 = x2.to(tl.float32)
                o1 = ((a1 * c).to(dt).to(tl.float32) + (-(a2 * s)).to(dt).to(tl.float32)).to(dt)
                o2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
        if head < H:
            dst = q_ptr + (row.to(tl.int64) * H + head) * D
        else:
            slot = tl.load(slot_ptr + row)
            kv = head - H
            cache = kc_ptr
            if head >= H + HKV:
                kv = head - H - HKV
                cache = vc_ptr
            dst = cache + slot * s_slot + kv * s_head + p * s_pos
        m = (half < D // 2) & live
        tl.store(dst + half, o1, mask=m)
        tl.store(dst + D // 2 + half, o2, mask=m)


def kernel_supported(q: torch.Tensor, kc: torch.Tensor) -> bool:
    """Whether the Triton kernel can run: Triton present, CUDA tensors (or TRITON_INTERPRET=1), a power-of-two
    head_dim >= 16."""
    d = q.shape[-1]
    return (triton is not None and (q.is_cuda or _interpret()) and d >= 16 and d & (d - 1) == 0
            and q.dtype in (torch.float32, torch.float16, torch.bfloat16))


def varlen_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, seqs: PackedSeqs,
                     meta: torch.Tensor | None = None) -> torch.Tensor:
    """``varlen_attention_ref``'s result from one Triton launch for all sequences (the reference where the kernel
    cannot run, see ``kernel_supported``). ``meta``: the table from ``kernel_meta(seqs, q.device)`` (built once
    per forward and shared by every layer). Raises ValueError for mismatched shapes."""
    N, h, d = q.shape
    if kc.dim() != 4 or kc.shape[-1] != d or vc.shape != kc.shape or h % kc.shape[1]:
        raise ValueError(f"q [N, h, d] = {tuple(q.shape)} needs kc, vc [S, hkv, L, d] with h % hkv == 0, got "
                         f"{tuple(kc.shape)}, {tuple(vc.shape)}")
    if N != seqs.num_tokens:
        raise ValueError(f"q has {N} rows but seqs hold {seqs.num_tokens} tokens")
    if not kernel_supported(q, kc):
        return varlen_attention_ref(q, kc, vc, seqs)
    if meta is None:
        meta = kernel_meta(seqs, q.device)
    n_blocks = len(seqs.blocks()[0])
    return _attend(q, kc, vc, meta, n_blocks, n_blocks, len(seqs.lens))


def _attend(q, kc, vc, meta, grid_blocks: int, MB: int, MS: int) -> torch.Tensor:
    """One launch of the varlen kernel over ``grid_blocks`` query blocks (>= the table's n_blocks); ``MB``, ``MS``:
    the table's capacities (``kernel_meta``). Rows no block covers (a graph's padding) are left unwritten."""
    N, h, d = q.shape
    if kc.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the cache must be contiguous in head_dim")
    out = torch.empty_like(q)
    _varlen_attn_kernel[(grid_blocks, h)](
        q, kc, vc, out, meta, MB, MS, d ** -0.5, h // kc.shape[1],
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=d, PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2)
    return out


def meta_size(MB: int, MS: int) -> int:
    """Entries of a ``kernel_meta`` table with room for ``MB`` query blocks and ``MS`` sequences."""
    return 3 + 2 * MB + 3 * MS + 1


def max_blocks(num_tokens: int, max_seqs: int) -> int:
    """The most query blocks ``num_tokens`` tokens in at most ``max_seqs`` sequences can need (each sequence's
    last block may be partial)."""
    return -(-num_tokens // BLOCK_M) + min(max_seqs, num_tokens)


def kernel_meta(seqs: PackedSeqs, device=None, MB: int | None = None, MS: int | None = None,
                host: bool = False) -> torch.Tensor:
    """The kernels' int64 table: ``[n_blocks, n_seqs, n_tokens, blk_seq (MB), blk_row (MB), cu (MS + 1),
    slot (MS), start (MS)]`` (block -> (sequence, first row), then cu offsets, slots and starts), with capacities
    ``MB`` >= n_blocks and ``MS`` >= n_seqs (default: exact). On ``device`` (copied without a host sync), or
    the host tensor with ``host=True``. Raises ValueError if a capacity is too small."""
    bs, br = seqs.blocks()
    nb, ns = len(bs), len(seqs.lens)
    MB, MS = nb if MB is None else MB, ns if MS is None else MS
    if nb > MB or ns > MS:
        raise ValueError(f"the table holds {MB} blocks and {MS} sequences; these need {nb} and {ns}")
    zb, zs = [0] * (MB - nb), [0] * (MS - ns)
    cu = seqs.cu
    t = torch.tensor([nb, ns, cu[-1]] + bs + zb + br + zb + cu + zs + seqs.slots + zs + seqs.starts + zs,
                     dtype=torch.long)
    return t if host else t.to(device, non_blocking=True)


def rope_kv_packed(qkv: torch.Tensor, model: DecoderLM, pos: torch.Tensor, slot: torch.Tensor, meta: torch.Tensor,
                   kc: torch.Tensor, vc: torch.Tensor, h: int, hkv: int) -> torch.Tensor:
    """One Triton launch: qkv ``[R, (h + 2 hkv) d]`` -> q ``[R, h, d]`` (rotated for LLaMA), and each of the first
    ``meta[2]`` rows' k (rotated) and v stored at ``kc/vc[slot[r], :, pos[r]]``; rows past ``meta[2]`` store
    nothing (a CUDA graph's padding). The eager arithmetic of ``packed_forward`` (each product, then the sum,
    rounded to the model dtype)."""
    R, d = qkv.shape[0], kc.shape[-1]
    q = torch.empty(R, h, d, dtype=qkv.dtype, device=qkv.device)
    rope = model.cfg.arch != "gpt2"
    cos, sin = (model.cos, model.sin) if rope else (qkv, qkv)  # unused without RoPE
    _rope_kv_packed_kernel[(R, h + 2 * hkv)](qkv, cos, sin, pos, slot, meta, q, kc, vc, kc.stride(0),
                                             kc.stride(1), kc.stride(2), h, hkv, D=d, ROPE=rope)
    return q


# --- the packed forward -----------------------------------------------------------------------------
@torch.inference_mode()
def packed_forward(model: DecoderLM, cache: KVCache, tokens: torch.Tensor, seqs: PackedSeqs,
                   all_positions: bool = False) -> torch.Tensor:
    """One forward of packed sequences: tokens ``[N]`` int64 -> logits ``[num_seqs, vocab]`` of each sequence's
    last token (``all_positions``: ``[N, vocab]``, every token's). Writes each token's K/V into
    ``cache[layer, slots[s], :, starts[s] + i]``.

    The model's own modules run every op but attention (norms, the TP-sharded GEMMs with their collectives, RoPE
    in the eager rounding, GPT-2's learned positions), so a whole prompt gives the eager prefill's logits; only
    the padding is gone. Raises ValueError when tokens and ``seqs`` disagree or a sequence would pass the
    cache's ``max_seq_len``.
    """
    N = tokens.shape[0]
    if tokens.dim() != 1 or N != seqs.num_tokens:
        raise ValueError(f"tokens must be [N] with N = {seqs.num_tokens} (sum of lens), got {tuple(tokens.shape)}")
    if max(s + n for s, n in zip(seqs.starts, seqs.lens)) > cache.max_seq_len:
        raise ValueError(f"a sequence ends past max_seq_len={cache.max_seq_len}: starts={seqs.starts}, "
                         f"lens={seqs.lens}")
    dev = tokens.device
    idx = torch.tensor([seqs.positions(), seqs.token_slots()], dtype=torch.long).to(dev, non_blocking=True)
    pos, tok_slot = idx[0], idx[1]
    x = model.embed_tokens(tokens)  # (N, C)
    rope = None
    if model.cfg.arch == "gpt2":
        x = x + model.wpe(pos)
    else:
        rope = (model.cos[pos].to(x.dtype)[:, None], model.sin[pos].to(x.dtype)[:, None])  # (N, 1, d)
    meta = None
    for layer in model.layers:
        a = layer.attn
        qkv = a.qkv_proj(layer.ln_1(x)).view(N, a.h + 2 * a.hkv, a.d)
        qk, v = qkv[:, : a.h + a.hkv], qkv[:, a.h + a.hkv:]
        if rope is not None:
            qk = qk * rope[0] + rotate_half(qk) * rope[1]
        kc, vc = cache.k[a.layer], cache.v[a.layer]  # (S, hkv, L, d)
        kc[tok_slot, :, pos] = qk[:, a.h:]
        vc[tok_slot, :, pos] = v
        q = qk[:, : a.h].contiguous()
        if meta is None and kernel_supported(q, kc):
            meta = kernel_meta(seqs, dev)
        y = varlen_attention(q, kc, vc, seqs, meta)  # (N, h, d)
        x = x + a.o_proj(y.reshape(N, a.h * a.d))
        x = x + layer.mlp(layer.ln_2(x))
    if not all_positions:  # non_blocking: torch.tensor(..., device=cuda) would wait for the layers above
        last = torch.tensor([c - 1 for c in seqs.cu[1:]]).to(dev, non_blocking=True)
        x = x[last]
    return model.lm_head(model.norm(x))


# --- the serving path: metadata built once, no host sync, CUDA graphs per token bucket ----------------------
GRAPH_BUCKETS = (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)


def token_bucket(n: int, buckets: tuple[int, ...] = GRAPH_BUCKETS) -> int | None:
    """The smallest bucket >= ``n`` tokens, or None above the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class PackedPrefill:
    """The engine's packed prefill (``packed_forward``'s logits) at a fixed host cost per step.

    An eager packed forward of a 1.1B LLaMA dispatches 30 torch ops a layer (660 in all, 225 of them views) plus a
    Triton launch. On the H200 a mixed step cost ~13 ms whatever its chunk (2026-12-04: 14.9 ms with a 16-token
    chunk, 16.5 ms with 2,032 tokens), the signature of host launch cost rather than GPU work, so small chunks ran
    at the launch rate. Here a batch's metadata (token ids, positions, slots, the last row of each sequence and the
    attention kernel's block table) is built on the host once and sent in one non-blocking copy; RoPE and the K/V
    store are one Triton kernel a layer; no op waits for the device. With ``cuda_graph`` (CUDA, one device), a batch
    of up to ``buckets[-1]`` tokens is padded to its bucket and replays the CUDA graph captured for that bucket
    (captured on first use, or by ``capture``): padding rows are computed but store no K/V and are never sampled,
    and the attention grid covers the bucket's most blocks (``max_blocks``), programs past the batch's storing
    nothing. Larger batches, where the GPU time hides the launches, run the same ops eagerly, unpadded.

    Args:
        model, cache: the runner's model and KV cache.
        max_seqs: the most sequences one batch holds (the cache's slots).
        cuda_graph: capture graphs (ignored off CUDA and under tensor parallelism; a failed capture falls back to
            eager, ``graph_error`` says why).
        buckets: token counts graphs are captured for (ascending); ``pad``: pad to them without graphs too (the
            CPU check of the padded path under TRITON_INTERPRET=1); None = pad exactly when graphs run.
    """

    def __init__(self, model: DecoderLM, cache: KVCache, max_seqs: int, cuda_graph: bool = False,
                 buckets: tuple[int, ...] = GRAPH_BUCKETS, pad: bool | None = None):
        if max_seqs < 1 or list(buckets) != sorted(set(buckets)) or (buckets and buckets[0] < 1):
            raise ValueError(f"max_seqs must be >= 1 and buckets ascending positive ints, got {max_seqs}, {buckets}")
        self.model, self.cache, self.max_seqs, self.buckets = model, cache, max_seqs, tuple(buckets)
        self.device = next(model.parameters()).device
        self.cuda_graph = bool(cuda_graph and self.device.type == "cuda" and model.group is None and buckets)
        self.pad = self.cuda_graph if pad is None else bool(pad and buckets)
        self.graph_error: str | None = None
        self.graphs: dict[int, tuple] = {}
        self._pool = None
        self.cap = self.buckets[-1] if buckets else 0
        self.MB = max_blocks(self.cap, max_seqs)
        self._static = None  # the padded path's device buffer: one layout, _layout(cap, max_seqs, MB)

    @staticmethod
    def _host(tokens: list[int], seqs: PackedSeqs, cap: int, MS: int, MB: int) -> torch.Tensor:
        """``[tokens | positions | slots]`` (``cap`` rows each, zero padded), last row of each sequence (``MS``),
        then the kernel table (``kernel_meta``): one int64 host tensor."""
        pad = [0] * (cap - len(tokens))
        last = [c - 1 for c in seqs.cu[1:]]
        rows = tokens + pad + seqs.positions() + pad + seqs.token_slots() + pad + last + [0] * (MS - len(last))
        return torch.cat([torch.tensor(rows, dtype=torch.long), kernel_meta(seqs, MB=MB, MS=MS, host=True)])

    def _body(self, buf: torch.Tensor, cap: int, R: int, MS: int, MB: int, grid: int) -> torch.Tensor:
        """The forward over the first ``R`` rows of ``buf`` (laid out by ``_host``): only device ops, no sync."""
        m, cache = self.model, self.cache
        tok, pos, slot = buf[:R], buf[cap:cap + R], buf[2 * cap:2 * cap + R]
        last, meta = buf[3 * cap:3 * cap + MS], buf[3 * cap + MS:]
        x = m.embed_tokens(tok)  # (R, C)
        if m.cfg.arch == "gpt2":
            x = x + m.wpe(pos)
        for layer in m.layers:
            a = layer.attn
            qkv = a.qkv_proj(layer.ln_1(x))
            kc, vc = cache.k[a.layer], cache.v[a.layer]
            q = rope_kv_packed(qkv, m, pos, slot, meta, kc, vc, a.h, a.hkv)
            y = _attend(q, kc, vc, meta, grid, MB, MS)
            x = x + a.o_proj(y.view(R, a.h * a.d))
            x = x + layer.mlp(layer.ln_2(x))
        return m.lm_head(m.norm(x[last]))

    @torch.inference_mode()
    def forward(self, tokens: list[int], seqs: PackedSeqs) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` of each sequence's last token (``packed_forward``'s); writes the K/V.
        With a graph the result is a view of the graph's output: read it before the next call. Raises
        ValueError when tokens and ``seqs`` disagree, a sequence passes ``max_seq_len``, or there are more than
        ``max_seqs`` sequences."""
        S, N = len(seqs.lens), seqs.num_tokens
        if len(tokens) != N:
            raise ValueError(f"tokens has {len(tokens)} ids but seqs hold {N} tokens")
        if S > self.max_seqs:
            raise ValueError(f"{S} sequences exceed max_seqs={self.max_seqs}")
        if max(s + n for s, n in zip(seqs.starts, seqs.lens)) > self.cache.max_seq_len:
            raise ValueError(f"a sequence ends past max_seq_len={self.cache.max_seq_len}: starts={seqs.starts}, "
                             f"lens={seqs.lens}")
        probe = self.cache.k[0]
        if not kernel_supported(probe, probe):
            toks = torch.tensor(tokens, dtype=torch.long).to(self.device, non_blocking=True)
            return packed_forward(self.model, self.cache, toks, seqs)
        nb = token_bucket(N, self.buckets) if self.pad else None
        if nb is None:  # exact: no padding, this batch's own table
            n_blocks = len(seqs.blocks()[0])
            buf = self._host(tokens, seqs, N, S, n_blocks).to(self.device, non_blocking=True)
            return self._body(buf, N, N, S, n_blocks, n_blocks)
        if self._static is None:
            self._static = torch.zeros(3 * self.cap + self.max_seqs + meta_size(self.MB, self.max_seqs),
                                       dtype=torch.long, device=self.device)
        self._static.copy_(self._host(tokens, seqs, self.cap, self.max_seqs, self.MB), non_blocking=True)
        args = (self._static, self.cap, nb, self.max_seqs, self.MB, max_blocks(nb, self.max_seqs))
        if not self.cuda_graph:
            return self._body(*args)[:S]
        try:
            graph = self.graphs.get(nb) or self._capture(nb, args)
        except RuntimeError as exc:  # capture unsupported here: keep serving eagerly, and say so
            log.warning("CUDA graph prefill failed (%s); running the packed prefill eagerly", exc)
            self.cuda_graph, self.graph_error = False, repr(exc)[:300]
            torch.cuda.synchronize(self.device)
            return self.forward(tokens, seqs)
        graph[0].replay()
        return graph[1][:S]

    def _capture(self, nb: int, args: tuple) -> tuple:
        # the warm-up runs (Triton compiles, cuBLAS workspaces) compute the current batch, writing the K/V it
        # writes anyway (twice the same values); the capture itself runs nothing: forward replays it next
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(2):
                self._body(*args)
        torch.cuda.current_stream(self.device).wait_stream(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            out = self._body(*args)
        self.graphs[nb] = (g, out)
        return self.graphs[nb]

    def capture(self, max_tokens: int) -> int:
        """Capture the graphs of every bucket up to ``max_tokens`` now (so no request waits for a capture): each
        with a batch of that many tokens spread over slots from 0 (it writes their K/V: call it before serving).
        Returns the number of graphs held; 0 without graphs."""
        L = self.cache.max_seq_len
        for nb in self.buckets:
            if not self.cuda_graph or nb > max_tokens or nb in self.graphs:
                continue
            lens = [min(L, nb - i) for i in range(0, nb, L)]
            if len(lens) > min(self.max_seqs, self.cache.num_slots):
                break
            seqs = PackedSeqs(list(range(len(lens))), [0] * len(lens), lens)
            self.forward([1] * nb, seqs)
        return len(self.graphs)
