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

    @triton.jit
    def _varlen_attn_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, meta_ptr, n_blocks, n_seqs, sm_scale, GROUP,
                            s_qn, s_qh, s_ks, s_kh, s_kl, s_on, s_oh,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
        # meta (int32): [blk_seq (n_blocks), blk_row (n_blocks), cu (n_seqs + 1), slot (n_seqs), start (n_seqs)]
        b = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.load(meta_ptr + b)
        m0 = tl.load(meta_ptr + n_blocks + b)
        base = 2 * n_blocks
        q0 = tl.load(meta_ptr + base + s)
        qlen = tl.load(meta_ptr + base + s + 1) - q0
        slot = tl.load(meta_ptr + base + n_seqs + 1 + s).to(tl.int64)
        ctx = tl.load(meta_ptr + base + 2 * n_seqs + 1 + s)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        mmask = offs_m < qlen
        rows = (q0 + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * s_qn + head * s_qh + offs_d[None, :], mask=mmask[:, None], other=0.0)
        qpos = ctx + offs_m
        kvh = head // GROUP
        kbase = kc_ptr + slot * s_ks + kvh * s_kh
        vbase = vc_ptr + slot * s_ks + kvh * s_kh
        end = ctx + tl.minimum(m0 + BLOCK_M, qlen)  # keys 0 .. end - 1: up to this block's last query
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
        acc = acc / l_i[:, None]
        tl.store(out_ptr + rows[:, None] * s_on + head * s_oh + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mmask[:, None])


def kernel_supported(q: torch.Tensor, kc: torch.Tensor) -> bool:
    """Whether the Triton kernel can run: Triton present, CUDA tensors (or TRITON_INTERPRET=1), a power-of-two
    head_dim >= 16."""
    d = q.shape[-1]
    return (triton is not None and (q.is_cuda or _interpret()) and d >= 16 and d & (d - 1) == 0
            and q.dtype in (torch.float32, torch.float16, torch.bfloat16))


def varlen_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, seqs: PackedSeqs,
                     meta: torch.Tensor | None = None) -> torch.Tensor:
    """``varlen_attention_ref``'s result from one Triton launch for all sequences (the reference where the kernel
    cannot run, see ``kernel_supported``). ``meta``: the int32 table from ``kernel_meta`` on q's device (built
    once per forward and shared by every layer). Raises ValueError for mismatched shapes."""
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
    out = torch.empty_like(q)
    if kc.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the cache must be contiguous in head_dim")
    _varlen_attn_kernel[(n_blocks, h)](
        q, kc, vc, out, meta, n_blocks, len(seqs.lens), d ** -0.5, h // kc.shape[1],
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=d, PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2)
    return out


def kernel_meta(seqs: PackedSeqs, device) -> torch.Tensor:
    """The kernel's int32 table: block -> (sequence, first row), then cu offsets, slots and starts."""
    bs, br = seqs.blocks()
    host = torch.tensor(bs + br + seqs.cu + seqs.slots + seqs.starts, dtype=torch.int32)
    return host.to(device, non_blocking=True)


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
    if not all_positions:
        last = torch.tensor([c - 1 for c in seqs.cu[1:]], device=dev)
        x = x[last]
    return model.lm_head(model.norm(x))
