"""Issue 38, prefill part: the padded prefill against packed and chunked prefill, side by side (1 x H200).

    python3 benchmarks/serve_ttft.py --out $OUT                # device, about 3-4 minutes: JSON + log + PNG
    python3 benchmarks/serve_ttft.py --smoke --out /tmp/ttft   # CPU plumbing check, llama-tiny, about 2 minutes
    python3 benchmarks/serve_ttft.py --tiny --out $OUT/ttft    # the same shapes on the GPU: a quick check
    python3 benchmarks/serve_ttft.py --plot DIR                # the PNG again from a fetched DIR/serve_ttft.json

Four engines per case, identical but for the prefill path (``PATHS``): ``padded`` (prompts right-padded to the
longest, one padded eager prefill forward, then the decode, every step; budget 32768 = 256 x 128), ``packed``
(``EngineConfig(prefill="packed")``: the same batches without padding, one varlen attention launch per layer:
the padding saving alone), ``chunked8192`` and ``chunked512`` (``prefill="chunked"``: packed, split into chunks
that run in the same step as the running requests' decode, under a token budget: 8192 is vLLM's serving default,
512 a latency setting). Packed and chunked run ``hpdl.serve.prefill.PackedPrefill``: batches of up to 2048 tokens
replay a CUDA graph per token bucket. All decode with the fused step from CUDA graphs. ``llama-1b`` random
weights, bfloat16, greedy, EOS ignored; each engine's graphs are captured and its prefill shapes run once before
anything is timed. Parts, each saved to serve_ttft.json as soon as it is done:

1. ``kernel``: the varlen attention kernel against its torch reference on the device (float32, bfloat16),
   and float32 greedy tokens of 8 requests (prompts 5..300 tokens) through the engine, packed and chunked
   (budget 96, graphs) vs padded.
2. ``poisson``: 200 requests arriving Poisson at 16 requests/s (seeded; the same arrivals for every path),
   128-token prompts, outputs uniform in 32..512: TTFT p50/p99, TPOT p50/p99, output tokens/s.
3. ``offline``: 64 and 256 requests at t = 0 (same lengths): output tokens/s, TTFT p50/p99; and 64 requests
   with prompts uniform in 16..512 and outputs in 32..128 (``varlen64``), where padding costs: the padded
   path computes every prompt to the longest of its batch (``prefill_padding_tokens``).
4. ``long``: 32 running requests (128-token prompts, 400 outputs) when a 4096-token prompt arrives at 0.15 s
   (``llama-1b-8k``: the same weights' shape with an 8k context): the running requests' inter-token latency
   (max, p99, the mean step while the prompt is prefilled) and the long request's TTFT; padded, packed and
   chunked at budgets 8192, 2048 and 512. Each path runs the scenario once untimed first (graph captures,
   kernel compiles).

The last lines printed are one table: a row per (case, metric), a column per path.
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
from hpdl.bench.common import Column, format_table, pyplot, run_metadata  # noqa: E402
from hpdl.serve.bench import release_engine  # noqa: E402

MODEL, LONG_MODEL, DTYPE = "llama-1b", "llama-1b-8k", "bfloat16"
SLOTS, MAX_LEN, PROMPT, OUT_LEN = 256, 640, 128, (32, 512)
RATE, N_POISSON, OFFLINE = 16.0, 200, [64, 256]
# (prefill mode, token budget): padded and packed hold a whole batch of prompts (256 x 128) in one forward, so
# packed differs from padded only by the padding; chunked at 8192 (vLLM's default for serving: throughput) and
# at 512 (latency: the smallest chunk a step carries beside 256 decode rows)
PATHS = [("padded", 32768), ("packed", 32768), ("chunked", 8192), ("chunked", 512)]
VARLEN = dict(n=64, prompt=(16, 512), out=(32, 128))  # mixed prompt lengths: where padding costs
LONG = dict(running=32, run_out=400, prompt=4096, out=16, arrival=0.15, slots=64, max_len=4224,
            budgets=[8192, 2048, 512])
CHECK = dict(model="llama-1b", lens=[5, 300, 17, 64, 129, 1, 250, 40], tokens=32, budget=96)
SMOKE = dict(MODEL="llama-tiny", LONG_MODEL="llama-tiny", DTYPE="float32", SLOTS=8, MAX_LEN=160, PROMPT=16,
             OUT_LEN=(4, 24), RATE=50.0, N_POISSON=12, OFFLINE=[4, 8],
             PATHS=[("padded", 2048), ("packed", 2048), ("chunked", 64), ("chunked", 12)],
             VARLEN=dict(n=6, prompt=(2, 100), out=(2, 8)),
             LONG=dict(running=4, run_out=40, prompt=300, out=4, arrival=0.01, slots=8, max_len=400,
                       budgets=[128, 64, 24]),
             CHECK=dict(model="llama-tiny", lens=[5, 60, 17, 1], tokens=8, budget=12))
_T0 = time.perf_counter()
RES: dict = {}
LOG: list[str] = []


def _say(out: Path, line: str) -> None:
    line = f"[{time.perf_counter() - _T0:6.1f}s] {line}"
    print(line, flush=True)
    LOG.append(line)
    (out / "serve_ttft.log").write_text("\n".join(LOG) + "\n")


def _save(out: Path, key: str, val) -> None:
    RES[key] = val
    (out / "serve_ttft.json").write_text(json.dumps(RES, indent=1, default=str))
    _say(out, f"{key}: {json.dumps(val, default=str)[:400]}")


def _name(mode: str, budget: int) -> str:
    return f"chunked{budget}" if mode == "chunked" else mode


def _engine(device, prefill, budget, model=None, dtype=None, slots=None, max_len=None):
    from hpdl.serve import EngineConfig, LLMEngine, ModelSpec

    return LLMEngine(ModelSpec(config=model or MODEL, dtype=dtype or DTYPE),
                     EngineConfig(num_slots=slots or SLOTS, max_seq_len=max_len or MAX_LEN, device=device,
                                  cuda_graph=True, prefill=prefill, max_prefill_tokens=budget))


def _pct(xs, q):
    import numpy as np

    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None


def kernel(out: Path, device: str) -> None:
    import random

    import torch

    from hpdl.serve import SamplingParams
    from hpdl.serve import prefill as pf

    torch.manual_seed(0)
    res = {"kernel_used": None}
    for dt in (torch.float32, torch.bfloat16):
        S, hkv, L, d, h = 4, 4, 1200, 64, 32
        kc = torch.randn(S, hkv, L, d, device=device, dtype=dt)
        vc = torch.randn(S, hkv, L, d, device=device, dtype=dt)
        seqs = pf.PackedSeqs([2, 0, 1, 3], [0, 500, 7, 0], [700, 129, 1, 64])
        q = torch.randn(seqs.num_tokens, h, d, device=device, dtype=dt)
        res["kernel_used"] = pf.kernel_supported(q, kc)
        err = (pf.varlen_attention(q, kc, vc, seqs).float() - pf.varlen_attention_ref(q, kc, vc, seqs).float())
        res[str(dt).split(".")[-1] + "_max_abs_diff"] = err.abs().max().item()
    _save(out, "kernel", res)
    try:
        _save(out, "packed_prefill", packed_prefill_check(device))
    except Exception:  # noqa: BLE001 - keep the engine checks
        _save(out, "packed_prefill_error", traceback.format_exc()[-3000:])
    rng = random.Random(0)
    vocab = 32000 if CHECK["model"].startswith("llama-1b") else 256
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in CHECK["lens"]]
    params = SamplingParams(max_tokens=CHECK["tokens"], ignore_eos=True, detokenize=False)
    toks, steps, graphs = {}, {}, {}
    for mode, budget in (("padded", 8192), ("packed", 8192), ("chunked", CHECK["budget"])):
        eng = _engine(device, mode, budget, model=CHECK["model"], dtype="float32", slots=4, max_len=384)
        toks[mode] = [o.token_ids for o in eng.generate(prompts, params)]
        steps[mode] = dict(eng.num_steps)
        graphs[mode] = _prefill_state(eng)
        release_engine(eng)
    res = {"requests": len(prompts), "tokens_each": CHECK["tokens"], "chunk_budget": CHECK["budget"],
           "steps": steps, "prefill_graphs": graphs}
    for mode in ("packed", "chunked"):  # against padded (the eager model's prefill)
        res[f"identical_{mode}"] = sum(a == b for a, b in zip(toks["padded"], toks[mode]))
        res[f"first_diff_{mode}"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                     for a, b in zip(toks["padded"], toks[mode])]
    _save(out, "greedy_float32", res)


def packed_prefill_check(device: str) -> dict:
    """PackedPrefill (CUDA graphs per token bucket) against the eager ``packed_forward`` in the model dtype: logits
    and K/V written, for whole prompts and chunks over a cached prefix; then the time of one prefill forward
    (host call to device done, median of 10) at 16, 512 and 2048 tokens, PackedPrefill (graphs on CUDA) vs the
    eager ``packed_forward`` (the first run's path)."""
    import random

    import numpy as np
    import torch

    from hpdl.models.gpt import KVCache
    from hpdl.serve import ModelSpec
    from hpdl.serve import prefill as pf
    from hpdl.serve.worker import DTYPES, build_model

    dt = DTYPES[DTYPE]
    model = build_model(ModelSpec(config=CHECK["model"], dtype=DTYPE), device)
    L = min(model.cfg.max_position, 2048)
    c0, c1 = (KVCache(model.cfg, 8, L, dt, device) for _ in range(2))
    pp = pf.PackedPrefill(model, c1, 8, cuda_graph=device == "cuda")
    rng = random.Random(1)
    res = {}
    for name, seqs in (("prompts", pf.PackedSeqs([2, 0, 3, 1], [0, 0, 0, 0], [300, 17, 1, 64])),
                       ("chunks", pf.PackedSeqs([2, 1, 0], [300, 64, 17], [20, 5, 100]))):
        toks = [rng.randrange(3, model.cfg.vocab_size) for _ in range(seqs.num_tokens)]
        ref = pf.packed_forward(model, c0, torch.tensor(toks, device=device), seqs).float()
        got = pp.forward(toks, seqs).float()
        res[name] = {"tokens": seqs.num_tokens, "logits_max_abs_diff": (got - ref).abs().max().item(),
                     "argmax_agree": int((got.argmax(-1) == ref.argmax(-1)).sum()), "rows": len(seqs.lens),
                     "kv_max_abs_diff": max((c1.k - c0.k).abs().max().item(), (c1.v - c0.v).abs().max().item())}
    res["graph"] = {"cuda_graph": pp.cuda_graph, "graphs": sorted(pp.graphs), "graph_error": pp.graph_error}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = {}
    for n in (16, 512, min(2048, L)):
        seqs = pf.PackedSeqs([0], [0], [n])
        toks = [rng.randrange(3, model.cfg.vocab_size) for _ in range(n)]
        tt = torch.tensor(toks, device=device)
        for label, fn in (("PackedPrefill", lambda: pp.forward(toks, seqs)),
                          ("packed_forward", lambda: pf.packed_forward(model, c0, tt, seqs))):
            ts = []
            for i in range(12):
                sync()
                t = time.perf_counter()
                fn()
                sync()
                if i >= 2:
                    ts.append((time.perf_counter() - t) * 1e3)
            times[f"{label}_{n}_ms"] = float(np.median(ts))
    res["forward_ms"] = times
    return res


def _prefill_state(eng) -> dict | None:
    """The packed prefill's CUDA graphs (buckets captured) and, if capture failed, why."""
    pp = eng.executor.runner._packed_prefill
    if pp is None:
        return None
    return {"cuda_graph": pp.cuda_graph, "graphs": sorted(pp.graphs), "graph_error": pp.graph_error}


def _summ(recs, stats: dict | None = None) -> dict:
    from hpdl.serve import bench

    s = bench.summarize(recs)
    keep = ("requests", "output_throughput", "makespan_s", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms", "mean_tpot_ms", "p99_itl_ms")
    r = {k: s[k] for k in keep if k in s}
    if stats is not None:
        r["prefill_padding_tokens"] = stats["prefill_positions_computed"] - stats["prefill_tokens"]
    return r


def serving(out: Path, device: str) -> None:
    """Poisson arrivals and the offline workloads, on one engine per prefill path."""
    from hpdl.serve import bench
    from hpdl.serve.worker import NAMED_CONFIGS

    vocab = NAMED_CONFIGS[MODEL].vocab_size
    poisson = bench.make_workload(N_POISSON, (PROMPT, PROMPT), OUT_LEN, RATE, vocab_size=vocab, seed=0)
    for mode, budget in PATHS:
        t = time.perf_counter()
        name = _name(mode, budget)
        eng = _engine(device, mode, budget)
        r = eng.executor.runner
        graphs = r.warm_up(prefill_tokens=budget if mode != "padded" else None)
        for n in [1, 2] + OFFLINE:  # every prefill shape below once (cuBLAS heuristics, Triton compiles)
            bench.run_engine(eng, bench.make_workload(n, (PROMPT, PROMPT), (2, 2), math.inf, vocab_size=vocab, seed=9))
        bench.run_engine(eng, bench.make_workload(VARLEN["n"], VARLEN["prompt"], (2, 2), math.inf, vocab_size=vocab,
                                                  seed=0))
        _save(out, f"{name}_setup", {"graphs": graphs, "seconds": time.perf_counter() - t, "fused": r.fused,
                                     "cuda_graph": r.cuda_graph, "budget": budget})
        base = eng.stats()
        recs = bench.run_engine(eng, poisson)
        st = {k: eng.stats()[k] - base[k] for k in ("prefill_tokens", "prefill_positions_computed")}
        _save(out, f"poisson_{name}", _summ(recs, st) | {"rate": RATE,
                                                          "ttft_ms": [round(x.ttft * 1e3, 3) for x in recs]})
        for n in OFFLINE:
            wl = bench.make_workload(n, (PROMPT, PROMPT), OUT_LEN, math.inf, vocab_size=vocab, seed=0)
            _save(out, f"offline{n}_{name}", _summ(bench.run_engine(eng, wl)))
        wl = bench.make_workload(VARLEN["n"], VARLEN["prompt"], VARLEN["out"], math.inf, vocab_size=vocab, seed=0)
        base = eng.stats()
        recs = bench.run_engine(eng, wl)
        st = {k: eng.stats()[k] - base[k] for k in ("prefill_tokens", "prefill_positions_computed")}
        _save(out, f"varlen{VARLEN['n']}_{name}", _summ(recs, st) | {"prompt_tokens": st["prefill_tokens"]})
        RES[f"{name}_final_state"] = {"cuda_graph": r.cuda_graph, "graph_error": r.graph_error,
                                      "prefill": _prefill_state(eng), "steps": dict(eng.num_steps)}
        release_engine(eng)


def long_prompt(out: Path, device: str) -> None:
    """Running requests' inter-token latency while a long prompt is prefilled."""
    from hpdl.serve import bench
    from hpdl.serve.worker import NAMED_CONFIGS

    vocab = NAMED_CONFIGS[LONG_MODEL].vocab_size
    wl = bench.make_workload(LONG["running"], (PROMPT, PROMPT), (LONG["run_out"], LONG["run_out"]), math.inf,
                             vocab_size=vocab, seed=1)
    wl += bench.make_workload(1, (LONG["prompt"], LONG["prompt"]), (LONG["out"], LONG["out"]), math.inf,
                              vocab_size=vocab, seed=2)
    wl[-1].arrival = LONG["arrival"]
    whole = LONG["prompt"] + LONG["slots"]
    for mode, budget in [("padded", whole), ("packed", whole)] + [("chunked", b) for b in LONG["budgets"]]:
        name = _name(mode, budget)
        eng = _engine(device, mode, budget, model=LONG_MODEL, slots=LONG["slots"], max_len=LONG["max_len"])
        bench.run_engine(eng, wl)  # untimed: captures the graphs and compiles what this scenario needs
        recs = bench.run_engine(eng, wl)
        run, lg = recs[:-1], recs[-1]
        # inter-token gaps of the running requests from the long prompt's arrival to its first token (+ one step)
        lo, hi = lg.arrival, lg.token_times[0]
        gaps = [b - a for r in run for a, b in zip(r.token_times, r.token_times[1:]) if b > lo and a < hi + 1e-9]
        all_gaps = [b - a for r in run for a, b in zip(r.token_times, r.token_times[1:])]
        trace = run[0].token_times
        _save(out, f"long_{name}", {
            "long_ttft_ms": lg.ttft * 1e3, "running_max_itl_ms": max(all_gaps) * 1e3,
            "running_p99_itl_ms": _pct(all_gaps, 99) * 1e3, "running_median_itl_ms": _pct(all_gaps, 50) * 1e3,
            "running_itl_during_prefill_ms": {"n": len(gaps), "max": max(gaps, default=0) * 1e3,
                                              "mean": sum(gaps) / max(len(gaps), 1) * 1e3},
            "running_mean_tpot_ms": sum(r.tpot for r in run) / len(run) * 1e3, "budget": budget,
            "steps": dict(eng.num_steps),
            "itl_trace_ms": [round((b - a) * 1e3, 3) for a, b in zip(trace, trace[1:])],
            "trace_t0_s": trace[0], "long_arrival_s": lo})
        release_engine(eng)


def plot(d: Path) -> None:
    import numpy as np

    plt = pyplot()
    res = json.loads((d / "serve_ttft.json").read_text())
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted(k for k in res if k.startswith("poisson_")):
        mode, r = key[len("poisson_"):], res[key]
        if r:
            xs = np.sort(r["ttft_ms"])
            ax[0].plot(xs, np.arange(1, len(xs) + 1) / len(xs),
                       label=f"{mode}: p50 {r['median_ttft_ms']:.1f} ms, p99 {r['p99_ttft_ms']:.1f} ms")
    ax[0].set(xscale="log", xlabel="TTFT (ms)", ylabel="fraction of requests",
              title=f"TTFT, Poisson {res.get('meta', {}).get('rate', RATE)} req/s")
    ax[0].legend(fontsize=8)
    for key in sorted(k for k in res if k.startswith("long_")):
        r = res[key]
        ts = np.cumsum([0] + r["itl_trace_ms"])[1:] / 1e3 + r["trace_t0_s"]
        ax[1].plot(ts, r["itl_trace_ms"], label=f"{key[5:]}: max {r['running_max_itl_ms']:.1f} ms", lw=0.8)
        ax[1].axvline(r["long_arrival_s"], color="k", lw=0.5)
    ax[1].set(yscale="log", xlabel="time (s)", ylabel="inter-token latency (ms)",
              title="a running request while a long prompt arrives")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(d / "serve_ttft.png", dpi=120)
    print(f"wrote {d / 'serve_ttft.png'}")


def table(out: Path) -> None:
    """Two compact side-by-side tables (the harness's): a row per (case, metric), a column per prefill path; then
    the long-prompt case, a row per running-request metric, a column per path."""
    names = [_name(m, b) for m, b in PATHS]
    metrics = [("output throughput", "tok/s", "output_throughput", 0), ("TTFT p50", "ms", "median_ttft_ms", 1),
               ("TTFT p99", "ms", "p99_ttft_ms", 1), ("TPOT p99", "ms", "p99_tpot_ms", 2)]
    cases = [("poisson", metrics)]
    cases += [(f"offline{n}", [metrics[0], metrics[1], metrics[3]]) for n in OFFLINE]
    cases += [(f"varlen{VARLEN['n']}", [metrics[0], metrics[1], ("padding", "tokens", "prefill_padding_tokens", 0)])]
    rows = []
    for case, ms in cases:
        for label, unit, key, nd in ms:
            vals = {n: RES.get(f"{case}_{n}", {}).get(key) for n in names}
            if any(x is not None for x in vals.values()):
                rows.append({"case": case, "metric": f"{label} ({unit})",
                             **{n: None if x is None else f"{x:.{nd}f}" for n, x in vals.items()}})
    cols = [Column("case", "case", fmt=str), Column("metric", "metric", fmt=str)]
    text = [format_table(rows, cols + [Column(n, n, fmt=str) for n in names])] if rows else []
    lnames = ["padded", "packed"] + [f"chunked{b}" for b in LONG["budgets"]]
    lrows = [("long prompt's TTFT (ms)", lambda r: r["long_ttft_ms"]),
             ("ITL max (ms)", lambda r: r["running_max_itl_ms"]), ("ITL p99 (ms)", lambda r: r["running_p99_itl_ms"]),
             ("ITL of a step with prefill, mean (ms)", lambda r: r["running_itl_during_prefill_ms"]["mean"])]
    if any(f"long_{n}" in RES for n in lnames):
        long_rows = [{"metric": label, **{n: get(RES[f"long_{n}"]) for n in lnames if f"long_{n}" in RES}}
                     for label, get in lrows]
        text.append(format_table(long_rows, [Column("metric", "long prompt arriving: running request", fmt=str)]
                                 + [Column(n, n, fmt=".2f") for n in lnames]))
    lines = "\n".join(text).splitlines()
    for k in ("kernel", "packed_prefill", "greedy_float32"):
        if k in RES:
            lines.append(f"{k}: {json.dumps({a: b for a, b in RES[k].items() if not a.startswith('first_diff')})}")
    for k in sorted(k for k in RES if k.endswith("_error")):
        lines.append(f"{k}: {str(RES[k])[-300:]}")
    for line in lines:
        _say(out, line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path, help="only make the PNG from DIR/serve_ttft.json")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check with llama-tiny")
    ap.add_argument("--tiny", action="store_true", help="--smoke's llama-tiny shapes on the device (CUDA when "
                    "present): the quick GPU check")
    ap.add_argument("--parts", default="kernel,serving,long", help="comma list of kernel, serving, long")
    args = ap.parse_args()
    if args.plot:
        return plot(args.plot)
    if args.out is None:
        ap.error("--out DIR is required (or --plot DIR)")
    bad = set(args.parts.split(",")) - {"kernel", "serving", "long"}
    if bad:
        ap.error(f"--parts: unknown {sorted(bad)}; expected a comma list of kernel, serving, long")
    if args.smoke or args.tiny:
        globals().update(SMOKE)
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    _save(args.out, "meta", run_metadata(device=device, versions=("triton",), model=MODEL, dtype=DTYPE, slots=SLOTS,
                                         max_seq_len=MAX_LEN, rate=RATE, requests=N_POISSON, paths=PATHS, long=LONG))
    for part, fn in (("kernel", kernel), ("serving", serving), ("long", long_prompt)):
        if part in args.parts.split(","):
            try:
                fn(args.out, device)
            except Exception:  # noqa: BLE001 - keep the other parts' results
                _save(args.out, f"{part}_error", traceback.format_exc()[-3000:])
    try:
        plot(args.out)
    except Exception:  # noqa: BLE001
        _say(args.out, traceback.format_exc()[-1500:])
    table(args.out)


if __name__ == "__main__":
    main()
