"""Tensor parallelism on CUDA with TP ranks sharing one GPU (``ranks_per_gpu``): TP = 2 and 4 give the same
greedy tokens as TP = 1 and Hugging Face in float32, with the process group's own all-reduce (gloo here) and
hpdl.comm's peer kernels. Device run: ``PYTHONPATH=src python3 -m pytest -m gpu tests/serve/test_tp_shared_gpu.py``."""

from __future__ import annotations

import random

import pytest
import torch

from serve_testutil import hf_greedy
from hpdl.serve import EngineConfig, LLMEngine, ModelSpec, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _generate(path: str, tp: int, all_reduce: str, prompts, maxt):
    eng = LLMEngine(ModelSpec(model=path, dtype="float32"),
                    EngineConfig(num_slots=3, max_seq_len=64, tensor_parallel_size=tp, tp_all_reduce=all_reduce,
                                 device="cuda", ranks_per_gpu=tp if tp > 1 else None, fused_decode=False))
    try:
        if tp > 1:
            assert eng.executor.runner.all_reduce == ("hpdl" if all_reduce == "hpdl" else "gloo")
        return [o.token_ids for o in eng.generate(prompts, [SamplingParams(max_tokens=m) for m in maxt])]
    finally:
        eng.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("all_reduce", ["nccl", "hpdl"])   # "nccl" = the process group's own: gloo here
def test_tp_on_one_gpu_matches_tp1_and_hf(hf_dir, tp, all_reduce):
    arch, path, hf = hf_dir
    heads = hf.config.num_key_value_heads if arch == "llama" else hf.config.n_head
    if heads % tp:
        pytest.skip(f"{arch}'s {heads} KV heads do not split over TP = {tp}")
    rng = random.Random(tp)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 16))] for _ in range(5)]
    maxt = [rng.randint(1, 16) for _ in prompts]
    ref = _generate(path, 1, all_reduce, prompts, maxt)
    got = _generate(path, tp, all_reduce, prompts, maxt)
    assert got == ref
    assert ref == [hf_greedy(hf, p, m) for p, m in zip(prompts, maxt)]
