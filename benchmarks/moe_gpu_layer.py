"""1 x GPU timing of one MoE layer's kernels, to predict the communication share of expert parallelism.

For GPT-MoE / Mixtral-like shapes, E in {8, 16, 32} and tokens per GPU T, this times on one GPU (CUDA events,
median of --iters after --warmup), in --dtype (default bfloat16):

* ``route``: router GEMM [T, H] x [H, E] + fp32 softmax + top-k (hpdl.models.gpt_moe.route),
* ``plan``: the dispatch planner (stable sort by destination rank, bincount) and the payload gather,
* ``experts_G``: the expert compute one of G expert-parallel GPUs does when T*G tokens are routed over E experts
  uniformly (T*k rows on its E/G local experts; the engine's loop of per-expert SwiGLU GEMMs),
* ``combine``: the inverse permutation and top-k weighted sum.

Then, with hpdl.comm.model's alpha-beta preset (``--machine``, a PREDICTION, labelled so), one Alltoall of the
layer's dispatch payload (T*k rows of H elements, a (1 - 1/G) share leaving the GPU) is predicted for G GPUs,
and the communication share of a layer is reported for the baseline (2 Alltoalls) and for ExFlow (1 Alltoall of
``--exflow-cross`` of the tokens, e.g. the held-out share `hpdl moe place` printed).

Run: ``python3 benchmarks/moe_gpu_layer.py --out $OUT/moe_gpu_layer.json`` (about 1-2 minutes on an H200).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hpdl.comm import model as cm
from hpdl.models.gpt_moe import route
from hpdl.moe import dispatch

SHAPES = {"gpt-moe-1.3b": (2048, 8192), "gpt-moe-350m": (1024, 4096), "mixtral-8x7b": (4096, 14336)}


def timeit(fn, warmup: int, iters: int) -> float:
    """Median seconds of ``fn()`` on the current CUDA stream (CPU wall clock without CUDA)."""
    for _ in range(warmup):
        fn()
    out = []
    cuda = torch.cuda.is_available()
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


def layer_case(H, Fdim, E, k, T, G, dtype, dev, warmup, iters, machine, exflow_cross):
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=dtype, generator=g)
    wr = torch.randn(E, H, device=dev, dtype=dtype, generator=g) * H ** -0.5
    wgu = torch.randn(E // G, 2 * Fdim, H, device=dev, dtype=dtype, generator=g) * H ** -0.5
    wd = torch.randn(E // G, H, Fdim, device=dev, dtype=dtype, generator=g) * Fdim ** -0.5
    ranks = torch.arange(E, device=dev) // (E // G)
    idx, w = route(F.linear(x, wr), k, k > 1)
    dest = ranks[idx.reshape(-1)]
    p = dispatch.plan(dest, G)
    xr = x.repeat_interleave(k, 0)

    def t_route():
        route(F.linear(x, wr), k, k > 1)

    def t_plan():
        pl = dispatch.plan(ranks[idx.reshape(-1)], G)
        xr.index_select(0, pl.order)

    rows = T * k  # rows this GPU computes in a balanced layer (T tokens per GPU arrive, k copies each)
    loc = torch.randint(0, E // G, (rows,), device=dev, generator=g)
    xin = torch.randn(rows, H, device=dev, dtype=dtype, generator=g)
    counts = torch.bincount(loc, minlength=E // G).tolist()
    order = torch.sort(loc, stable=True).indices
    xs = xin[order]

    def t_experts():
        outs, off = [], 0
        for e, c in enumerate(counts):
            if c:
                gate, up = F.linear(xs[off:off + c], wgu[e]).chunk(2, -1)
                outs.append(F.linear(F.silu(gate) * up, wd[e]))
            off += c
        return torch.cat(outs)

    y = t_experts()
    inv = dispatch.inverse(p.order)
    yback = torch.randn(T * k, H, device=dev, dtype=dtype, generator=g)

    def t_combine():
        (yback[inv].view(T, k, H) * w[..., None].to(dtype)).sum(1)

    res = {"hidden": H, "ffn": Fdim, "experts": E, "top_k": k, "tokens_per_gpu": T, "gpus": G}
    for name, fn in (("route", t_route), ("plan", t_plan), ("experts", t_experts), ("combine", t_combine)):
        res[f"{name}_us"] = timeit(fn, warmup, iters) * 1e6
    del y
    compute = sum(res[f"{n}_us"] for n in ("route", "plan", "experts", "combine")) * 1e-6
    payload = T * k * H * torch.finfo(dtype).bits // 8  # bytes a GPU sends per dispatch, own share included
    a2a = cm.alltoall_time(machine, "direct", G, payload, g=min(G, machine.gpus_per_node))
    a2a_ex = cm.alltoall_time(machine, "direct", G, payload * exflow_cross / (1 - 1 / G), g=min(G, machine.gpus_per_node))
    res.update(predicted_a2a_us=a2a * 1e6, predicted_exflow_a2a_us=a2a_ex * 1e6, payload_bytes=payload,
               predicted_comm_share_baseline=2 * a2a / (2 * a2a + compute),
               predicted_comm_share_exflow=a2a_ex / (a2a_ex + compute),
               predicted_layer_speedup=(2 * a2a + compute) / (a2a_ex + compute))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="gpt-moe-350m,gpt-moe-1.3b,mixtral-8x7b")
    ap.add_argument("--experts", default="8,16,32")
    ap.add_argument("--tokens", default="16,64,256,1024,4096", help="tokens per GPU per layer")
    ap.add_argument("--gpus", default="4,8", help="expert-parallel GPU counts to predict for")
    ap.add_argument("--top-k", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--machine", default="h100-ndr", choices=sorted(cm.PRESETS))
    ap.add_argument("--exflow-cross", type=float, default=0.5, help="ExFlow's cross-GPU token share (measured "
                    "held-out share of the placement; 1 - 1/G for a random one)")
    ap.add_argument("--out", default="moe_gpu_layer.json")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    machine = cm.PRESETS[a.machine]
    rows = []
    t0 = time.time()
    with torch.no_grad():
        for shape in a.shapes.split(","):
            H, Fd = SHAPES[shape]
            for E in map(int, a.experts.split(",")):
                for G in map(int, a.gpus.split(",")):
                    if E % G:
                        continue
                    for T in map(int, a.tokens.split(",")):
                        r = layer_case(H, Fd, E, a.top_k, T, G, dtype, dev, a.warmup, a.iters, machine, a.exflow_cross)
                        r["shape"] = shape
                        rows.append(r)
                        print(f"[{time.time() - t0:5.0f}s] {shape} E={E} G={G} T={T}: route {r['route_us']:.0f} us, "
                              f"plan {r['plan_us']:.0f}, experts {r['experts_us']:.0f}, combine {r['combine_us']:.0f}; "
                              f"PREDICTED a2a {r['predicted_a2a_us']:.0f} us, comm share baseline "
                              f"{r['predicted_comm_share_baseline']:.2f} / exflow {r['predicted_comm_share_exflow']:.2f}",
                              flush=True)
    out = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor(),
           "torch": torch.__version__, "dtype": a.dtype, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine_model": {"name": machine.name, "source": machine.source, "note": "predicted_* = alpha-beta "
                             "model (hpdl.comm.model), not measured"},
           "exflow_cross": a.exflow_cross, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"-> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
