"""Flover's scheduler: pure CPU bookkeeping of requests, KV slots and buffer reordering.

Flover (Yao et al., HiPC 2023, arXiv 2305.13484) fuses the token generation of every in-flight request into
one decoder forward per iteration. Each request owns one pre-allocated KV slot, and the fused step reads the
contiguous slot range ``[start, start + n)``. When a request in the middle finishes, the range has a hole;
``plan_compaction`` moves the fewest live slots so the range is contiguous again (the paper's buffer
reordering; ``memory_shuffler.h`` in the authors' code slides a window of width n and keeps the one holding
the most live slots). The scheduler never touches tensors: it emits ``StepPlan`` objects that the
executor runs, and reads back sampled tokens (the vLLM v1 scheduler/worker split).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate

from hpdl.serve.sampling import SamplingParams

REORDER_MODES = ("window", "prefix", "none")


def plan_compaction(live: list[bool], anchor: int | None = None) -> tuple[int, list[tuple[int, int]]]:
    """Fewest slot moves that make the live slots one contiguous range.

    Args:
        live: ``live[i]`` is True when slot i holds a running request.
        anchor: fix the range start (0 for CUDA graphs, whose captured views start at slot 0); None lets the
            window slide to wherever the fewest moves are needed (Flover).
    Returns:
        ``(start, moves)``: the new range is ``[start, start + sum(live))`` and ``moves`` lists
        ``(src, dst)`` slot copies, each a live slot outside the window into a free slot inside it. Every live
        slot outside the final window must move once, so choosing the window with the most live slots is
        optimal and ``len(moves) = n - max_w live[w:w+n]``.
    """
    n, S = sum(live), len(live)
    if n == 0:
        return 0, []
    if anchor is not None and not 0 <= anchor <= S - n:
        raise ValueError(f"anchor must be in [0, {S - n}] for {n} live slots of {S}, got {anchor}")
    pre = [0, *accumulate(int(x) for x in live)]
    if anchor is None:
        start = max(range(S - n + 1), key=lambda w: (pre[w + n] - pre[w], -w))
    else:
        start = anchor
    holes = [i for i in range(start, start + n) if not live[i]]
    outside = [i for i in range(S) if live[i] and not start <= i < start + n]
    return start, list(zip(outside, holes))


@dataclass
class Request:
    """One generation request and its progress (owned by the scheduler while unfinished)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None  # set when finish_reason is "error": what failed for this request alone
    cumulative_logprob: float = 0.0  # sum of the output tokens' logprobs (when params.logprobs is set)

    @property
    def num_cached(self) -> int:
        """KV positions written for this request: the prompt plus every output token except the newest."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)


@dataclass
class StepPlan:
    """What the workers run in one forward: slot moves first, then a prefill or a fused decode.

    prefill: ``prefill_tokens`` (one list per new request) into ``prefill_slots``; with ``prompt_logprobs`` the
    forward returns logits at every prompt position ``[rows, T, vocab]`` instead of ``[rows, vocab]``.
    decode: rows are slots ``[start, start + n)``; ``decode_tokens[i]`` at ``decode_positions[i]``; rows whose
    slot is free (``reorder='none'`` leaves holes) carry token 0 at position 0 and are ignored.
    """

    moves: list[tuple[int, int, int]] = field(default_factory=list)  # (src, dst, length)
    prefill_tokens: list[list[int]] = field(default_factory=list)
    prefill_slots: list[int] = field(default_factory=list)
    start: int = 0
    n: int = 0
    decode_tokens: list[int] = field(default_factory=list)
    decode_positions: list[int] = field(default_factory=list)
    requests: list[Request | None] = field(default_factory=list)  # row -> request (engine side only)
    prompt_logprobs: bool = False

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill_slots)

    def single(self, row: int) -> StepPlan:
        """Row ``row`` of this plan alone (the engine retries a failed forward request by request). The moves are
        kept: each copies a live slot into a hole, so running them again copies the same data."""
        if self.is_prefill:
            return StepPlan(moves=self.moves, prefill_tokens=[self.prefill_tokens[row]],
                            prefill_slots=[self.prefill_slots[row]], requests=[self.requests[row]],
                            prompt_logprobs=self.prompt_logprobs)
        return StepPlan(moves=self.moves, start=self.start + row, n=1, decode_tokens=[self.decode_tokens[row]],
                        decode_positions=[self.decode_positions[row]], requests=[self.requests[row]])


class Scheduler:
    """Request queue + slot allocator + reordering; ``schedule_*`` emit plans, ``update`` reads tokens back.

    Args:
        num_slots: pre-allocated KV slots = the most requests decoded together (``max_num_seqs``).
        max_seq_len: positions per slot; a request needs ``len(prompt) + max_tokens <= max_seq_len``.
        max_prefill_tokens: padded tokens (rows x longest prompt) one batched prefill may hold.
        reorder: ``"window"`` (Flover, the range slides), ``"prefix"`` (range anchored at slot 0, needed by
            CUDA graphs), or ``"none"`` (no moves; the decode covers the span of live slots, holes included).
    """

    def __init__(self, num_slots: int, max_seq_len: int, max_prefill_tokens: int = 8192, reorder: str = "window"):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if reorder not in REORDER_MODES:
            raise ValueError(f"reorder must be one of {REORDER_MODES}, got {reorder!r}")
        self.num_slots, self.max_seq_len, self.reorder = num_slots, max_seq_len, reorder
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * num_slots
        self.start = 0
        self.num_moves = 0
        self.computed_rows = 0  # decode rows run (holes included), for the reordering comparison
        self.live_rows = 0  # decode rows that belonged to a running request
        self._pending_moves: list[tuple[int, int, int]] = []
        self._holes = False  # a slot was freed since the last compaction

    # --- queue ------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request. Raises ValueError if its prompt is empty or it cannot fit a slot."""
        if not req.prompt_ids:
            raise ValueError("prompt must contain at least one token")
        need = len(req.prompt_ids) + req.params.max_tokens
        if need > self.max_seq_len:
            raise ValueError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) = {need} "
                             f"exceeds max_seq_len={self.max_seq_len}")
        self.waiting.append(req)

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    def finish(self, req: Request, reason: str) -> None:
        """Finish ``req`` now (stop string, abort, error): its slot is free for the next compaction. A finished
        request only takes the new reason (a stop string completed by the last allowed token is a 'stop')."""
        if req.finish_reason is not None:
            req.finish_reason = reason
            return
        req.finish_reason, req.finish_time = reason, time.perf_counter()
        if req.slot is not None:
            self.slots[req.slot] = None
            req.slot, self._holes = None, True
        elif req in self.waiting:
            self.waiting.remove(req)

    # --- planning ---------------------------------------------------------------------------------
    def _compact(self) -> list[tuple[int, int, int]]:
        if not self._holes:  # admissions keep the range contiguous; only finishes make holes
            return []
        self._holes = False
        live = [r is not None for r in self.slots]
        n = sum(live)
        if self.reorder == "none" or n == 0:
            self.start = 0 if n == 0 else self.start
            return []
        start, moves = plan_compaction(live, 0 if self.reorder == "prefix" else None)
        out = []
        for src, dst in moves:
            req = self.slots[src]
            self.slots[dst], self.slots[src], req.slot = req, None, dst
            out.append((src, dst, req.num_cached))
        self.start, self.num_moves = start, self.num_moves + len(moves)
        return out

    def _free_slot(self) -> int | None:
        n = sum(r is not None for r in self.slots)
        if n == self.num_slots:
            return None
        if self.reorder == "none":  # first fit
            return self.slots.index(None)
        if n == 0:
            self.start = 0
            return 0
        if self.start + n < self.num_slots:  # grow the contiguous range at its end, else at its front
            return self.start + n
        self.start -= 1
        return self.start

    def schedule_prefill(self) -> StepPlan | None:
        """Admit waiting requests FIFO into free slots (one batched prefill), or None if none can start."""
        moves = self._compact()
        plan = StepPlan(moves=moves)
        longest = 0
        while self.waiting:
            req = self.waiting[0]
            longest2 = max(longest, len(req.prompt_ids))
            if plan.prefill_slots and longest2 * (len(plan.prefill_slots) + 1) > self.max_prefill_tokens:
                break
            slot = self._free_slot()
            if slot is None:
                break
            self.waiting.popleft()
            self.slots[slot], req.slot, longest = req, slot, longest2
            plan.prefill_slots.append(slot)
            plan.prefill_tokens.append(req.prompt_ids)
            plan.requests.append(req)
            plan.prompt_logprobs |= req.params.prompt_logprobs is not None
        if not plan.prefill_slots:
            self._pending_moves = moves
            return None
        return plan

    def schedule_decode(self) -> StepPlan | None:
        """One fused decode step over every running request, or None if nothing runs."""
        moves = self._pending_moves + self._compact()
        self._pending_moves = []
        idx = [i for i, r in enumerate(self.slots) if r is not None]
        if not idx:
            return None
        start, stop = (idx[0], idx[-1] + 1) if self.reorder == "none" else (self.start, self.start + len(idx))
        plan = StepPlan(moves=moves, start=start, n=stop - start)
        for i in range(start, stop):
            req = self.slots[i]
            plan.requests.append(req)
            plan.decode_tokens.append(req.output_ids[-1] if req else 0)
            plan.decode_positions.append(req.num_cached if req else 0)
        self.computed_rows += plan.n
        self.live_rows += len(idx)
        return plan

    def update(self, plan: StepPlan, tokens: list[int], eos_token_id: int | None) -> list[Request]:
        """Append each row's sampled token; finish requests on EOS, stop token ids or max_tokens.

        Returns the requests that got a token this step (finished ones have ``finish_reason`` set).
        """
        now = time.perf_counter()
        touched = []
        for req, tok in zip(plan.requests, tokens):
            if req is None or req.finish_reason is not None:
                continue
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            p = req.params
            if (tok == eos_token_id and not p.ignore_eos) or tok in p.stop_token_ids:
                self.finish(req, "stop")
            elif len(req.output_ids) >= p.max_tokens:
                self.finish(req, "length")
            touched.append(req)
        return touched
