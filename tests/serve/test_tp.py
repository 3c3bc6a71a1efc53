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


@pytest.mark.timeout(180)
def test_a_failed_tp_start_leaves_no_process_group_and_no_workers():
    """A TP engine whose start fails (here rank 0's runner rejects fused_decode=True, which is single-device)
    raises that error, ends its worker and destroys the process group: a second TP engine in the same process
    starts and serves (it failed with "trying to initialize the default process group twice")."""
    import multiprocessing

    import torch.distributed as dist

    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="fused=True but the fused decode cannot run this model"):
        LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=2, max_seq_len=32, tensor_parallel_size=2,
                                                               fused_decode=True))
    assert not dist.is_initialized()
    assert not set(multiprocessing.active_children()) - before  # the worker rank was ended
    eng = LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=2, max_seq_len=32, tensor_parallel_size=2,
                                                                 prefill="chunked", max_prefill_tokens=5))
    try:
        (out,) = eng.generate([[3, 1, 4, 1, 5, 9, 2, 6]], SamplingParams(max_tokens=3))
    finally:
        eng.shutdown()
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.timeout(180)
def test_an_engine_that_fails_after_its_tp_executor_started_shuts_it_down(monkeypatch):
    import torch.distributed as dist

    import hpdl.serve.engine as engine_mod

    def broken(_):
        raise OSError("tokenizer files unreadable")

    monkeypatch.setattr(engine_mod, "load_tokenizer", broken)
    with pytest.raises(OSError, match="tokenizer files unreadable"):
        LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=2, max_seq_len=32, tensor_parallel_size=2))
    assert not dist.is_initialized()


@pytest.mark.timeout(180)
def test_a_tp_rank_that_dies_fails_the_engine_naming_it_and_shutdown_frees_everything():
    """A worker rank killed between steps: the next step raises WorkerFailedError naming it (never a hang in
    rank 0's collective), and shutdown leaves no process and no process group."""
    import multiprocessing
    import os
    import signal

    import torch.distributed as dist

    from hpdl.runtime import WorkerFailedError

    eng = LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=2, max_seq_len=32, tensor_parallel_size=2))
    try:
        (out,) = eng.generate([[3, 1, 4]], SamplingParams(max_tokens=2))
        assert len(out.token_ids) == 2
        (proc,) = eng.executor.group._procs
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
        with pytest.raises(WorkerFailedError, match=r"rank 1 failed[\s\S]*rank 1 died: exited with code -9"):
            eng.generate([[2, 7]], SamplingParams(max_tokens=2))
    finally:
        eng.shutdown()
    assert not dist.is_initialized()
    assert proc not in multiprocessing.active_children()
