"""Expert-parallel MoE inference over torch.distributed: the 2-Alltoall baseline and ExFlow's 1-Alltoall
context-coherent mode (arXiv 2401.08383, section 4.1). Device-generic (CPU or CUDA tensors, the same code): a thin
executor over the model's router (:func:`hpdl.models.gpt_moe.route`), the placement (:mod:`hpdl.moe.placement`),
the device dispatch planner (:func:`hpdl.moe.dispatch.plan_device`) and grouped expert GEMMs
(:mod:`hpdl.moe.grouped`). Collectives are :mod:`hpdl.comm`'s public ``all_to_all_single`` / ``all_gather``.

Every rank holds the non-expert weights and, on its device, only the experts that the placement gives it (a
``[n_local, 2F, H]`` / ``[n_local, H, F]`` stack per MoE layer).

* ``baseline`` (DeepSpeed-MoE): a request lives on its home rank. Per MoE layer: dispatch Alltoall of the normed
  hidden rows to the experts' ranks, one grouped GEMM over the local experts, combine Alltoall back home.
* ``exflow`` (top-1 only): context coherence. The prompts are all-gathered at the start; every layer's K/V rows
  computed on a rank are all-gathered (in the cache dtype, asynchronously, one all-gather per layer) and the new
  tokens after every step, so every rank's KV cache holds every request's context. A token then runs attention
  wherever it is and stays on its expert's rank after a MoE layer: one dispatch Alltoall per layer (the residual
  stream, with gate weight, expert, request, position and a valid flag packed bit for bit in extra columns), no
  combine. Prefill runs as in the baseline (a prompt's tokens need each other's same-layer K/V).
  [Design reading: the paper's "all-gather of new tokens" leaves open how the K/V a token produced on different
  ranks becomes coherent; gathering those K/V rows per layer is ours.]

Capacities (``capacity``):

* ``"worst_case"``: no count exchange and no host sync in a decode step. Every rank sends ``C`` rows to every peer
  (``C`` = the most rows a rank can hold, derived from the all-gathered prompt table, so all ranks agree and no
  row can overflow), the valid flag rides in-band, token buffers have fixed sizes (pads flagged), attention runs
  over the fixed cache length. A decode step is CUDA-graph capturable (``cuda_graph=True``). Rows past capacity
  (impossible by construction) are counted on the device and raise at the end of :meth:`MoEEngine.generate`.
* ``"exchange"``: exact counts exchanged before every payload Alltoall (one small collective and one host sync
  per layer, no padding rows): the bandwidth-bound choice.

Both modes are dropless and give the greedy tokens of the single-process model (tests: world 1, 2, 4).
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

import hpdl.comm as hc
from hpdl.models.gpt import KVCache
from hpdl.models.gpt_moe import MoEDecoder
from hpdl.moe import dispatch, grouped
from hpdl.moe.errors import MoEError
from hpdl.moe.placement import contiguous, validate
from hpdl.runtime.errors import HpdlError, WorkerFailedError

MODES = ("baseline", "exflow")
CAPACITIES = ("exchange", "worst_case")
# Header every rank contributes to the start-of-generate all-gather, so arguments that must agree across ranks
# are compared before the first payload collective (a rank that raised alone, or ranks that disagree on
# max_new_tokens, check or the placement, would otherwise leave the others blocked in the next collective).
_HDR = ("problem", "max_new_tokens", "mode", "capacity", "placement", "model", "check")
_PROBLEMS = {1: "prompts: a prompt is empty (every prompt needs at least one token)",
             2: "max_new_tokens must be an int >= 1",
             3: "prompts: a token id outside [0, vocab_size)",
             4: "prompts must be a list of prompts, each a list of int token ids (got a flat list or non-ints)",
             5: "placement does not fit this world size / model"}
_CHECK_CODE = {None: 2, False: 0, True: 1}
_MAX_ID = 2 ** 62  # larger ints cannot travel in the int64 header


def _digest(*parts: bytes) -> int:
    """63-bit digest (fits an int64 collective) of byte strings."""
    h = hashlib.sha256()
    for b in parts:
        h.update(b)
    return int(h.hexdigest()[:15], 16)


@dataclass
class CommStats:
    """Per MoE layer: payload Alltoall calls, bytes sent to other ranks, host seconds of the call (on CUDA the
    launch time: the engine does not synchronise to time); count exchanges; all-gathers; rows dispatched and
    rows that left the rank (all forwards, and decode forwards apart); rows past capacity (must be 0)."""

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
    rows_dispatched_decode: dict = field(default_factory=lambda: defaultdict(int))
    rows_cross_decode: dict = field(default_factory=lambda: defaultdict(int))
    overflow_rows: int = 0

    def as_dict(self) -> dict:
        return {"a2a_calls": dict(self.a2a_calls), "a2a_bytes": dict(self.a2a_bytes),
                "a2a_seconds": dict(self.a2a_seconds), "count_calls": self.count_calls,
                "count_seconds": self.count_seconds, "gather_calls": self.gather_calls,
                "gather_bytes": self.gather_bytes, "gather_seconds": self.gather_seconds,
                "rows_dispatched": dict(self.rows_dispatched), "rows_cross": dict(self.rows_cross),
                "rows_dispatched_decode": dict(self.rows_dispatched_decode),
                "rows_cross_decode": dict(self.rows_cross_decode), "overflow_rows": self.overflow_rows}


def _pack(x: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Rows ``x [n, H]`` (any float dtype) with int32 columns ``meta [n, m]`` appended bit for bit (a view, not
    a cast: in bf16 a position or request id above 256 would round), so one collective carries both."""
    if (4 * meta.shape[1]) % x.element_size():
        meta = torch.cat([meta, torch.zeros(len(meta), 1, dtype=torch.int32, device=meta.device)], 1)
    return torch.cat([x, meta.contiguous().view(x.dtype)], 1)


def _unpack(rows: torch.Tensor, H: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_pack`: ``(x [n, H], meta [n, m] int32)``."""
    return rows[:, :H], rows[:, H:].contiguous().view(torch.int32)[:, :m]


def _shell(model: MoEDecoder, device: torch.device) -> MoEDecoder:
    """A copy of ``model`` on ``device`` without the routed experts' weights (the engine keeps the local ones)."""
    saved = []
    for blk in model.layers:
        if blk.is_moe:
            saved.append((blk.mlp, blk.mlp.w_gate_up, blk.mlp.w_down))
            blk.mlp.w_gate_up = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            blk.mlp.w_down = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    try:
        shell = copy.deepcopy(model)
    finally:
        for mlp, a, b in saved:
            mlp.w_gate_up, mlp.w_down = a, b
    return shell.to(device).eval()


def _prompt_problem(prompts, vocab: int) -> int:
    """Problem code (see ``_PROBLEMS``) of a rank's ``prompts`` argument, 0 when fine; never raises."""
    if not isinstance(prompts, (list, tuple)):
        return 4
    for p in prompts:
        if not isinstance(p, (list, tuple)):
            return 4
        if len(p) == 0:
            return 1
        for t in p:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                return 4
            if t < 0 or t >= vocab:
                return 3
    return 0


class MoEEngine:
    """Greedy generation with expert parallelism on the default (or given) process group.

    Args:
        model: a :class:`MoEDecoder` in eval mode, identical on every rank (any device; it is not modified).
        placement: ``ranks [n_moe_layers, E]`` (a :mod:`hpdl.moe.placement` array) or None for contiguous.
        mode: "baseline" or "exflow".
        check: hpdl.comm's per-call argument check (None = ``HPDL_MOE_CHECK``, whose ``auto`` defers to
            ``HPDL_CHECK``; benchmarks pass False). Must be the same on every rank (checked).
        record_routing: keep every token's experts per MoE layer, keyed by (request, position) (host syncs).
        capacity: "worst_case" or "exchange" (module docstring); None = "worst_case" on CUDA, else "exchange".
        device: where weights, buffers and the KV cache live (default: the model's device).
        algorithm: hpdl.comm algorithm of the payload collectives; "auto" = the peer "push" kernel for CUDA tensors
            on a non-NCCL group (ranks of one host), "native" on NCCL, hpdl.comm's "auto" for CPU tensors.
        grouped_backend: :mod:`hpdl.moe.grouped` backend ("auto", "grouped_mm", "bmm").

    Raises:
        MoEError: unknown mode or capacity, exflow with top_k > 1; in a single process also a placement for
            another world size or model (with G > 1 that error is deferred to :meth:`generate`, where every rank
            raises it together).
    """

    def __init__(self, model: MoEDecoder, placement=None, mode: str = "exflow", group=None,
                 check: bool | None = None, record_routing: bool = False, capacity: str | None = None,
                 device=None, algorithm: str = "auto", grouped_backend: str = "auto"):
        if mode not in MODES:
            raise MoEError(f"mode must be one of {MODES}, got {mode!r}")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if capacity is None:
            capacity = "worst_case" if self.device.type == "cuda" else "exchange"
        if capacity not in CAPACITIES:
            raise MoEError(f"capacity must be one of {CAPACITIES}, got {capacity!r}")
        cfg = model.cfg
        if mode == "exflow" and cfg.top_k != 1:
            raise MoEError(f"mode='exflow' needs top_k=1 (a top-k token would need a combine at its primary "
                           f"expert's rank), model has top_k={cfg.top_k}")
        if check is None:
            from hpdl.runtime import env

            mode_env = env.get("HPDL_MOE_CHECK")
            check = None if mode_env == "auto" else bool(mode_env)
        self.model, self.cfg, self.mode, self.group, self.check = model, cfg, mode, group, check
        self.capacity = capacity
        self.G = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        backend = str(dist.get_backend(group)) if dist.is_initialized() else "none"
        if algorithm == "auto" and self.device.type == "cuda" and self.G > 1:
            algorithm = "native" if "nccl" in backend else "push"
        self.algorithm = algorithm
        # small host-side collectives (prompt table, counts) travel on the device NCCL needs, else on the CPU
        self._meta_dev = self.device if "nccl" in backend else torch.device("cpu")
        nl, E = len(cfg.moe_layers), cfg.n_experts
        self._problem, self._problem_msg = 0, ""
        try:
            ranks = contiguous(nl, E, self.G) if placement is None else np.asarray(placement)
            if ranks.shape != (nl, E):
                raise MoEError(f"placement shape {ranks.shape}, expected (moe layers={nl}, n_experts={E})")
            ranks = validate(ranks, self.G)
        except (MoEError, ValueError) as e:
            if self.G == 1:
                raise
            # raising here, on this rank alone, would leave the peers blocked in generate's first collective
            self._problem, self._problem_msg = 5, str(e)
            ranks = contiguous(nl, E, self.G)
        self.ranks = torch.as_tensor(ranks)
        self.ranks_dev = self.ranks.to(self.device)
        self.moe_index = {l: i for i, l in enumerate(cfg.moe_layers)}
        # what every rank must share: the placement, and the model's config and router weights (routing decides
        # where tokens go; the full weights are not hashed, that would cost seconds on a real checkpoint)
        self._place_digest = _digest(self.ranks.numpy().tobytes())
        self._model_digest = _digest(cfg.identity().encode(), *(
            blk.mlp.gate.weight.detach().float().cpu().contiguous().numpy().tobytes()
            for blk in model.layers if blk.is_moe))
        self.net = _shell(model, self.device)
        self.dtype = self.net.embed_tokens.weight.dtype
        # only this rank's experts, stacked per MoE layer; local_of[li, e] = local index or n_local (not here)
        self.w_gate_up, self.w_down, local_of = [], [], []
        for li, l in enumerate(cfg.moe_layers):
            mlp = model.layers[l].mlp
            loc = torch.nonzero(self.ranks[li] == self.rank).flatten()
            self.w_gate_up.append(mlp.w_gate_up.detach()[loc].to(self.device, self.dtype).contiguous())
            self.w_down.append(mlp.w_down.detach()[loc].to(self.device, self.dtype).contiguous())
            lo = torch.full((E,), len(loc), dtype=torch.int64)
            lo[loc] = torch.arange(len(loc))
            local_of.append(lo)
        self.local_of = torch.stack(local_of).to(self.device)
        self.grouped_backend = grouped.backend_for(self.device, self.dtype,
                                                   (cfg.hidden_size, cfg.expert_size, 2 * cfg.expert_size),
                                                   grouped_backend)
        self.stats = CommStats()
        self.record_routing = record_routing
        self.routing: dict[tuple[int, int], list[int]] = {}
        self._phase = 0
        self.sync_timing = False  # generate's self.timings: host times; True synchronises CUDA around phases
        self.timings: dict = {}

    # --- collectives (hpdl.comm public API; everything after the tensors by keyword) ----------------------
    def _call(self, what: str, layer: int | None, fn, *args, **kw):
        """One hpdl.comm collective. hpdl's own errors (timeouts naming the silent rank, mismatches) pass
        through; the backend's untyped RuntimeError (gloo: "Connection closed by peer" when a rank died)
        becomes a WorkerFailedError that names this rank, the collective and the MoE layer."""
        try:
            return fn(*args, **kw)
        except HpdlError:
            raise
        except RuntimeError as e:
            where = f"MoE layer {layer}" if layer is not None else "the context all-gather"
            raise WorkerFailedError(f"rank {self.rank}: {what} at {where} failed; a peer rank of the "
                                    f"{self.G}-rank group died or closed its connection ({str(e)[:300]})") from e

    def _a2a(self, payload: torch.Tensor, send: list[int], recv: list[int], layer: int) -> torch.Tensor:
        out = torch.empty(sum(recv), payload.shape[1], dtype=payload.dtype, device=payload.device)
        t0 = time.perf_counter()
        if self.G > 1:
            self._call("payload Alltoall", layer, hc.all_to_all_single, out, payload.contiguous(),
                       output_split_sizes=recv, input_split_sizes=send, group=self.group,
                       algorithm=self.algorithm, check=self.check)
        else:
            out.copy_(payload)
        self.stats.a2a_seconds[layer] += time.perf_counter() - t0
        self.stats.a2a_calls[layer] += 1
        self.stats.a2a_bytes[layer] += (sum(send) - send[self.rank]) * payload.shape[1] * payload.element_size()
        return out

    def _dispatch(self, rows: torch.Tensor, dest: torch.Tensor, valid: torch.Tensor, li: int, C: int):
        """Send ``rows [n, W]`` (valid ones) to ranks ``dest [n]``. Returns ``(received rows [R, W] grouped by
        source, ctx)``; ``ctx`` lets :meth:`_combine` send results back. Pad rows of the received buffer are
        zero, so their int32 flag column reads 0."""
        cap = C if self.capacity == "worst_case" else None
        p = dispatch.plan_device(dest, valid, self.G, cap)
        cnt = self._counters
        cnt[self._phase, li, 0] += valid.sum()
        cnt[self._phase, li, 1] += (valid & (dest != self.rank)).sum()
        cnt[self._phase, li, 2] += p.overflow
        buf = torch.zeros(p.trash + 1, rows.shape[1], dtype=rows.dtype, device=rows.device)
        buf.index_copy_(0, p.spos, rows)
        if cap is not None:
            split = [cap] * self.G
            return self._a2a(buf[:p.trash], split, split, li), (p, split, split)
        t0 = time.perf_counter()
        send_t = p.counts.to(self._meta_dev)
        recv_t = torch.empty_like(send_t)
        if self.G > 1:
            self._call("count exchange", li, hc.all_to_all_single, recv_t, send_t, group=self.group,
                       check=self.check)
        else:
            recv_t.copy_(send_t)
        send, recv = send_t.tolist(), recv_t.tolist()  # the host sync this mode accepts
        self.stats.count_calls += 1
        self.stats.count_seconds += time.perf_counter() - t0
        return self._a2a(buf[:sum(send)], send, recv, li), (p, send, recv)

    def _combine(self, y: torch.Tensor, ctx, li: int) -> torch.Tensor:
        """The dispatch reversed: ``y`` (rows as received) back to their senders, in the senders' row order."""
        p, send, recv = ctx
        back = self._a2a(y, recv, send, li)
        back = torch.cat([back, back.new_zeros(p.trash + 1 - back.shape[0], back.shape[1])], 0)
        return back[p.spos]  # pad rows read the zero trash row

    def _gather(self, rows: torch.Tensor, what: str, async_op: bool = False):
        """All-gather of equal-size ``rows [n, W]`` -> ``(out [G*n, W], work or None)``."""
        out = torch.empty(self.G * rows.shape[0], rows.shape[1], dtype=rows.dtype, device=rows.device)
        t0 = time.perf_counter()
        if rows.is_cuda and self.algorithm in ("push", "pull"):
            # the peer kernel is an Alltoall: send the same block to every rank (same bytes on the wire)
            work = self._call(what, None, hc.all_to_all_single, out, rows.repeat(self.G, 1), group=self.group,
                              async_op=async_op, algorithm=self.algorithm, check=self.check)
        else:
            work = self._call(what, None, hc.all_gather, out, rows.contiguous(), group=self.group,
                              async_op=async_op, algorithm=self.algorithm if rows.is_cuda else "auto",
                              check=self.check)
        self.stats.gather_calls += 1
        self.stats.gather_bytes += (self.G - 1) * rows.numel() * rows.element_size()
        self.stats.gather_seconds += time.perf_counter() - t0
        return out, work

    # --- MoE layer ---------------------------------------------------------------------------------------
    def _experts(self, li: int, x: torch.Tensor, e: torch.Tensor, w: torch.Tensor, valid: torch.Tensor):
        """Weighted local expert outputs of rows ``x [R, H]`` (expert ``e``, gate weight ``w`` fp32), 0 for pad
        rows; one grouped GEMM pair over all local experts (rows sorted by local expert on the device)."""
        El = self.w_gate_up[li].shape[0]
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        el = self.local_of[li][e.clamp(0, self.cfg.n_experts - 1)]
        foreign = valid & (el == El)
        self._counters[self._phase, li, 3] += foreign.sum()  # a row for an expert placed elsewhere
        key = torch.where(valid, el, El)
        order = torch.sort(key, stable=True).indices
        per = (key[:, None] == torch.arange(El + 1, device=key.device)[None, :]).sum(0)
        offs = per[:El].cumsum(0).to(torch.int32)
        ys = grouped.swiglu(x[order], self.w_gate_up[li], self.w_down[li], offs, self.grouped_backend)
        y = torch.empty_like(ys).index_copy_(0, order, ys)
        return torch.where((key < El)[:, None], y * w[:, None].to(x.dtype), torch.zeros((), dtype=x.dtype,
                                                                                           device=x.device))

    def _moe_combine(self, li, blk, h, req, pos, valid, C):
        """Baseline: dispatch copies to expert ranks, compute, combine back to this rank."""
        x = blk.ln_2(h)
        _, idx, w = blk.mlp.route(x)
        self._record(li, req, pos, idx, valid)
        n, k = idx.shape
        dest = self.ranks_dev[li][idx.reshape(-1)]
        one = torch.ones(n * k, dtype=torch.int32, device=h.device)
        meta = torch.stack([w.reshape(-1).float().view(torch.int32), idx.reshape(-1).int(), one], 1)
        recv, ctx = self._dispatch(_pack(x.repeat_interleave(k, 0), meta), dest, valid.repeat_interleave(k),
                                   li, C)
        H = x.shape[1]
        x_r, m_r = _unpack(recv, H, 3)
        y = self._experts(li, x_r, m_r[:, 1].long(), m_r[:, 0].view(torch.float32), m_r[:, 2] == 1)
        out = self._combine(y, ctx, li).view(n, k, H).sum(1)
        s = blk.mlp.shared(x)
        return h + (out if s is None else out + s), req, pos, valid

    def _moe_stay(self, li, blk, h, req, pos, valid, C):
        """ExFlow: dispatch the residual stream to the expert's rank; the token stays there. Returns the
        received tokens compacted into this rank's fixed ``[nmax]`` token buffer (pads flagged)."""
        x = blk.ln_2(h)
        _, idx, w = blk.mlp.route(x)
        self._record(li, req, pos, idx, valid)
        dest = self.ranks_dev[li][idx[:, 0]]
        one = torch.ones(len(dest), dtype=torch.int32, device=h.device)
        meta = torch.stack([w[:, 0].float().view(torch.int32), idx[:, 0].int(), req.int(), pos.int(), one], 1)
        recv, _ = self._dispatch(_pack(h, meta), dest, valid, li, C)
        H = h.shape[1]
        h_r, m_r = _unpack(recv, H, 5)
        v_r = m_r[:, 4] == 1
        x_r = blk.ln_2(h_r)
        y = self._experts(li, x_r, m_r[:, 1].long(), m_r[:, 0].view(torch.float32), v_r)
        s = blk.mlp.shared(x_r)
        h_r = h_r + (y if s is None else y + s)
        if self.capacity == "exchange":  # exact rows, all real: no padded buffer to keep
            return h_r, m_r[:, 2].long(), m_r[:, 3].long(), v_r
        # compact: valid rows to the front of a fixed [nmax] buffer (no host count), the rest pads
        n = self._nmax
        tgt = torch.where(v_r, v_r.long().cumsum(0) - 1, n).clamp_max(n)
        hb = h.new_zeros(n + 1, H).index_copy_(0, tgt, h_r)[:n]
        rb = torch.zeros(n + 1, dtype=torch.int64, device=h.device).index_copy_(0, tgt, m_r[:, 2].long())[:n]
        pb = torch.zeros(n + 1, dtype=torch.int64, device=h.device).index_copy_(0, tgt, m_r[:, 3].long())[:n]
        vb = torch.arange(n, device=h.device) < v_r.sum()
        return hb, rb, pb, vb

    def _record(self, li, req, pos, idx, valid):
        if self.record_routing:  # debugging aid: host syncs
            for r, q, e, v in zip(req.tolist(), pos.tolist(), idx.tolist(), valid.tolist()):
                if v:
                    self.routing.setdefault((r, q), [None] * len(self.cfg.moe_layers))[li] = e

    # --- forward over all layers -------------------------------------------------------------------------
    def _attention(self, blk, h, slot, pos):
        """Residual attention of ``h [n, H]`` at (cache slot, position); K/V written to the cache first, then
        attention over the fixed cache length with a causal mask (no host value: ``S`` is the cache length)."""
        if h.shape[0] == 0:  # a rank may hold no token (a shape, not a device value)
            e = h.new_zeros(0, self.cfg.n_kv_heads, self.cfg.head_dim)
            return h, e, e
        o, k, v = blk.attn.cached(blk.ln_1(h), self.net.rope(pos, h.dtype), self.cache, slot, pos,
                                  self.cache.max_seq_len)
        return h + o, k, v

    def _forward(self, ids, req, pos, valid, stay: bool, C: int, kv_rows: int | None):
        """Tokens ``ids [n]`` of requests ``req`` at ``pos`` (``valid`` flags real rows) through every layer.
        With ``kv_rows`` (ExFlow) every layer's K/V rows (``kv_rows`` rows per rank, pads flagged) are
        all-gathered and applied at the end: on CUDA one asynchronous all-gather per layer, started right after
        the layer's attention (hpdl.comm's side stream); on CPU, where collectives block, the layers' rows are
        gathered in one call at the end (fewer latency-bound calls). Returns (h, req, pos, valid) of the tokens
        that end on this rank."""
        h = self.net.embed(ids)
        per_layer = ids.is_cuda
        pending, rows = [], []
        for blk in self.net.layers:
            slot = torch.where(valid, self.slot_of[req], self._dummy)
            p = torch.where(valid, pos, 0)
            h, k, v = self._attention(blk, h, slot, p)
            if kv_rows is not None and self.G > 1:
                buf = self._kv_rows(blk.layer, k, v, slot, p, valid, kv_rows)
                if per_layer:
                    pending.append(self._gather(buf, "K/V all-gather", async_op=True))
                else:
                    rows.append(buf)
            if blk.is_moe:
                fn = self._moe_stay if stay else self._moe_combine
                h, req, pos, valid = fn(self.moe_index[blk.layer], blk, h, req, pos, valid, C)
            else:
                h = h + blk.mlp(blk.ln_2(h))
        if rows:
            pending.append(self._gather(torch.cat(rows, 0), "K/V all-gather"))
        for out, work in pending:
            if work is not None:
                work.wait()
            self._kv_apply(out)
        return h, req, pos, valid

    def _kv_rows(self, layer: int, k, v, slot, pos, valid, rows: int) -> torch.Tensor:
        """One layer's K/V rows in the cache dtype with (layer, slot, position, flag) packed bit for bit,
        padded to ``rows`` rows (pads flagged 0)."""
        n, kvd = k.shape[0], self.cfg.n_kv_heads * self.cfg.head_dim
        meta = torch.stack([torch.full_like(slot, layer).int(), slot.int(), pos.int(), valid.int()], 1)
        packed = _pack(torch.cat([k.reshape(n, kvd), v.reshape(n, kvd)], 1).to(self.cache.k.dtype), meta)
        buf = packed.new_zeros(rows, packed.shape[1])
        buf[:n] = packed
        return buf

    def _kv_apply(self, out: torch.Tensor) -> None:
        kvd = self.cfg.n_kv_heads * self.cfg.head_dim
        kv, meta = _unpack(out, 2 * kvd, 4)
        ok = meta[:, 3] == 1
        l = meta[:, 0].long()
        s = torch.where(ok, meta[:, 1].long(), self._dummy)
        p = torch.where(ok, meta[:, 2].long(), 0)
        shape = (len(kv), self.cfg.n_kv_heads, self.cfg.head_dim)
        self.cache.k[l, s, :, p] = kv[:, :kvd].reshape(shape)
        self.cache.v[l, s, :, p] = kv[:, kvd:].reshape(shape)

    # --- start-of-generate agreement ----------------------------------------------------------------------
    def _header(self, prompts, max_new_tokens) -> list[int]:
        problem = self._problem or _prompt_problem(prompts, self.cfg.vocab_size)
        if not problem and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer))
                            or max_new_tokens < 1):
            problem = 2
        mnt = int(max_new_tokens) if isinstance(max_new_tokens, (int, np.integer)) and \
            abs(int(max_new_tokens)) < _MAX_ID else -1
        return [problem, mnt, MODES.index(self.mode), CAPACITIES.index(self.capacity), self._place_digest,
                self._model_digest, _CHECK_CODE.get(self.check, 3)]

    def _check_headers(self, headers: list[list[int]]) -> None:
        """Raise the same MoEError on every rank when a rank's arguments are bad or differ from rank 0's."""
        for g, h in enumerate(headers):
            if h[0]:
                # the same text on every rank (the rank's own detail, e.g. the placement's error, is in __cause__)
                raise MoEError(f"rank {g}: {_PROBLEMS[h[0]]} (max_new_tokens={h[1]}); every rank stops") from (
                    MoEError(self._problem_msg) if g == self.rank and self._problem_msg else None)
        names = {"mode": MODES, "capacity": CAPACITIES, "check": ("False", "True", "None", "?")}
        for f, name in enumerate(_HDR[1:], 1):
            for g, h in enumerate(headers):
                if h[f] != headers[0][f]:
                    a, b = headers[0][f], h[f]
                    if name in names:
                        a, b = names[name][a], names[name][b]
                    elif name in ("placement", "model"):
                        a, b = f"digest {a:x}", f"digest {b:x}"
                    raise MoEError(f"rank {g} has {name}={b}, rank 0 has {name}={a}: every rank must call "
                                   f"generate with the same {name}" + (" (placement array)" if name == "placement"
                                   else " (config and router weights)" if name == "model" else ""))

    def _gather_prompts(self, prompts, max_new_tokens) -> tuple[list[list[int]], list[int]]:
        """All-gather every rank's prompts (the only metadata exchange at start), after a header of the
        arguments that must agree (checked on every rank, so all raise together); returns all prompts in global
        request order and the global ids of this rank's requests. A rank with a problem sends no prompts, so a
        bad value (2**70, a float) never reaches the int64 tensor."""
        hdr = self._header(prompts, max_new_tokens)
        body = [] if hdr[0] else [len(prompts)] + [len(p) for p in prompts] + [int(t) for p in prompts for t in p]
        if hdr[0]:
            body = [0]
        flat = torch.tensor(hdr + body, dtype=torch.int64, device=self._meta_dev)[:, None]
        if self.G == 1:
            rows = flat[:, 0].tolist()
        else:
            # fixed check=False: ranks that differ in `check` must still run the same collectives here
            n = torch.tensor([flat.shape[0]], dtype=torch.int64, device=self._meta_dev)
            counts = torch.empty(self.G, dtype=torch.int64, device=self._meta_dev)
            self._call("count all-gather", None, hc.all_gather, counts, n, group=self.group, check=False)
            m = int(counts.max())
            buf = torch.zeros(m, 1, dtype=torch.int64, device=self._meta_dev)
            buf[:flat.shape[0]] = flat
            out = torch.empty(self.G * m, 1, dtype=torch.int64, device=self._meta_dev)
            self._call("prompt all-gather", None, hc.all_gather, out, buf, group=self.group, check=False)
            cl = counts.tolist()
            rows = [x for g in range(self.G) for x in out[g * m:g * m + cl[g], 0].tolist()]
        out_p, mine, i, g = [], [], 0, 0
        self._owners = []
        headers = []
        while i < len(rows):
            headers.append(rows[i:i + len(_HDR)])
            i += len(_HDR)
            n = rows[i]
            lens = rows[i + 1:i + 1 + n]
            j = i + 1 + n
            self._owners.append(list(range(len(out_p), len(out_p) + n)))
            for ln in lens:
                if g == self.rank:
                    mine.append(len(out_p))
                out_p.append(rows[j:j + ln])
                j += ln
            i, g = j, g + 1
        self._check_headers(headers)
        return out_p, mine

    # --- generation --------------------------------------------------------------------------------------
    def _dev(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, cuda_graph: bool = False
                 ) -> dict[int, list[int]]:
        """Greedy-decode this rank's ``prompts`` (any count, also 0; lengths may differ; packed, no padding).

        Returns ``{global request id: max_new_tokens generated ids}`` for this rank's requests; request ids
        number the requests of rank 0, then rank 1, ... . ``self.stats`` holds the communication counters.
        With ``capacity="worst_case"`` a decode step reads no device value on the host; ``cuda_graph=True``
        captures one decode step in a CUDA graph and replays it (CUDA only).

        Raises:
            MoEError: on every rank at once, before any payload collective, when some rank passed prompts that
                are not a list of non-empty lists of int ids in ``[0, vocab_size)``, ``max_new_tokens`` not an int
                >= 1, a placement that does not fit, or when ranks differ in ``max_new_tokens``, mode, capacity,
                check, placement or model (config and router weights); the message names the rank and the
                argument. Also when prompt + max_new_tokens exceeds ``max_position``, when ``cuda_graph`` is
                asked without CUDA or with ``capacity="exchange"``, and (after the run) when rows overflowed a
                capacity or reached a rank that does not hold their expert.
        """
        if cuda_graph and (self.device.type != "cuda" or self.capacity != "worst_case"):
            raise MoEError(f"cuda_graph=True needs device cuda and capacity='worst_case', got device "
                           f"{self.device}, capacity {self.capacity!r}")
        t_start = time.perf_counter()
        all_prompts, mine = self._gather_prompts(prompts, max_new_tokens)  # raises on all ranks together
        B = len(all_prompts)
        if B == 0:
            return {}
        max_len = max(len(p) for p in all_prompts) + max_new_tokens
        if max_len > self.cfg.max_position:
            raise MoEError(f"prompt + max_new_tokens = {max_len} exceeds max_position={self.cfg.max_position}")
        coherent = self.mode == "exflow"
        owned = list(range(B)) if coherent else mine  # whose context this rank keeps
        dev = self.device
        nl = len(self.cfg.moe_layers)
        self._counters = torch.zeros(2, nl, 4, dtype=torch.int64, device=dev)
        slot_of = torch.full((B,), len(owned), dtype=torch.int64)
        slot_of[torch.tensor(owned, dtype=torch.int64)] = torch.arange(len(owned))
        self.slot_of = slot_of.to(dev)
        self._dummy = len(owned)  # slot where pad rows write (never read)
        self.cache = KVCache(self.cfg, len(owned) + 1, max_len, dtype=self.dtype, device=dev)
        k = self.cfg.top_k
        owners = self._owners
        # prefill (both modes: tokens return to their home rank); capacity = most rows any rank sends
        self._phase = 0
        req = self._dev([r for r in mine for _ in all_prompts[r]])
        pos = self._dev([q for r in mine for q in range(len(all_prompts[r]))])
        ids = self._dev([t for r in mine for t in all_prompts[r]])
        n_pre = max(sum(len(all_prompts[r]) for r in rs) for rs in owners)
        valid = torch.ones(len(ids), dtype=torch.bool, device=dev)
        h, req, pos, valid = self._forward(ids, req, pos, valid, stay=False, C=k * n_pre,
                                           kv_rows=n_pre if coherent else None)
        ends = np.cumsum([len(all_prompts[r]) for r in mine], dtype=np.int64) - 1
        last = torch.as_tensor(ends, dtype=torch.int64).to(dev)
        h, req, pos = h[last], req[last], pos[last]
        tok = self.net.head(h).argmax(-1)
        # decode token buffer: baseline = own requests; ExFlow = a fixed [B] buffer (tokens wander), pads flagged
        self._nmax = B if coherent else len(mine)
        n0 = len(mine)
        # exact counts keep exact buffers (ExFlow's token count per rank then varies step to step)
        n_buf = n0 if self.capacity == "exchange" else self._nmax
        st_tok = torch.zeros(n_buf, dtype=torch.int64, device=dev)
        st_req, st_pos = torch.zeros_like(st_tok), torch.zeros_like(st_tok)
        st_tok[:n0], st_req[:n0], st_pos[:n0] = tok, req, pos
        st_valid = torch.arange(n_buf, device=dev) < n0
        out_tok = torch.zeros(B + 1, max_new_tokens, dtype=torch.int64, device=dev)
        C = k * (B if coherent else max(len(rs) for rs in owners))
        self._record_tokens(out_tok, 0, st_tok, st_req, st_valid, coherent)
        state = (st_tok, st_req, st_pos, st_valid)
        self._phase = 1
        t_pre = self._clock()

        def step(state):
            tok, req, pos, valid = state
            h, req, pos, valid = self._forward(tok, req, pos + 1, valid, stay=coherent, C=C,
                                               kv_rows=self._nmax if coherent else None)
            return self.net.head(h).argmax(-1), req, pos, valid

        graph, static, g_out = None, None, None
        for s in range(1, max_new_tokens):
            if cuda_graph and s >= 2:  # step 1 ran eagerly (warm-up: lazy inits happen outside the capture)
                if graph is None:
                    static = tuple(t.clone() for t in state)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        g_out = step(static)
                for a, b in zip(static, state):
                    a.copy_(b)
                graph.replay()
                state = tuple(t.clone() for t in g_out)
            else:
                state = step(state)
            self._record_tokens(out_tok, s, state[0], state[1], state[3], coherent)
        self.graph = graph
        t_end = self._clock()
        self.timings = {"prefill_s": t_pre - t_start, "decode_s": t_end - t_pre, "decode_steps": max_new_tokens - 1}
        res = self._host(out_tok[:B])  # the one host read of the decode loop
        self._finish_stats()
        return {r: res[r] for r in mine}

    def _host(self, t: torch.Tensor) -> list:
        """The device-to-host reads after the decode loop (one place, so tests can run on device "meta")."""
        return t.tolist()

    def _clock(self) -> float:
        """Host time; with ``sync_timing`` on CUDA after a device synchronise (benchmarks only: a host sync)."""
        if self.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _record_tokens(self, out_tok, step, tok, req, valid, coherent):
        """Write this step's tokens into ``out_tok [B+1, steps]`` on the device (pads to row B). ExFlow: the
        tokens of every rank are all-gathered first (the paper's step-end all-gather of new tokens)."""
        rows = torch.stack([req, tok, valid.long()], 1)
        if coherent and self.G > 1:
            if rows.shape[0] < self._nmax:  # exact-count buffers: pad to the agreed size (pads flagged 0)
                rows = torch.cat([rows, rows.new_zeros(self._nmax - rows.shape[0], 3)], 0)
            rows, _ = self._gather(rows, "token all-gather")
        ok = rows[:, 2] == 1
        out_tok[torch.where(ok, rows[:, 0], out_tok.shape[0] - 1), step] = rows[:, 1]

    def _finish_stats(self) -> None:
        c = torch.as_tensor(self._host(self._counters))
        for li in range(c.shape[1]):
            self.stats.rows_dispatched[li] += int(c[:, li, 0].sum())
            self.stats.rows_cross[li] += int(c[:, li, 1].sum())
            self.stats.rows_dispatched_decode[li] += int(c[1, li, 0])
            self.stats.rows_cross_decode[li] += int(c[1, li, 1])
        self.stats.overflow_rows += int(c[:, :, 2].sum())
        if int(c[:, :, 2].sum()):
            raise MoEError(f"rank {self.rank}: {int(c[:, :, 2].sum())} rows exceeded the agreed capacity "
                           f"(per MoE layer {c[:, :, 2].sum(0).tolist()}); the tokens are incomplete")
        if int(c[:, :, 3].sum()):
            bad = c[:, :, 3].sum(0).tolist()
            raise MoEError(f"rank {self.rank} received tokens for experts placed on other ranks (per MoE layer "
                           f"{bad}): ranks use different placements")
