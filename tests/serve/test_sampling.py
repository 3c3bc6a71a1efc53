"""The sampling pipeline: processors against exact expected logits, the sampler's filters and generators, logprobs,
per-row failure isolation, and SamplingParams bounds."""

from __future__ import annotations

import math

import pytest
import torch

from hpdl.serve.sampling import (InvalidParamError, Sampler, SamplingParams, apply_logit_bias, apply_min_tokens,
                                 apply_penalties, prompt_logprobs, token_logprobs)
from hpdl.serve.scheduler import Request


def _req(rid, params, prompt=(1,), out=()):
    r = Request(rid, list(prompt), params)
    r.output_ids = list(out)
    return r


def test_filters_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    s = Sampler()
    seen = {s.sample(logits, [_req(f"r{i}", SamplingParams(temperature=1.0, top_k=2, seed=i))]).tokens[0]
            for i in range(200)}
    assert seen == {0, 1}
    # top_p = 0.7: the smallest prefix with mass >= 0.7 is {0, 1}
    seen = {s.sample(logits, [_req(f"p{i}", SamplingParams(temperature=1.0, top_p=0.7, seed=i))]).tokens[0]
            for i in range(200)}
    assert seen == {0, 1}
    assert s.sample(logits, [_req("g", SamplingParams(temperature=1.0, top_p=1e-6, seed=3))]).tokens == [0]


def test_extreme_top_p_and_repetition_penalty_sample_instead_of_failing():
    """Issue 38: top_p = 5e-324 (0 in float32) dropped every token, and repetition_penalty = 1e-40 overflowed the
    seen tokens' logits to +inf; both gave NaN probabilities and the request failed with a 500."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for tp in (5e-324, 1e-300):
        out = Sampler().sample(logits, [_req("p", SamplingParams(temperature=1.0, top_p=tp, seed=1))])
        assert not out.errors and out.tokens == [0]
    # tokens 1 and 2 were seen (prompt): dividing their positive logits by 1e-40 makes them the only candidates
    logits = torch.tensor([[3.0, 2.0, 1.0, 4.0]])
    seen = set()
    for i in range(60):
        out = Sampler().sample(logits, [_req(f"r{i}", SamplingParams(temperature=1.0, repetition_penalty=1e-40,
                                                                     seed=i), prompt=(1, 2))])
        assert not out.errors, out.errors
        seen.add(out.tokens[0])
    assert seen == {1, 2}


def test_seeded_rows_are_reproducible_and_greedy_rows_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rows = [_req("a", SamplingParams(temperature=0.9, seed=7)), _req("b", SamplingParams()), None]
    first = Sampler().sample(logits, rows).tokens
    assert first == Sampler().sample(logits, rows).tokens
    assert first[1] == int(logits[1].argmax()) and first[2] == -1
    for extreme in (2**64 - 1, -2**63):  # torch's whole seed range works
        Sampler().sample(logits, [_req("s", SamplingParams(temperature=1.0, seed=extreme))])


def test_tiny_temperatures_are_greedy():
    logits = torch.tensor([[0.0, 1e-3, 5.0, 4.999]])
    for t in (1e-40, 1e-6, 0.0):
        assert Sampler().sample(logits, [_req("t", SamplingParams(temperature=t, seed=1))]).tokens == [2]


def test_penalties_follow_their_definitions_exactly():
    x = torch.tensor([2.0, -1.0, 0.5, -0.5, 3.0])
    counts = torch.tensor([0.0, 2.0, 1.0, 0.0, 0.0])
    prompt = torch.tensor([True, False, False, False, False])
    got = apply_penalties(x.clone(), counts, prompt, SamplingParams(repetition_penalty=2.0))
    assert got.tolist() == [1.0, -2.0, 0.25, -0.5, 3.0]  # seen: prompt token 0, output tokens 1, 2
    got = apply_penalties(x.clone(), counts, None, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    assert got.tolist() == [2.0, -1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, -0.5, 3.0]
    assert apply_logit_bias(x.clone(), torch.tensor([4, 0]), torch.tensor([-100.0, 1.0])).tolist() == \
        [3.0, -1.0, 0.5, -0.5, -97.0]
    p = SamplingParams(min_tokens=2, stop_token_ids=[3])
    masked = apply_min_tokens(x.clone(), 1, p, eos_token_id=4).tolist()
    assert masked[3] == masked[4] == -math.inf and masked[:3] == [2.0, -1.0, 0.5]
    assert apply_min_tokens(x.clone(), 2, p, eos_token_id=4).tolist() == x.tolist()


def test_sampler_applies_processors_to_greedy_rows_with_its_own_counts():
    s = Sampler(eos_token_id=2)
    logits = torch.tensor([[1.0, 0.9, 5.0, 0.0]])
    r = _req("r", SamplingParams(min_tokens=1, frequency_penalty=2.0), prompt=[3], out=[])
    assert s.sample(logits, [r]).tokens == [0]  # EOS (2) held back, then the argmax of the rest
    r.output_ids.append(0)
    assert s.sample(logits, [r]).tokens == [2]  # min_tokens reached
    r2 = _req("r2", SamplingParams(frequency_penalty=2.0, presence_penalty=0.0), out=[])
    row = torch.tensor([[1.0, 0.9, -5.0, -5.0]])
    assert s.sample(row, [r2]).tokens == [0]
    r2.output_ids.append(0)
    assert s.sample(row, [r2]).tokens == [1]  # 1.0 - 2 * 1 < 0.9: the count of token 0 was taken in


def test_logprobs_are_the_models_log_softmax():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(1))
    lp = torch.log_softmax(logits, -1)
    rows = [_req("a", SamplingParams(logprobs=3, temperature=0.0)),
            _req("b", SamplingParams(logprobs=0, temperature=1.0, seed=2, logit_bias={5: 50.0}))]
    out = Sampler().sample(logits, rows)
    assert out.tokens[1] == 5  # the bias picked the token; its reported logprob is the model's
    a, b = out.logprobs
    assert a.token_id == int(logits[0].argmax()) and a.logprob == pytest.approx(lp[0].max().item())
    assert [t for t, _ in a.top] == lp[0].topk(3).indices.tolist()
    assert b.top == [] and b.logprob == pytest.approx(lp[1, 5].item())
    pl = prompt_logprobs(logits, [7, 8], 1)
    assert pl[0] is None and pl[1].logprob == pytest.approx(lp[0, 8].item())
    assert token_logprobs(logits[:1], [3], 0)[0].logprob == pytest.approx(lp[0, 3].item())


def test_a_failing_row_fails_alone(monkeypatch):
    import hpdl.serve.sampling as sm

    apply = sm.apply_logit_bias

    def faulty(x, ids, values):
        if ids.tolist() == [9]:
            raise RuntimeError("injected")
        return apply(x, ids, values)

    monkeypatch.setattr(sm, "apply_logit_bias", faulty)
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))
    rows = [_req("a", SamplingParams(logit_bias={1: 100.0})), _req("b", SamplingParams(logit_bias={9: 1.0})),
            _req("c", SamplingParams(logprobs=1))]
    out = Sampler().sample(logits, rows)
    assert list(out.errors) == [1] and "injected" in str(out.errors[1])
    assert out.tokens == [1, -1, int(logits[2].argmax())] and out.logprobs[2] is not None


@pytest.mark.parametrize("kw, param", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=True), "max_tokens"), (dict(stop=[""]), "stop"),
    (dict(stop=["x"], detokenize=False), "stop"), (dict(seed=2**64), "seed"), (dict(seed=-2**63 - 1), "seed"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_p=0), "top_p"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={1: 1000.0}), "logit_bias"), (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1),
                                                                                    "prompt_logprobs"),
])
def test_invalid_params_name_the_field(kw, param):
    with pytest.raises(InvalidParamError) as e:
        SamplingParams(**kw)
    assert e.value.param == param and param in str(e.value)


def test_vocabulary_checks():
    SamplingParams(top_k=10, logit_bias={9: 1.0}).check_vocab(10)
    for kw, param in ((dict(top_k=11), "top_k"), (dict(logit_bias={10: 1.0}), "logit_bias"),
                      (dict(stop_token_ids=[10]), "stop_token_ids")):
        with pytest.raises(InvalidParamError, match=param):
            SamplingParams(**kw).check_vocab(10)
