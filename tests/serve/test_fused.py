"""The fused decode step (hpdl.serve.fused) against the eager model: its torch references in-process, its Triton
kernels on CPU under TRITON_INTERPRET=1 in a subprocess (the interpreter is chosen when kernels are defined)."""

from __future__ import annotations


import pytest
import torch

from serve_testutil import hf_greedy, run_interpreted
from hpdl.models.gpt import Batch, DecoderConfig, DecoderLM, KVCache, rope_tables
from hpdl.serve import EngineConfig, LLMEngine, ModelSpec, SamplingParams
from hpdl.serve import fused as fz

# hidden 128, 8 heads of 16, 2 KV heads (GQA groups of 4): small, but every kernel's shape path is taken
CFG = DecoderConfig(arch="llama", vocab_size=300, hidden_size=128, n_layers=3, n_heads=8, n_kv_heads=2,
                    intermediate_size=200, max_position=256)


def _prefilled(seed=0, dtype=torch.float32, slots=6, L=200):
    """A random model and a cache whose slots 1..4 hold prompts of different lengths (prefilled eagerly)."""
    torch.manual_seed(seed)
    model = DecoderLM(CFG).init_random(seed, std=0.1).to(dtype).eval()
    cache = KVCache(CFG, slots, L, dtype, "cpu")
    lens = [5, 1, 130, 70]
    with torch.inference_mode():
        for s, n in zip(range(1, 5), lens):
            toks = torch.randint(0, CFG.vocab_size, (1, n))
            model(toks, cache, Batch(positions=torch.arange(n)[None], slots=torch.tensor([s]),
                                     last=torch.tensor([n - 1])))
    return model, cache, torch.tensor(lens)


def _decode_both(model, cache, pos, steps=4, **kw):
    """Decode ``steps`` greedy steps of slots 1..4 eagerly and fused from the same cache; the tokens and logits."""
    ce = KVCache(CFG, cache.num_slots, cache.max_seq_len, cache.k.dtype, "cpu")
    ce.k.copy_(cache.k), ce.v.copy_(cache.v)
    toks = torch.tensor([3, 1, 4, 1])
    te, tf, le, lf = toks.clone(), toks.clone(), [], []
    with torch.inference_mode():
        for _ in range(steps):
            kv = int(pos.max()) + 1
            a = model(te[:, None], ce, Batch(positions=pos[:, None], start=1, kv_len=kv))
            b, top = fz.fused_decode(model, cache, tf, pos, 1, kv, **kw)
            le.append(a), lf.append(b)
            te, tf, pos = a.argmax(-1), top, pos + 1
            assert torch.equal(top, b.argmax(-1))
    return le, lf, ce


STREAM = [{}, dict(gemm="stream", norm_prologue_rows=0), dict(gemm="stream", norm_prologue_rows=256),
          dict(rope_in_attention=False), dict(gemm="stream", rope_in_attention=False)]
IDS = ["cublas", "stream", "stream-norm-prologue", "cublas-rope-kernel", "stream-rope-kernel"]


@pytest.mark.parametrize("kw", STREAM, ids=IDS)
def test_references_match_eager_decode_float32(kw):
    model, cache, lens = _prefilled()
    le, lf, ce = _decode_both(model, cache, lens.clone(), **kw)
    for a, b in zip(le, lf):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    torch.testing.assert_close(cache.k, ce.k, rtol=1e-4, atol=1e-5)  # K/V written at the same places
    torch.testing.assert_close(cache.v, ce.v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw", STREAM, ids=IDS)
def test_references_match_eager_decode_bfloat16(kw):
    model, cache, lens = _prefilled(dtype=torch.bfloat16)
    le, lf, _ = _decode_both(model, cache, lens.clone(), steps=1, **kw)
    torch.testing.assert_close(lf[0].float(), le[0].float(), rtol=0.05, atol=0.05)


def test_split_count_fills_the_device_and_bounds_chunks():
    assert fz.attention_splits(1, 4, 640) == 10  # batch 1: every 64-position chunk its own program
    assert fz.attention_splits(64, 4, 640) == 2
    assert fz.attention_splits(128, 4, 640) == 1
    assert fz.attention_splits(1, 4, 10) == 1


def test_supports_and_engine_flag():
    assert fz.supports(DecoderLM(CFG)) is None
    gpt2 = DecoderLM(DecoderConfig(arch="gpt2", vocab_size=10, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=2,
                                   intermediate_size=64, max_position=32))
    assert "gpt2" in fz.supports(gpt2)
    with pytest.raises(ValueError, match="fused"):
        LLMEngine(ModelSpec(config="gpt2-tiny"), EngineConfig(num_slots=2, max_seq_len=32, fused_decode=True))
    eng = LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=2, max_seq_len=32))
    assert eng.executor.runner.fused is False  # CPU default: the eager reference
    with pytest.raises(ValueError, match="fused_gemm"):
        EngineConfig(fused_gemm="cutlass")
    # stream GEMMs live inside the fused step: on the eager step (CPU default, --eager-decode, GPT-2) they were
    # silently ignored and the run reported the eager step's numbers
    for spec, kw, why in (("llama-tiny", {}, "default on cpu"), ("gpt2-tiny", {}, "LLaMA's"),
                          ("llama-tiny", dict(fused_decode=False), "fused_decode=False")):
        with pytest.raises(ValueError, match=f"fused_gemm='stream'.*{why}"):
            LLMEngine(ModelSpec(config=spec), EngineConfig(num_slots=2, max_seq_len=32, fused_gemm="stream", **kw))
    model, cache, lens = _prefilled()
    with pytest.raises(ValueError, match="gemm must be one of"):
        fz.fused_decode(model, cache, torch.tensor([1]), torch.tensor([3]), 1, 4, gemm="cutlass")


def test_stream_gemm_where_the_fused_step_does_not_run_is_an_error(capsys):
    # it was silently ignored: the eager step ran and the caller believed it measured the stream GEMMs
    from hpdl.cli import main

    with pytest.raises(ValueError, match="fused_gemm='stream'.*fused_decode=False"):
        EngineConfig(fused_gemm="stream", fused_decode=False)
    with pytest.raises(ValueError, match="fused_gemm='stream'.*needs the fused decode step.*default on cpu"):
        LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=2, max_seq_len=32, fused_gemm="stream"))
    with pytest.raises(ValueError, match="fused_gemm='stream'.*needs the fused decode step.*LLaMA's"):
        LLMEngine(ModelSpec(config="gpt2-tiny"), EngineConfig(num_slots=2, max_seq_len=32, fused_gemm="stream"))
    assert main(["serve", "--config", "llama-tiny", "--fused-gemm", "stream"]) == 1
    err = capsys.readouterr().err
    assert "usage: hpdl serve" in err and "--fused-gemm stream" in err and "--device cuda" in err


@pytest.mark.parametrize("gemm", ["cublas", "stream"])
def test_engine_fused_greedy_equals_hf(hf_dir, gemm):
    arch, path, hf = hf_dir
    if arch != "llama":
        pytest.skip("the fused step is LLaMA's")
    prompts = [[5, 6, 7], [9] * 30, [1], [200, 100, 50, 25]]
    maxt = [20, 7, 33, 12]
    eng = LLMEngine(ModelSpec(model=path), EngineConfig(num_slots=3, max_seq_len=64, fused_decode=True,
                                                        fused_gemm=gemm))
    assert eng.executor.runner.fused and eng.executor.runner.fused_gemm == gemm
    outs = eng.generate(prompts, [SamplingParams(max_tokens=m) for m in maxt])
    for p, m, o in zip(prompts, maxt, outs):
        assert o.token_ids == hf_greedy(hf, p, m), (p, m)


def test_triton_kernels_interpreted_match_references():
    run_interpreted(__file__)


def _interpreted_check() -> None:
    """Run under TRITON_INTERPRET=1: each kernel against its reference, then whole fused steps against eager."""
    assert fz.use_triton(torch.zeros(1)), "TRITON_INTERPRET=1 must be set before hpdl.serve.fused is imported"
    torch.manual_seed(0)
    n, C, h, hkv, d, S, L = 3, 128, 8, 2, 16, 6, 200
    x, r, w = torch.randn(n, C), torch.randn(n, C), torch.rand(C)
    for res in (None, r):
        r1, y1 = fz.add_rmsnorm_ref(x, None if res is None else res.clone(), w, 1e-5)
        r2, y2 = fz.add_rmsnorm(x, None if res is None else res.clone(), w, 1e-5)
        torch.testing.assert_close(y2, y1), torch.testing.assert_close(r2, r1)
    cos, sin = rope_tables(CFG)
    pos = torch.tensor([3, 0, 150])
    qkv = torch.randn(n, (h + 2 * hkv) * d)
    c1, v1, c2, v2 = (torch.zeros(S, hkv, L, d) for _ in range(4))
    torch.testing.assert_close(fz.rope_kv(qkv, cos, sin, pos, c2, v2, 2, h, hkv),
                               fz.rope_kv_ref(qkv, cos, sin, pos, c1, v1, 2, h, hkv))
    torch.testing.assert_close(c2, c1), torch.testing.assert_close(v2, v1)
    kc, vc, q = torch.randn(S, hkv, L, d), torch.randn(S, hkv, L, d), torch.randn(n, h, d)
    ref = fz.decode_attention_ref(q, kc, vc, pos, 2)
    for splits in (1, 2, 3):  # one pass, and split-K with empty chunks for the short rows
        torch.testing.assert_close(fz.decode_attention(q, kc, vc, pos, 2, 151, splits=splits, block_n=16), ref)
        for one_shot in (True, False, True):  # the chunks combined by the last program, every split's partials
            fz.COMBINE_ONE_SHOT = one_shot  # loaded at once or split by split; counters left at 0 for the next call
            torch.testing.assert_close(fz.decode_attention(q, kc, vc, pos, 2, 151, splits=splits, block_n=16,
                                                           fuse_combine=True), ref)
    # RoPE + K/V write inside the attention kernel: bit-equal to rope_kv then decode_attention (same arithmetic,
    # also bfloat16, whose interpreted tl.dot is not the reference's), and close to the references in float32
    for dt in (torch.float32, torch.bfloat16):
        qkv_t, kc0, vc0 = qkv.to(dt), kc.to(dt), vc.to(dt)
        for splits, fc in ((1, False), (2, False), (3, True)):
            k1, v1, k2, v2 = kc0.clone(), vc0.clone(), kc0.clone(), vc0.clone()
            q1 = fz.rope_kv(qkv_t, cos, sin, pos, k1, v1, 2, h, hkv)
            a = fz.decode_attention(q1, k1, v1, pos, 2, 151, splits=splits, block_n=16, fuse_combine=fc)
            b = fz.rope_decode_attention(qkv_t, cos, sin, pos, k2, v2, 2, h, hkv, 151, splits=splits, block_n=16,
                                         fuse_combine=fc)
            assert torch.equal(a, b) and torch.equal(k1, k2) and torch.equal(v1, v2), (dt, splits, fc)
            if dt == torch.float32:
                k3, v3 = kc0.clone(), vc0.clone()
                r = fz.decode_attention_ref(fz.rope_kv_ref(qkv_t, cos, sin, pos, k3, v3, 2, h, hkv), k3, v3, pos, 2)
                torch.testing.assert_close(b, r), torch.testing.assert_close(k2, k3)
    from hpdl.serve.stream_gemm import counters
    assert int(counters(q.device).abs().sum()) == 0
    gu = torch.randn(n, 400)
    torch.testing.assert_close(fz.silu_mul(gu), fz.silu_mul_ref(gu))
    for dt in (torch.float32, torch.bfloat16):  # the step's greedy argmax: ties to the first index, as torch
        lg = torch.randn(4, 320).to(dt)
        lg[1, 7] = lg[1, 200] = 50.0
        lg[2] = -3e38
        lg[3, 299] = 99.0
        for t in (lg, lg[:, :300]):  # contiguous, and a row-strided view (a padded vocabulary)
            assert torch.equal(fz.argmax_rows(t), t.argmax(-1)), dt
    # whole steps with RoPE in the attention kernel (rope_kv's path is bit-equal, above): cuBLAS-path kernels,
    # then the stream GEMMs without and with the norm prologue
    for kw in STREAM[:3]:
        model, cache, lens = _prefilled()
        le, lf, ce = _decode_both(model, cache, lens.clone(), steps=3 if not kw else 2, **kw)
        for a, b in zip(le, lf):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(cache.k, ce.k, rtol=1e-4, atol=1e-5)
    print("ok")


if __name__ == "__main__":
    _interpreted_check()
