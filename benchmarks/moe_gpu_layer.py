"""One Mixtral-like MoE layer on one GPU: the device engine's grouped expert GEMMs and whole layer, host syncs
counted, and the ExFlow/baseline gain PREDICTED for 8-64 GPUs from these measured times (issue 36's layer goal).

Measured (CUDA events, median of --iters after --warmup, --dtype bfloat16), for hidden 4096, ffn 14336, E = 8,
top-2 (and top-1 for the prediction), T in --tokens tokens on the GPU:

* ``grouped``: :func:`hpdl.moe.grouped.swiglu` over the T*k routed rows (sorted by expert, real router), the
  engine's expert path (``torch._grouped_mm`` on SM90 bf16);
* ``dense``: ONE dense SwiGLU GEMM pair (one expert's weights) over the same T*k rows: the goal is
  grouped <= 1.25 x dense;
* ``loop``: the previous engine's Python loop, one GEMM pair per expert (host-known counts);
* ``layer``: the engine's whole MoE layer as it runs in decode at G = 1 (router, device dispatch plan, packing,
  the Alltoall slot (a copy at G = 1), grouped experts, combine), eager: the goal is layer <= 1.5 x grouped;
* ``layer_graph``: the same layer replayed from a CUDA graph (launch overhead removed);
* ``syncs_layer`` / ``syncs_decode_step``: host syncs counted by ``torch.cuda.set_sync_debug_mode("warn")``
  during one layer call and during every decode step of a 1-layer engine generate (goal 0).

Then, PREDICTED (hpdl.comm.model's ``--machine`` preset, alpha-beta; not calibrated on this machine, which has one
GPU): per layer, baseline = layer (its 8-expert GEMM replaced by the one local expert's) + 2 Alltoalls of the T*k rows; ExFlow (top-1) = layer + one Alltoall of the
``--exflow-cross`` share + the per-layer K/V all-gather, charged after the layer (serial) or beside the layer's
compute, as the engine issues it (overlapped); for 8 GPUs (one NVLink node) and 16-64 (2-8 nodes over the
preset's NICs). Labelled as prediction beside the paper's 2.2x. ``--predict-from run/moe_gpu_layer.json``
recomputes only the prediction from an earlier run's measured rows.

Run (about 2-3 minutes on an H200): ``python3 benchmarks/moe_gpu_layer.py --out $OUT``; ``--smoke`` runs tiny
shapes on the CPU in seconds. Writes ``$OUT/moe_gpu_layer.json``, ``.png`` and ``.log``; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from hpdl.bench.common import run_metadata, utc_now
from hpdl.comm import model as cm
from hpdl.models.gpt_moe import MoEConfig, MoEDecoder
from hpdl.moe import grouped
from hpdl.moe.engine import MoEEngine

PAPER_GAIN = 2.2  # ExFlow (arXiv 2401.08383): up to 2.2x over DeepSpeed-MoE, MoE-16 on 8 GPUs


def timeit(fn, warmup: int, iters: int, cuda: bool) -> float:
    """Median seconds of ``fn()`` (CUDA events on the current stream; wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def count_syncs(fn, cuda: bool) -> int | None:
    """Host syncs CUDA's sync-debug mode reports while ``fn()`` runs (None on CPU)."""
    if not cuda:
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(x.message).lower() for x in w)


class _CountingEngine(MoEEngine):
    """Counts host syncs inside decode forwards and token recording (sync-debug "warn")."""

    decode_syncs = 0

    def _wrap(self, fn, *a, **k):
        if self._phase != 1 or self.device.type != "cuda":
            return fn(*a, **k)
        out = []
        self.decode_syncs += count_syncs(lambda: out.append(fn(*a, **k)), True)
        return out[0]

    def _forward(self, *a, **k):
        return self._wrap(super()._forward, *a, **k)

    def _record_tokens(self, *a, **k):
        return self._wrap(super()._record_tokens, *a, **k)


def build(H, Fd, E, k, dtype, dev, heads, kv_heads):
    cfg = MoEConfig(vocab_size=256, hidden_size=H, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, n_experts=E,
                    top_k=k, expert_size=Fd, norm_topk_prob=k > 1, max_position=64)
    torch.manual_seed(0)
    with torch.device(dev):
        m = MoEDecoder(cfg)
    with torch.no_grad():
        m.layers[0].mlp.gate.weight.normal_(0, 0.02)
        m.layers[0].mlp.w_gate_up.mul_(H ** -0.5 / 0.02)
        m.layers[0].mlp.w_down.mul_(Fd ** -0.5 / 0.02)
    return m.to(dtype).eval()


def layer_rows(m, k, tokens, a, dev, dtype, cuda, log):
    """Every measurement for one top-k model at every token count."""
    eng = _CountingEngine(m, mode="baseline", device=dev, capacity="worst_case")
    blk = eng.net.layers[0]
    wgu, wd = eng.w_gate_up[0], eng.w_down[0]
    H = m.cfg.hidden_size
    rows = []
    for T in tokens:
        g = torch.Generator(device=dev).manual_seed(T)
        h = torch.randn(T, H, device=dev, dtype=dtype, generator=g)
        req = torch.arange(T, device=dev)
        pos = torch.zeros(T, dtype=torch.int64, device=dev)
        valid = torch.ones(T, dtype=torch.bool, device=dev)
        eng._counters = torch.zeros(2, 1, 4, dtype=torch.int64, device=dev)
        eng._phase = 1
        with torch.no_grad():
            x = blk.ln_2(h)
            _, idx, _ = blk.mlp.route(x)
            e = idx.reshape(-1)
            order = torch.sort(e, stable=True).indices
            xs = x.repeat_interleave(k, 0)[order].contiguous()
            cnt = torch.bincount(e, minlength=m.cfg.n_experts)
            offs = cnt.cumsum(0).to(torch.int32)
            counts = cnt.tolist()

            def t_grouped():
                return grouped.swiglu(xs, wgu, wd, offs, eng.grouped_backend)

            def t_dense():
                gate, up = F.linear(xs, wgu[0]).chunk(2, -1)
                return F.linear(F.silu(gate) * up, wd[0])

            def t_loop():
                outs, off = [], 0
                for ex, c in enumerate(counts):
                    if c:
                        gate, up = F.linear(xs[off:off + c], wgu[ex]).chunk(2, -1)
                        outs.append(F.linear(F.silu(gate) * up, wd[ex]))
                    off += c
                return torch.cat(outs)

            def t_layer():
                return eng._moe_combine(0, blk, h, req, pos, valid, T * k)[0]

            r = {"top_k": k, "tokens": T, "rows": T * k, "grouped_backend": eng.grouped_backend,
                 "expert_counts": counts}
            for name, fn in (("grouped", t_grouped), ("dense", t_dense), ("loop", t_loop), ("layer", t_layer)):
                r[f"{name}_us"] = timeit(fn, a.warmup, a.iters, cuda) * 1e6
            r["syncs_layer"] = count_syncs(t_layer, cuda)
            if cuda:
                graph = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    t_layer()  # warm-up on the capture stream
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(graph):
                    t_layer()
                r["layer_graph_us"] = timeit(graph.replay, a.warmup, a.iters, cuda) * 1e6
                del graph
            else:
                r["layer_graph_us"] = None
            # one dense GEMM over the rows does 1/E of the weights' reads: at small T the grouped call is bound by
            # reading all E experts' weights, which no dense comparison can show; report both ratios
            r["grouped_over_dense"] = r["grouped_us"] / r["dense_us"]
            r["layer_over_grouped"] = r["layer_us"] / r["grouped_us"]
            if r["layer_graph_us"]:
                r["layer_graph_over_grouped"] = r["layer_graph_us"] / r["grouped_us"]
        rows.append(r)
        log(f"top-{k} T={T:5d}: grouped {r['grouped_us']:8.0f} us ({r['grouped_over_dense']:.2f}x dense "
            f"{r['dense_us']:.0f}), loop {r['loop_us']:.0f}, layer {r['layer_us']:.0f} "
            f"({r['layer_over_grouped']:.2f}x grouped), graph {r['layer_graph_us'] or float('nan'):.0f}, "
            f"syncs/layer {r['syncs_layer']}")
    return eng, rows


def decode_syncs(m, dev, dtype) -> dict:
    """Host syncs in every decode step of a 1-layer engine generate (G = 1, worst-case capacity)."""
    eng = _CountingEngine(m, mode="baseline", device=dev, capacity="worst_case")
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    eng.generate(prompts, 5)
    return {"decode_steps": 4, "syncs": eng.decode_syncs if dev.type == "cuda" else None}


def predict(rows1, a, machine, kv_bytes_per_token, row_bytes):
    """PREDICTION: per-layer baseline vs ExFlow time for G GPUs from the measured top-1 layer times.

    ExFlow's per-layer K/V all-gather is issued asynchronously on hpdl.comm's side stream right after the layer's
    attention and is needed only by the next decode step, so two bounds are given: ``serial`` charges it after the
    layer (nothing overlaps), ``overlapped`` lets it run beside the layer's compute while sharing the links with
    the Alltoall (link time a2a + gather, compute hidden behind it or it behind compute):
    ``a2a + max(compute, gather)``. The engine measures neither on several GPUs here; both are model outputs.
    ``compute`` is the measured layer (CUDA graph) with its all-8-experts grouped GEMM replaced by the measured
    one-expert dense GEMM over the same rows: at G >= E each GPU holds one expert and receives about T*k rows.
    """
    out = []
    for r in rows1:
        T = r["tokens"]
        compute = ((r["layer_graph_us"] or r["layer_us"]) - r["grouped_us"] + r["dense_us"]) * 1e-6
        for G in (8, 16, 32, 64):
            gpn = min(G, machine.gpus_per_node)
            n = T * row_bytes  # bytes a GPU sends in one dispatch (own share included)
            base = compute + 2 * cm.alltoall_time(machine, "direct", G, n, g=gpn)
            cross = a.exflow_cross
            ex_a2a = cm.alltoall_time(machine, "direct", G, n * cross * G / (G - 1), g=gpn)
            kv = cm.alltoall_time(machine, "direct", G, G * T * kv_bytes_per_token, g=gpn)
            ex = compute + ex_a2a + kv
            ex_overlap = ex_a2a + max(compute, kv)
            out.append({"tokens": T, "gpus": G, "nodes": G // gpn, "predicted_baseline_us": base * 1e6,
                        "predicted_exflow_us": ex * 1e6, "predicted_gain": base / ex,
                        "predicted_exflow_overlapped_us": ex_overlap * 1e6,
                        "predicted_gain_overlapped": base / ex_overlap, "kv_gather_us": kv * 1e6,
                        "saved_a2a_us": (base - compute - ex_a2a) * 1e6, "exflow_cross": cross,
                        "random_cross": 1 - 1 / G})
    return out


def add_prediction(res, a, machine):
    """Fill ``res["prediction"]`` and ``res["machine_model"]`` from ``res["rows"]`` (top-1 rows)."""
    heads, kvh = (32, 8) if res["hidden"] >= 1024 else (4, 2)
    esz = torch.finfo(getattr(torch, res["dtype"])).bits // 8
    kv_bytes = 2 * kvh * (res["hidden"] // heads) * esz
    row_bytes = res["hidden"] * esz + 20  # the residual row plus its packed int32 columns
    res["exflow_cross"] = a.exflow_cross
    res["prediction"] = predict([r for r in res["rows"] if r["top_k"] == 1], a, machine, kv_bytes, row_bytes)
    res["machine_model"] = {"name": machine.name, "source": machine.source,
                            "note": "predicted_* = alpha-beta model (hpdl.comm.model preset), not measured, not "
                                    "calibrated on this machine; *_overlapped: the K/V all-gather beside the "
                                    "layer's compute (it is asynchronous in the engine), the other: after it"}
    res["paper_gain"] = PAPER_GAIN


def log_prediction(res, log):
    log("PREDICTED ExFlow/baseline layer gain, serial / overlapped K/V all-gather (" + res["machine_model"]["name"]
        + " preset, cross " + str(res["exflow_cross"]) + "; higher is better for ExFlow):")
    for G in (8, 16, 32, 64):
        p = [x for x in res["prediction"] if x["gpus"] == G]
        log(f"  {G:>2} GPUs: " + ", ".join(f"T={x['tokens']}: {x['predicted_gain']:.2f}/"
                                          f"{x['predicted_gain_overlapped']:.2f}x" for x in p)
            + f"  (paper {PAPER_GAIN}x)")


def plot(res, path):
    from hpdl.bench.common import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    rows = [r for r in res["rows"] if r["top_k"] == res["top_k"]]
    T = [r["tokens"] for r in rows]
    for key, st in (("dense_us", "k--"), ("grouped_us", "o-"), ("loop_us", "s:"), ("layer_us", "^-"),
                    ("layer_graph_us", "v-")):
        if rows and rows[0].get(key) is not None:
            ax[0].plot(T, [r[key] for r in rows], st, label=key[:-3])
    ax[0].set(xscale="log", yscale="log", xlabel="tokens on the GPU", ylabel="us (median, CUDA events)",
              title=f"one MoE layer, H={res['hidden']}, F={res['ffn']}, E={res['experts']}, top-{res['top_k']}")
    ax[0].legend(fontsize=8)
    for G in (8, 16, 32, 64):
        p = [x for x in res["prediction"] if x["gpus"] == G]
        line, = ax[1].plot([x["tokens"] for x in p], [x["predicted_gain_overlapped"] for x in p], "o-",
                           label=f"{G} GPUs, K/V gather overlapped")
        ax[1].plot([x["tokens"] for x in p], [x["predicted_gain"] for x in p], "x:", color=line.get_color(),
                   label=f"{G} GPUs, serial")
    ax[1].axhline(PAPER_GAIN, color="gray", ls="--", label="paper 2.2x")
    ax[1].set(xscale="log", xlabel="tokens per GPU", ylabel="baseline / ExFlow layer time (higher: ExFlow faster)",
              title=f"PREDICTION ({res['machine_model']['name']} preset, cross {res['exflow_cross']})")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def repredict(a) -> int:
    """``--predict-from``: the measured rows kept, the prediction made again (e.g. after a model change)."""
    res = json.loads(Path(a.predict_from).read_text())
    add_prediction(res, a, cm.PRESETS[a.machine])
    res["predicted_from"] = {"file": Path(a.predict_from).name, "measured": res.get("date"),
                             "predicted": utc_now()}
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "moe_gpu_layer.json").write_text(json.dumps(res, indent=1))
    try:
        plot(res, out_dir / "moe_gpu_layer.png")
    except ImportError as e:
        print(f"no plot ({e})")
    log_prediction(res, print)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="16,64,256,1024,4096")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--machine", default="h100-ndr", choices=sorted(cm.PRESETS))
    ap.add_argument("--exflow-cross", type=float, default=0.5, help="ExFlow's cross-GPU token share (the held-out "
                    "share `hpdl moe place` printed; 1 - 1/G for a random placement)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU allowed, seconds")
    ap.add_argument("--predict-from", metavar="JSON", help="no measurement: recompute the prediction (and the "
                    "plot) from the measured rows of an earlier run's moe_gpu_layer.json, into --out")
    ap.add_argument("--out", default=".", help="directory for moe_gpu_layer.{json,png,log}")
    a = ap.parse_args(argv)
    if a.predict_from:
        return repredict(a)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if a.smoke:
        a.hidden, a.ffn, a.warmup, a.iters = 64, 128, 1, 3
        if a.tokens == ap.get_default("tokens"):
            a.tokens = "16,64"
    elif not cuda:
        print("no CUDA device: use --smoke for a CPU check", file=sys.stderr)
        return 2
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    logf = open(out_dir / "moe_gpu_layer.log", "w")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    dtype = getattr(torch, a.dtype)
    tokens = [int(x) for x in a.tokens.split(",")]
    heads, kvh = (32, 8) if a.hidden >= 1024 else (4, 2)
    t0 = time.time()
    res = run_metadata(device="cuda" if cuda else "cpu", dtype=a.dtype, hidden=a.hidden, ffn=a.ffn,
                       experts=a.experts, top_k=a.top_k, exflow_cross=a.exflow_cross, rows=[])
    for k in sorted({a.top_k, 1}, reverse=True):
        m = build(a.hidden, a.ffn, a.experts, k, dtype, dev, heads, kvh)
        eng, rows = layer_rows(m, k, tokens, a, dev, dtype, cuda, log)
        res["rows"] += rows
        if k == a.top_k:
            res["decode"] = decode_syncs(m, dev, dtype)
            log(f"decode: {res['decode']['syncs']} host syncs in {res['decode']['decode_steps']} decode steps")
        del eng, m
        if cuda:
            torch.cuda.empty_cache()
        log(f"[{time.time() - t0:.0f}s] top-{k} done")
    add_prediction(res, a, cm.PRESETS[a.machine])
    (out_dir / "moe_gpu_layer.json").write_text(json.dumps(res, indent=1))
    try:
        plot(res, out_dir / "moe_gpu_layer.png")
    except ImportError as e:
        log(f"no plot ({e})")
    log(f"\n{'k':>2} {'T':>5} {'grouped us':>10} {'dense us':>9} {'g/d':>5} {'layer us':>9} {'l/g':>5} "
        f"{'graph us':>9} {'loop us':>8} {'syncs':>5}")
    for r in res["rows"]:
        log(f"{r['top_k']:>2} {r['tokens']:>5} {r['grouped_us']:10.0f} {r['dense_us']:9.0f} "
            f"{r['grouped_over_dense']:5.2f} {r['layer_us']:9.0f} {r['layer_over_grouped']:5.2f} "
            f"{r['layer_graph_us'] or float('nan'):9.0f} {r['loop_us']:8.0f} {str(r['syncs_layer']):>5}")
    log(f"decode-step host syncs: {res['decode']['syncs']} over {res['decode']['decode_steps']} steps")
    log_prediction(res, log)
    log(f"-> {out_dir}/moe_gpu_layer.{{json,png,log}} in {time.time() - t0:.0f}s")
    logf.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
