"""Decoder-only language models (GPT-2 and LLaMA) with a slot KV cache and tensor parallelism.

One readable file in the nanoGPT manner: config, tensor-parallel linear layers, norms, attention, MLP,
block, model, then loading of Hugging Face format checkpoints (``config.json`` + ``*.safetensors``).

This is hpdl's one decoder: :mod:`hpdl.models.gpt_moe` is the same :class:`Block` (norms, :class:`Attention`,
RoPE, KV-cache writes) with a mixture-of-experts block in place of the :class:`MLP` on its MoE layers, and
:class:`MoEConfig <hpdl.models.gpt_moe.MoEConfig>` extends :class:`DecoderConfig`.

KV-cache layout (Flover, arXiv 2305.13484, section 3): the cache is pre-allocated as ``num_slots``
fixed-size slots, ``k, v: [n_layers, num_slots, n_kv_heads_local, max_seq_len, head_dim]``. A request owns one
slot for its lifetime. The fused decode step reads the contiguous slot range ``[start, start + n)`` as a
view (no gather), which is why the engine keeps live slots contiguous by buffer reordering.

Tensor parallelism (Megatron-LM, arXiv 1909.08053): q/k/v and the MLP's first matrices are split by
output columns (heads), the attention output and MLP down projections by input rows followed by one
all-reduce, and the LM head by vocabulary rows followed by an all-gather of the logits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hpdl.models.layers import RMSNorm, apply_rope


def check_int(cfg, name: str, minimum: int) -> None:
    """Raise ValueError unless ``cfg.<name>`` is an int (not a bool) ``>= minimum``, naming the field."""
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass
class DecoderConfig:
    """Architecture of a decoder-only model; ``arch`` is ``"gpt2"`` or ``"llama"``.

    Every arch but ``"gpt2"`` is a LLaMA-style block (RMSNorm, RoPE, SwiGLU, no biases but optional q/k/v ones).
    ``attention_bias``: biases on the q/k/v projections (Qwen2); GPT-2 has biases everywhere regardless.
    ``qk_norm``: RMSNorm over all q and all k features before RoPE (OLMoE; needs tensor-parallel world 1).
    """

    ARCHS: ClassVar[tuple[str, ...]] = ("gpt2", "llama")
    arch: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 2048
    n_layers: int = 22
    n_heads: int = 32
    n_kv_heads: int = 4
    intermediate_size: int = 5632
    max_position: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    head_dim_: int | None = field(default=None, repr=False)
    attention_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self):
        """Raises:
            ValueError: a field of the wrong type or range (named, with the expected value), or sizes that do
                not divide (heads by KV heads, hidden size by heads), or an odd RoPE head size.
        """
        if self.arch not in self.ARCHS:
            raise ValueError(f"arch must be one of {self.ARCHS}, got {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size",
                     "max_position"):
            check_int(self, name, 1)
        for name in ("head_dim_", "bos_token_id", "eos_token_id"):
            if getattr(self, name) is not None:
                check_int(self, name, 1 if name == "head_dim_" else 0)
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim_ is None and self.hidden_size % self.n_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be a multiple of n_heads={self.n_heads}")
        if self.arch != "gpt2" and self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embedding rotates pairs)")

    @property
    def head_dim(self) -> int:
        return self.head_dim_ or self.hidden_size // self.n_heads

    @classmethod
    def from_hf(cls, cfg: dict) -> "DecoderConfig":
        """Translate a Hugging Face ``config.json`` dict (GPT2 or Llama model_type)."""
        mt = cfg.get("model_type")
        eos = cfg.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        if mt == "gpt2":
            return cls(arch="gpt2", vocab_size=cfg["vocab_size"], hidden_size=cfg["n_embd"], n_layers=cfg["n_layer"],
                       n_heads=cfg["n_head"], n_kv_heads=cfg["n_head"],
                       intermediate_size=cfg.get("n_inner") or 4 * cfg["n_embd"], max_position=cfg["n_positions"],
                       norm_eps=cfg.get("layer_norm_epsilon", 1e-5), tie_word_embeddings=True,
                       bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos)
        if mt == "llama":
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                raise ValueError(f"only default RoPE is supported, config has rope_type={rope.get('rope_type')!r}")
            return cls(arch="llama", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                       n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                       n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                       intermediate_size=cfg["intermediate_size"], max_position=cfg["max_position_embeddings"],
                       norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 1e4)),
                       tie_word_embeddings=cfg.get("tie_word_embeddings", False), bos_token_id=cfg.get("bos_token_id"),
                       eos_token_id=eos, head_dim_=cfg.get("head_dim"))
        raise ValueError(f"config.json model_type must be 'gpt2' or 'llama', got {mt!r}")

    def to_hf(self):
        """The equivalent ``transformers`` config object (for baselines and tests)."""
        import transformers
        if self.arch == "gpt2":
            return transformers.GPT2Config(vocab_size=self.vocab_size, n_embd=self.hidden_size, n_layer=self.n_layers,
                                           n_head=self.n_heads, n_inner=self.intermediate_size,
                                           n_positions=self.max_position, layer_norm_epsilon=self.norm_eps,
                                           bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id)
        if self.attention_bias or self.qk_norm:  # HF Llama's attention_bias also biases o_proj; no qk-norm
            raise ValueError("a Llama config has attention_bias=False and qk_norm=False")
        return transformers.LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                                        num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
                                        num_key_value_heads=self.n_kv_heads, intermediate_size=self.intermediate_size,
                                        max_position_embeddings=self.max_position, rms_norm_eps=self.norm_eps,
                                        rope_theta=self.rope_theta, tie_word_embeddings=self.tie_word_embeddings,
                                        bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
                                        head_dim=self.head_dim)


# --- tensor-parallel linear layers -------------------------------------------------------------------
def _tp(group) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


class ColumnParallelLinear(nn.Linear):
    """y = x W_shard^T over ``parts``: fused matrices (q|k|v, gate|up), each split by output rows (``tp_dim = 0``).

    Rank r holds rows ``[r*ceil(P/ws), ...)`` of every part P, concatenated; one GEMM serves them all.
    """

    def __init__(self, in_f: int, parts: list[int], bias: bool, group=None, gather: bool = False):
        rank, ws = _tp(group)
        self.parts, self.local = list(parts), [math.ceil(p / ws) for p in parts]
        self.out_full, self.group, self.gather, self.tp_dim = sum(parts), group, gather, 0
        super().__init__(in_f, sum(self.local), bias=bias)

    def load_parts(self, name: str, fulls: list[torch.Tensor], rank: int) -> None:
        """Copy this rank's rows of each full part into parameter ``name`` ("weight" or "bias")."""
        p = getattr(self, name)
        if len(fulls) != len(self.parts):
            raise ValueError(f"expected {len(self.parts)} parts for {name}, got {len(fulls)}")
        with torch.no_grad():
            p.zero_()  # vocab padding rows stay zero
            off = 0
            for full, P, n in zip(fulls, self.parts, self.local):
                if full.shape[0] != P or (p.ndim == 2 and full.shape[1] != p.shape[1]):
                    raise ValueError(f"shape mismatch: checkpoint {tuple(full.shape)} vs part of {P} rows x "
                                     f"{p.shape[1] if p.ndim == 2 else ''}")
                lo, hi = min(rank * n, P), min((rank + 1) * n, P)
                p[off:off + hi - lo].copy_(full[lo:hi])
                off += n

    def forward(self, x):
        y = super().forward(x)
        if self.gather and self.group is not None:  # vocab-parallel logits: all-gather the shards
            parts = [torch.empty_like(y) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, y.contiguous(), group=self.group)
            y = torch.cat(parts, dim=-1)
        return y[..., : self.out_full] if self.gather else y


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_shard W_shard^T) + b: each rank holds ``in_features / world`` input columns (``tp_dim = 1``)."""

    def __init__(self, in_f: int, out_f: int, bias: bool, group=None):
        rank, ws = _tp(group)
        self.group, self.tp_dim = group, 1
        self.fast_all_reduce = None  # optional callable(y) -> reduced y or None (too big): see hpdl.serve.worker
        super().__init__(in_f // ws, out_f, bias=bias)

    def forward(self, x):
        y = F.linear(x, self.weight)
        if self.group is not None:
            out = self.fast_all_reduce(y) if self.fast_all_reduce is not None else None
            if out is None:
                dist.all_reduce(y, group=self.group)
                out = y
            y = out
        return y + self.bias if self.bias is not None else y


# --- attention with the slot KV cache ----------------------------------------------------------------
@dataclass
class Batch:
    """How a forward call maps rows to KV slots.

    prefill (``slots`` set): ``tokens [B, T]`` right-padded prompts, row b writes slot ``slots[b]`` positions
    ``0..T-1``; ``last [B]`` is the index of each row's last real token (``all_positions``: logits of every
    position ``[B, T, vocab]`` instead, for prompt logprobs).
    decode (``slots`` None): ``tokens [n, 1]``, row i is slot ``start + i`` at position ``positions[i, 0]`` and
    attends to cache positions ``0..positions[i, 0]`` within the first ``kv_len``.
    """

    positions: torch.Tensor
    slots: torch.Tensor | None = None
    last: torch.Tensor | None = None
    start: int = 0
    kv_len: int = 0
    mask: torch.Tensor | None = None  # decode: set once per forward by DecoderLM
    all_positions: bool = False


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE and the slot KV cache; the one attention of every hpdl decoder.

    Pieces (shapes for a tensor-parallel rank: ``h``, ``hkv`` local heads of ``d`` dims): :meth:`qkv` (fused
    projection, optional q/k RMSNorm, RoPE), :meth:`attend` (SDPA + output projection), and two ways to use the
    cache: :meth:`forward` (hpdl.serve: slot prefill or contiguous decode, see :class:`Batch`) and :meth:`cached`
    (packed tokens of any slots and positions: hpdl.models.gpt_moe and hpdl.moe's engine).
    """

    def __init__(self, cfg: DecoderConfig, layer: int, group=None):
        super().__init__()
        rank, ws = _tp(group)
        if cfg.n_heads % ws or cfg.n_kv_heads % ws:
            raise ValueError(f"n_heads={cfg.n_heads} and n_kv_heads={cfg.n_kv_heads} must divide by tp world {ws}")
        if cfg.qk_norm and ws > 1:  # the norm spans every head: it would need an all-reduce
            raise ValueError(f"qk_norm=True needs tensor-parallel world 1, got {ws}")
        self.layer, self.d = layer, cfg.head_dim
        self.h, self.hkv = cfg.n_heads // ws, cfg.n_kv_heads // ws
        gpt2 = cfg.arch == "gpt2"
        kvd = cfg.n_kv_heads * self.d
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.n_heads * self.d, kvd, kvd],
                                             gpt2 or cfg.attention_bias, group)
        self.o_proj = RowParallelLinear(cfg.n_heads * self.d, cfg.hidden_size, gpt2, group)
        self.q_norm = RMSNorm(cfg.n_heads * self.d, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(kvd, cfg.norm_eps) if cfg.qk_norm else None

    def qkv(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed ``x [..., C]`` -> q ``[..., h, d]``, k and v ``[..., hkv, d]``; with ``rope = (cos, sin)``
        (``[..., 1, d]``, see :func:`rope_at`) q and k are rotated. One GEMM for q, k and v."""
        y = self.qkv_proj(x)
        if self.q_norm is not None:  # OLMoE: RMSNorm over all q (all k) features, before RoPE
            q, k, v = y.split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], -1)
            y = torch.cat([self.q_norm(q), self.k_norm(k), v], -1)
        y = y.view(*x.shape[:-1], self.h + 2 * self.hkv, self.d)
        qk, v = y[..., : self.h + self.hkv, :], y[..., self.h + self.hkv:, :]
        if rope is not None:  # rotate q and k together
            qk = apply_rope(qk, *rope)
        return qk[..., : self.h, :], qk[..., self.h:, :], v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
        """``q [B, T, h, d]``, ``k, v [B, S, hkv, d]``, boolean ``mask [B, T, S]`` (True = attend; None = causal,
        ``S = T``) -> ``o_proj`` output ``[B, T, C]``. SDPA with K/V repeated per query group."""
        B, T = q.shape[:2]
        rep = self.h // self.hkv
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(rep, 1),
                                           v.transpose(1, 2).repeat_interleave(rep, 1),
                                           attn_mask=None if mask is None else mask[:, None], is_causal=mask is None)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.h * self.d))  # (B, h, T, d) -> (B, T, C)

    def _store(self, cache, rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one position per token: ``k, v [N, hkv, d]`` at cache (layer, ``rows [N]``, ``pos [N]``)."""
        cache.k[self.layer, rows, :, pos] = k  # the slot layout: [L, slots, hkv, S, d]
        cache.v[self.layer, rows, :, pos] = v

    def forward(self, x, rope, cache, b: Batch):
        B, T, _ = x.shape
        q, k, v = self.qkv(x, rope)  # (B, T, h | hkv, d)
        kc, vc = cache.k[self.layer], cache.v[self.layer]  # (S, hkv, L, d)
        if b.slots is not None:  # prefill: attend within the prompt, then store K/V into the slots
            kc[b.slots, :, :T] = k.transpose(1, 2)
            vc[b.slots, :, :T] = v.transpose(1, 2)
            return self.attend(q, k, v)  # right padding + causal = no pad mask needed
        # decode: write one position per row, read the contiguous slot range as a view
        n, pos = B, b.positions[:, 0]
        self._store(cache, torch.arange(b.start, b.start + n, device=x.device), pos, k[:, 0], v[:, 0])
        K = kc[b.start:b.start + n, :, :b.kv_len]  # (n, hkv, kv_len, d)
        V = vc[b.start:b.start + n, :, :b.kv_len]
        qg = q.view(n, self.hkv, self.h // self.hkv, self.d)  # GQA without repeating K/V: (n, hkv, g, d)
        s = torch.matmul(qg, K.transpose(-1, -2)) * (self.d ** -0.5)  # (n, hkv, g, kv_len)
        s = s.masked_fill(b.mask, float("-inf"))  # b.mask (n, 1, 1, kv_len): True = not yet written
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(V.dtype)
        y = torch.matmul(p, V).view(n, self.h, 1, self.d)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.h * self.d))

    def cached(self, x: torch.Tensor, rope, cache, slots: torch.Tensor, pos: torch.Tensor,
               kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed tokens: normed ``x [N, C]`` of cache ``slots [N]`` at positions ``pos [N]`` (int64), ``rope``
        ``[N, 1, d]`` or None. Writes every token's K/V at (layer, slot, pos) first, then each token attends to
        positions ``0..pos`` of its own slot within the first ``kv_len`` (default ``max(pos) + 1``, a host read;
        pass the cache length for a sync-free step): one call serves packed prefill and decode.

        Returns ``(o [N, C], k [N, hkv, d], v [N, hkv, d])`` (``o`` after ``o_proj``; k rotated).
        """
        q, k, v = self.qkv(x, rope)
        self._store(cache, slots, pos, k, v)
        S = int(pos.max()) + 1 if kv_len is None else kv_len
        mask = torch.arange(S, device=x.device)[None, :] <= pos[:, None]  # [N, S]
        kc, vc = cache.k[self.layer], cache.v[self.layer]
        o = self.attend(q[:, None], kc[slots, :, :S].transpose(1, 2), vc[slots, :, :S].transpose(1, 2), mask[:, None])
        return o[:, 0], k, v


class MLP(nn.Module):
    """SwiGLU (LLaMA-style archs; gate|up fused in one GEMM, ``up_proj [2I, C]``) or GPT-2's gelu MLP.

    ``size``: the hidden width ``I``, by default ``cfg.intermediate_size`` (MoE models: a shared expert's).
    """

    def __init__(self, cfg: DecoderConfig, group=None, size: int | None = None):
        super().__init__()
        size = cfg.intermediate_size if size is None else size
        self.llama = cfg.arch != "gpt2"
        bias = not self.llama
        n_up = 2 if self.llama else 1
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, [size] * n_up, bias, group)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias, group)

    def forward(self, x):
        if self.llama:  # SwiGLU
            gate, up = self.up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))  # GPT-2's gelu_new


class Block(nn.Module):
    """Pre-norm decoder block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``. ``mlp`` replaces the dense
    :class:`MLP` (hpdl.models.gpt_moe passes its MoE block); it maps ``[..., C]`` to ``[..., C]``."""

    def __init__(self, cfg: DecoderConfig, layer: int, group=None, mlp: nn.Module | None = None):
        super().__init__()
        norm = (lambda: RMSNorm(cfg.hidden_size, cfg.norm_eps)) if cfg.arch != "gpt2" else \
            (lambda: nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps))
        self.ln_1, self.attn, self.ln_2 = norm(), Attention(cfg, layer, group), norm()
        self.mlp = MLP(cfg, group) if mlp is None else mlp

    def forward(self, x, rope, cache, b):
        x = x + self.attn(self.ln_1(x), rope, cache, b)
        return x + self.mlp(self.ln_2(x))


class KVCache:
    """Pre-allocated slot KV cache: ``k, v: [n_layers, num_slots, n_kv_heads_local, max_seq_len, head_dim]``.

    Shared by every decoder in hpdl (this one, :mod:`hpdl.models.gpt_moe`, and the engines of hpdl.serve and
    hpdl.moe): ``cfg`` needs ``n_layers``, ``n_kv_heads``, ``head_dim`` and ``max_position``.
    """

    def __init__(self, cfg: DecoderConfig, num_slots: int, max_seq_len: int, dtype=torch.float32, device="cpu",
                 tp_world: int = 1):
        if max_seq_len > cfg.max_position:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's max_position={cfg.max_position}: pass a "
                             f"max_seq_len <= {cfg.max_position} (hpdl serve: --max-seq-len)")
        shape = (cfg.n_layers, num_slots, cfg.n_kv_heads // tp_world, max_seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_seq_len = num_slots, max_seq_len

    @property
    def bytes_per_slot(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (buffer reordering)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class DecoderLM(nn.Module):
    """GPT-2 or LLaMA decoder; ``forward`` returns logits ``[B, vocab]`` of each row's last token."""

    def __init__(self, cfg: DecoderConfig, group=None):
        super().__init__()
        self.cfg, self.group = cfg, group
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # replicated on every rank
        if cfg.arch == "gpt2":
            self.wpe = nn.Embedding(cfg.max_position, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, group) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if cfg.arch != "gpt2" else \
            nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, [cfg.vocab_size], False, group, gather=True)
        if cfg.arch != "gpt2":
            register_rope(self, cfg)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor, cache: KVCache, b: Batch) -> torch.Tensor:
        """tokens ``[B, T]`` int64 -> logits ``[B, vocab]`` (float of the model dtype) at ``b.last`` (or T-1);
        ``[B, T, vocab]`` with ``b.all_positions``."""
        x = self.embed_tokens(tokens)  # (B, T, C)
        rope = None
        if self.cfg.arch == "gpt2":
            x = x + self.wpe(b.positions)
        else:
            rope = rope_at(self, b.positions, x.dtype)
        if b.slots is None:  # decode: one mask for every layer; position p attends to 0..p
            b.mask = (torch.arange(b.kv_len, device=x.device)[None, :] > b.positions[:, :1])[:, None, None, :]
        for layer in self.layers:
            x = layer(x, rope, cache, b)
        if not b.all_positions:
            x = x[torch.arange(x.shape[0], device=x.device), b.last] if b.last is not None else x[:, -1]
        return self.lm_head(self.norm(x))

    def init_random(self, seed: int = 0, std: float = 0.02) -> "DecoderLM":
        """Random weights (normal(0, std) matrices, unit norms, zero biases), identical on every TP rank."""
        dev = next(self.parameters()).device
        g = torch.Generator(device=dev).manual_seed(seed)
        rank, ws = _tp(self.group)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif p.ndim == 1:
                    p.fill_(1.0)
                else:  # draw the full tensors, keep this rank's shard, so any TP world gives the same model
                    mod = self.get_submodule(name.rsplit(".", 1)[0])
                    if isinstance(mod, ColumnParallelLinear):
                        mod.load_parts("weight", [torch.randn(P, p.shape[1], generator=g, device=dev) * std
                                                  for P in mod.parts], rank)
                    else:
                        shape = [p.shape[0], p.shape[1] * ws] if isinstance(mod, RowParallelLinear) else p.shape
                        _copy_shard(p, torch.randn(shape, generator=g, device=dev) * std,
                                    getattr(mod, "tp_dim", None), rank)
        return self


def rope_tables(cfg: DecoderConfig, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[length, head_dim]`` float32 (``length`` default: ``cfg.max_position``) in HF's rotate_half
    convention (RoFormer, arXiv 2104.09864). A row depends only on its position, so a longer table extends a
    shorter one."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    freqs = torch.outer(torch.arange(cfg.max_position if length is None else length).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()




def register_rope(model: nn.Module, cfg: DecoderConfig) -> None:
    """Give ``model`` the :func:`rope_tables` as non-persistent buffers ``cos``, ``sin`` (they follow ``.to()``)."""
    cos, sin = rope_tables(cfg)
    model.register_buffer("cos", cos, persistent=False)
    model.register_buffer("sin", sin, persistent=False)


def rope_at(model: nn.Module, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of ``model``'s tables at integer ``positions [...]``: ``[..., 1, head_dim]`` in ``dtype``
    (broadcast over heads), cast before use as HF does. The ``rope`` argument of :class:`Attention`."""
    return model.cos[positions].to(dtype)[..., None, :], model.sin[positions].to(dtype)[..., None, :]


def _copy_shard(p: torch.Tensor, full: torch.Tensor, tp_dim, rank: int) -> None:
    if tp_dim is None or p.ndim == 0 or (tp_dim == 1 and p.ndim == 1):
        if tuple(full.shape) != tuple(p.shape):
            raise ValueError(f"shape mismatch: checkpoint {tuple(full.shape)} vs model {tuple(p.shape)}")
        p.copy_(full)
        return
    n = p.shape[tp_dim]
    shard = full.narrow(tp_dim, min(rank * n, full.shape[tp_dim]), max(0, min(n, full.shape[tp_dim] - rank * n)))
    p.zero_()  # vocab padding rows stay zero
    p.narrow(tp_dim, 0, shard.shape[tp_dim]).copy_(shard)


def _hf_names(cfg: DecoderConfig, i: int) -> dict[str, list[str]]:
    """Our parameter -> the Hugging Face tensors it is made of, in fused order (q|k|v, gate|up)."""
    if cfg.arch == "llama":
        p = f"model.layers.{i}."
        return {"ln_1.weight": [p + "input_layernorm.weight"], "ln_2.weight": [p + "post_attention_layernorm.weight"],
                "attn.qkv_proj.weight": [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
                "attn.o_proj.weight": [p + "self_attn.o_proj.weight"],
                "mlp.up_proj.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                "mlp.down_proj.weight": [p + "mlp.down_proj.weight"]}
    p = f"transformer.h.{i}."
    m = {f"{ln}.{w}": [p + f"{ln}.{w}"] for ln in ("ln_1", "ln_2") for w in ("weight", "bias")}
    for w in ("weight", "bias"):  # c_attn is one [in, 3C] Conv1D: split into q, k, v by the loader
        m |= {f"attn.qkv_proj.{w}": [p + f"attn.c_attn.{w}"], f"attn.o_proj.{w}": [p + f"attn.c_proj.{w}"],
              f"mlp.up_proj.{w}": [p + f"mlp.c_fc.{w}"], f"mlp.down_proj.{w}": [p + f"mlp.c_proj.{w}"]}
    return m


def load_pretrained(path: str | Path, group=None, dtype=torch.float32, device="cpu") -> DecoderLM:
    """Load a Hugging Face format GPT-2 or Llama directory (``config.json`` + ``*.safetensors``), TP-sharded.

    Every checkpoint tensor is checked by name and shape; GPT-2's Conv1D weights are transposed; q/k/v and
    gate/up are fused into one matrix each (one GEMM instead of three or two per layer). Raises FileNotFoundError (no config or no safetensors), ValueError (missing
    key, unexpected architecture or shape mismatch).
    """
    from safetensors import safe_open

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {path} has no *.safetensors weights")
    cfg = DecoderConfig.from_hf(json.loads((path / "config.json").read_text()))
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})
    gpt2 = cfg.arch == "gpt2"

    def get(name):
        for cand in (name, name.removeprefix("transformer.")):
            if cand in tensors:
                return tensors[cand].float()
        raise ValueError(f"checkpoint {path} lacks tensor {name!r}")

    with torch.device("meta"):
        model = DecoderLM(cfg, group)
    model = model.to_empty(device="cpu").to(torch.float32)
    if cfg.arch == "llama":  # to_empty left the RoPE tables uninitialised
        model.cos, model.sin = rope_tables(cfg)
    rank, _ = _tp(group)
    params = dict(model.named_parameters())
    with torch.no_grad():
        params["embed_tokens.weight"].copy_(get("transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"))
        if gpt2:
            params["wpe.weight"].copy_(get("transformer.wpe.weight"))
            params["norm.weight"].copy_(get("transformer.ln_f.weight"))
            params["norm.bias"].copy_(get("transformer.ln_f.bias"))
        else:
            params["norm.weight"].copy_(get("model.norm.weight"))
        head = get("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight") if not gpt2 \
            else get("transformer.wte.weight")
        model.lm_head.load_parts("weight", [head], rank)
        for i, layer in enumerate(model.layers):
            for ours, theirs in _hf_names(cfg, i).items():
                fulls = [get(t) for t in theirs]
                if gpt2:
                    fulls = [t.t() if t.ndim == 2 else t for t in fulls]  # Conv1D stores [in, out]
                    if "qkv_proj" in ours:
                        fulls = list(fulls[0].chunk(3, 0))
                mod_name, pname = ours.rsplit(".", 1)
                mod = layer.get_submodule(mod_name)
                if isinstance(mod, ColumnParallelLinear):
                    mod.load_parts(pname, fulls, rank)
                else:
                    _copy_shard(getattr(mod, pname), fulls[0], getattr(mod, "tp_dim", None), rank)
    return model.to(device=device, dtype=dtype)
