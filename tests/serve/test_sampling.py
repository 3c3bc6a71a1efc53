"""Sampler filters: top-k / top-p keep exactly the tokens they should; per-request generators are reproducible."""

from __future__ import annotations

import pytest
import torch

from hpdl.serve.sampling import Sampler, SamplingParams


def test_filters_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    s = Sampler()
    seen = {s.sample(logits, [(f"r{i}", SamplingParams(temperature=1.0, top_k=2, seed=i))])[0] for i in range(200)}
    assert seen == {0, 1}
    # top_p = 0.7: the smallest prefix with mass >= 0.7 is {0, 1}
    seen = {s.sample(logits, [(f"p{i}", SamplingParams(temperature=1.0, top_p=0.7, seed=i))])[0] for i in range(200)}
    assert seen == {0, 1}
    assert s.sample(logits, [("g", SamplingParams(temperature=1.0, top_p=1e-6, seed=3))]) == [0]


def test_seeded_rows_are_reproducible_and_greedy_rows_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rows = [("a", SamplingParams(temperature=0.9, seed=7)), ("b", SamplingParams()), None]
    first = Sampler().sample(logits, rows)
    assert first == Sampler().sample(logits, rows)
    assert first[1] == int(logits[1].argmax()) and first[2] == int(logits[2].argmax())


def test_invalid_params():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
