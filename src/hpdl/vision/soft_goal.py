"""``hpdl bench attention --suite goal``: issue 34's goal table for SOFT, side by side, in one run.

    NCCL_NVLS_ENABLE=0 hpdl bench attention --device cuda --suite goal --time-budget 200 --out $OUT/soft
    hpdl bench attention --suite goal --smoke --out /tmp/x          # CPU: tiny shapes, a check of the code

1. ``check``: the Triton kernels (:mod:`hpdl.models.soft_kernels`) against their torch references on the device,
   before anything is timed: landmark products and gradients, the Newton inverse (fused and tiled, both starts,
   early exit on, the steps it ran in the case column) against the official 20-step iteration (float64 torch) on
   random and on ill-conditioned (clustered) landmark sets, and ``soft_attention`` Triton vs torch forward and
   backward. A failure on random inputs stops the run (exit 1). Then the layer's training step captured in a
   CUDA graph (child process; a failure reports its stage and innermost frames, not fatal).
2. ``layer``: one SOFT attention layer (dim 384, 6 heads, sr_ratio 8: m = N/64 landmarks, ``SoftAttention``
   defaults otherwise) forward+backward under bf16 autocast, batch 1, at 4k/16k/33k/65k tokens (64x64, 128x128,
   128x256, 256x256 maps), against the same layer with flash SDPA (``attention="sdpa"``, flash required): median
   ms and peak MiB above the inputs. ``soft`` is the default (Newton stops on the device once converged; the
   ``steps`` column: steps it ran), ``soft_newton20`` all 20 steps (``nr_tol=0``, the previous default).
3. ``models``: soft_tiny vs timm pvt_v2_b1 and soft_small vs pvt_v2_b2 (random init), 224 px, bf16 autocast,
   channels_last; training (batch 128: forward, backward, no optimizer) and inference (batch 256) images/s,
   eager and compiled (:func:`compile_blocks`: every transformer block, both models alike; compiled runs last,
   pair by pair, each started only with ``COMPILE_MARGIN_S`` of ``--time-budget`` left; skipped ones say so).
   ``--goal-parts`` picks from ``layer,eager,compiled`` (the check always runs first).

Writes ``soft_goal.json``, ``soft_goal.png`` and ``soft_goal.txt`` (the tables) to ``--out``; prints the tables.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hpdl.models import soft_kernels as sk
from hpdl.models.soft_ops import gaussian_kernel, newton_pinv, soft_attention

PAIRS = (("soft_tiny", "pvt_v2_b1"), ("soft_small", "pvt_v2_b2"))
PAIRS_BY_NAME = (("tiny", PAIRS[0]), ("small", PAIRS[1]))  # --goal-pairs names


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _clustered(bh, m, d, spread, g, device):
    if spread >= 1:
        return torch.randn(bh, m, d, generator=g, device=device) * d ** -0.25
    centres = torch.randn(bh, 2, d, generator=g, device=device) * d ** -0.25
    return centres[:, torch.arange(m, device=device) % 2] + spread * torch.randn(bh, m, d, generator=g, device=device)


# ------------------------------------------------------------------------------------------------------ check

def run_check(device, smoke: bool) -> list[dict]:
    """Kernel vs reference rows: name, case, relative error, tolerance, ok, gate (a failing gate stops timing)."""
    rows = []

    def add(name, case, err, tol, gate=True):
        rows.append({"check": name, "case": case, "rel_err": err, "tol": tol, "ok": err <= tol, "gate": gate})

    g = torch.Generator(device=device).manual_seed(0)
    shapes = ((1, 128, 20, 16), (1, 130, 70, 32)) if smoke else ((6, 4096, 64, 64), (6, 2048, 256, 64))
    for k, (bh, n, m, d) in enumerate(shapes):
        q = torch.randn(bh, n, d, generator=g, device=device) * d ** -0.25
        lm = q.reshape(bh, m, -1, d)[:, :, 0] if n % m == 0 else q[:, :m]
        x, a = torch.randn(bh, n, d, generator=g, device=device), torch.randn(bh, n, d, generator=g, device=device)
        y, b = torch.randn(bh, m, d, generator=g, device=device), torch.randn(bh, m, d, generator=g, device=device)
        ref_r = sk.landmark_rows_ref(q.double(), lm.double(), y.double(), a.double(), b.double())
        ref_c = sk.landmark_cols_ref(q.double(), lm.double(), x.double(), a.double(), b.double())
        for prec, tol in ((("ieee", 1e-5), ("tf32", 2e-2)) if k == 0 else (("tf32", 2e-2),)):
            got_r, got_c = sk.landmark_rows(q, lm, y, a, b, prec), sk.landmark_cols(q, lm, x, a, b, prec)
            case = f"N={n} m={m} d={d} {prec}"
            add("rows P@y", case, _rel(got_r[0], ref_r[0]), tol)
            add("rows dq", case, _rel(got_r[1], ref_r[1]), tol)
            add("cols P^T@x", case, _rel(got_c[0], ref_c[0]), tol)
            add("cols dl", case, _rel(got_c[1], ref_c[1]), tol)
    for m in ((12, 70) if smoke else (49, 64, 256, 1024)):
        for spread, label in ((1.0, "random"), (0.05, "clustered")):
            lmk = _clustered(2 if smoke else 4, m, 32, spread, g, device)
            a = gaussian_kernel(lmk, lmk)
            cond = torch.linalg.cond(a.double()[0] + 0.01 * torch.eye(m, device=device, dtype=torch.float64)).item()
            for start in ("official", "identity"):
                ref = newton_pinv(a.double(), 20, 0.01, 1.8, start=start)   # the official iteration (torch, fp64)
                for prec in ((None,) if m <= sk.FUSED_MAX_M else (None, "tf32")):
                    # early exit on (the default): the steps each matrix ran are in the case column
                    got, steps = sk.newton_inverse(a, 20, 0.01, 1.8, start, prec, return_steps=True)
                    path = "fused fp32" if m <= sk.FUSED_MAX_M else f"tiled {prec or 'tf32x3'}+2 fp32"
                    add(f"newton {start}", f"m={m} {label} cond={cond:.1e} {path} steps {int(steps.max())}",
                        _rel(got, ref), 1e-3, gate=label == "random")
            exact = torch.linalg.inv(a.double() + 0.01 * torch.eye(m, device=device, dtype=torch.float64))
            add("newton identity vs exact inverse", f"m={m} {label}", _rel(sk.newton_inverse(a, 20), exact), 1e-3,
                gate=False)
            add("newton official vs exact inverse", f"m={m} {label}",
                _rel(sk.newton_inverse(a, 20, start="official"), exact), 1e-3, gate=False)
    # the whole attention: Triton vs torch (both float32, same start and backward)
    b_, h, n, d, m = (1, 2, 256, 16, 16) if smoke else (1, 6, 4096, 64, 64)
    q = (torch.randn(b_, h, n, d, generator=g, device=device) * d ** -0.25).requires_grad_()
    v = torch.randn(b_, h, n, d, generator=g, device=device).requires_grad_()
    # every (n/m)-th token as a landmark: spread like the model's conv+LayerNorm landmarks at random init
    # (cond ~2-4); segment means would crowd near the origin (cond ~m/reg), a Newton-convergence test instead
    lm = q.detach()[:, :, :: n // m].clone().requires_grad_()
    up = torch.randn(b_, h, n, d, generator=g, device=device)
    res = {}
    for impl in ("torch", "triton"):
        out = soft_attention(q, v, lm, impl=impl if sk.available(q) or impl == "torch" else "torch")
        res[impl] = (out, *torch.autograd.grad((out * up).sum(), (q, v, lm)))
    for i, name in enumerate(("out", "dq", "dv", "dlandmarks")):
        add(f"soft_attention {name}", f"N={n} m={m} d={d} triton vs torch", _rel(res["triton"][i], res["torch"][i]),
            2e-2)
    # the layer's layout: bf16 q and v as head views of [B, N, H*d] projections (read in their strides, q centred
    # on chip, dq stored in bf16) against the torch path on the same bf16 inputs
    qb, vb = (t.detach().bfloat16().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, v))
    lb = lm.detach().bfloat16().requires_grad_()
    res = {}
    for impl in ("torch", "triton"):
        out = soft_attention(qb, vb, lb, impl=impl if sk.available(q) or impl == "torch" else "torch")
        res[impl] = (out, *torch.autograd.grad((out.float() * up).sum(), (qb, vb, lb)))
    for i, name in enumerate(("out", "dq", "dv", "dlandmarks")):
        add(f"soft_attention bf16 views {name}", f"N={n} m={m} d={d} triton vs torch",
            _rel(res["triton"][i], res["torch"][i]), 3e-2)
    # identity start vs the official iteration at the output, random init (the numerics goal)
    with torch.no_grad():
        o_id = soft_attention(q, v, lm, impl="torch", start="identity")
        o_off = soft_attention(q, v, lm, impl="torch", start="official")
    add("output identity vs official start", f"N={n} m={m} random init", _rel(o_id, o_off), 1e-3)
    if device.type == "cuda":  # the layer (Triton path) captured in a CUDA graph, forward and backward
        # in child processes: a capture that fails part-way leaves the process's CUDA generator inside a capture
        # ("Offset increment outside graph capture" at the next random op), which would end the run. First the
        # whole training step (forward + backward) in one graph, as PyTorch's whole-network recipe; if that
        # fails, the same with thread-local capture errors (the backward runs on autograd's device thread)
        import subprocess
        import sys

        for mode in ("global", "thread_local"):
            try:
                done = subprocess.run([sys.executable, "-c", _GRAPH_CHECK, mode], capture_output=True, text=True,
                                      timeout=60)
                got = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
                    "error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1]}
            except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
                got = {"error": type(e).__name__}
            if "rel_err" in got:
                add("CUDA graph capture of the layer", f"fwd+bwd step, {mode} capture: out, dx vs eager",
                    got["rel_err"], 1e-5, gate=False)
                break
            # reported, not fatal (timing does not use graphs); where = the innermost frames of the failure
            rows.append({"check": "CUDA graph capture of the layer", "case": f"{mode}: {got.get('error', '?')}"[:80],
                         "rel_err": float("inf"), "tol": 1e-5, "ok": False, "gate": False,
                         "detail": got})
    return rows


_GRAPH_CHECK = """
import json, sys, traceback, torch
from hpdl.models.soft import SoftAttention
mode = sys.argv[1]
def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
stage = "setup"
try:
    torch.manual_seed(0)
    layer = SoftAttention(384, 6, 8).cuda()
    x = torch.randn(1, 4096, 384, device="cuda", requires_grad=True)
    up = torch.randn(1, 4096, 384, device="cuda")
    def step():
        x.grad = None
        out = layer(x, 64, 64)
        out.backward(up)
        return out
    ref = step().detach().clone()
    gref = x.grad.clone()
    stage = "host syncs (set_sync_debug_mode error)"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    step()
    torch.cuda.set_sync_debug_mode(0)
    stage = "warm-up on a side stream"
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    stage = "capture"
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode=mode):
        out = step()
    stage = "replay"
    x.grad.zero_()
    g.replay()
    torch.cuda.synchronize()
    print(json.dumps({"rel_err": max(rel(out, ref), rel(x.grad, gref))}))
except Exception as e:
    torch.cuda.set_sync_debug_mode(0)
    frames = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)]
    print(json.dumps({"error": f"{stage}: {type(e).__name__}: {str(e)[:160]}", "where": frames[-6:]}))
"""


# ------------------------------------------------------------------------------------------------------ layer

def _timed(fn, device, warmup, reps):
    from hpdl.vision.timing import measure

    return measure(fn, device, warmup, reps)


def graphed(step, device, warmup: int, reps: int) -> dict:
    """``step`` (a whole forward+backward) captured once in a CUDA graph, then its replay timed as
    :func:`hpdl.vision.bench.measure` times eager calls (CUDA events, median of ``reps`` after ``warmup``): what a
    user of CUDA graphs or ``torch.compile(mode="reduce-overhead")`` sees, with the host's launch cost gone.
    Warm-up before the capture on a side stream (PyTorch's recipe); the inputs and every tensor the step creates
    (activations, gradients) live in the graph's pool, replays overwrite them in place. Returns ``ms``,
    ``ms_min`` and ``graph_mib`` (the most the allocator held above its start during the capture: the graph's
    working memory, the peak of the replay). Raises whatever the capture raises (the caller reports it)."""
    from hpdl.vision.timing import measure

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    torch.cuda.synchronize(device)
    mib = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    m = measure(g.replay, device, warmup, reps)
    del g
    return {"ms": m["ms"], "ms_min": m["ms_min"], "graph_mib": mib}


GRAPHED = ("soft", "sdpa_flash")  # the layer variants also timed as one CUDA graph (the default SOFT and SDPA)


def run_layer(device, smoke: bool, warmup: int, reps: int, graphs: bool | None = None) -> list[dict]:
    from hpdl.models.soft import SoftAttention
    from hpdl.vision.timing import _sdpa_context

    dim, heads, sr = (32, 2, 4) if smoke else (384, 6, 8)
    maps = ((16, 16), (32, 32)) if smoke else ((64, 64), (128, 128), (128, 256), (256, 256))
    # on CPU the Triton kernels would run interpreted (slow; the check above covers them): torch there
    impl = "auto" if device.type == "cuda" else "torch"
    # soft: the default (Newton stops on the device once converged); soft_newton20: every one of the 20 steps
    # (nr_tol=0, the previous default), to show what the early exit buys in the same run
    variants = {"soft": dict(impl=impl), "soft_newton20": dict(impl=impl, nr_tol=0.0),
                "sdpa_flash": dict(attention="sdpa")}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ctx, _ = _sdpa_context(device, dtype)
    graphs = device.type == "cuda" if graphs is None else graphs
    graph_error = None   # after a failed capture the process's CUDA state is suspect: no more captures
    rows = []
    for H, W in maps:
        n = H * W
        for name, kw in variants.items():
            torch.manual_seed(0)
            layer = SoftAttention(dim, heads, sr, **kw).to(device)
            x = torch.randn(1, n, dim, device=device, requires_grad=True)
            grad = torch.randn(1, n, dim, device=device)

            def step():
                x.grad = None
                for p in layer.parameters():
                    p.grad = None
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32), ctx():
                    out = layer(x, H, W)
                out.backward(grad)

            row = {"tokens": n, "map": f"{H}x{W}", "method": name,
                   "landmarks": (H // sr) * (W // sr) if name != "sdpa_flash" else None}
            try:
                m = _timed(step, device, warmup, reps)
                rows.append({**row, "status": "ok", "fwd_bwd_ms": m["ms"], "peak_mib": m["peak_mib"]})
                if graphs and name in GRAPHED:
                    if graph_error is None:
                        try:
                            gm = graphed(step, device, warmup, reps)
                            rows[-1].update(graph_ms=gm["ms"], graph_mib=gm["graph_mib"])
                        except Exception as e:  # noqa: BLE001 - reported; the eager rows stand
                            graph_error = f"{type(e).__name__}: {str(e)[:160]}"
                            rows[-1]["graph_error"] = graph_error
                    else:
                        rows[-1]["graph_error"] = "skipped after an earlier capture failed"
                # diagnostics: never fatal to the timed rows
                try:
                    rows[-1]["nr_steps"] = _newton_steps(layer, x, H, W, dtype)
                    if device.type == "cuda" and name == "soft" and n <= 16384:  # where it is launch-bound
                        rows[-1]["profile"] = profile_step(step)
                except Exception as e:  # noqa: BLE001 - reported in the JSON
                    rows[-1]["diagnostics_error"] = f"{type(e).__name__}: {str(e)[:160]}"
            except torch.cuda.OutOfMemoryError:
                rows.append({**row, "status": "oom"})
            layer = x = grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def profile_step(step, calls: int = 3, top: int = 8) -> dict:
    """Where one call of ``step`` goes on CUDA (torch.profiler, ``calls`` calls after the timed ones): host
    milliseconds to issue it, device milliseconds of its kernels (summed), kernels launched, and the ``top``
    kernels by device time. Host >= device means launch-bound. Times are under the profiler (a little slower)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        host = time.perf_counter() - t0
        sync()
    per = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            t = getattr(e, "device_time", None)
            t = e.cuda_time if t is None else t
            k = per.setdefault(e.name[:60], [0.0, 0])
            k[0] += t / 1e3 / calls
            k[1] += 1
    ranked = sorted(per.items(), key=lambda kv: -kv[1][0])
    # where the host's time goes: operators by self CPU time (ms per step), the issue cost of each kind of call
    host_ops = sorted(((a.key, a.self_cpu_time_total / 1e3 / calls, a.count // calls)
                       for a in prof.key_averages()), key=lambda t: -t[1])
    return {"host_ms": host * 1e3 / calls, "device_ms": sum(v[0] for v in per.values()),
            "kernels": sum(v[1] for v in per.values()) // calls,
            "top": [{"kernel": k, "ms": v[0], "count": v[1] // calls} for k, v in ranked[:top]],
            "host_top": [{"op": k[:60], "ms": ms, "count": c} for k, ms, c in host_ops[:top]]}


def _newton_steps(layer, x, H, W, dtype) -> int | None:
    """Most Newton steps any head of this layer's landmark kernel runs (Triton path only; None otherwise)."""
    if layer.attention != "soft" or not sk.available(x) or layer.impl == "torch":
        return None
    b, n, c = x.shape
    h, d = layer.num_heads, layer.head_dim
    with torch.no_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        q = layer.W_q(x).view(b, n, h, d).transpose(1, 2) * d ** -0.25
        lm = layer.landmarks(q, H, W).float()
    _, lc = sk.centre(lm[..., :1, :].flatten(0, 1), lm.flatten(0, 1))   # as soft_core builds A
    a = gaussian_kernel(lc, lc)
    _, steps = sk.newton_inverse(a.contiguous(), layer.nr_iters,
                                 layer.nr_reg, 1.8, "identity", layer.nr_precision,
                                 tol=sk.NR_TOL if layer.nr_tol is None else layer.nr_tol, return_steps=True)
    return int(steps.max())


# ----------------------------------------------------------------------------------------------------- models

def _model(name: str, device):
    if name.startswith("soft_"):
        from hpdl.models.soft import create

        return create(name, impl="auto" if device.type == "cuda" else "torch").to(device)
    import timm

    return timm.create_model(name, pretrained=False).to(device)


COMPILE_MARGIN_S = 40.0  # a compiled model (per-block compile, train + inference graphs) starts only this early


def compile_blocks(model: torch.nn.Module, **compile_kwargs) -> int:
    """Regional compilation (PyTorch's recipe for cold-start time): ``torch.compile`` every transformer block
    in place (modules whose class name ends in ``Block``: SOFT's ``SoftBlock``/``Block``, timm PVTv2's ``Block``)
    instead of the whole model; identical blocks share one compiled graph, so the compile time grows with the
    number of stages, not the depth. ``compile_kwargs`` go to ``torch.compile``. Returns the number of blocks
    compiled."""
    blocks = [m for m in model.modules() if type(m).__name__.endswith("Block")]
    for m in blocks:
        m.compile(**compile_kwargs)
    return len(blocks)


def run_models(device, smoke: bool, warmup: int, reps: int, modes, budget_end: float, pairs=PAIRS) -> list[dict]:
    """Images/s of each model of ``pairs`` (SOFT, PVTv2), mode by mode in the order of ``modes`` (``"compiled"``
    first puts the compiled pairs before the eager ones: the budget then skips eager rows, not compiled ones)."""
    size = 64 if smoke else 224
    tb, ib = (2, 2) if smoke else (128, 256)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    names = [n for pair in pairs for n in pair]
    if "compiled" in modes:  # blocks of 4 stages x train/eval each recompile once: room for all of them
        import torch._dynamo.config as dcfg

        for key in ("cache_size_limit", "recompile_limit"):
            if hasattr(dcfg, key):
                setattr(dcfg, key, max(getattr(dcfg, key), 64))
    for mode in modes:
        for name in names:
            row = {"model": name, "mode": mode, "image_size": size, "train_batch": tb, "infer_batch": ib}
            # a compile takes half a minute or so: start one only with COMPILE_MARGIN_S of budget left (eager: 10 s)
            margin = 0 if smoke else COMPILE_MARGIN_S if mode == "compiled" else 10
            if time.perf_counter() > budget_end - margin:
                rows.append({**row, "status": "skipped", "why": "--time-budget spent"})
                continue
            t0 = time.perf_counter()
            try:
                torch.manual_seed(0)
                model = _model(name, device).to(memory_format=torch.channels_last)
                row["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
                fn = model
                if mode == "compiled":
                    torch._dynamo.reset()
                    row["compiled_blocks"] = compile_blocks(model, dynamic=False)  # one graph per stage
                xt = torch.randn(tb, 3, size, size, device=device).to(memory_format=torch.channels_last)
                xi = torch.randn(ib, 3, size, size, device=device).to(memory_format=torch.channels_last)

                def train():
                    for p in model.parameters():
                        p.grad = None
                    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                        loss = fn(xt).float().logsumexp(-1).mean()
                    loss.backward()

                def infer():
                    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                        fn(xi)

                model.train()
                mt = _timed(train, device, warmup, reps)
                model.eval()
                mi = _timed(infer, device, warmup, reps)
                rows.append({**row, "status": "ok", "train_images_per_s": tb / mt["ms"] * 1e3,
                             "infer_images_per_s": ib / mi["ms"] * 1e3, "train_peak_mib": mt["peak_mib"],
                             "seconds": time.perf_counter() - t0})
            except torch.cuda.OutOfMemoryError:
                rows.append({**row, "status": "oom"})
            except Exception as e:  # a compile failure is reported, not fatal: the eager rows stand
                rows.append({**row, "status": "error", "why": f"{type(e).__name__}: {str(e)[:200]}"})
            finally:
                model = fn = xt = xi = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


# -------------------------------------------------------------------------------------------------- reporting

def _f(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def format_goal(result: dict) -> str:
    lines = []
    if result.get("check"):
        bad = [r for r in result["check"] if not r["ok"]]
        lines.append(f"# kernel check on {result['meta']['device_name']}: {len(result['check']) - len(bad)}/"
                     f"{len(result['check'])} within tolerance (FAIL stops the run; warn: a known numerical limit, "
                     f"e.g. the official start's 20 steps on ill-conditioned landmarks)")
        for r in result["check"]:
            lines.append(f"{'ok  ' if r['ok'] else ('FAIL' if r['gate'] else 'warn')} {r['check']:<34} "
                         f"{r['case']:<48} rel {r['rel_err']:.2e} (tol {r['tol']:.0e})")
            if r.get("detail"):
                lines.append(f"     {r['detail'].get('error', '')}")
                lines.extend(f"     at {w}" for w in r["detail"].get("where", []))
    if result.get("layer"):
        lines.append("# attention layer dim 384, 6 heads, sr_ratio 8, batch 1, fwd+bwd, bf16 autocast: ms (peak MiB)")
        by = {}
        for r in result["layer"]:
            by.setdefault(r["tokens"], {})[r["method"]] = r
        methods = list(dict.fromkeys(r["method"] for r in result["layer"]))
        lines.append(f"{'tokens':>7} {'m':>5} {'steps':>5} " + " ".join(f"{m:>22}" for m in methods)
                     + "  sdpa/soft")
        for n, rs in by.items():
            cells = []
            for m in methods:
                r = rs.get(m, {})
                cells.append(f"{_f(r.get('fwd_bwd_ms')):>9} ({_f(r.get('peak_mib'), '.0f'):>8})"
                             if r.get("status") == "ok" else f"{r.get('status', '-'):>22}")
            ratio = (rs["sdpa_flash"]["fwd_bwd_ms"] / rs["soft"]["fwd_bwd_ms"]
                     if rs.get("sdpa_flash", {}).get("status") == "ok" and rs.get("soft", {}).get("status") == "ok"
                     else None)
            m = _f(rs.get("soft", {}).get("landmarks"), "d")
            st = _f(rs.get("soft", {}).get("nr_steps"), "d")   # Newton steps the default ran (of 20)
            lines.append(f"{n:>7} {m:>5} {st:>5} " + " ".join(f"{c:>22}" for c in cells) + f"  {_f(ratio)}x")
    graph_rows = [r for r in result.get("layer") or [] if "graph_ms" in r or "graph_error" in r]
    if graph_rows:
        lines.append("# the same layers, fwd+bwd captured in one CUDA graph, replay timed (torch.compile "
                     "mode='reduce-overhead' / CUDA-graph users; no host launch cost): ms (graph MiB); "
                     "sdpa/soft > 1: SOFT faster")
        lines.append(f"{'tokens':>7} " + " ".join(f"{m + '_graph':>22}" for m in GRAPHED) + "  sdpa/soft  (eager)")
        by = {}
        for r in graph_rows:
            by.setdefault(r["tokens"], {})[r["method"]] = r
        for n, rs in by.items():
            cells = [f"{_f(rs[m]['graph_ms']):>9} ({_f(rs[m].get('graph_mib'), '.0f'):>8})" if "graph_ms" in
                     rs.get(m, {}) else f"{'failed' if m in rs else '-':>22}" for m in GRAPHED]
            ok = all("graph_ms" in rs.get(m, {}) for m in GRAPHED)
            ratio = rs["sdpa_flash"]["graph_ms"] / rs["soft"]["graph_ms"] if ok else None
            eager = (rs["sdpa_flash"]["fwd_bwd_ms"] / rs["soft"]["fwd_bwd_ms"]
                     if all(rs.get(m, {}).get("status") == "ok" for m in GRAPHED) else None)
            lines.append(f"{n:>7} " + " ".join(f"{c:>22}" for c in cells) + f"  {_f(ratio):>8}x  ({_f(eager)}x)")
        for r in graph_rows:
            if r.get("graph_error"):
                lines.append(f"# graph {r['method']} at {r['tokens']} tokens: {r['graph_error']}")
    for r in result.get("layer") or []:
        if r.get("diagnostics_error"):
            lines.append(f"# {r['method']} at {r['tokens']} tokens: steps/profile failed: {r['diagnostics_error']}")
        if r.get("profile"):
            pr = r["profile"]
            lines.append(f"# profile, {r['method']} at {r['tokens']} tokens, one fwd+bwd: host {pr['host_ms']:.2f} ms to "
                         f"issue, device {pr['device_ms']:.2f} ms in {pr['kernels']} kernels; top:")
            lines.extend(f"#   {k['ms']:7.3f} ms x{k['count']:<3} {k['kernel']}" for k in pr["top"])
            if pr.get("host_top"):
                lines.append("#   host (self CPU ms per step, under the profiler):")
                lines.extend(f"#   {k['ms']:7.3f} ms x{k['count']:<3} {k['op']}" for k in pr["host_top"])
    if result.get("models"):
        lines.append(f"# images/s at {result['models'][0]['image_size']} px, bf16 autocast, channels_last; train "
                     f"batch {result['models'][0]['train_batch']} (fwd+bwd), infer batch "
                     f"{result['models'][0]['infer_batch']}")
        lines.append("# compiled: torch.compile of every transformer block (regional compilation), both models")
        lines.append(f"{'model':>12} {'mode':>9} {'train img/s':>12} {'infer img/s':>12}  status")
        for r in result["models"]:
            lines.append(f"{r['model']:>12} {r['mode']:>9} {_f(r.get('train_images_per_s'), '.0f'):>12} "
                         f"{_f(r.get('infer_images_per_s'), '.0f'):>12}  {r['status']}"
                         f"{' (' + r['why'] + ')' if r.get('why') else ''}")
        ok = {(r["model"], r["mode"]): r for r in result["models"] if r["status"] == "ok"}
        for soft, pvt in PAIRS:
            for mode in ("eager", "compiled"):
                a, b = ok.get((soft, mode)), ok.get((pvt, mode))
                if a and b:
                    tr = a["train_images_per_s"] / b["train_images_per_s"]
                    inf = a["infer_images_per_s"] / b["infer_images_per_s"]
                    lines.append(f"# {soft}/{pvt} {mode}: train {tr:.2f}x, infer {inf:.2f}x")
    return "\n".join(lines)


def plot_goal(result: dict, out: Path) -> str:
    from hpdl.bench.common import pyplot

    plt = pyplot()

    models = [r for r in result.get("models") or [] if r["status"] == "ok"]
    # no model rows (e.g. --goal-parts layer): two panels, not an empty third one
    fig, axes = plt.subplots(1, 3 if models else 2, figsize=(16, 4.5) if models else (11, 4.5))
    layer = result.get("layer") or []
    for method in dict.fromkeys(r["method"] for r in layer):
        ok = [r for r in layer if r["method"] == method and r["status"] == "ok"]
        if ok:
            axes[0].plot([r["tokens"] for r in ok], [r["fwd_bwd_ms"] for r in ok], "o-", label=method)
            if ok[0]["peak_mib"] is not None:
                axes[1].plot([r["tokens"] for r in ok], [r["peak_mib"] for r in ok], "o-", label=method)
            gr = [r for r in ok if "graph_ms" in r]
            if gr:
                axes[0].plot([r["tokens"] for r in gr], [r["graph_ms"] for r in gr], "s--", label=method + " graph")
    for ax, lab in zip(axes[:2], ("fwd+bwd ms", "peak MiB above inputs")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel(lab)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    axes[0].set_title("attention layer (dim 384, 6 heads, sr 8)")
    if not models:
        return _finish_plot(fig, plt, result, out)
    labels = [f"{r['model']}\n{r['mode']}" for r in models]
    xs = range(len(models))
    axes[2].bar([x - 0.2 for x in xs], [r["train_images_per_s"] for r in models], 0.4, label="train")
    axes[2].bar([x + 0.2 for x in xs], [r["infer_images_per_s"] for r in models], 0.4, label="infer")
    axes[2].set_xticks(list(xs))
    axes[2].set_xticklabels(labels, fontsize=6, rotation=45, ha="right")
    axes[2].set_ylabel("images/s")
    axes[2].legend()
    axes[2].set_title("SOFT vs PVTv2 (224 px, bf16)")
    return _finish_plot(fig, plt, result, out)


def _finish_plot(fig, plt, result: dict, out: Path) -> str:
    fig.suptitle(f"SOFT goal run: {result['meta']['device_name']}, {result['meta']['date']}")
    fig.tight_layout()
    fig.savefig(out / "soft_goal.png", dpi=120)
    plt.close(fig)
    return "soft_goal.png"


@dataclass(kw_only=True)
class GoalOptions:
    """What :func:`run_goal` runs after the kernel check (``hpdl bench attention --suite goal`` builds it from
    ``--goal-parts``, ``--goal-pairs``, ``--warmup``, ``--reps``, ``--time-budget`` and ``--smoke``)."""

    parts: list[str] = field(default_factory=lambda: ["layer", "eager"])  # of layer, eager, compiled, in order
    pairs: list[str] = field(default_factory=lambda: ["tiny", "small"])   # names of PAIRS_BY_NAME, in order
    warmup: int = 3            # untimed calls per point
    reps: int = 10             # timed calls per point (median)
    time_budget: float = 270.0  # seconds after which remaining model runs are skipped
    smoke: bool = False        # tiny shapes: a check of the code

    def __post_init__(self):
        names = dict(PAIRS_BY_NAME)
        bad = [p for p in self.parts if p not in ("layer", "eager", "compiled")]
        if bad:
            raise ValueError(f"parts must be some of layer, eager, compiled, got {self.parts}")
        if not self.pairs or any(p not in names for p in self.pairs) or len(set(self.pairs)) != len(self.pairs):
            raise ValueError(f"pairs must list {list(names)} at most once each, got {self.pairs}")
        if not self.time_budget > 0:
            raise ValueError(f"time_budget must be > 0 seconds, got {self.time_budget}")


def run_goal(options: GoalOptions, device, meta: dict, out: Path) -> int:
    """The whole goal run; returns the exit status (1 if a gating kernel check fails or a row is non-finite)."""
    t0 = time.perf_counter()
    smoke = options.smoke
    result: dict = {"meta": {**meta, "suite": "goal", "smoke": smoke}}
    result["check"] = run_check(device, smoke)
    failed = [r for r in result["check"] if r["gate"] and not r["ok"]]
    print(f"# check done ({time.perf_counter() - t0:.0f} s), {len(failed)} gating failures", flush=True)
    parts = list(options.parts)
    if not failed:
        if "layer" in parts:
            # graphed rows only where the check's capture of the layer worked (a failed capture mid-run can leave
            # the process's CUDA state unusable for the rows after it)
            cap = [r for r in result["check"] if r["check"] == "CUDA graph capture of the layer"]
            graphs = device.type == "cuda" and bool(cap) and cap[-1]["ok"]
            result["layer"] = run_layer(device, smoke, options.warmup, options.reps, graphs=graphs)
            if device.type == "cuda" and not graphs:
                result["meta"]["graphs"] = "skipped: the check's CUDA-graph capture of the layer failed"
            print(f"# layer done ({time.perf_counter() - t0:.0f} s)", flush=True)
        modes = [m for m in parts if m in ("eager", "compiled")]   # in the order asked
        if modes:
            pairs = [dict(PAIRS_BY_NAME)[p] for p in options.pairs]
            result["models"] = run_models(device, smoke, options.warmup, options.reps, modes,
                                          t0 + options.time_budget, pairs)
    result["meta"]["seconds"] = time.perf_counter() - t0
    (out / "soft_goal.json").write_text(json.dumps(result, indent=1))
    png = plot_goal(result, out)
    text = format_goal(result)
    (out / "soft_goal.txt").write_text(text + "\n")
    print(text)
    print(f"# wrote {out / 'soft_goal.json'} {out / png} {out / 'soft_goal.txt'} in {result['meta']['seconds']:.0f} s")
    return 1 if failed else 0
