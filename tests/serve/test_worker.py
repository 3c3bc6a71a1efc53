"""The CUDA-graph decode path's bucketing and padding (eager and fused steps), run on CPU with an eager stand-in
for the graph."""

from __future__ import annotations

import random

import pytest
import torch

from hpdl.serve import EngineConfig, LLMEngine, ModelSpec, SamplingParams
from hpdl.serve.worker import ModelRunner


class _EagerGraph:
    """Replays the captured call eagerly (same static buffers, same padded shapes as a CUDA graph)."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def _fake_capture(self, nb, kb):
    toks = torch.zeros(nb, 1, dtype=torch.long)
    pos = torch.zeros(nb, 1, dtype=torch.long)
    out = torch.empty(nb, self.model.cfg.vocab_size)
    top = torch.empty(nb, dtype=torch.long) if self.fused else None
    self.captured.append((nb, kb))

    def run():
        logits, am = self._decode(toks, pos, 0, kb)
        out.copy_(logits)
        if top is not None:
            top.copy_(am)
    return _EagerGraph(run), toks, pos, out, top


@pytest.mark.parametrize("fused", [False, True])
def test_padded_bucketed_decode_matches_exact_decode(monkeypatch, fused):
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    params = [SamplingParams(max_tokens=rng.randint(1, 100), ignore_eos=True) for _ in prompts]
    prompts[0], params[0] = [7] * 55, SamplingParams(max_tokens=100, ignore_eos=True)  # reaches kv bucket 160
    spec = ModelSpec(config="llama-tiny")
    ref = LLMEngine(spec, EngineConfig(num_slots=6, max_seq_len=160, reorder="prefix")).generate(prompts, params)
    monkeypatch.setattr(ModelRunner, "_capture", _fake_capture)
    monkeypatch.setattr(ModelRunner, "captured", [], raising=False)
    eng = LLMEngine(spec, EngineConfig(num_slots=6, max_seq_len=160, cuda_graph=True, fused_decode=fused))
    eng.executor.runner.cuda_graph = True  # CPU: force the graph path
    assert eng.scheduler.reorder == "prefix"
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    keys = set(ModelRunner.captured)
    assert {nb for nb, _ in keys} <= {1, 2, 4, 6} and {kb for _, kb in keys} >= {128, 160}


@pytest.mark.parametrize("fused", [False, True])
def test_chunked_prefill_mixed_plans_on_the_graph_path(monkeypatch, fused):
    """Mixed plans (prompt chunks + decode rows, placeholder rows for prompts still being prefilled) through the
    padded, bucketed graph decode give the tokens of the padded prefill and exact decode."""
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 60))] for _ in range(9)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in prompts]
    spec = ModelSpec(config="llama-tiny")
    ref = LLMEngine(spec, EngineConfig(num_slots=5, max_seq_len=160, reorder="prefix")).generate(prompts, params)
    monkeypatch.setattr(ModelRunner, "_capture", _fake_capture)
    monkeypatch.setattr(ModelRunner, "captured", [], raising=False)
    eng = LLMEngine(spec, EngineConfig(num_slots=5, max_seq_len=160, cuda_graph=True, fused_decode=fused,
                                       prefill="chunked", max_prefill_tokens=13))
    eng.executor.runner.cuda_graph = True  # CPU: force the graph path
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert eng.num_steps["mixed"] > 0 and ModelRunner.captured


def test_warm_up_captures_every_bucket(monkeypatch):
    monkeypatch.setattr(ModelRunner, "_capture", _fake_capture)
    monkeypatch.setattr(ModelRunner, "captured", [], raising=False)
    eng = LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=6, max_seq_len=160, cuda_graph=True))
    r = eng.executor.runner
    assert r.warm_up() == 0  # CPU: no graphs
    r.cuda_graph = True
    assert r.warm_up() == 4 * 2  # batch buckets 1, 2, 4, 6 x KV buckets 128, 160
    assert set(ModelRunner.captured) == {(nb, kb) for nb in (1, 2, 4, 6) for kb in (128, 160)}


def test_engine_warm_up_captures_before_serving_and_tokens_stay_exact(monkeypatch):
    """LLMEngine.warm_up (what `hpdl serve --cuda-graph` runs at start-up) captures every decode bucket before the
    first request, refuses a busy engine, and the requests served after it get the tokens of an engine without
    graphs (the warm-up's K/V writes do not leak into them)."""
    monkeypatch.setattr(ModelRunner, "_capture", _fake_capture)
    monkeypatch.setattr(ModelRunner, "captured", [], raising=False)
    spec = ModelSpec(config="llama-tiny")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = LLMEngine(spec, EngineConfig(num_slots=4, max_seq_len=64, reorder="prefix")).generate(prompts, params)
    eng = LLMEngine(spec, EngineConfig(num_slots=4, max_seq_len=64, cuda_graph=True))
    assert eng.warm_up() == 0   # CPU: the runner takes no graphs
    eng.executor.runner.cuda_graph = True   # CPU: force the graph path
    assert eng.warm_up() == 3 and set(ModelRunner.captured) == {(1, 64), (2, 64), (4, 64)}
    assert [o.token_ids for o in eng.generate(prompts, params)] == [o.token_ids for o in ref]
    eng.add_request(prompts[0], params)
    with pytest.raises(RuntimeError, match="idle engine"):
        eng.warm_up()


class _LaunchFailure(Exception):
    """Stands for Triton's OutOfResources: not a RuntimeError, so the engine retries each row alone."""


def _failing_capture(self, nb, kb):
    """The real capture's warm-up (writes K/V position 0 of slots [0, nb)), then, for more than one row, a
    kernel that cannot launch (as the float32 multi-row stream-GEMM configs did; one row worked)."""
    toks = torch.zeros(nb, 1, dtype=torch.long)
    if nb == 1:
        return _fake_capture(self, nb, kb)
    with self._position0_kept(nb):
        self._decode(toks, toks.clone(), 0, kb)
        raise _LaunchFailure("shared memory")


def test_failed_capture_keeps_live_kv_and_tokens(monkeypatch):
    """On the H200 a stream-GEMM config over the shared-memory limit failed inside the capture's warm-up after
    it had overwritten the running requests' position-0 K/V: float32 greedy tokens then diverged from eager at
    token 1-3. The warm-up's K/V writes must be undone whatever happens."""
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 30))] for _ in range(4)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in prompts]
    spec = ModelSpec(config="llama-tiny")
    ref = LLMEngine(spec, EngineConfig(num_slots=4, max_seq_len=64)).generate(prompts, params)
    monkeypatch.setattr(ModelRunner, "_capture", _failing_capture)
    monkeypatch.setattr(ModelRunner, "captured", [], raising=False)
    eng = LLMEngine(spec, EngineConfig(num_slots=4, max_seq_len=64, cuda_graph=True))
    eng.executor.runner.cuda_graph = True  # CPU: force the graph path (every capture fails)
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    r = eng.executor.runner
    k0 = r.cache.k[:, :2, :, 0].clone()
    with pytest.raises(_LaunchFailure):
        with r._position0_kept(2):
            r.cache.k[:, :2, :, 0] = 7.0
            raise _LaunchFailure("x")
    assert torch.equal(r.cache.k[:, :2, :, 0], k0)


def _fake_capture_path(self, nb, kb, path):
    """``_fake_capture`` that decodes with the given fused path and records it."""
    toks = torch.zeros(nb, 1, dtype=torch.long)
    pos = torch.zeros(nb, 1, dtype=torch.long)
    out = torch.empty(nb, self.model.cfg.vocab_size)
    top = torch.empty(nb, dtype=torch.long) if self.fused else None
    self.captured.append((nb, kb, path))

    def run():
        logits, am = self._decode(toks, pos, 0, kb, path)
        out.copy_(logits)
        if top is not None:
            top.copy_(am)
    g = _EagerGraph(run)
    g.path = path
    return g, toks, pos, out, top


def test_auto_gemm_picks_the_faster_path_per_bucket_then_cublas_above_the_threshold(monkeypatch):
    """--fused-gemm auto: each batch bucket's first capture times both paths and keeps the faster graph; once
    cuBLAS wins, larger buckets take it unmeasured; later KV buckets reuse the decision; tokens stay eager's."""
    timed = []

    def fake_time(self, caps, nb, kb):  # the device's verdict, scripted: stream faster up to 2 rows
        timed.append((nb, kb, sorted(caps)))
        return {"stream_pdl": 0.9 if nb <= 2 else 1.5, "cublas": 1.0 if nb != 4 else 1.4}
    monkeypatch.setattr(ModelRunner, "_capture_path", _fake_capture_path)
    monkeypatch.setattr(ModelRunner, "_time_captures", fake_time)
    monkeypatch.setattr(ModelRunner, "captured", [], raising=False)
    spec = ModelSpec(config="llama-tiny")
    eng = LLMEngine(spec, EngineConfig(num_slots=6, max_seq_len=160, cuda_graph=True, fused_decode=True,
                                       fused_gemm="auto"))
    r = eng.executor.runner
    assert r._path(1) == "cublas"  # nothing measured yet (no graphs): cuBLAS
    r.cuda_graph = True  # CPU: force the graph path
    assert r.warm_up() == 4 * 2
    assert timed == [(1, 128, ["cublas", "stream_pdl"]), (2, 128, ["cublas", "stream_pdl"]),
                     (4, 128, ["cublas", "stream_pdl"])]  # bucket 6 is above the threshold: not measured
    assert {nb: c["path"] for nb, c in r.gemm_choice.items()} == {1: "stream_pdl", 2: "stream_pdl", 4: "cublas",
                                                                  6: "cublas"}
    assert r.gemm_choice[1]["ms"] == {"stream_pdl": 0.9, "cublas": 1.0} and "threshold" in r.gemm_choice[6]["by"]
    kept = {key: g[0].path for key, g in r._graphs.items()}
    assert kept == {(nb, kb): ("stream_pdl" if nb <= 2 else "cublas") for nb in (1, 2, 4, 6) for kb in (128, 160)}
    assert r._path(2) == "stream_pdl" and r._path(3) == "cublas" and r._path(5) == "cublas"
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(7)]
    params = [SamplingParams(max_tokens=rng.randint(1, 60), ignore_eos=True) for _ in prompts]
    ref = LLMEngine(spec, EngineConfig(num_slots=6, max_seq_len=160, reorder="prefix")).generate(prompts, params)
    assert [o.token_ids for o in eng.generate(prompts, params)] == [o.token_ids for o in ref]


def test_auto_gemm_config_where_the_fused_step_does_not_run():
    # "auto" may become the default: it must not refuse engines that run the eager step (CPU, GPT-2)
    for spec in ("llama-tiny", "gpt2-tiny"):
        r = LLMEngine(ModelSpec(config=spec), EngineConfig(num_slots=2, max_seq_len=32,
                                                           fused_gemm="auto")).executor.runner
        assert not r.fused and r.fused_gemm == "auto"
    with pytest.raises(ValueError, match="'cublas', 'stream' or 'auto'"):
        EngineConfig(fused_gemm="fastest")


def test_auto_gemm_keeps_serving_when_one_path_cannot_capture(monkeypatch):
    def capture(self, nb, kb, path):
        if path == "stream_pdl":
            raise _LaunchFailure("out of resources")
        return _fake_capture_path(self, nb, kb, path)

    def no_timing(self, caps, nb, kb):
        raise AssertionError("one path left: nothing to time")
    monkeypatch.setattr(ModelRunner, "_capture_path", capture)
    monkeypatch.setattr(ModelRunner, "_time_captures", no_timing)
    monkeypatch.setattr(ModelRunner, "captured", [], raising=False)
    eng = LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=2, max_seq_len=64, cuda_graph=True,
                                                                 fused_decode=True, fused_gemm="auto"))
    r = eng.executor.runner
    r.cuda_graph = True
    assert r.warm_up() == 2
    assert r.gemm_choice[1]["path"] == "cublas" and "out of resources" in r.gemm_choice[1]["errors"]["stream_pdl"]
    assert r.cuda_graph and r.graph_error is None
