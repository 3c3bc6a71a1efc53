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
PREFILL_MODES = ("padded", "packed", "chunked")


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
    num_prefilled: int | None = None  # chunked prefill: prompt positions written (or planned); None = all

    @property
    def num_cached(self) -> int:
        """KV positions written for this request: the prompt (its prefilled part, while chunks remain) plus every
        output token except the newest."""
        done = len(self.prompt_ids) if self.num_prefilled is None else self.num_prefilled
        return done + max(len(self.output_ids) - 1, 0)


@dataclass
class StepPlan:
    """What the workers run in one step: slot moves first, then a prefill, a fused decode, or both (mixed).

    prefill: ``prefill_tokens`` (one list per sequence) into ``prefill_slots``; with ``prompt_logprobs`` the
    forward returns logits at every prompt position ``[rows, T, vocab]`` instead of ``[rows, vocab]``.
    ``packed``: the sequences run packed (``hpdl.serve.prefill``, no padding); sequence i may be a chunk of a
    prompt, its tokens at positions ``prefill_starts[i] ..``, and only chunks with ``prefill_final[i]`` (the
    prompt's last chunk) are sampled.
    decode: rows are slots ``[start, start + n)``; ``decode_tokens[i]`` at ``decode_positions[i]``; rows whose
    slot is free (``reorder='none'`` leaves holes) carry token 0 at position 0, rows of a request still being
    prefilled carry token 0 at the position its next chunk writes first; both are ignored.
    Logits rows (and ``requests``) are the prefill sequences first, then the decode rows.
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
    packed: bool = False
    prefill_starts: list[int] = field(default_factory=list)
    prefill_final: list[bool] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill_slots)

    @property
    def num_prefill_rows(self) -> int:
        return len(self.prefill_slots)

    def sampled(self) -> list[Request | None]:
        """``requests`` with None for rows that produce no token (a prompt chunk that is not the last)."""
        k = len(self.prefill_final)
        return [None if i < k and not self.prefill_final[i] else r for i, r in enumerate(self.requests)]

    def single(self, row: int) -> StepPlan:
        """Row ``row`` of this plan alone (the engine retries a failed forward request by request). The moves are
        kept: each copies a live slot into a hole, so running them again copies the same data; so are K/V writes."""
        k = self.num_prefill_rows
        if row < k:
            return StepPlan(moves=self.moves, prefill_tokens=[self.prefill_tokens[row]],
                            prefill_slots=[self.prefill_slots[row]], requests=[self.requests[row]],
                            prompt_logprobs=self.prompt_logprobs, packed=self.packed,
                            prefill_starts=self.prefill_starts[row:row + 1],
                            prefill_final=self.prefill_final[row:row + 1])
        row -= k
        return StepPlan(moves=self.moves, start=self.start + row, n=1, decode_tokens=[self.decode_tokens[row]],
                        decode_positions=[self.decode_positions[row]], requests=[self.requests[k + row]])


class Scheduler:
    """Request queue + slot allocator + reordering; ``schedule_*`` emit plans, ``update`` reads tokens back.

    Args:
        num_slots: pre-allocated KV slots = the most requests decoded together (``max_num_seqs``).
        max_seq_len: positions per slot; a request needs ``len(prompt) + max_tokens <= max_seq_len``.
        max_prefill_tokens: ``prefill="padded"``: padded tokens (rows x longest prompt) one batched prefill may
            hold; ``"packed"``: prompt tokens one packed prefill may hold; ``"chunked"``: the token budget of a step,
            decode rows (one token each) plus prefill chunk tokens [vLLM's max_num_batched_tokens].
        prefill: ``"padded"`` (a right-padded batch, then a decode, each step), ``"packed"`` (prompts packed
            without padding, then a decode) or ``"chunked"`` (one mixed plan a step: every running request
            decodes, and the budget left over goes to prompt chunks, oldest first, so a long prompt is prefilled
            over several steps and never stalls the running requests; Sarathi-Serve, OSDI 2024).
        reorder: ``"window"`` (Flover, the range slides), ``"prefix"`` (range anchored at slot 0, needed by
            CUDA graphs), or ``"none"`` (no moves; the decode covers the span of live slots, holes included).
    """

    def __init__(self, num_slots: int, max_seq_len: int, max_prefill_tokens: int = 8192, reorder: str = "window",
                 prefill: str = "padded"):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if reorder not in REORDER_MODES:
            raise ValueError(f"reorder must be one of {REORDER_MODES}, got {reorder!r}")
        check_prefill(prefill, max_prefill_tokens, num_slots)
        self.prefill = prefill
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
        self._prefilling: list[Request] = []  # admitted, prompt not yet fully prefilled (chunked), oldest first
        self.prefill_tokens = 0  # prompt tokens prefilled so far
        self.padded_prefill_tokens = 0  # positions the prefill forwards computed (padding included)

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
        if req in self._prefilling:
            self._prefilling.remove(req)
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
        plan = StepPlan(moves=moves, packed=self.prefill == "packed")
        longest = total = 0
        while self.waiting:
            req = self.waiting[0]
            longest2 = max(longest, len(req.prompt_ids))
            cost = total + len(req.prompt_ids) if plan.packed else longest2 * (len(plan.prefill_slots) + 1)
            if plan.prefill_slots and cost > self.max_prefill_tokens:
                break
            total += len(req.prompt_ids)
            slot = self._free_slot()
            if slot is None:
                break
            self.waiting.popleft()
            self.slots[slot], req.slot, longest = req, slot, longest2
            plan.prefill_slots.append(slot)
            plan.prefill_tokens.append(req.prompt_ids)
            plan.prefill_starts.append(0)
            plan.prefill_final.append(True)
            plan.requests.append(req)
            plan.prompt_logprobs |= req.params.prompt_logprobs is not None
        if not plan.prefill_slots:
            self._pending_moves = moves
            return None
        self._count_prefill(plan)
        return plan

    def _count_prefill(self, plan: StepPlan) -> None:
        lens = [len(t) for t in plan.prefill_tokens]
        self.prefill_tokens += sum(lens)
        self.padded_prefill_tokens += sum(lens) if plan.packed else len(lens) * max(lens)

    def _take_slot(self, req: Request) -> bool:
        slot = self._free_slot()
        if slot is None:
            return False
        self.waiting.popleft()
        self.slots[slot], req.slot, req.num_prefilled = req, slot, 0
        self._prefilling.append(req)
        return True

    def schedule_mixed(self) -> StepPlan | None:
        """``prefill="chunked"``: one plan for this step, or None if nothing runs.

        Every request that has output tokens decodes (one row each, as ``schedule_decode``); the rest of the
        ``max_prefill_tokens`` budget goes to prompt chunks: first the request whose prompt is partly prefilled,
        then waiting requests FIFO as slots allow. A request asking for prompt logprobs is never chunked: it is
        prefilled whole in a plan of its own (no decode rows that step).
        """
        moves = self._pending_moves + self._compact()
        self._pending_moves = []
        plan = StepPlan(moves=moves, packed=True)
        decoding = sum(1 for r in self.slots if r is not None and r.output_ids)
        budget = self.max_prefill_tokens - decoding
        if self.waiting and self.waiting[0].params.prompt_logprobs is not None and not self._prefilling:
            req = self.waiting[0]
            if self._take_slot(req):
                self._add_chunk(plan, req, len(req.prompt_ids))
                plan.prompt_logprobs = True
                self._count_prefill(plan)
                return plan
        for req in list(self._prefilling):
            if budget <= 0:
                break
            take = min(budget, len(req.prompt_ids) - req.num_prefilled)
            self._add_chunk(plan, req, take)
            budget -= take
        while budget > 0 and self.waiting and self.waiting[0].params.prompt_logprobs is None:
            req = self.waiting[0]
            if not self._take_slot(req):
                break
            take = min(budget, len(req.prompt_ids))
            self._add_chunk(plan, req, take)
            budget -= take
        if plan.prefill_slots:
            self._count_prefill(plan)
        self._decode_rows(plan, [i for i, r in enumerate(self.slots) if r is not None])
        if not plan.prefill_slots and plan.n == 0:
            return None
        return plan

    def _add_chunk(self, plan: StepPlan, req: Request, take: int) -> None:
        st = req.num_prefilled
        req.num_prefilled = st + take
        final = req.num_prefilled == len(req.prompt_ids)
        if final:
            self._prefilling.remove(req)
        plan.prefill_slots.append(req.slot)
        plan.prefill_tokens.append(req.prompt_ids[st:st + take])
        plan.prefill_starts.append(st)
        plan.prefill_final.append(final)
        plan.requests.append(req)

    def _decode_rows(self, plan: StepPlan, idx: list[int]) -> None:
        """Append the decode rows over the live slot range to ``plan`` (n = 0 when no request has a token yet)."""
        if not any(self.slots[i].output_ids for i in idx):
            return
        start, stop = (idx[0], idx[-1] + 1) if self.reorder == "none" else (self.start, self.start + len(idx))
        plan.start, plan.n = start, stop - start
        for i in range(start, stop):
            req = self.slots[i]
            if req is not None and not req.output_ids:  # still prefilling: a harmless write its next chunk redoes
                plan.requests.append(None)
                plan.decode_tokens.append(0)
                plan.decode_positions.append(min(req.num_prefilled, self.max_seq_len - 1))
                continue
            plan.requests.append(req)
            plan.decode_tokens.append(req.output_ids[-1] if req else 0)
            plan.decode_positions.append(req.num_cached if req else 0)
        self.computed_rows += plan.n
        self.live_rows += sum(1 for r in plan.requests[len(plan.prefill_slots):] if r is not None)

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
        for req, tok in zip(plan.sampled(), tokens):
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


def check_prefill(prefill: str, max_prefill_tokens: int, num_slots: int) -> None:
    """Raise ValueError naming the argument for a bad prefill mode or token budget."""
    if prefill not in PREFILL_MODES:
        raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
    if isinstance(max_prefill_tokens, bool) or not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 1:
        raise ValueError(f"max_prefill_tokens must be an int >= 1, got {max_prefill_tokens!r}")
    if prefill == "chunked" and max_prefill_tokens <= num_slots:
        raise ValueError(f"max_prefill_tokens must be > num_slots ({num_slots}) with prefill='chunked': each of up "
                         f"to num_slots decoding requests takes one token of the step budget, and prompt chunks "
                         f"need the rest; got {max_prefill_tokens}")
