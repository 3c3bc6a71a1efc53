"""Tensor parallelism over 2 gloo ranks gives the same greedy tokens as Hugging Face generate."""

from __future__ import annotations

import random

import pytest

from serve_testutil import hf_greedy
from hpdl.serve import EngineConfig, LLMEngine, ModelSpec, SamplingParams


@pytest.mark.timeout(180)
@pytest.mark.parametrize("all_reduce", ["nccl", "hpdl"])  # "nccl" = the process group's own (gloo here)
def test_tp2_matches_hf(hf_dir, all_reduce):
    arch, path, hf = hf_dir
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 16))] for _ in range(6)]
    maxt = [rng.randint(1, 20) for _ in prompts]
    eng = LLMEngine(ModelSpec(model=path), EngineConfig(num_slots=3, max_seq_len=64, tensor_parallel_size=2,
                                                        tp_all_reduce=all_reduce))
    try:
        if all_reduce == "hpdl":
            assert eng.executor.runner.all_reduce == "hpdl"
        outs = eng.generate(prompts, [SamplingParams(max_tokens=m) for m in maxt])
    finally:
        eng.shutdown()
    for p, m, o in zip(prompts, maxt, outs):
        assert o.token_ids == hf_greedy(hf, p, m)
