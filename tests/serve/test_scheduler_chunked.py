"""Chunked prefill plans (Scheduler.schedule_mixed): pure CPU, fake tokens, no model."""

from __future__ import annotations

import random

import pytest

from hpdl.serve.engine import EngineConfig
from hpdl.serve.sampling import SamplingParams
from hpdl.serve.scheduler import Request, Scheduler


def _req(i, plen, maxt, **kw):
    return Request(f"r{i}", list(range(1, plen + 1)), SamplingParams(max_tokens=maxt, ignore_eos=True, **kw))


def _run_step(sched, plan, tok=7):
    """Fake forward: one token for every row that samples."""
    return sched.update(plan, [tok] * len(plan.requests), eos_token_id=None)


def test_long_prompt_is_chunked_and_running_requests_decode_every_step():
    sched = Scheduler(num_slots=4, max_seq_len=4200, max_prefill_tokens=64, reorder="prefix", prefill="chunked")
    for i in range(3):
        sched.add_request(_req(i, 8, 200))
    plan = sched.schedule_mixed()
    assert plan.prefill_tokens == [list(range(1, 9))] * 3 and plan.prefill_final == [True] * 3 and plan.n == 0
    _run_step(sched, plan)
    long = _req(9, 4000, 4)
    sched.add_request(long)
    chunks, step = [], 0
    while long.num_prefilled is None or long.num_prefilled < 4000:
        plan = sched.schedule_mixed()
        step += 1
        # the three running requests decode in every step; the rest of the budget (64 - 3) is the chunk
        decoding = [r for r in plan.requests[plan.num_prefill_rows:] if r is not None]
        assert len(decoding) == 3 and plan.n == 4  # the long request's slot is a placeholder row
        assert sum(map(len, plan.prefill_tokens)) + 3 <= 64
        assert plan.prefill_starts == [sum(chunks)]
        chunks.append(len(plan.prefill_tokens[0]))
        i = plan.num_prefill_rows + plan.requests[plan.num_prefill_rows:].index(None)
        assert plan.decode_tokens[i - plan.num_prefill_rows] == 0  # placeholder: written again by the next chunk
        assert plan.decode_positions[i - plan.num_prefill_rows] == long.num_prefilled
        touched = _run_step(sched, plan)
        assert (long in touched) == plan.prefill_final[0]  # only the last chunk gives the first token
    assert sum(chunks) == 4000 and chunks[:-1] == [61] * (len(chunks) - 1) and step == -(-4000 // 61)
    assert long.output_ids == [7] and sched.prefill_tokens == 4024 == sched.padded_prefill_tokens
    plan = sched.schedule_mixed()  # now it decodes with the others
    assert not plan.is_prefill and plan.n == 4 and all(r is not None for r in plan.requests)


def test_budget_fills_with_several_prompts_fifo_and_slots_limit_admission():
    sched = Scheduler(num_slots=3, max_seq_len=256, max_prefill_tokens=50, prefill="chunked")
    for i, n in enumerate([20, 20, 20, 5]):
        sched.add_request(_req(i, n, 3))
    plan = sched.schedule_mixed()
    assert [len(t) for t in plan.prefill_tokens] == [20, 20, 10] and plan.prefill_final == [True, True, False]
    assert [r.request_id for r in plan.requests] == ["r0", "r1", "r2"] and len(sched.waiting) == 1  # 3 slots
    _run_step(sched, plan)
    plan = sched.schedule_mixed()  # 2 decode rows + r2's last 10 tokens; r3 waits for a slot
    assert plan.prefill_tokens == [list(range(11, 21))] and plan.prefill_starts == [10]
    assert plan.n == 3 and plan.requests[1:].count(None) == 1


def test_prompt_logprobs_request_is_never_chunked():
    sched = Scheduler(num_slots=4, max_seq_len=256, max_prefill_tokens=16, prefill="chunked")
    sched.add_request(_req(0, 8, 50))
    _run_step(sched, sched.schedule_mixed())
    sched.add_request(_req(1, 40, 2, logprobs=0, prompt_logprobs=0))
    plan = sched.schedule_mixed()
    assert plan.prompt_logprobs and plan.prefill_tokens == [list(range(1, 41))] and plan.n == 0
    _run_step(sched, plan)
    plan = sched.schedule_mixed()
    assert not plan.is_prefill and plan.n == 2


def test_random_churn_every_request_finishes_once_and_prompts_are_written_in_order():
    rng = random.Random(0)
    for reorder in ("window", "prefix", "none"):
        sched = Scheduler(num_slots=4, max_seq_len=128, max_prefill_tokens=12, reorder=reorder, prefill="chunked")
        reqs = [_req(i, rng.randint(1, 40), rng.randint(1, 20)) for i in range(25)]
        pending, written = list(reqs), {}
        while pending or sched.has_unfinished():
            for _ in range(rng.randint(0, 2)):
                if pending:
                    sched.add_request(pending.pop(0))
            plan = sched.schedule_mixed()
            if plan is None:
                continue
            assert sum(map(len, plan.prefill_tokens)) + sum(r is not None for r in plan.requests[
                plan.num_prefill_rows:]) <= 12 or plan.prompt_logprobs
            for req, st, toks in zip(plan.requests, plan.prefill_starts, plan.prefill_tokens):
                assert st == written.get(req.request_id, 0), (st, written.get(req.request_id))
                assert toks == req.prompt_ids[st:st + len(toks)]
                written[req.request_id] = st + len(toks)
            for i, req in enumerate(plan.requests[plan.num_prefill_rows:]):
                if req is not None:  # a decode row: its prompt is complete, at its next position
                    assert written[req.request_id] == len(req.prompt_ids)
                    assert plan.decode_positions[i] == len(req.prompt_ids) + len(req.output_ids) - 1
            assert all(sched.slots[r.slot] is r for r in sched.running)
            for r in plan.requests[:plan.num_prefill_rows]:
                if rng.random() < 0.05 and r.finish_reason is None:  # an abort mid-prefill
                    sched.finish(r, "abort")
            _run_step(sched, plan)
        for r in reqs:
            assert r.finish_reason in ("length", "abort")
            if r.finish_reason == "length":
                assert len(r.output_ids) == r.params.max_tokens


@pytest.mark.parametrize("kw, message", [
    (dict(prefill="paged"), "prefill must be one of"),
    (dict(prefill="chunked", max_prefill_tokens=64, num_slots=64), r"max_prefill_tokens must be > num_slots \(64\)"),
    (dict(max_prefill_tokens=0), "max_prefill_tokens must be an int >= 1, got 0"),
    (dict(max_prefill_tokens=2.5), "max_prefill_tokens must be an int >= 1, got 2.5"),
])
def test_bad_prefill_config_names_the_argument(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)
    with pytest.raises(ValueError, match=message):
        Scheduler(kw.get("num_slots", 4), 64, kw.get("max_prefill_tokens", 8192), prefill=kw.get("prefill", "padded"))


@pytest.mark.parametrize("kw, message", [
    (dict(max_seq_len=0), "max_seq_len must be an int >= 2, got 0"),  # no room for a 1-token prompt and 1 token
    (dict(max_seq_len=1), "max_seq_len must be an int >= 2, got 1"),
    (dict(max_seq_len=-3), "max_seq_len must be an int >= 2, got -3"),
    (dict(max_seq_len=1.5), "max_seq_len must be an int >= 2, got 1.5"),
    (dict(max_seq_len=True), "max_seq_len must be an int >= 2, got True"),
    (dict(tensor_parallel_size=1.0), "tensor_parallel_size must be an int >= 1, got 1.0"),
    (dict(tensor_parallel_size=True), "tensor_parallel_size must be an int >= 1, got True"),
    (dict(reorder="bogus"), "reorder must be one of"),  # before any tensor-parallel rank is started
])
def test_bad_engine_geometry_names_the_argument(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)
