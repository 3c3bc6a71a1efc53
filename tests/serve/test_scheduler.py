"""Scheduler and buffer reordering: pure CPU, fake tokens (no model)."""

from __future__ import annotations

import itertools
import random

import pytest

from hpdl.serve.sampling import SamplingParams
from hpdl.serve.scheduler import Request, Scheduler, plan_compaction


def _brute_min_moves(live):
    n, S = sum(live), len(live)
    return min(sum(1 for i in range(S) if live[i] and not w <= i < w + n) for w in range(S - n + 1))


@pytest.mark.parametrize("S", range(1, 9))
def test_plan_compaction_is_minimal_and_valid(S):
    for live in itertools.product([False, True], repeat=S):
        live = list(live)
        n = sum(live)
        if n == 0:
            assert plan_compaction(live) == (0, [])
            continue
        start, moves = plan_compaction(live)
        assert len(moves) == _brute_min_moves(live)
        after = list(live)
        for src, dst in moves:
            assert after[src] and not after[dst]
            after[src], after[dst] = False, True
        assert after == [start <= i < start + n for i in range(S)]
        s0, m0 = plan_compaction(live, anchor=0)  # anchored: every live slot at >= n moves once
        assert s0 == 0 and len(m0) == sum(live[n:])


def test_plan_compaction_rejects_bad_anchor():
    with pytest.raises(ValueError, match="anchor"):
        plan_compaction([True, True, False], anchor=2)


@pytest.mark.parametrize("reorder", ["window", "prefix", "none"])
def test_every_request_finishes_once_with_its_tokens(reorder):
    rng = random.Random(0)
    sched = Scheduler(num_slots=4, max_seq_len=64, max_prefill_tokens=40, reorder=reorder)
    reqs = [Request(f"r{i}", [1] * rng.randint(1, 10), SamplingParams(max_tokens=rng.randint(1, 12)))
            for i in range(20)]
    pending, done, step = list(reqs), [], 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 3)):  # requests join between iterations
            if pending:
                sched.add_request(pending.pop(0))
        for schedule in (sched.schedule_prefill, sched.schedule_decode):  # prefill, then the fused decode
            plan = schedule()
            if plan is None:
                continue
            # the slot <-> request map is a bijection and the decode range is contiguous when reordering
            live = [i for i, r in enumerate(sched.slots) if r is not None]
            assert all(sched.slots[r.slot] is r for r in sched.running)
            if not plan.is_prefill and reorder != "none":
                assert live == list(range(plan.start, plan.start + plan.n))
                assert [r.num_cached for r in plan.requests] == plan.decode_positions
            # the fake model emits token 7, or token 2 = EOS now and then to finish requests early
            toks = [2 if rng.random() < 0.05 else 7 for _ in plan.requests]
            done += [r for r in sched.update(plan, toks, eos_token_id=2) if r.finish_reason]
        step += 1
        assert step < 1000
    assert sorted(r.request_id for r in done) == sorted(r.request_id for r in reqs)
    for r in reqs:
        assert r.finish_reason in ("stop", "length")
        assert len(r.output_ids) == r.params.max_tokens or r.output_ids[-1] == 2
    if reorder != "none":
        assert sched.num_moves > 0


def test_add_request_validation():
    sched = Scheduler(num_slots=2, max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        sched.add_request(Request("a", [1] * 10, SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_request(Request("b", [], SamplingParams()))
    with pytest.raises(ValueError, match="reorder"):
        Scheduler(2, 16, reorder="paged")
