"""LLMEngine greedy tokens equal Hugging Face generate per request, while requests join, finish and move."""

from __future__ import annotations

import random

import pytest

from serve_testutil import hf_greedy
from hpdl.serve import EngineConfig, LLMEngine, ModelSpec, SamplingParams


def _workload(seed=0, n=12):
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 20))] for _ in range(n)]
    return prompts, [rng.randint(1, 30) for _ in prompts]


@pytest.mark.parametrize("reorder", ["window", "prefix", "none"])
def test_greedy_equals_hf_generate_under_churn(hf_dir, reorder):
    arch, path, hf = hf_dir
    prompts, maxt = _workload()
    # 5 slots for 12 requests: later requests join as earlier ones finish; small prefill batches
    eng = LLMEngine(ModelSpec(model=path), EngineConfig(num_slots=5, max_seq_len=64, reorder=reorder,
                                                        max_prefill_tokens=40))
    outs = eng.generate(prompts, [SamplingParams(max_tokens=m) for m in maxt])
    for p, m, o in zip(prompts, maxt, outs):
        assert o.token_ids == hf_greedy(hf, p, m), (p, m)
        assert o.finish_reason == ("stop" if o.token_ids[-1] == 257 else "length")
    st = eng.stats()
    assert st["running"] == 0 and st["waiting"] == 0
    if reorder != "none":
        assert st["reorder_moves"] > 0  # the test really exercised buffer reordering


def test_requests_joining_mid_run_match_solo(hf_dir):
    arch, path, hf = hf_dir
    prompts, maxt = _workload(seed=1, n=6)
    eng = LLMEngine(ModelSpec(model=path), EngineConfig(num_slots=8, max_seq_len=64))
    ids, outs = {}, {}
    for step in range(200):
        if step < len(prompts):  # one new request per iteration while others decode
            ids[eng.add_request(prompts[step], SamplingParams(max_tokens=maxt[step]))] = step
        for o in eng.step():
            if o.finished:
                outs[ids[o.request_id]] = o.token_ids
        if len(outs) == len(prompts):
            break
    assert all(outs[i] == hf_greedy(hf, prompts[i], maxt[i]) for i in range(len(prompts)))


def test_seeded_sampling_is_batch_independent():
    spec = ModelSpec(config="llama-tiny")
    p = SamplingParams(max_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    solo = LLMEngine(spec, EngineConfig(num_slots=4, max_seq_len=64)).generate([[1, 2, 3]], p)[0].token_ids
    eng = LLMEngine(spec, EngineConfig(num_slots=4, max_seq_len=64))
    others = [SamplingParams(max_tokens=k, temperature=1.0, ignore_eos=True) for k in (3, 20, 7)]
    outs = eng.generate([[9, 9], [1, 2, 3], [4], [5, 6]], [others[0], p, others[1], others[2]])
    assert outs[1].token_ids == solo
    greedy = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    top1 = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=5,
                                                     ignore_eos=True))[0].token_ids
    assert top1 == greedy


def test_stop_strings_and_abort():
    eng = LLMEngine(ModelSpec(config="gpt2-tiny"), EngineConfig(num_slots=4, max_seq_len=128))
    full = eng.generate(["hello"], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    text = full.text
    assert len(text) > 4
    stop = text[3:5]
    cut = eng.generate(["hello"], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]
    rid = eng.add_request("hello", SamplingParams(max_tokens=40))
    eng.step()
    eng.abort(rid)
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [(rid, "abort")]
    assert not eng.has_unfinished()


def test_bad_requests_raise_and_engine_keeps_serving():
    eng = LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=2, max_seq_len=32))
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.add_request([1] * 30, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request([1, 999])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    assert len(eng.generate([[1, 2]], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids) == 5


@pytest.mark.parametrize("kw, message", [
    (dict(ranks_per_gpu=0), "ranks_per_gpu must be an int >= 1, got 0"),
    (dict(ranks_per_gpu="2"), "ranks_per_gpu must be an int >= 1, got '2'"),
    (dict(ranks_per_gpu=True), "ranks_per_gpu must be an int >= 1, got True"),
    (dict(ranks_per_gpu=2, tensor_parallel_size=2), "ranks_per_gpu=2 needs device='cuda'"),
])
def test_engine_config_checks_ranks_per_gpu(kw, message):
    """Refused when the config is made, before any TP rank is started (a rank refusing it later would leave
    the others waiting at the rendezvous)."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", **kw)


def test_engine_config_checks_the_variable_for_tp_on_cuda(monkeypatch):
    monkeypatch.setenv("HPDL_RANKS_PER_GPU", "two")
    with pytest.raises(ValueError, match="HPDL_RANKS_PER_GPU='two' is invalid"):
        EngineConfig(device="cuda", tensor_parallel_size=2)
    EngineConfig(device="cpu", tensor_parallel_size=2)   # a GPU-only setting: a CPU engine does not read it
