"""Expert-parallel MoE inference over torch.distributed: the 2-Alltoall baseline and ExFlow's 1-Alltoall
context-coherent mode (arXiv 2401.08383, section 4.1). A thin executor over the pure pieces: the model's
router (:func:`hpdl.models.gpt_moe.route`), the placement (:mod:`hpdl.moe.placement`) and the dispatch planner
(:mod:`hpdl.moe.dispatch`). Collectives are :mod:`hpdl.comm`'s public ``all_to_all_single`` / ``all_gather``.

Every rank holds the (small) model; rank ``r`` computes only the experts that the placement gives it.

* ``baseline`` (DeepSpeed-MoE): a request lives on its home rank. Per MoE layer: exchange counts, dispatch
  Alltoall of the normed hidden rows to the experts' ranks, expert compute, combine Alltoall back home.
* ``exflow`` (top-1 only): context coherence. At the start the prompts are all-gathered, and after every step
  the new tokens and the K/V rows computed on each rank are all-gathered, so every rank's KV cache holds every
  request's whole context. A token can then run attention wherever it is, so after a MoE layer it stays on its
  expert's rank: per MoE layer one count exchange plus one dispatch Alltoall (of the residual stream, with the
  gate weight, request and position packed in extra fp32 columns; the expert's rank recomputes the norm), and
  no combine. A token moves only when its next expert is on another rank, which is what placement minimises.
  Prefill runs as in the baseline (a prompt's tokens must see each other's same-layer K/V), then the prompts'
  K/V are all-gathered. [Design reading: the paper's "all-gather of new tokens" leaves open how the K/V that a
  token produced on different ranks becomes coherent; gathering those K/V rows once per step is ours.]
  Cost: every rank keeps all contexts (KV memory x G) and receives the others' K/V every step.

Both modes are dropless and give the greedy tokens of the single-process model (tests: world 1, 2, 4).
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

import hpdl.comm as hc
from hpdl.models.gpt_moe import KVCache, MoEDecoder
from hpdl.moe import dispatch
from hpdl.moe.errors import MoEError
from hpdl.moe.placement import contiguous, validate
from hpdl.runtime.errors import HpdlError, WorkerFailedError

MODES = ("baseline", "exflow")
CAPACITIES = ("exchange", "worst_case")
# Header every rank contributes to the start-of-generate all-gather, so arguments that must agree across ranks
# are compared before the first payload collective (a rank that raised alone, or ranks that disagree on
# max_new_tokens or the placement, would otherwise leave the others blocked in the next collective).
_HDR = ("problem", "max_new_tokens", "mode", "capacity", "placement", "model")
_PROBLEMS = {1: "a prompt is empty (every prompt needs at least one token)",
             2: "max_new_tokens must be >= 1",
             3: "a prompt holds a token id outside [0, vocab_size)"}


def _digest(*parts: bytes) -> int:
    """63-bit digest (fits an int64 collective) of byte strings."""
    h = hashlib.sha256()
    for b in parts:
        h.update(b)
    return int(h.hexdigest()[:15], 16)


@dataclass
class CommStats:
    """Per MoE layer: payload Alltoall calls, bytes sent to other ranks, seconds; count exchanges; all-gathers."""

    a2a_calls: dict = field(default_factory=lambda: defaultdict(int))
    a2a_bytes: dict = field(default_factory=lambda: defaultdict(int))
    a2a_seconds: dict = field(default_factory=lambda: defaultdict(float))
    count_calls: int = 0
    count_seconds: float = 0.0
    gather_calls: int = 0
    gather_bytes: int = 0
    gather_seconds: float = 0.0
    rows_dispatched: dict = field(default_factory=lambda: defaultdict(int))
    rows_cross: dict = field(default_factory=lambda: defaultdict(int))

    def as_dict(self) -> dict:
        return {"a2a_calls": dict(self.a2a_calls), "a2a_bytes": dict(self.a2a_bytes),
                "a2a_seconds": dict(self.a2a_seconds), "count_calls": self.count_calls,
                "count_seconds": self.count_seconds, "gather_calls": self.gather_calls,
                "gather_bytes": self.gather_bytes, "gather_seconds": self.gather_seconds,
                "rows_dispatched": dict(self.rows_dispatched), "rows_cross": dict(self.rows_cross)}


def _pack(x: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Rows ``x [n, H]`` (any float dtype) with int32 columns ``meta [n, m]`` appended bit for bit (a view, not
    a cast: in bf16 a position or request id above 256 would round), so one Alltoall carries both."""
    if (4 * meta.shape[1]) % x.element_size():
        meta = torch.cat([meta, torch.zeros(len(meta), 1, dtype=torch.int32)], 1)
    return torch.cat([x, meta.contiguous().view(x.dtype)], 1)


def _unpack(rows: torch.Tensor, H: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_pack`: ``(x [n, H], meta [n, m] int32)``."""
    return rows[:, :H], rows[:, H:].contiguous().view(torch.int32)[:, :m]


class MoEEngine:
    """Greedy generation with expert parallelism on the default (or given) process group.

    Args:
        model: a :class:`MoEDecoder` in eval mode, identical on every rank.
        placement: ``ranks [n_moe_layers, E]`` (a :mod:`hpdl.moe.placement` array) or None for contiguous.
        mode: "baseline" or "exflow".
        check: hpdl.comm's per-call argument check (None = ``HPDL_MOE_CHECK``, whose ``auto`` defers to
            ``HPDL_CHECK``; benchmarks pass False).
        record_routing: keep every token's experts per MoE layer, keyed by (request, position).
        capacity: "exchange" (exact counts exchanged before every payload Alltoall: a small extra collective
            per layer, no padding) or "worst_case" (no count exchange: every rank sends ``C`` rows to every peer,
            where ``C`` is the most rows any rank can hold, derived from the all-gathered prompt table so all
            ranks agree; pad rows carry a 0 flag and are never computed; dropless, more bytes, one collective
            less per layer: the latency-bound choice).

    Raises:
        MoEError: unknown mode, exflow with top_k > 1, a placement for another world size or model.
    """

    def __init__(self, model: MoEDecoder, placement=None, mode: str = "exflow", group=None,
                 check: bool | None = None, record_routing: bool = False, capacity: str = "exchange"):
        if mode not in MODES:
            raise MoEError(f"mode must be one of {MODES}, got {mode!r}")
        if capacity not in CAPACITIES:
            raise MoEError(f"capacity must be one of {CAPACITIES}, got {capacity!r}")
        self.capacity, self.cap_rows = capacity, 0
        cfg = model.cfg
        if mode == "exflow" and cfg.top_k != 1:
            raise MoEError(f"mode='exflow' needs top_k=1 (a top-k token would need a combine at its primary "
                           f"expert's rank), model has top_k={cfg.top_k}")
        if check is None:
            from hpdl.runtime import env

            mode_env = env.get("HPDL_MOE_CHECK")
            check = None if mode_env == "auto" else bool(mode_env)
        self.model, self.cfg, self.mode, self.group, self.check = model, cfg, mode, group, check
        self.G = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        nl = len(cfg.moe_layers)
        ranks = contiguous(nl, cfg.n_experts, self.G) if placement is None else np.asarray(placement)
        if ranks.shape != (nl, cfg.n_experts):
            raise MoEError(f"placement shape {ranks.shape}, expected (moe layers={nl}, n_experts={cfg.n_experts})")
        self.ranks = torch.as_tensor(validate(ranks, self.G))
        self.moe_index = {l: i for i, l in enumerate(cfg.moe_layers)}
        # what every rank must share: the placement, and the model's config and router weights (routing decides
        # where tokens go; the full weights are not hashed, that would cost seconds on a real checkpoint)
        self._place_digest = _digest(self.ranks.numpy().tobytes())
        self._model_digest = _digest(cfg.identity().encode(), *(
            blk.mlp.gate.weight.detach().float().cpu().contiguous().numpy().tobytes()
            for blk in model.layers if blk.is_moe))
        self.stats = CommStats()
        self.record_routing = record_routing
        self.routing: dict[tuple[int, int], list[int]] = {}

    # --- collectives (hpdl.comm public API; everything after the tensors by keyword) ----------------------
    def _call(self, what: str, layer: int | None, fn, *args, **kw) -> None:
        """One hpdl.comm collective. hpdl's own errors (timeouts naming the silent rank, mismatches) pass
        through; the backend's untyped RuntimeError (gloo: "Connection closed by peer" when a rank died)
        becomes a WorkerFailedError that names this rank, the collective and the MoE layer."""
        try:
            fn(*args, **kw)
        except HpdlError:
            raise
        except RuntimeError as e:
            where = f"MoE layer {layer}" if layer is not None else "the context all-gather"
            raise WorkerFailedError(f"rank {self.rank}: {what} at {where} failed; a peer rank of the "
                                    f"{self.G}-rank group died or closed its connection ({str(e)[:300]})") from e

    def _exchange(self, payload: torch.Tensor, send: list[int], layer: int) -> tuple[torch.Tensor, list[int]]:
        """Dispatch ``payload`` (rows grouped by destination, ``send[q]`` rows for rank q); returns (received
        rows grouped by source, recv counts per source). "exchange": counts first, then exactly sized rows;
        "worst_case": one equal-split Alltoall of ``cap_rows`` rows per peer with a validity column."""
        if self.capacity == "worst_case":
            C = self.cap_rows
            if max(send, default=0) > C:
                raise MoEError(f"rank {self.rank}: {max(send)} rows for one peer exceed the agreed capacity {C}")
            buf = self._pad(torch.cat([payload, torch.ones(len(payload), 1, dtype=payload.dtype)], 1), send, C)
            got = self._a2a(buf, [C] * self.G, [C] * self.G, layer)
            valid = got[:, -1].view(self.G, C) > 0
            recv = valid.sum(1).tolist()
            return got[valid.reshape(-1), :-1], recv
        t0 = time.perf_counter()
        send_t = torch.tensor(send, dtype=torch.int64)
        recv_t = torch.empty(self.G, dtype=torch.int64)
        if self.G > 1:
            self._call("count exchange", layer, hc.all_to_all_single, recv_t, send_t, group=self.group,
                       check=self.check)
        else:
            recv_t.copy_(send_t)
        t1 = time.perf_counter()
        recv = recv_t.tolist()
        out = self._a2a(payload, send, recv, layer)
        self.stats.count_calls += 1
        self.stats.count_seconds += t1 - t0
        return out, recv

    def _combine(self, y: torch.Tensor, recv: list[int], send: list[int], layer: int) -> torch.Tensor:
        """The dispatch reversed: ``y`` (rows grouped by source) back to their sources."""
        if self.capacity == "worst_case":
            C = self.cap_rows
            got = self._a2a(self._pad(y, recv, C), [C] * self.G, [C] * self.G, layer)
            return self._unpad(got, send, C)
        return self._a2a(y, recv, send, layer)

    def _pad(self, rows: torch.Tensor, counts: list[int], C: int) -> torch.Tensor:
        """Rows grouped by peer (``counts``) -> ``[G*C, W]`` with peer q's rows at ``[q*C, q*C + counts[q])``."""
        buf = torch.zeros(self.G * C, rows.shape[1], dtype=rows.dtype)
        idx = torch.cat([torch.arange(q * C, q * C + n) for q, n in enumerate(counts)]) if rows.shape[0] else \
            torch.zeros(0, dtype=torch.int64)
        buf[idx] = rows
        return buf

    def _unpad(self, buf: torch.Tensor, counts: list[int], C: int) -> torch.Tensor:
        idx = torch.cat([torch.arange(q * C, q * C + n) for q, n in enumerate(counts)])
        return buf[idx]

    def _a2a(self, payload: torch.Tensor, send: list[int], recv: list[int], layer: int) -> torch.Tensor:
        out = torch.empty(sum(recv), payload.shape[1], dtype=payload.dtype)
        t0 = time.perf_counter()
        if self.G > 1:
            self._call("payload Alltoall", layer, hc.all_to_all_single, out, payload.contiguous(),
                       output_split_sizes=recv, input_split_sizes=send,
                                 group=self.group, check=self.check)
        else:
            out.copy_(payload)
        self.stats.a2a_seconds[layer] += time.perf_counter() - t0
        self.stats.a2a_calls[layer] += 1
        self.stats.a2a_bytes[layer] += (sum(send) - send[self.rank]) * payload.shape[1] * payload.element_size()
        return out

    def _gather_rows(self, rows: torch.Tensor, cap: int | None = None) -> torch.Tensor:
        """Variable-size all-gather; returns all ranks' rows in rank order. Without ``cap``: counts first, then
        rows padded to the largest count. With ``cap`` (an agreed upper bound): one all-gather of ``cap`` rows
        per rank, pad rows marked ``-2`` in column 0 (callers' real rows never hold -2 there)."""
        t0 = time.perf_counter()
        if self.G == 1:
            return rows
        if cap is not None:
            if rows.shape[0] > cap:
                raise MoEError(f"rank {self.rank}: {rows.shape[0]} rows exceed the agreed gather capacity {cap}")
            buf = torch.full((cap, rows.shape[1]), -2.0, dtype=rows.dtype)
            buf[:rows.shape[0]] = rows
            out = torch.empty(self.G * cap, rows.shape[1], dtype=rows.dtype)
            self._call("padded all-gather", None, hc.all_gather, out, buf, group=self.group, check=self.check)
            self.stats.gather_calls += 1
            self.stats.gather_bytes += (self.G - 1) * cap * rows.shape[1] * rows.element_size()
            self.stats.gather_seconds += time.perf_counter() - t0
            return out[out[:, 0] > -2]
        n = torch.tensor([rows.shape[0]], dtype=torch.int64)
        counts = torch.empty(self.G, dtype=torch.int64)
        self._call("count all-gather", None, hc.all_gather, counts, n, group=self.group, check=self.check)
        m = int(counts.max())
        buf = torch.zeros(m, rows.shape[1], dtype=rows.dtype)
        buf[:rows.shape[0]] = rows
        out = torch.empty(self.G * m, rows.shape[1], dtype=rows.dtype)
        self._call("row all-gather", None, hc.all_gather, out, buf, group=self.group, check=self.check)
        self.stats.gather_calls += 2
        self.stats.gather_bytes += (self.G - 1) * m * rows.shape[1] * rows.element_size()
        self.stats.gather_seconds += time.perf_counter() - t0
        keep = torch.cat([torch.arange(g * m, g * m + int(counts[g])) for g in range(self.G)])
        return out[keep]

    # --- MoE layer ---------------------------------------------------------------------------------------
    def _experts(self, mlp, x: torch.Tensor, e: torch.Tensor, w: torch.Tensor, li: int) -> torch.Tensor:
        out = torch.empty_like(x)
        for ex in torch.unique(e).tolist():
            if int(self.ranks[li, ex]) != self.rank:
                raise MoEError(f"rank {self.rank} received a token for expert {ex} of MoE layer {li}, placed on "
                               f"rank {int(self.ranks[li, ex])}: ranks use different placements")
            rows = torch.where(e == ex)[0]
            out[rows] = mlp.expert(ex, x[rows]) * w[rows, None].to(x.dtype)
        return out

    def _moe_combine(self, li, blk, h, req, pos):
        """Baseline: dispatch copies to expert ranks, compute, combine back to this rank."""
        x = blk.post_attention_layernorm(h)
        _, idx, w = blk.mlp.route(x)
        self._record(li, req, pos, idx)
        n, k = idx.shape
        dest = self.ranks[li][idx.reshape(-1)]
        p = dispatch.plan(dest, self.G)
        meta = torch.stack([w.reshape(-1).float().view(torch.int32), idx.reshape(-1).int()], 1)
        payload = _pack(x.repeat_interleave(k, 0), meta)[p.order]
        self.stats.rows_dispatched[li] += n * k
        self.stats.rows_cross[li] += n * k - p.send_counts[self.rank]
        recv, rc = self._exchange(payload, p.send_counts, li)
        H = x.shape[1]
        x_r, m_r = _unpack(recv, H, 2)
        y = self._experts(blk.mlp, x_r, m_r[:, 1].long(), m_r[:, 0].view(torch.float32), li)
        back = self._combine(y, rc, p.send_counts, li)
        out = back[dispatch.inverse(p.order)].view(n, k, H).sum(1)
        s = blk.mlp.shared(x)
        return h + (out if s is None else out + s), req, pos

    def _moe_stay(self, li, blk, h, req, pos):
        """ExFlow: dispatch the residual stream to the expert's rank; the token stays there."""
        x = blk.post_attention_layernorm(h)
        _, idx, w = blk.mlp.route(x)
        self._record(li, req, pos, idx)
        dest = self.ranks[li][idx[:, 0]]
        p = dispatch.plan(dest, self.G)
        meta = torch.stack([w[:, 0].float().view(torch.int32), idx[:, 0].int(), req.int(), pos.int()], 1)
        payload = _pack(h, meta)[p.order]
        self.stats.rows_dispatched[li] += len(dest)
        self.stats.rows_cross[li] += len(dest) - p.send_counts[self.rank]
        recv, _ = self._exchange(payload, p.send_counts, li)
        H = h.shape[1]
        h_r, m_r = _unpack(recv, H, 4)
        w_r, e_r = m_r[:, 0].view(torch.float32), m_r[:, 1].long()
        req_r, pos_r = m_r[:, 2].long(), m_r[:, 3].long()
        x_r = blk.post_attention_layernorm(h_r)
        y = self._experts(blk.mlp, x_r, e_r, w_r, li)
        s = blk.mlp.shared(x_r)
        return h_r + (y if s is None else y + s), req_r, pos_r

    def _record(self, li, req, pos, idx):
        if self.record_routing:
            for r, q, e in zip(req.tolist(), pos.tolist(), idx.tolist()):
                self.routing.setdefault((r, q), [None] * len(self.cfg.moe_layers))[li] = e

    # --- forward over all layers -------------------------------------------------------------------------
    def _forward(self, ids, req, pos, stay: bool, kv_log: list | None):
        """Tokens ``ids [n]`` of requests ``req`` at ``pos`` through every layer; returns (h, req, pos) of the
        tokens that end on this rank (with ``stay`` they may differ from the ones that started here)."""
        h = self.model.embed(ids)
        for l, blk in enumerate(self.model.layers):
            slot = self.slot_of[req]
            h = blk.attention(h, slot, pos, self.cache)
            if kv_log is not None:
                kv_log.append((l, slot.clone(), pos.clone()))
            if blk.is_moe:
                fn = self._moe_stay if stay else self._moe_combine
                h, req, pos = fn(self.moe_index[l], blk, h, req, pos)
            else:
                h = h + blk.mlp(blk.post_attention_layernorm(h))
        return h, req, pos

    def _sync_context(self, kv_log, req, pos, tok, cap: int | None = None):
        """ExFlow's per-step all-gather: K/V rows computed here + new tokens; every rank applies all of them."""
        kvd = self.cfg.n_kv_heads * self.cfg.head_dim
        parts = []
        for l, slot, p in kv_log:
            k = self.cache.k[l, slot, p].reshape(len(slot), kvd).float()  # fp32 rows hold any cache dtype exactly
            v = self.cache.v[l, slot, p].reshape(len(slot), kvd).float()
            meta = torch.stack([torch.full_like(slot, l), slot, p], 1).float()
            parts.append(torch.cat([meta, k, v], 1))
        tok_rows = torch.zeros(len(req), 3 + 2 * kvd)
        tok_rows[:, 0], tok_rows[:, 1], tok_rows[:, 2] = -1, req.float(), tok.float()
        rows = self._gather_rows(torch.cat(parts + [tok_rows], 0), cap)
        is_tok = rows[:, 0] < 0
        kvr = rows[~is_tok]
        l, s, p = kvr[:, 0].long(), kvr[:, 1].long(), kvr[:, 2].long()
        shape = (len(kvr), self.cfg.n_kv_heads, self.cfg.head_dim)
        self.cache.k[l, s, p] = kvr[:, 3:3 + kvd].reshape(shape).to(self.cache.k.dtype)
        self.cache.v[l, s, p] = kvr[:, 3 + kvd:].reshape(shape).to(self.cache.v.dtype)
        tr = rows[is_tok]
        return tr[:, 1].long(), tr[:, 2].long()

    def _header(self, prompts: list[list[int]], max_new_tokens: int) -> list[int]:
        problem = 0
        if any(len(p) == 0 for p in prompts):
            problem = 1
        elif max_new_tokens < 1:
            problem = 2
        elif any(t < 0 or t >= self.cfg.vocab_size for p in prompts for t in p):
            problem = 3
        return [problem, int(max_new_tokens), MODES.index(self.mode), CAPACITIES.index(self.capacity),
                self._place_digest, self._model_digest]

    def _check_headers(self, headers: list[list[int]]) -> None:
        """Raise the same MoEError on every rank when a rank's arguments are bad or differ from rank 0's."""
        for g, h in enumerate(headers):
            if h[0]:
                raise MoEError(f"rank {g}: {_PROBLEMS[h[0]]} (max_new_tokens={h[1]}); every rank stops")
        for f, name in enumerate(_HDR[1:], 1):
            for g, h in enumerate(headers):
                if h[f] != headers[0][f]:
                    a, b = headers[0][f], h[f]
                    if name == "mode":
                        a, b = MODES[a], MODES[b]
                    elif name == "capacity":
                        a, b = CAPACITIES[a], CAPACITIES[b]
                    elif name in ("placement", "model"):
                        a, b = f"digest {a:x}", f"digest {b:x}"
                    raise MoEError(f"rank {g} has {name}={b}, rank 0 has {name}={a}: every rank must call "
                                   f"generate with the same {name}" + (" (placement array)" if name == "placement"
                                   else " (config and router weights)" if name == "model" else ""))

    def _gather_prompts(self, prompts: list[list[int]], max_new_tokens: int = 1
                        ) -> tuple[list[list[int]], list[int]]:
        """All-gather every rank's prompts (the only metadata exchange at start), after a header of the
        arguments that must agree (checked on every rank, so all raise together); returns all prompts in global
        request order and the global ids of this rank's requests."""
        flat = torch.tensor(self._header(prompts, max_new_tokens) + [len(prompts)] + [len(p) for p in prompts] +
                            [t for p in prompts for t in p], dtype=torch.int64)[:, None]
        rows = self._gather_rows(flat)[:, 0].tolist()
        out, mine, i, g = [], [], 0, 0
        self._owners = []
        headers = []
        while i < len(rows):
            headers.append(rows[i:i + len(_HDR)])
            i += len(_HDR)
            n = rows[i]
            lens = rows[i + 1:i + 1 + n]
            j = i + 1 + n
            self._owners.append(list(range(len(out), len(out) + n)))
            for ln in lens:
                if g == self.rank:
                    mine.append(len(out))
                out.append(rows[j:j + ln])
                j += ln
            i, g = j, g + 1
        self._check_headers(headers)
        return out, mine

    def _sync_cap(self, step: int, owners: list[list[int]], all_prompts) -> int | None:
        """With ``capacity="worst_case"``: the most rows any rank can contribute to a step's all-gather (every
        layer's K/V of the tokens it may hold, plus its sampled tokens), so the counts all-gather is skipped."""
        if self.capacity != "worst_case":
            return None
        n_layers = self.cfg.n_layers
        if step == 0:  # after prefill: a rank's own prompt tokens at every layer, and one token per own request
            return max(n_layers * sum(len(all_prompts[r]) for r in rs) + len(rs) for rs in owners)
        return (n_layers + 1) * len(all_prompts)  # a rank may hold every request's token at every layer

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> dict[int, list[int]]:
        """Greedy-decode this rank's ``prompts`` (any count, also 0; lengths may differ; packed, no padding).

        Returns ``{global request id: max_new_tokens generated ids}`` for this rank's requests; request ids
        number the requests of rank 0, then rank 1, ... . ``self.stats`` holds the communication counters.

        Raises:
            MoEError: on every rank at once, before any payload collective, when some rank passed an empty
                prompt, a token outside the vocabulary or ``max_new_tokens < 1``, or when ranks differ in
                ``max_new_tokens``, mode, capacity, placement or model (config and router weights); the
                message names the rank. Also when prompt + max_new_tokens exceeds ``max_position``.
        """
        all_prompts, mine = self._gather_prompts(prompts, max_new_tokens)  # raises on all ranks together
        B = len(all_prompts)
        max_len = max((len(p) for p in all_prompts), default=1) + max_new_tokens
        if max_len > self.cfg.max_position:
            raise MoEError(f"prompt + max_new_tokens = {max_len} exceeds max_position={self.cfg.max_position}")
        coherent = self.mode == "exflow"
        owned = list(range(B)) if coherent else mine  # whose context this rank keeps
        self.slot_of = torch.full((max(B, 1),), -1, dtype=torch.int64)
        self.slot_of[torch.tensor(owned, dtype=torch.int64)] = torch.arange(len(owned))
        dtype = self.model.embed_tokens.weight.dtype  # the cache holds K/V in the model's dtype (bf16 too)
        self.cache = KVCache(self.cfg, max(1, len(owned)), max_len, dtype=dtype)
        # prefill (both modes: tokens return to their home rank)
        req = torch.tensor([r for r in mine for _ in all_prompts[r]], dtype=torch.int64)
        pos = torch.tensor([q for r in mine for q in range(len(all_prompts[r]))], dtype=torch.int64)
        ids = torch.tensor([t for r in mine for t in all_prompts[r]], dtype=torch.int64)
        # worst-case capacity per (source, destination) pair, from the prompt table every rank holds: in prefill
        # a rank holds its own prompts' tokens; in decode one token per request of its own (baseline) or, as
        # tokens wander in ExFlow, up to every request's.
        k = self.cfg.top_k
        counts = self._owners  # global request ids of every rank, from the gathered table
        self.cap_rows = k * max((sum(len(all_prompts[r]) for r in rs) for rs in counts), default=0)
        kv_log = [] if coherent else None
        h, req, pos = self._forward(ids, req, pos, stay=False, kv_log=kv_log)
        self.cap_rows = k * (B if coherent else max((len(rs) for rs in counts), default=0))
        last = torch.tensor([i for i in range(len(req)) if i + 1 == len(req) or req[i + 1] != req[i]],
                            dtype=torch.int64)
        h, req, pos = h[last], req[last], pos[last]
        tok = self.model.head(h).argmax(-1)
        out: dict[int, list[int]] = {r: [] for r in mine}
        for step in range(max_new_tokens):
            if coherent:
                all_req, all_tok = self._sync_context(kv_log, req, pos, tok, self._sync_cap(step, counts, all_prompts))
                for r, t in zip(all_req.tolist(), all_tok.tolist()):
                    if r in out:
                        out[r].append(t)
            else:
                for r, t in zip(req.tolist(), tok.tolist()):
                    out[r].append(t)
            if step + 1 == max_new_tokens:
                break
            kv_log = [] if coherent else None
            h, req, pos = self._forward(tok, req, pos + 1, stay=coherent, kv_log=kv_log)
            tok = self.model.head(h).argmax(-1)
        return out
