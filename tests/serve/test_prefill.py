"""Packed variable-length prefill and chunked prefill: equal to the padded eager prefill and to HF generate.

The Triton kernel runs on CPU under TRITON_INTERPRET=1 in a subprocess (the interpreter is chosen when kernels
are defined). Its bfloat16 case runs on the device only: Triton 3.8's interpreter gives garbage for bfloat16
``tl.dot`` (a 16x16 product off by 1e10 in a standalone check), so float16 stands in here.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from serve_testutil import hf_greedy, run_interpreted
from hpdl.models.gpt import Batch, KVCache
from hpdl.serve import EngineConfig, LLMEngine, ModelSpec, SamplingParams
from hpdl.serve import prefill as pf
from hpdl.serve.worker import build_model


def _eager_prefill(model, cache, prompts, slots):
    T = max(map(len, prompts))
    toks = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = torch.tensor(p)
    with torch.inference_mode():
        return model(toks, cache, Batch(positions=torch.arange(T)[None].expand(len(prompts), T),
                                        slots=torch.tensor(slots), last=torch.tensor([len(p) - 1 for p in prompts])))


@pytest.mark.parametrize("config", ["llama-tiny", "gpt2-tiny"])
def test_packed_and_chunked_forward_equal_the_padded_prefill(config):
    model = build_model(ModelSpec(config=config), "cpu")
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 37, 1, 12)]
    slots = [2, 0, 3, 1]
    c_pad, c_pack, c_chunk = (KVCache(model.cfg, 4, 64, torch.float32, "cpu") for _ in range(3))
    ref = _eager_prefill(model, c_pad, prompts, slots)
    seqs = pf.PackedSeqs(slots, [0] * 4, [len(p) for p in prompts])
    got = pf.packed_forward(model, c_pack, torch.tensor(sum(prompts, [])), seqs)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for s, p in zip(slots, prompts):
        torch.testing.assert_close(c_pack.k[:, s, :, : len(p)], c_pad.k[:, s, :, : len(p)], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c_pack.v[:, s, :, : len(p)], c_pad.v[:, s, :, : len(p)], rtol=1e-5, atol=1e-6)
    # the same prompts in chunks of at most 8 tokens, two sequences per forward, each chunk over its cached prefix
    last = {}
    pieces = [(i, st, min(8, len(p) - st)) for i, p in enumerate(prompts) for st in range(0, len(p), 8)]
    while pieces:
        part = pieces[:2] if len(pieces) > 1 and pieces[0][0] != pieces[1][0] else pieces[:1]
        del pieces[: len(part)]
        s = pf.PackedSeqs([slots[i] for i, _, _ in part], [st for _, st, _ in part], [n for _, _, n in part])
        toks = torch.tensor([t for i, st, n in part for t in prompts[i][st:st + n]])
        out = pf.packed_forward(model, c_chunk, toks, s)
        for (i, st, n), row in zip(part, out):
            if st + n == len(prompts[i]):
                last[i] = row
    torch.testing.assert_close(torch.stack([last[i] for i in range(4)]), ref, rtol=1e-4, atol=1e-5)
    assert pf.padded_tokens(seqs.lens) == 4 * 37 and seqs.num_tokens == 55


def test_packed_forward_rejects_bad_input():
    model = build_model(ModelSpec(config="llama-tiny"), "cpu")
    cache = KVCache(model.cfg, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="tokens must be"):
        pf.packed_forward(model, cache, torch.tensor([1, 2, 3]), pf.PackedSeqs([0], [0], [2]))
    with pytest.raises(ValueError, match="max_seq_len=16"):
        pf.packed_forward(model, cache, torch.tensor([1, 2]), pf.PackedSeqs([0], [15], [2]))
    with pytest.raises(ValueError, match="lens must be >= 1"):
        pf.PackedSeqs([0], [0], [0])


def test_engine_counts_the_padding_packing_saves():
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 60, 9, 30, 2, 44)]
    stats = {}
    for mode in ("padded", "packed"):
        eng = LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=8, max_seq_len=96, prefill=mode))
        eng.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
        stats[mode] = eng.stats()
    assert stats["packed"]["prefill_tokens"] == stats["packed"]["prefill_positions_computed"] == 148
    assert stats["padded"]["prefill_positions_computed"] == 6 * 60  # one batch padded to the longest prompt


def _workload(seed=0, n=12):
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 30))] for _ in range(n)]
    return prompts, [rng.randint(1, 25) for _ in prompts]


@pytest.mark.parametrize("prefill, reorder, budget", [("packed", "window", 40), ("chunked", "window", 9),
                                                      ("chunked", "prefix", 16), ("chunked", "none", 7)])
def test_greedy_equals_hf_generate_under_churn(hf_dir, prefill, reorder, budget):
    """Twelve requests through five slots; chunked budgets of 7-16 tokens split most prompts into chunks that
    run beside the decode rows; requests join as others finish (at EOS or max_tokens) and slots move."""
    arch, path, hf = hf_dir
    prompts, maxt = _workload()
    eng = LLMEngine(ModelSpec(model=path), EngineConfig(num_slots=5, max_seq_len=64, reorder=reorder,
                                                        max_prefill_tokens=budget, prefill=prefill))
    outs = eng.generate(prompts, [SamplingParams(max_tokens=m) for m in maxt])
    for p, m, o in zip(prompts, maxt, outs):
        assert o.token_ids == hf_greedy(hf, p, m), (p, m)
    if prefill == "chunked":
        assert eng.num_steps["mixed"] > 0  # chunks really ran beside decode rows


def test_chunked_equals_unchunked_and_prompt_logprobs_work():
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(9)]
    params = [SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True) for _ in prompts]
    params[4] = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outs, plp = {}, {}
    for mode, budget in (("padded", 8192), ("chunked", 11)):
        eng = LLMEngine(ModelSpec(config="gpt2-tiny"), EngineConfig(num_slots=4, max_seq_len=64, prefill=mode,
                                                                    max_prefill_tokens=budget))
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        final = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.prompt_logprobs is not None:  # on the request's first output
                    plp[mode] = o.prompt_logprobs
                if o.finished:
                    final[o.request_id] = o.token_ids
        outs[mode] = [final[i] for i in ids]
    assert outs["padded"] == outs["chunked"]
    a, b = plp["padded"], plp["chunked"]
    assert len(a) == len(b) == len(prompts[4]) and a[0] is None
    for x, y in zip(a[1:], b[1:]):
        assert abs(x.logprob - y.logprob) < 1e-4


def test_http_server_with_chunked_prefill(hf_dir, tmp_path):
    """Concurrent clients of a live server on chunked prefill (budget 9 tokens, 4 slots) get their solo HF greedy
    text; a stream equals the non-streamed reply; echo + logprobs (never chunked) match the non-chunked server's."""
    import asyncio

    import httpx

    from serve_testutil import Server

    arch, path, hf = hf_dir
    if arch != "llama":
        pytest.skip("one architecture is enough over HTTP")
    servers = {mode: Server(LLMEngine(ModelSpec(model=path), EngineConfig(num_slots=4, max_seq_len=96, prefill=mode,
                                                                         max_prefill_tokens=budget)))
               for mode, budget in (("chunked", 9), ("padded", 8192))}
    try:
        url = servers["chunked"].url
        prompts = [[(11 * i + j) % 256 for j in range(2 + 4 * i)] for i in range(8)]

        async def go():
            async with httpx.AsyncClient(timeout=120) as c:
                rs = await asyncio.gather(*(c.post(f"{url}/v1/completions", json={
                    "prompt": p, "max_tokens": 6 + i, "temperature": 0, "ignore_eos": True})
                    for i, p in enumerate(prompts)))
                return [r.json() for r in rs]

        from hpdl.serve.tokenizer import ByteTokenizer

        for i, (p, res) in enumerate(zip(prompts, asyncio.run(go()))):
            ref = hf_greedy(hf, p, 6 + i)
            assert res["choices"][0]["text"] == ByteTokenizer().decode([t for t in ref if t != 257]), i
        body = {"prompt": "chunked prefill over http", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        full = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        s = httpx.post(f"{url}/v1/completions", json=body | {"stream": True}, timeout=60).text
        chunks = [json.loads(ln[6:]) for ln in s.splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == full
        echo = body | {"echo": True, "logprobs": 2, "max_tokens": 3}
        a, b = (httpx.post(f"{servers[m].url}/v1/completions", json=echo, timeout=60).json()["choices"][0]["logprobs"]
                for m in ("chunked", "padded"))
        assert a["tokens"] == b["tokens"] and a["token_logprobs"][0] is None
        assert a["token_logprobs"][1:] == pytest.approx(b["token_logprobs"][1:], abs=1e-4)
    finally:
        for srv in servers.values():
            srv.close()


def test_row_by_row_retry_keeps_each_rows_logits_when_forwards_share_an_output_buffer(monkeypatch):
    """A CUDA-graph forward returns a view of the graph's output; the engine's row-by-row retry (after a failed
    batch forward) ran the same graph once per row, so without a copy every row read the last row's logits. The
    executor here returns views of one reused buffer, as a graph does, and the first packed prefill of several
    prompts raises: every request must still get the tokens of a clean run."""
    prompts = [[(7 * i + j) % 256 for j in range(3 + 5 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    def engine():
        return LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=4, max_seq_len=64, prefill="packed"))

    ref = [o.token_ids for o in engine().generate(prompts, params)]
    eng = engine()
    execute, buf, failed = eng.executor.execute, torch.empty(0), []

    def graph_like(plan):
        nonlocal buf
        if len(plan.prefill_slots) > 1 and not failed:
            failed.append(plan)
            raise RuntimeError("injected batch fault")
        out = execute(plan)
        if buf.shape != out.shape:
            buf = torch.empty_like(out)
        return buf.copy_(out)

    monkeypatch.setattr(eng.executor, "execute", graph_like)
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert failed


def test_varlen_kernel_compiles_one_variant_for_any_batch():
    """Triton compiles a kernel per specialisation key (an int argument equal to 1, or divisible by 16, changes it).
    The first device run passed the batch's block and sequence counts as specialised ints: batches of 1, 16 or 17
    sequences each compiled a new variant while serving. Every batch must map to one key."""
    pytest.importorskip("triton")
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    kern = pf._varlen_attn_kernel
    bind = create_function_from_signature(kern.signature, kern.params, BaseBackend)
    q, kc = torch.zeros(64, 4, 16), torch.zeros(40, 2, 128, 16)
    keys = set()
    for n_seqs in (1, 2, 16, 17, 32):
        for n in (1, 5, 64, 65, 128):
            seqs = pf.PackedSeqs(list(range(n_seqs)), [0] * n_seqs, [n] * n_seqs)
            nb = len(seqs.blocks()[0])
            keys.add(str(bind(q, kc, kc, q, pf.kernel_meta(seqs, "cpu"), nb, n_seqs, 0.25, 2, 64, 16, 4096, 2048,
                              16, 64, 16, BLOCK_M=64, BLOCK_N=64, D=16, PREC="ieee")[1]))
    assert len(keys) == 1, keys


def test_triton_kernel_interpreted_matches_reference():
    run_interpreted(__file__)


def _interpreted_check() -> None:
    torch.manual_seed(0)
    for dt, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        S, hkv, L, d, h = 3, 2, 200, 16, 4
        kc, vc = torch.randn(S, hkv, L, d, dtype=dt), torch.randn(S, hkv, L, d, dtype=dt)
        # a 70-token prompt (two query blocks), a chunk over 70 cached positions, one token, an 8-token chunk
        seqs = pf.PackedSeqs([2, 0, 1, 1], [0, 70, 5, 130], [70, 3, 1, 8])
        q = torch.randn(seqs.num_tokens, h, d, dtype=dt)
        assert pf.kernel_supported(q, kc)
        torch.testing.assert_close(pf.varlen_attention(q, kc, vc, seqs), pf.varlen_attention_ref(q, kc, vc, seqs),
                                   rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="q has 3 rows"):
        pf.varlen_attention(q[:3], kc, vc, seqs)
    # a whole packed forward through the kernel equals the padded eager prefill (float32, head_dim 16)
    model = build_model(ModelSpec(config="llama-tiny"), "cpu")
    prompts = [[5, 9, 200, 17] * 20, [3] * 7, [250]]
    c1, c2 = (KVCache(model.cfg, 4, 96, torch.float32, "cpu") for _ in range(2))
    ref = _eager_prefill(model, c1, prompts, [1, 3, 0])
    got = pf.packed_forward(model, c2, torch.tensor(sum(prompts, [])),
                            pf.PackedSeqs([1, 3, 0], [0, 0, 0], [len(p) for p in prompts]))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    _interpreted_packed_prefill(model)
    print("ok")


def _interpreted_packed_prefill(model) -> None:
    """PackedPrefill (the engine's path: Triton RoPE + K/V store, one metadata table) equals packed_forward,
    exact and padded to token buckets (the CUDA-graph layout: a fixed grid, padding rows, a table left over from a
    larger batch), and launches nothing that needs host data once the forward has started."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    rng = random.Random(1)
    ref_c, c_exact, c_pad = (KVCache(model.cfg, 4, 96, torch.float32, "cpu") for _ in range(3))
    g = torch.Generator().manual_seed(2)
    k0, v0 = torch.randn(ref_c.k.shape, generator=g), torch.randn(ref_c.v.shape, generator=g)
    for c in (ref_c, c_exact, c_pad):  # a cached prefix for the chunks below
        c.k.copy_(k0)
        c.v.copy_(v0)
    exact = pf.PackedPrefill(model, c_exact, 4)
    padded = pf.PackedPrefill(model, c_pad, 4, buckets=(16, 64, 128), pad=True)
    # 77 tokens (bucket 128: 5 blocks in a grid of 6), then 11 (bucket 16) over the bigger batch's table
    for seqs in (pf.PackedSeqs([2, 0, 3, 1], [0, 9, 0, 40], [66, 3, 1, 7]), pf.PackedSeqs([1, 0], [47, 12], [10, 1])):
        toks = [rng.randrange(256) for _ in range(seqs.num_tokens)]
        ref = pf.packed_forward(model, ref_c, torch.tensor(toks), seqs)
        for runner in (exact, padded):
            with Ops() as rec:
                got = runner.forward(toks, seqs)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            # every host tensor is made before the embedding lookup, and nothing reads a device value back: the
            # forward can be captured in a CUDA graph and never waits for the device
            body = rec.ops[rec.ops.index("aten.embedding"):]
            assert not {"aten.lift_fresh", "aten._local_scalar_dense", "aten.nonzero"} & set(body), body
        for c in (c_exact, c_pad):  # the same K/V, and nothing written by padding rows
            torch.testing.assert_close(c.k, ref_c.k, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(c.v, ref_c.v, rtol=1e-5, atol=1e-6)
    # through the engine: chunks of at most 9 tokens beside decode rows, each batch padded to a token bucket (the
    # CUDA-graph layout), give the padded prefill's greedy tokens
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (23, 4, 11, 1)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    toks = {}
    for mode in ("padded", "chunked"):
        eng = LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=3, max_seq_len=40, prefill=mode,
                                                                     max_prefill_tokens=9 if mode == "chunked" else 99))
        runner = eng.executor.runner
        runner._packed_prefill = pf.PackedPrefill(runner.model, runner.cache, 3, buckets=(4, 8, 16), pad=True)
        toks[mode] = [o.token_ids for o in eng.generate(prompts, params)]
        assert mode == "padded" or eng.num_steps["mixed"] > 0
    assert toks["chunked"] == toks["padded"]


if __name__ == "__main__":
    _interpreted_check()
