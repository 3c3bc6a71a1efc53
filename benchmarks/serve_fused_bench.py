"""Issue 28: the fused decode step against the eager one, side by side in one device run (1 x H200).

    python3 benchmarks/serve_fused_bench.py --out $OUT            # device: JSON (+ PNG) into $OUT
    python3 benchmarks/serve_fused_bench.py --plot DIR            # here: the PNG from a fetched fused.json
    python3 benchmarks/serve_fused_bench.py --smoke --out /tmp/x  # CPU plumbing check, llama-tiny
    python3 benchmarks/serve_fused_bench.py --tiny --out $OUT/x   # the same shapes on the GPU: a quick check
    python3 benchmarks/serve_fused_bench.py --fused-gemm stream --parts fused --out $OUT  # the stream GEMM step

Parts, each saved into fused.json as soon as it is done (a timeout keeps what finished):
1. correctness: greedy tokens of the fused and eager paths through ``LLMEngine`` (CUDA graphs on) in float32;
   one decode step's logits, fused vs eager, in float32 and bfloat16.
2. per path (fused, then eager): ``llama-1b`` random weights, bfloat16, 256 slots of 640 positions, every graph
   captured first (``ModelRunner.warm_up``) and each workload's prefill shape run once; batch-1 TPOT (128-token prompt, 256 new tokens), then offline
   workloads of 16, 64 and 256 requests (128-token prompts, outputs uniform in 32..512, EOS ignored), the
   decode roofline at 1, 64 and 256 rows, and the kernels of one decode step (torch.profiler, outside a graph).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from hpdl.bench.common import pyplot, run_metadata  # noqa: E402
from hpdl.serve.bench import release_engine  # noqa: E402

MODEL, DTYPE, SLOTS, MAX_LEN, PROMPT, OUT_LEN = "llama-1b", "bfloat16", 256, 640, 128, (32, 512)
CONCURRENCY, B1_TOKENS, ROOF_ROWS = [16, 64, 256], 256, [1, 64, 256]
GOALS = {"64": 25000, "256": 60000, "tpot_b1_ms": 1.0}
FUSED_GEMM = "cublas"  # --fused-gemm stream: the fused path with hpdl.serve.stream_gemm (issue 38)
SMOKE = dict(MODEL="llama-tiny", DTYPE="float32", SLOTS=8, MAX_LEN=160, PROMPT=16, OUT_LEN=(4, 24),
             CONCURRENCY=[4, 8], B1_TOKENS=16, ROOF_ROWS=[1, 8])
_T0 = time.perf_counter()
RES: dict = {}


def _save(out: Path, key: str, val) -> None:
    RES[key] = val
    (out / "fused.json").write_text(json.dumps(RES, indent=1, default=str))
    print(f"[{time.perf_counter() - _T0:6.1f}s] {key}: {json.dumps(val, default=str)[:300]}", flush=True)


def _engine(device, fused, dtype=None, slots=None, max_len=None, model=None):
    from hpdl.serve import EngineConfig, LLMEngine, ModelSpec

    return LLMEngine(ModelSpec(config=model or MODEL, dtype=dtype or DTYPE),
                     EngineConfig(num_slots=slots or SLOTS, max_seq_len=max_len or MAX_LEN, device=device,
                                  cuda_graph=True, fused_decode=fused, max_prefill_tokens=PROMPT * 256,
                                  fused_gemm=FUSED_GEMM if fused else "cublas"))


def kernels(out: Path, device: str) -> None:
    """Each Triton kernel against its torch reference on the device, float32 and bfloat16 (max abs diff)."""
    import torch

    from hpdl.models.gpt import DecoderConfig, rope_tables
    from hpdl.serve import fused as fz

    torch.manual_seed(0)
    res = {}
    for dt in (torch.float32, torch.bfloat16):
        n, C, h, hkv, d, S, L = 5, 2048, 32, 4, 64, 8, 640
        x, r = (torch.randn(n, C, device=device, dtype=dt) for _ in range(2))
        w = torch.rand(C, device=device, dtype=dt)
        r1, y1 = fz.add_rmsnorm_ref(x, r.clone(), w, 1e-5)
        r2, y2 = fz.add_rmsnorm(x, r.clone(), w, 1e-5)
        e = {"add_rmsnorm": max((y1 - y2).abs().max().item(), (r1 - r2).abs().max().item())}
        cos, sin = (t.to(device) for t in rope_tables(DecoderConfig(max_position=L)))
        pos = torch.tensor([3, 0, 639, 200, 64], device=device)
        qkv = torch.randn(n, (h + 2 * hkv) * d, device=device, dtype=dt)
        c1, v1, c2, v2 = (torch.zeros(S, hkv, L, d, device=device, dtype=dt) for _ in range(4))
        q1 = fz.rope_kv_ref(qkv, cos, sin, pos, c1, v1, 1, h, hkv)
        q2 = fz.rope_kv(qkv, cos, sin, pos, c2, v2, 1, h, hkv)
        e["rope_kv"] = max((q1 - q2).abs().max().item(), (c1 - c2).abs().max().item(), (v1 - v2).abs().max().item())
        kc, vc = torch.randn(S, hkv, L, d, device=device, dtype=dt), torch.randn(S, hkv, L, d, device=device, dtype=dt)
        q = torch.randn(n, h, d, device=device, dtype=dt)
        ref = fz.decode_attention_ref(q, kc, vc, pos, 1)
        for sp in (1, 3, 10):
            e[f"attention_split{sp}"] = (fz.decode_attention(q, kc, vc, pos, 1, 640, splits=sp) - ref).abs().max().item()
        gu = torch.randn(n, 2 * 5632, device=device, dtype=dt)
        e["silu_mul"] = (fz.silu_mul(gu) - fz.silu_mul_ref(gu)).abs().max().item()
        res[str(dt).split(".")[-1]] = e
    _save(out, "kernels_max_abs_diff", res)


def correctness(out: Path, device: str) -> None:
    """Greedy tokens through the engine (float32), and one decode step's logits (float32, bfloat16)."""
    import random

    import torch

    from hpdl.models.gpt import Batch
    from hpdl.serve import SamplingParams
    from hpdl.serve.fused import fused_decode

    rng = random.Random(0)
    prompts = [[rng.randrange(32000 if MODEL == "llama-1b" else 256) for _ in range(rng.randint(8, 60))]
               for _ in range(8)]
    params = [SamplingParams(max_tokens=64, ignore_eos=True, detokenize=False)] * len(prompts)
    toks = {}
    for fused in (True, False):
        eng = _engine(device, fused, "float32", slots=8, max_len=256)
        toks[fused] = [o.token_ids for o in eng.generate(prompts, params)]
        r = eng.executor.runner
        ok = (r.fused == fused, r.cuda_graph or device == "cpu", r.graph_error)
        release_engine(eng)
    same = sum(a == b for a, b in zip(toks[True], toks[False]))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                  for a, b in zip(toks[True], toks[False])]
    _save(out, "greedy_float32", {"requests": len(prompts), "tokens_each": 64, "identical_requests": same,
                                  "first_differing_token": first_diff, "runner_state": ok})
    for dtype in ("float32", "bfloat16"):
        eng = _engine(device, True, dtype, slots=8, max_len=256)
        r = eng.executor.runner
        n = 4
        with torch.inference_mode():
            for s in range(n):
                t = torch.tensor([prompts[s]], device=r.device)
                r.model(t, r.cache, Batch(positions=torch.arange(t.shape[1], device=r.device)[None],
                                          slots=torch.tensor([s], device=r.device),
                                          last=torch.tensor([t.shape[1] - 1], device=r.device)))
            pos = torch.tensor([len(p) for p in prompts[:n]], device=r.device)
            tk = torch.tensor([5, 6, 7, 8], device=r.device)
            ref = r.model(tk[:, None], r.cache, Batch(positions=pos[:, None], start=0, kv_len=int(pos.max()) + 1))
            got, top = fused_decode(r.model, r.cache, tk, pos, 0, 128, gemm=FUSED_GEMM)
        d = (got.float() - ref.float()).abs()
        _save(out, f"logits_{dtype}", {"max_abs_diff": d.max().item(), "mean_abs_diff": d.mean().item(),
                                       "ref_std": ref.float().std().item(),
                                       "argmax_equal": int((top == ref.argmax(-1)).sum()), "rows": n})
        release_engine(eng)


def throughput(out: Path, device: str, fused: bool) -> None:
    from hpdl.serve import bench
    from hpdl.serve.worker import NAMED_CONFIGS

    name = "fused" if fused else "eager"
    t = time.perf_counter()
    eng = _engine(device, fused)
    r = eng.executor.runner
    graphs = r.warm_up()
    vocab = NAMED_CONFIGS[MODEL].vocab_size
    for n in [1] + CONCURRENCY:  # every prefill shape measured below, once (cuBLAS heuristics, lazy loading)
        bench.run_engine(eng, bench.make_workload(n, (PROMPT, PROMPT), (2, 2), math.inf, vocab_size=vocab, seed=9))
    _save(out, f"{name}_setup", {"graphs": graphs, "seconds": time.perf_counter() - t, "fused": r.fused,
                                 "fused_gemm": r.fused_gemm,
                                 "cuda_graph": r.cuda_graph, "graph_error": r.graph_error})
    res = {}
    w1 = bench.make_workload(1, (PROMPT, PROMPT), (B1_TOKENS, B1_TOKENS), math.inf, vocab_size=vocab, seed=0)
    rec = bench.run_engine(eng, w1)[0]
    res["1"] = {"tpot_ms": rec.tpot * 1e3, "output_tokens": rec.output_len,
                "output_throughput": 1.0 / rec.tpot}
    _save(out, f"{name}_b1", res["1"])
    for n in CONCURRENCY:
        wl = bench.make_workload(n, (PROMPT, PROMPT), OUT_LEN, math.inf, vocab_size=vocab, seed=0)
        s = bench.summarize(bench.run_engine(eng, wl))
        s["decode_steps"] = eng.num_steps["decode"]
        res[str(n)] = s
        _save(out, f"{name}_{n}", {k: s[k] for k in ("output_throughput", "makespan_s", "mean_tpot_ms")
                                   if k in s} | {"output_tokens": sum(w.output_len for w in wl)})
    hbm = bench.hbm_bandwidth(r.device)
    ctx = PROMPT + (OUT_LEN[0] + OUT_LEN[1]) // 4  # mean cached positions over a request's life
    try:
        res["roofline"] = [bench.decode_roofline(eng, n, ctx, hbm=hbm) for n in ROOF_ROWS]
        for line in res["roofline"]:
            print(bench.roofline_line(line), flush=True)
    except Exception:  # noqa: BLE001 - keep the throughput numbers
        res["roofline_error"] = traceback.format_exc()[-1500:]
    try:
        res["kernels_per_step"] = {str(n): kernel_count(r, n, ctx) for n in (1, 64)}
    except Exception:  # noqa: BLE001
        res["kernels_error"] = traceback.format_exc()[-1500:]
    res["final_state"] = {"fused": r.fused, "cuda_graph": r.cuda_graph, "graph_error": r.graph_error}
    _save(out, name, res)
    release_engine(eng)


def kernel_count(runner, n: int, ctx: int) -> int | None:
    """Device kernels of one decode step of ``n`` rows run outside a graph (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if runner.device.type != "cuda":
        return None
    toks = torch.zeros(n, 1, dtype=torch.long, device=runner.device)
    pos = torch.full((n, 1), ctx, dtype=torch.long, device=runner.device)
    with torch.inference_mode():
        runner._decode(toks, pos, 0, ctx + 1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner._decode(toks, pos, 0, ctx + 1)
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def plot(d: Path) -> None:
    plt = pyplot()
    res = json.loads((d / "fused.json").read_text())
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, style in (("fused", "o-"), ("eager", "s--")):
        if name in res:
            xs = [1] + [int(k) for k in res[name] if k.isdigit() and k != "1"]
            ys = [res[name][str(x)]["output_throughput"] for x in xs]
            ax.plot(xs, ys, style, label=f"{name} (CUDA graph)")
    ax.plot([64, 256], [GOALS["64"], GOALS["256"]], "k*", ms=10, label="issue 28 goals")
    ax.plot([1], [1e3 / GOALS["tpot_b1_ms"]], "k*", ms=10)
    ax.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="output tokens/s",
           title=f"hpdl.serve decode, {MODEL} {DTYPE}, 1 x H200")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(d / "serve_fused.png", dpi=120)
    print(f"wrote {d / 'serve_fused.png'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path, help="only make the PNG from DIR/fused.json")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check with llama-tiny")
    ap.add_argument("--tiny", action="store_true", help="--smoke's llama-tiny shapes on the device (CUDA when "
                    "present): the quick GPU check")
    ap.add_argument("--parts", default="kernels,correctness,fused,eager")
    ap.add_argument("--fused-gemm", default="cublas", choices=["cublas", "stream"],
                    help="GEMMs of the fused path (stream: hpdl.serve.stream_gemm, issue 38)")
    args = ap.parse_args()
    globals()["FUSED_GEMM"] = args.fused_gemm
    if args.plot:
        return plot(args.plot)
    if args.smoke or args.tiny:
        globals().update(SMOKE)
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    _save(args.out, "versions", run_metadata(device=device, versions=("transformers", "triton"), model=MODEL,
                                             dtype=DTYPE, slots=SLOTS, max_seq_len=MAX_LEN, fused_gemm=FUSED_GEMM))
    for part in args.parts.split(","):
        try:
            if part == "kernels":
                kernels(args.out, device)
            elif part == "correctness":
                correctness(args.out, device)
            else:
                throughput(args.out, device, part == "fused")
        except Exception:  # noqa: BLE001 - keep the other parts' results
            _save(args.out, f"{part}_error", traceback.format_exc()[-3000:])
    try:
        plot(args.out)
    except Exception:  # noqa: BLE001
        print(traceback.format_exc(), flush=True)


if __name__ == "__main__":
    main()
