"""GPT-style mixture-of-experts decoder (Mixtral / Qwen2-MoE / OLMoE family) and a loader for their checkpoints.

The decoder of :mod:`hpdl.models.gpt` with an MoE MLP: :class:`MoEConfig` extends
:class:`~hpdl.models.gpt.DecoderConfig`, every layer is gpt's :class:`~hpdl.models.gpt.Block` (RMSNorm, the one
:class:`~hpdl.models.gpt.Attention` with RoPE and the slot KV cache, GQA) whose MLP is the sparse
:class:`MoEBlock` (router + SwiGLU experts, optional shared expert) on MoE layers and gpt's SwiGLU
:class:`~hpdl.models.gpt.MLP` elsewhere. Then loading of Hugging Face checkpoint directories (``config.json`` +
``*.safetensors``, per-expert or fused expert tensors) and hpdl checkpoints (``hpdl_moe.pt``, old layouts too).

The pieces an expert-parallel engine needs are public, so :mod:`hpdl.moe.engine` can run the layer loop itself and
place the expert computation on other ranks: :meth:`MoEDecoder.embed`, :meth:`MoEDecoder.rope`,
:meth:`Attention.cached <hpdl.models.gpt.Attention.cached>`, :meth:`MoEBlock.route`, :meth:`MoEBlock.expert`,
:meth:`MoEBlock.shared`, :meth:`MoEDecoder.head`.

Routing (Switch Transformer, arXiv 2101.03961, for top-1; Mixtral, arXiv 2401.04088, for top-2): router logits
``x W_r^T`` -> softmax in fp32 -> top-k; with ``norm_topk_prob`` the k weights are renormalised to sum to 1
(Mixtral), otherwise they stay softmax probabilities (Qwen2-MoE, OLMoE, Switch). Dropless: no capacity limit.
A layer ``i`` is MoE when ``(i + 1) % moe_every == 0`` and ``i`` is not in ``dense_layers`` (Qwen2-MoE's
``decoder_sparse_step`` / ``mlp_only_layers``); other layers have a dense SwiGLU MLP of ``intermediate_size``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import InitVar, asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpdl.models import gpt
from hpdl.models.gpt import MLP, DecoderConfig
from hpdl.models.layers import RMSNorm
from hpdl.runtime.errors import HpdlError


class MoEConfigError(HpdlError, ValueError):
    """A MoE model configuration or checkpoint does not fit; the message names the field and the expected value."""


ARCHS = ("mixtral", "qwen2_moe", "olmoe")


@dataclass
class MoEConfig(DecoderConfig):
    """Architecture of a MoE decoder: :class:`~hpdl.models.gpt.DecoderConfig` (``arch`` only selects the Hugging
    Face class for :meth:`to_hf`; ``intermediate_size`` is the dense layers' MLP width) plus the experts.

    ``n_experts`` routed experts of ``expert_size`` hidden units each, ``top_k`` of them per token;
    ``shared_expert_size`` > 0 adds Qwen2-MoE's always-on shared expert with a sigmoid gate. ``dense_size`` is
    the earlier name of ``intermediate_size`` (hpdl_moe.pt files before issue 40 carry it); when given it wins.
    The decoder fields' defaults here describe a tiny model (tests, :mod:`hpdl.moe.train`'s byte-level demo).
    """

    ARCHS: ClassVar[tuple[str, ...]] = ARCHS
    arch: str = "mixtral"
    vocab_size: int = 256
    hidden_size: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    intermediate_size: int = 128
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    n_experts: int = 8
    top_k: int = 1
    expert_size: int = 128
    moe_every: int = 1
    dense_layers: list[int] = field(default_factory=list)
    shared_expert_size: int = 0
    norm_topk_prob: bool = False
    dense_size: InitVar[int | None] = None

    def __post_init__(self, dense_size: int | None = None):
        if dense_size is not None:
            self.intermediate_size = dense_size
        try:
            super().__post_init__()
            for name, minimum in (("n_experts", 1), ("top_k", 1), ("expert_size", 1), ("moe_every", 1),
                                  ("shared_expert_size", 0)):
                gpt.check_int(self, name, minimum)
        except ValueError as e:  # the decoder's checks, as this module's error type
            raise MoEConfigError(str(e)) from None
        if not 1 <= self.top_k <= self.n_experts:
            raise MoEConfigError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        bad = [i for i in self.dense_layers if isinstance(i, bool) or not isinstance(i, int)
               or not 0 <= i < self.n_layers]
        if bad:
            raise MoEConfigError(f"dense_layers must hold layer indices in [0, n_layers={self.n_layers}), got "
                                 f"{self.dense_layers}")
        if not self.moe_layers:
            raise MoEConfigError(f"no MoE layer: n_layers={self.n_layers}, moe_every={self.moe_every}, "
                                 f"dense_layers={self.dense_layers}")

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the decoder layers whose MLP is a MoE block, in order."""
        return [i for i in range(self.n_layers) if (i + 1) % self.moe_every == 0 and i not in self.dense_layers]

    def identity(self) -> str:
        """Short stable hash of the architecture (stored in traces and placements)."""
        d = asdict(self)
        d["dense_size"] = d.pop("intermediate_size")  # hashed under its first name: saved placements still match
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_hf(cls, cfg: dict) -> "MoEConfig":
        """Translate a Hugging Face ``config.json`` dict (model_type mixtral, qwen2_moe or olmoe).

        Raises:
            MoEConfigError: another model_type, a non-default RoPE, sliding windows, or ``clip_qkv``.
        """
        mt = cfg.get("model_type")
        if mt not in ARCHS:
            raise MoEConfigError(f"config.json model_type must be one of {ARCHS}, got {mt!r}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise MoEConfigError(f"rope_type must be 'default', got {rope.get('rope_type')!r}")
        if cfg.get("use_sliding_window") or (mt == "mixtral" and cfg.get("sliding_window")):
            raise MoEConfigError(f"sliding_window must be null, got {cfg.get('sliding_window')!r}")
        if cfg.get("clip_qkv") is not None:
            raise MoEConfigError(f"clip_qkv must be null, got {cfg.get('clip_qkv')!r}")
        eos = cfg.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        common = dict(arch=mt, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                      n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                      n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                      top_k=cfg["num_experts_per_tok"], max_position=cfg.get("max_position_embeddings", 2048),
                      norm_eps=cfg.get("rms_norm_eps", 1e-6),
                      rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 1e4)),
                      tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                      bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos, head_dim_=cfg.get("head_dim"))
        if mt == "mixtral":
            return cls(**common, n_experts=cfg["num_local_experts"], expert_size=cfg["intermediate_size"],
                       intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
        if mt == "qwen2_moe":
            return cls(**common, n_experts=cfg["num_experts"], expert_size=cfg["moe_intermediate_size"],
                       intermediate_size=cfg["intermediate_size"], moe_every=cfg.get("decoder_sparse_step", 1),
                       dense_layers=list(cfg.get("mlp_only_layers") or []),
                       shared_expert_size=cfg.get("shared_expert_intermediate_size", 0),
                       norm_topk_prob=cfg.get("norm_topk_prob", False), attention_bias=cfg.get("qkv_bias", True))
        return cls(**common, n_experts=cfg["num_experts"], expert_size=cfg["intermediate_size"],
                   intermediate_size=cfg["intermediate_size"], norm_topk_prob=cfg.get("norm_topk_prob", False),
                   attention_bias=cfg.get("attention_bias", False), qk_norm=True)

    def to_hf(self):
        """The equivalent ``transformers`` config object (for reference comparisons in tests)."""
        import transformers

        common = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.n_layers,
                      num_attention_heads=self.n_heads, num_key_value_heads=self.n_kv_heads,
                      num_experts_per_tok=self.top_k, max_position_embeddings=self.max_position,
                      rms_norm_eps=self.norm_eps, tie_word_embeddings=self.tie_word_embeddings,
                      bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id, pad_token_id=None,
                      head_dim=self.head_dim, rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})
        if self.arch == "mixtral":
            if not self.norm_topk_prob or self.moe_layers != list(range(self.n_layers)) or self.shared_expert_size:
                raise MoEConfigError("a Mixtral config needs norm_topk_prob=True, MoE in every layer, no shared expert")
            return transformers.MixtralConfig(**common, num_local_experts=self.n_experts,
                                              intermediate_size=self.expert_size, sliding_window=None)
        if self.arch == "qwen2_moe":
            return transformers.Qwen2MoeConfig(**common, num_experts=self.n_experts,
                                               moe_intermediate_size=self.expert_size,
                                               intermediate_size=self.intermediate_size,
                                               decoder_sparse_step=self.moe_every,
                                               mlp_only_layers=list(self.dense_layers),
                                               shared_expert_intermediate_size=self.shared_expert_size,
                                               norm_topk_prob=self.norm_topk_prob, qkv_bias=self.attention_bias,
                                               use_sliding_window=False)
        if self.moe_layers != list(range(self.n_layers)) or self.shared_expert_size or not self.qk_norm:
            raise MoEConfigError("an OLMoE config needs MoE in every layer, qk_norm=True, no shared expert")
        return transformers.OlmoeConfig(**common, num_experts=self.n_experts, intermediate_size=self.expert_size,
                                        norm_topk_prob=self.norm_topk_prob, attention_bias=self.attention_bias)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of router logits ``[N, E]`` -> ``(experts [N, k] int64, weights [N, k] fp32)``.

    Softmax in fp32 over all experts, ``torch.topk`` (ties go to the lower index), optional renormalisation.
    Pure function: the engine and the trace collector call it on exactly the logits the reference computes.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return idx, w


class MoEBlock(nn.Module):
    """Router + ``E`` SwiGLU experts stored fused (``w_gate_up [E, 2F, H]``, ``w_down [E, H, F]``) + optional
    shared expert (gpt's :class:`~hpdl.models.gpt.MLP`). The MLP of a MoE layer's :class:`Block`: ``forward``
    maps ``[..., H]`` to ``[..., H]`` (dropless single-process reference), :meth:`routed` also returns the
    routing; the engine uses the pieces."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        H, Fe, E = cfg.hidden_size, cfg.expert_size, cfg.n_experts
        self.cfg = cfg
        self.gate = nn.Linear(H, E, bias=False)
        self.w_gate_up = nn.Parameter(torch.randn(E, 2 * Fe, H) * 0.02)
        self.w_down = nn.Parameter(torch.randn(E, H, Fe) * 0.02)
        self.shared_expert = MLP(cfg, size=cfg.shared_expert_size) if cfg.shared_expert_size else None
        self.shared_expert_gate = nn.Linear(H, 1, bias=False) if cfg.shared_expert_size else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [N, H]`` (normed) -> (router logits [N, E], experts [N, k] int64, weights [N, k] fp32)."""
        logits = self.gate(x)
        idx, w = route(logits, self.cfg.top_k, self.cfg.norm_topk_prob)
        return logits, idx, w

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on ``x [n, H]`` -> ``[n, H]`` (unweighted)."""
        gate, up = F.linear(x, self.w_gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_down[e])

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's gated output ``[N, H]``, or None when the model has none."""
        if self.shared_expert is None:
            return None
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def combine(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Dropless mixture ``sum_k w_k * expert_{idx_k}(x)`` for ``x [N, H]``, experts in ascending order."""
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, self.expert(e, x[tok]) * w[tok, slot, None].to(x.dtype))
        return out

    def routed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [N, H]`` -> (output [N, H], router logits [N, E], experts [N, k])."""
        logits, idx, w = self.route(x)
        out = self.combine(x, idx, w)
        s = self.shared(x)
        return (out if s is None else out + s), logits, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]``."""
        return self.routed(x.reshape(-1, x.shape[-1]))[0].view_as(x)


class Block(gpt.Block):
    """gpt's decoder block with a :class:`MoEBlock` as MLP on MoE layers (``is_moe``), gpt's SwiGLU MLP of
    ``intermediate_size`` elsewhere. Parameters: ``ln_1``, ``attn.{qkv_proj, o_proj, q_norm, k_norm}``, ``ln_2``,
    ``mlp``."""

    def __init__(self, cfg: MoEConfig, layer: int):
        is_moe = layer in cfg.moe_layers
        super().__init__(cfg, layer, mlp=MoEBlock(cfg) if is_moe else None)
        self.layer, self.is_moe = layer, is_moe


class MoEDecoder(nn.Module):
    """Decoder-only MoE language model: ``forward(ids)`` -> logits (with ``return_routing``, the routing too)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        gpt.register_rope(self, cfg)
        # True for a model loaded from the first hpdl_moe.pt layout, whose code computed RoPE at any position:
        # its max_position was never a limit, so forward grows the tables instead of refusing (see load_model)
        self.rope_grows = False
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def rope(self, pos: torch.Tensor, dtype: torch.dtype | None = None):
        """RoPE ``(cos, sin)`` ``[..., 1, head_dim]`` at positions ``pos [...]`` (int64 in ``[0, max_position)``)
        in ``dtype`` (default: the model's), the ``rope`` argument of :class:`~hpdl.models.gpt.Attention`."""
        return gpt.rope_at(self, pos, self.embed_tokens.weight.dtype if dtype is None else dtype)

    @property
    def position_limit(self) -> int | None:
        """Most positions :meth:`forward` takes: ``cfg.max_position``, or None (no limit) when ``rope_grows``."""
        return None if self.rope_grows else self.cfg.max_position

    def _grow_rope(self, length: int) -> None:
        """Extend the RoPE tables to at least ``length`` positions (doubling, so a growing input recomputes them
        O(log T) times); the buffers keep their device."""
        n = max(length, 2 * self.cos.shape[0])
        cos, sin = gpt.rope_tables(self.cfg, n)
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: ``h [..., H]`` -> logits ``[..., V]``."""
        return self.lm_head(self.norm(h))

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None, return_routing: bool = False):
        """``ids [B, T]`` int64 (right padding marked 0 in ``attention_mask [B, T]``) -> logits ``[B, T, V]``,
        plus, with ``return_routing``, lists over MoE layers of router logits ``[B*T, E]`` and experts
        ``[B*T, k]``. Positions count real tokens only, so a right-padded row equals the unpadded one.

        Raises:
            MoEConfigError: ``T`` exceeds ``max_position`` (the RoPE tables' length), unless ``rope_grows`` (a
                model of the first checkpoint layout: the tables are extended).
        """
        B, T = ids.shape
        if T > self.cos.shape[0]:
            if not self.rope_grows:
                raise MoEConfigError(f"ids has {T} positions, more than max_position={self.cfg.max_position}")
            self._grow_rope(T)
        am = torch.ones(B, T, dtype=torch.bool, device=ids.device) if attention_mask is None else attention_mask.bool()
        pos = (am.long().cumsum(-1) - 1).clamp_min(0)
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        mask = causal[None] & am[:, None, :]
        mask = mask | torch.eye(T, dtype=torch.bool, device=ids.device)[None]  # pad rows attend to themselves
        h = self.embed(ids)
        rope = self.rope(pos, h.dtype)
        logits_l, idx_l = [], []
        for blk in self.layers:
            q, k, v = blk.attn.qkv(blk.ln_1(h), rope)
            h = h + blk.attn.attend(q, k, v, mask)
            x = blk.ln_2(h)
            if not blk.is_moe:
                h = h + blk.mlp(x)
                continue
            out, lg, idx = blk.mlp.routed(x.reshape(-1, x.shape[-1]))
            h = h + out.view_as(h)
            logits_l.append(lg)
            idx_l.append(idx)
        logits = self.head(h)
        return (logits, logits_l, idx_l) if return_routing else logits

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
        """Reference greedy decoding of one prompt by full recomputation (no cache): the engine's oracle."""
        ids = list(prompt)
        out = []
        for _ in range(max_new_tokens):
            nxt = int(self.forward(torch.tensor([ids]))[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
            if stop_at_eos and nxt == self.cfg.eos_token_id:
                break
        return out


# --- Hugging Face checkpoints ------------------------------------------------------------------------
def _expert_names(arch: str, prefix: str, e: int) -> tuple[str, str, str]:
    if arch == "mixtral":
        b = f"{prefix}.block_sparse_moe.experts.{e}"
        return f"{b}.w1.weight", f"{b}.w3.weight", f"{b}.w2.weight"
    b = f"{prefix}.mlp.experts.{e}"
    return f"{b}.gate_proj.weight", f"{b}.up_proj.weight", f"{b}.down_proj.weight"


def _fused_names(cfg: MoEConfig, i: int, layer: str, attn: str, mlp: str, shared: str) -> dict[str, list[str]]:
    """Our layer-``i`` norm, attention and dense-MLP parameters -> the source tensors each is made of,
    concatenated along dim 0 in this order (q|k|v, gate|up). ``layer``/``attn``/``mlp``/``shared``: the source's
    module prefixes (HF and the first hpdl layout both name the tensors ``input_layernorm``,
    ``post_attention_layernorm``, ``{q,k,v,o}_proj``, ``{q,k}_norm``, ``{gate,up,down}_proj``)."""
    q, p = f"layers.{i}", f"{attn}."
    g, u, d = "gate_proj", "up_proj", "down_proj"
    m = {f"{q}.ln_1.weight": [f"{layer}.input_layernorm.weight"],
         f"{q}.ln_2.weight": [f"{layer}.post_attention_layernorm.weight"],
         f"{q}.attn.qkv_proj.weight": [p + f"{n}_proj.weight" for n in "qkv"],
         f"{q}.attn.o_proj.weight": [p + "o_proj.weight"]}
    if cfg.attention_bias:
        m[f"{q}.attn.qkv_proj.bias"] = [p + f"{n}_proj.bias" for n in "qkv"]
    if cfg.qk_norm:
        m[f"{q}.attn.q_norm.weight"], m[f"{q}.attn.k_norm.weight"] = [p + "q_norm.weight"], [p + "k_norm.weight"]
    if i not in cfg.moe_layers:
        m[f"{q}.mlp.up_proj.weight"] = [f"{mlp}.{g}.weight", f"{mlp}.{u}.weight"]
        m[f"{q}.mlp.down_proj.weight"] = [f"{mlp}.{d}.weight"]
    elif cfg.shared_expert_size:
        m[f"{q}.mlp.shared_expert.up_proj.weight"] = [f"{shared}.{g}.weight", f"{shared}.{u}.weight"]
        m[f"{q}.mlp.shared_expert.down_proj.weight"] = [f"{shared}.{d}.weight"]
    return m


def _take_fused(out: dict, names: dict[str, list[str]], take) -> None:
    """``out[ours] = cat(take(t) for t in theirs)`` for every entry of ``names`` (see :func:`_fused_names`)."""
    for ours, theirs in names.items():
        ts = [take(t) for t in theirs]
        out[ours] = ts[0] if len(ts) == 1 else torch.cat(ts, 0)


_FIRST_LAYOUT_KEY = "layers.0.input_layernorm.weight"   # a tensor only the first hpdl_moe.pt layout has


def upgrade_state_dict(cfg: MoEConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map a state dict of the MoE decoder's first layout (its own attention: ``layers.{i}.input_layernorm``,
    ``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``q_norm``, ``post_attention_layernorm``, SwiGLU
    ``gate_proj``/``up_proj``/``down_proj``) onto the shared :class:`~hpdl.models.gpt.Block`'s names (``ln_1``,
    ``attn.qkv_proj`` = q|k|v, ``ln_2``, ``mlp.up_proj`` = gate|up). A dict already in the current layout is
    returned unchanged. Raises MoEConfigError naming a missing tensor."""
    if _FIRST_LAYOUT_KEY not in sd:
        return sd
    src = dict(sd)

    def take(name):
        if name not in src:
            raise MoEConfigError(f"old-layout state dict has no tensor {name!r}")
        return src.pop(name)

    out = {}
    for i in range(cfg.n_layers):
        q = f"layers.{i}"
        _take_fused(out, _fused_names(cfg, i, q, q, f"{q}.mlp", f"{q}.mlp.shared_expert"), take)
    out.update(src)  # embeddings, final norm, head, routers, experts, shared-expert gates: same names
    return out


def convert_hf_state_dict(cfg: MoEConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map a Hugging Face Mixtral / Qwen2-MoE / OLMoE state dict onto :class:`MoEDecoder`'s names.

    Accepts per-expert tensors (``experts.{e}.w1/w3/w2`` or ``gate_proj/up_proj/down_proj``, what
    ``save_pretrained`` writes) and fused ones (``experts.gate_up_proj [E, 2F, H]``, ``experts.down_proj``);
    q/k/v and gate/up are fused into one matrix each, as :class:`~hpdl.models.gpt.Attention` and
    :class:`~hpdl.models.gpt.MLP` hold them.

    Raises:
        MoEConfigError: a tensor is missing (named) or has the wrong shape.
    """
    def take(name):
        if name not in sd:
            raise MoEConfigError(f"checkpoint has no tensor {name!r} (arch={cfg.arch})")
        return sd[name]

    out = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.n_layers):
        p, q = f"model.layers.{i}", f"layers.{i}"
        moe = f"{p}.block_sparse_moe" if cfg.arch == "mixtral" else f"{p}.mlp"
        _take_fused(out, _fused_names(cfg, i, p, f"{p}.self_attn", f"{p}.mlp", f"{moe}.shared_expert"), take)
        if i not in cfg.moe_layers:
            continue
        out[f"{q}.mlp.gate.weight"] = take(f"{moe}.gate.weight")
        if f"{moe}.experts.gate_up_proj" in sd:
            out[f"{q}.mlp.w_gate_up"] = sd[f"{moe}.experts.gate_up_proj"]
            out[f"{q}.mlp.w_down"] = take(f"{moe}.experts.down_proj")
        else:
            gu, dn = [], []
            for e in range(cfg.n_experts):
                g, u, d = (take(n) for n in _expert_names(cfg.arch, p, e))
                gu.append(torch.cat([g, u], 0))
                dn.append(d)
            out[f"{q}.mlp.w_gate_up"], out[f"{q}.mlp.w_down"] = torch.stack(gu), torch.stack(dn)
        if cfg.shared_expert_size:
            out[f"{q}.mlp.shared_expert_gate.weight"] = take(f"{moe}.shared_expert_gate.weight")
    return out


def load_pretrained(path: str | Path, dtype=torch.float32, device="cpu") -> MoEDecoder:
    """Load a local Hugging Face Mixtral / Qwen2-MoE / OLMoE directory (``config.json`` + ``*.safetensors``).

    With a ``model.safetensors.index.json`` exactly the shards its ``weight_map`` names are read (a stale or
    foreign ``.safetensors`` file beside them is ignored); otherwise every ``*.safetensors`` file. Nothing is
    downloaded. Raises FileNotFoundError (no config.json or no safetensors) and MoEConfigError
    (config.json not JSON or missing a key, an unreadable safetensors file, unsupported config, missing or
    mis-shaped tensor; the file or key is named).
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"path={path}: no config.json")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MoEConfigError(f"{path / 'config.json'}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise MoEConfigError(f"{path / 'config.json'}: expected a JSON object, got {type(raw).__name__}")
    try:
        cfg = MoEConfig.from_hf(raw)
    except KeyError as e:
        raise MoEConfigError(f"{path / 'config.json'}: missing key {e.args[0]!r} "
                             f"(model_type={raw.get('model_type')!r})") from None
    except MoEConfigError as e:
        raise MoEConfigError(f"{path / 'config.json'}: {e}") from None
    index = path / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint: exactly the shards its weight_map names (stale files ignored)
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            names = sorted(set(wmap.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise MoEConfigError(f"{index}: not a safetensors index with a 'weight_map' ({type(e).__name__}: "
                                 f"{e})") from None
        files = [path / n for n in names]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index} names shard {f.name}, which is missing")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"path={path}: no *.safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError / OSError
            raise MoEConfigError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    model = MoEDecoder(cfg)
    mapped = convert_hf_state_dict(cfg, sd)
    own = model.state_dict()
    for k, t in mapped.items():
        if own[k].shape != t.shape:
            raise MoEConfigError(f"tensor {k}: checkpoint shape {tuple(t.shape)}, model expects {tuple(own[k].shape)}")
    missing, _ = model.load_state_dict(mapped, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing:
        raise MoEConfigError(f"checkpoint {path} lacks {missing[:4]}")
    return model.to(dtype=dtype, device=device).eval()


def save_checkpoint(model: MoEDecoder, path: str | Path, extra: dict | None = None) -> None:
    """Save ``model`` as ``hpdl_moe.pt`` (config + state dict) in directory ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    blob = {"config": asdict(model.cfg), "state_dict": model.state_dict(), "extra": extra or {}}
    if getattr(model, "rope_grows", False):   # a re-saved first-layout model keeps its unlimited positions
        blob["rope_grows"] = True
    torch.save(blob, path / "hpdl_moe.pt")


def load_model(path: str | Path) -> MoEDecoder:
    """Load an hpdl checkpoint directory (``hpdl_moe.pt``, any layout :func:`upgrade_state_dict` knows) or a
    Hugging Face one (``config.json``).

    Raises:
        FileNotFoundError: no such directory, or neither file in it.
        MoEConfigError: a corrupt or foreign file, bad JSON, a missing config key or tensor (file and key named).
    """
    path = Path(path)
    f = path / "hpdl_moe.pt"
    if f.is_file():
        try:
            blob = torch.load(f, map_location="cpu", weights_only=True)
            cfg = MoEConfig(**blob["config"])
            m = MoEDecoder(cfg)
            m.load_state_dict(upgrade_state_dict(cfg, blob["state_dict"]))
            # the first layout computed RoPE on the fly at any position: its max_position (often small, e.g. 32)
            # was never enforced, so such a model keeps working past it (the config, and its identity, unchanged)
            m.rope_grows = bool(blob.get("rope_grows") or _FIRST_LAYOUT_KEY in blob["state_dict"])
        except MoEConfigError as e:
            raise MoEConfigError(f"{f}: {e}") from None
        except Exception as e:  # noqa: BLE001 - unpickling, a missing key or a shape mismatch: name the file
            raise MoEConfigError(f"{f}: not a loadable hpdl_moe.pt checkpoint ({type(e).__name__}: "
                                 f"{str(e)[:300]})") from None
        return m.eval()
    if not path.is_dir():
        raise FileNotFoundError(f"path={path}: no such directory (expected an hpdl_moe.pt or HF checkpoint dir)")
    return load_pretrained(path)


def weights_identity(model: nn.Module) -> str:
    """Short sha256 over the parameters' bytes (stored in traces so a trace names the exact weights)."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
