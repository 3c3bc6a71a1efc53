"""Issue 38: hpdl's weight-streaming decode GEMMs (``hpdl.serve.stream_gemm``) against cuBLAS, and the decode step
built on them against the current fused step (cuBLAS GEMMs) and the eager step, in one device run (1 x H200).

    timeout 300 python3 benchmarks/serve_decode_kernels.py --out $OUT/serve   # device, about 4 minutes
    python3 benchmarks/serve_decode_kernels.py --quick --out $OUT/serve       # device, about 2 minutes: rows 1, 64
    python3 benchmarks/serve_decode_kernels.py --full --out $OUT/serve        # device, rows up to 256 (> 4 min)
    timeout 290 python3 benchmarks/serve_decode_kernels.py --auto --out $OUT/serve  # device, ~4 min: the
        # --fused-gemm auto decision (parts compile, step, greedy, engine; 5. below), no gemm part
    python3 benchmarks/serve_decode_kernels.py --smoke --out /tmp/sdk         # CPU plumbing check: tiny shapes, torch
                                                                              # fallback (TRITON_INTERPRET=1: kernels)
    python3 benchmarks/serve_decode_kernels.py --tiny --out $OUT/sdk          # device, about 1 minute: the smoke
                                                                              # shapes on the GPU (a quick check)
    python3 benchmarks/serve_decode_kernels.py --plot DIR                     # the PNG from DIR/decode_kernels.json

Writes 3 files into --out: decode_kernels.json (saved after every part, so a timeout keeps what finished),
decode_kernels.png and log.txt; the table printed last is also the log's end. Parts (by default run in the order
compile, step, greedy, gemm: the issue's goal first; the gemm part's rows are skipped one by one when time runs
out); one that would start past the time budget is skipped and says so:
0. compile: every stream_gemm candidate the parts below launch, compiled in a process pool into Triton's on-disk
   cache (the main process then loads instead of compiling, one kernel after another).
1. copy bandwidth (``hpdl.serve.bench.hbm_bandwidth``, the reference of every "% of copy" below).
2. gemm: the 1.1B model's decode GEMMs (qkv, o, gate_up, down, lm_head) at M = 1, 16, 64 rows: cuBLAS (``F.linear``),
   stream_gemm's Triton kernel (tuned on the device at its first call: ``stream_gemm.time_config`` over every
   candidate), the same with PDL (rows in PDL_ROWS), and with the prologue/epilogue the new step fuses:
   ``cublas_fused`` (cuBLAS between the fused step's own RMSNorm / SiLU-mul kernels or with the residual add:
   ``stream_gemm.CUBLAS_CONFIG``), ``stream_fused`` (Triton) and ``auto_fused`` (the tuner's pick of the two per
   shape, ``stream_gemm.CUBLAS_CANDIDATE``; ``auto_fused_config`` says which). Each is one CUDA graph running the
   GEMM over 22 distinct weight copies (lm_head: 4), as a decode step does, so weights come from HBM, not L2; the
   graphs are replayed in ROUNDS rounds of REPS replays with the implementations interleaved in every round: median,
   min and max per GEMM. GB/s counts weight + input + output bytes. Max abs error against torch on the device (bf16),
   and the torch reference's own error against float32. ``gemm_step_total``: the step's 89 GEMMs (22 layers x 4 +
   lm_head) summed from the medians.
3. step: one decode step of ``llama-1b`` (bf16, random weights) at 1, 16 and 64 rows, 264 cached positions each, CUDA
   graph, the paths interleaved over rounds as above: eager model, current fused step (cuBLAS), stream step with
   Triton GEMMs only, ``stream_auto`` (cuBLAS among each shape's candidates: what ``--fused-gemm stream`` runs), and
   the Triton-only step with PDL; TPOT = step time, tok/s = rows / step time, the roofline (bytes the step must move,
   ``fused.step_bytes``, over its time, against the copy bandwidth), kernels per step (torch.profiler at 1 and 64
   rows) and each path's logits against the eager step's (max abs, argmax agreement).
4. greedy_float32: 8 requests x 48 greedy tokens through ``LLMEngine`` (float32 llama-1b, CUDA graphs), stream
   step (and with PDL) vs eager step: identical tokens? (stream_gemm.TUNE off for this part only: one compile
   per variant; the 17:30 run of 2026-12-04 left it off for the parts after it, so its stream numbers were
   untuned.)

5. engine (``--auto``): ``LLMEngine`` for eager, fused cuBLAS and ``fused_gemm="auto"`` (llama-1b bf16, 256 slots x
   640, CUDA graphs, ``warm_up``), batch-1 TPOT (128-token prompt, 256 new tokens) and 64 / 256 offline requests
   (128-token prompts, outputs 32..512), the paths interleaved over 2 rounds. With ``--auto`` the step part runs
   at 1/16/64/256 rows for eager, fused_cublas, ``auto`` (a ``ModelRunner(fused_gemm="auto")``'s own graph),
   stream_pdl and the 19:32 arrangements (``*_1932``: the separate rope_kv kernel, the attention's split-by-split
   combine, torch's argmax), the greedy part
   compares fused_cublas, stream_pdl and auto with eager, and ``auto_default_decision`` says whether ``auto`` is
   never slower than cuBLAS beyond noise (step: auto's fastest round slower than cuBLAS's slowest and the median
   > 1% slower; engine: > 2% and no overlap of rounds) and where the default is set.

``tuned_us`` is the tuner's own time for the plain stream GEMM's chosen config (``stream_config``), to compare with
the table's ``stream_us``. ``--parts`` runs compile first, the rest in the order given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from hpdl.bench.common import Column, format_table, pyplot, run_metadata  # noqa: E402
from hpdl.serve.bench import release_engine  # noqa: E402

MODEL, DTYPE, ROWS, STEP_ROWS, CTX, KV_LEN, SLOTS, MAX_LEN = "llama-1b", "bfloat16", [1, 16, 64], [1, 16, 64], \
    264, 384, 256, 640
COPIES, LM_COPIES, REPS, ROUNDS, BUDGET_S, JOBS, COMPILE_S = 22, 4, 10, 5, 225.0, 14, 70.0
GEMM_LEFT_S = 60.0  # the gemm part starts no (GEMM, rows) row with less time left (the step part needs ~50 s)
NORM_PROLOGUE_ROWS = 16  # hpdl.serve.fused.NORM_PROLOGUE_ROWS (checked in main)
PDL_ROWS, PARTS = [1, 16], ""  # rows whose stream GEMMs are also measured with PDL; --parts
PDL_ON, GREEDY = True, "stream,stream_pdl"
STEP_PATHS = "eager,fused_cublas,stream,stream_auto,stream_pdl"
# --full: the 2026-12-04 sweep (rows up to 256, both RMSNorm placements); more than 4 minutes with tuning
FULL = dict(ROWS=[1, 16, 64, 256], STEP_ROWS=[1, 64, 256], PDL_ROWS=[1, 8, 16, 64, 256],
            STEP_PATHS="eager,fused_cublas,stream,stream_auto,stream_norm_in_gemm,stream_norm_kernel,stream_pdl")
# --quick: rows 1 and 64 only (~2 minutes)
QUICK = dict(ROWS=[1, 64], STEP_ROWS=[1, 64], COPIES=16, ROUNDS=3, BUDGET_S=128.0, COMPILE_S=40.0, JOBS=14,
             GEMM_LEFT_S=30.0, STEP_PATHS="eager,fused_cublas,stream,stream_auto,stream_pdl", GREEDY="stream_pdl",
             PDL_ROWS=[1])
# --auto: the --fused-gemm auto decision run (issue 38): step level eager / fused_cublas / auto (+ stream_pdl and
# the 19:32 arrangements with the separate rope_kv kernel) at 1/16/64/256 rows, then the engine (batch-1 TPOT,
# 64 and 256 requests) for eager / fused_cublas / auto interleaved, then float32 greedy through the engine
AUTO = dict(STEP_ROWS=[1, 16, 64, 256], ROWS=[1, 16], PDL_ROWS=[1, 16], PARTS_DEFAULT="compile,step,greedy,engine",
            COMPILE_ROWS=[1, 16],  # the rows whose stream kernels run (above them auto measures cuBLAS the faster)
            STEP_PATHS="eager,fused_cublas,fused_cublas_1932,stream_pdl,stream_pdl_1932,auto",
            GREEDY="fused_cublas,stream_pdl,auto", BUDGET_S=235.0, COMPILE_S=45.0)
ENGINE_PATHS, ENGINE_ROUNDS, ENGINE_REQS, PROMPT, OUT_LEN, B1_TOKENS = "eager,fused_cublas,auto", 2, [64, 256], 128, \
    (32, 512), 256
PARTS_DEFAULT = "compile,step,greedy,gemm"
COMPILE_ROWS = None  # rows whose stream_gemm candidates the compile pool builds; None: ROWS and STEP_ROWS
SMOKE = dict(MODEL="llama-tiny", DTYPE="float32", ROWS=[1, 4], STEP_ROWS=[1, 4], CTX=20, KV_LEN=32, SLOTS=4,
             MAX_LEN=64, COPIES=2, LM_COPIES=1, REPS=2, ROUNDS=2, JOBS=2, PDL_ROWS=[1], ENGINE_REQS=[3, 4],
             PROMPT=8, OUT_LEN=(2, 12), B1_TOKENS=8, ENGINE_ROUNDS=1)
TINY = dict(BUDGET_S=60.0, COMPILE_S=30.0, GEMM_LEFT_S=10.0, JOBS=8)  # --tiny: SMOKE's shapes on the GPU, in a minute
_T0 = time.perf_counter()
RES: dict = {}
OUT: Path = Path(".")


def _log(msg: str) -> None:
    line = f"[{time.perf_counter() - _T0:6.1f}s] {msg}"
    print(line, flush=True)
    with open(OUT / "log.txt", "a") as f:
        f.write(line + "\n")


def _save(key: str, val) -> None:
    RES[key] = val
    (OUT / "decode_kernels.json").write_text(json.dumps(RES, indent=1, default=str))
    _log(f"{key}: {json.dumps(val[-1] if isinstance(val, list) and val else val, default=str)[:400]}")


def _left() -> float:
    return BUDGET_S - (time.perf_counter() - _T0)


def gemm_shapes() -> dict[str, tuple[int, int, dict]]:
    """name -> (weight rows, K, the fused variant's stream_gemm kwargs besides tensors)."""
    from hpdl.serve.worker import NAMED_CONFIGS

    c = NAMED_CONFIGS[MODEL]
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    return {"qkv": (qkv, c.hidden_size, {"norm": True}), "o": (c.hidden_size, c.n_heads * c.head_dim, {"res": True}),
            "gate_up": (2 * c.intermediate_size, c.hidden_size, {"norm": True, "silu": True}),
            "down": (c.hidden_size, c.intermediate_size, {"res": True}),
            "lm_head": (c.vocab_size, c.hidden_size, {"norm": True})}


def _args(x, w, fused: dict, dev, dt):
    """stream_gemm keyword arguments of the fused variant for input ``x`` and weight ``w``."""
    import torch

    kw = {}
    n = w.shape[0] // 2 if fused.get("silu") else w.shape[0]
    if fused.get("res"):
        kw["residual"] = torch.randn(x.shape[0], n, device=dev, dtype=dt)
    if fused.get("norm"):
        kw["norm_weight"] = torch.rand(x.shape[1], device=dev, dtype=dt) + 0.5
        kw["eps"] = 1e-5
    if fused.get("silu"):
        kw["silu_mul"] = True
    return kw


# --- 0. compile farm -----------------------------------------------------------------------------------------
def _compile_job(job) -> str:
    """In a pool worker: launch every candidate config of one (shape, rows, variant), which compiles it into
    Triton's on-disk cache (shared with the main process)."""
    import torch

    from hpdl.serve import stream_gemm as sg

    nw, K, M, fused, norm_rows, dev, dtype, first_only, pdl_too = job  # pdl_too: also the PDL variants
    dev, dt = torch.device(dev), getattr(torch, dtype)
    x = torch.randn(M, K, device=dev, dtype=dt)
    w = torch.randn(nw, K, device=dev, dtype=dt) * 0.02
    kw = _args(x, w, fused, dev, dt)
    if M > norm_rows:
        kw.pop("norm_weight", None)
    epi = 2 if kw.get("silu_mul") else (1 if "residual" in kw else 0)
    n = nw // 2 if epi == 2 else nw
    out = torch.empty(M, n, device=dev, dtype=dt)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    cands = sg.candidates(M, n, K, sms, x.element_size(), epi, "norm_weight" in kw, sg.shared_memory_limit(dev))
    failed = []
    for cfg in cands[:1] if first_only else cands:
        for pdl in (False, True) if pdl_too and sg.pdl_supported(dev) else (False,):  # PDL is a constexpr
            try:  # one config that fails (e.g. out of resources) does not stop the others compiling
                sg._launch(x, w, out, kw.get("residual"), kw.get("norm_weight"), kw.get("eps", 1e-6), epi, cfg,
                           pdl=pdl)
            except Exception as exc:  # noqa: BLE001 - the tuner skips it on the device too
                failed.append(f"{cfg} pdl={pdl}: {exc!r}"[:200])
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if failed:
        raise RuntimeError("; ".join(failed))
    return f"{nw}x{K} M={M} {fused}"


def compile_all(device) -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, wait

    import os

    if JOBS <= 0 or not (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return _save("compile", "skipped (CPU without TRITON_INTERPRET=1)")
    t = time.perf_counter()
    jobs, seen = [], set()

    def add(job):
        """Queue ``job`` unless one with the same binaries was queued: kernels depend on K, the row bucket, the
        epilogue, the prologue, the dtype and PDL (N only through the runtime split count)."""
        nw, K, M, fused, norm_rows, _, dtype, first_only, pdl = job
        key = (K, M, bool(fused.get("silu")), bool(fused.get("res")), bool(fused.get("norm")) and M <= norm_rows,
               dtype, first_only, pdl)
        if key not in seen:
            seen.add(key)
            jobs.append(job)
    for M in sorted(COMPILE_ROWS or set(ROWS) | set(STEP_ROWS)):  # in order: the M = 1 kernels compile first
        for name, (nw, K, fused) in gemm_shapes().items():
            pdl = PDL_ON and M in PDL_ROWS
            add((nw, K, M, fused, NORM_PROLOGUE_ROWS, str(device), DTYPE, False, pdl))  # the stream step's
            add((nw, K, M, {}, 0, str(device), DTYPE, False, pdl))  # the plain GEMM
            add((nw, K, M, fused, 1 << 30, str(device), DTYPE, False, pdl))  # with the norm prologue (gemm part)
            if fused.get("norm") and "stream_norm_kernel" in STEP_PATHS:
                add((nw, K, M, fused, 0, str(device), DTYPE, False, pdl))  # the step without it
    if "greedy" in PARTS:  # the float32 engine's variants (TUNE off: the first candidate), 8 and 1 rows
        for name, (nw, K, fused) in gemm_shapes().items():
            for M in (1, 8):
                add((nw, K, M, fused, 1 << 30, str(device), "float32", True, "stream_pdl" in GREEDY))
    # ProcessPoolExecutor, not Pool: a worker that dies raises BrokenProcessPool instead of hanging the map
    ex = ProcessPoolExecutor(min(JOBS, len(jobs)), mp_context=mp.get_context("spawn"))
    futs = [ex.submit(_compile_job, j) for j in jobs]
    done, late = wait(futs, timeout=COMPILE_S)
    errors = [repr(f.exception())[:300] for f in done if f.exception() is not None]
    if late:  # give up on the rest: the main process compiles what is missing
        for f in late:
            f.cancel()
        for proc in list(getattr(ex, "_processes", {}).values()):  # our own workers, by object
            proc.terminate()
    ex.shutdown(wait=not late, cancel_futures=True)
    _save("compile", {"jobs": len(jobs), "finished": len(done) - len(errors), "errors": errors[:5],
                      "unfinished": len(late), "seconds": round(time.perf_counter() - t, 1)})


# --- 2. per-GEMM table -----------------------------------------------------------------------------------------
def _capture(fn, device):
    """``fn`` after one warm call (compiles, tunes), captured into a CUDA graph; returns the replay (CPU: ``fn``)."""
    import torch

    fn()
    if device.type != "cuda":
        return fn
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g.replay


def _time_ms(replay, reps: int, device) -> float:
    """Milliseconds per ``replay()`` over ``reps`` back-to-back calls (CUDA events; CPU: wall clock)."""
    import torch

    if device.type != "cuda":
        t = time.perf_counter()
        for _ in range(reps):
            replay()
        return (time.perf_counter() - t) / reps * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


class _Replay:
    """A function that already replays a CUDA graph (the engine's own): ``_interleaved`` times it as it is."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self):
        return self.fn()


def _interleaved(fns: dict, device, pre=None) -> tuple[dict, dict]:
    """Capture every ``fns[name]`` (``pre(name)`` runs before its warm call and capture, e.g. to set a flag;
    ``pre(None)`` after), then time them in ``ROUNDS`` rounds of ``REPS`` replays each, the implementations
    interleaved within every round (a clock or thermal drift hits all alike). Returns ``({name: [ms per call,
    one per round]}, {name: error})``; an implementation that fails to run or capture is in the second only."""
    replays, errors = {}, {}
    for name, fn in fns.items():
        if pre is not None:
            pre(name)
        try:
            replays[name] = fn.fn if isinstance(fn, _Replay) and device.type == "cuda" else _capture(fn, device)
        except Exception as exc:  # noqa: BLE001 - one implementation's failure keeps the others
            errors[name] = repr(exc)[:400]
        finally:
            if pre is not None:
                pre(None)
    times = {name: [] for name in replays}
    for _ in range(ROUNDS):
        for name, replay in replays.items():
            times[name].append(_time_ms(replay, REPS, device))
    return times, errors


def _stats(ms: list[float]) -> dict:
    """Median, min and max of per-round times, and the spread (max - min) / median."""
    import statistics

    med = statistics.median(ms)
    return {"median": med, "min": min(ms), "max": max(ms), "spread": (max(ms) - min(ms)) / med if med else 0.0}


def gemms(device, copy_bw: float) -> None:
    import torch
    import torch.nn.functional as F

    from hpdl.serve import stream_gemm as sg

    dt = getattr(torch, DTYPE)
    torch.manual_seed(0)
    rows, total = [], {}
    with_cublas = sg.CUBLAS_CANDIDATE
    sg.CUBLAS_CANDIDATE = False  # "stream*": the Triton kernels alone; "auto_fused": with the cuBLAS candidate
    try:
        _gemms(device, copy_bw, sg, F, dt, rows, total)
    finally:
        sg.CUBLAS_CANDIDATE = with_cublas


def _gemms(device, copy_bw, sg, F, dt, rows, total) -> None:
    import torch

    for name, (nw, K, fused) in gemm_shapes().items():
        copies = LM_COPIES if name == "lm_head" else COPIES
        ws = [torch.randn(nw, K, device=device, dtype=dt) * 0.02 for _ in range(copies)]
        for M in ROWS:
            if _left() < GEMM_LEFT_S:
                _save(f"gemm_skipped_{name}_{M}", "time budget")
                continue
            x = torch.randn(M, K, device=device, dtype=dt)
            kw = _args(x, ws[0], fused, device, dt)
            nout = nw // 2 if fused.get("silu") else nw
            r = {"gemm": name, "M": M, "N": nw, "K": K}
            # (c) errors, on the first weight copy
            ref = F.linear(x, ws[0])
            exact = (x.float() @ ws[0].float().T)
            r["err_stream"] = (sg.stream_gemm(x, ws[0]).float() - ref.float()).abs().max().item()
            r["err_ref_vs_fp32"] = (ref.float() - exact).abs().max().item()
            fref = sg.stream_gemm_ref(x, ws[0], kw.get("residual"), kw.get("norm_weight"), kw.get("eps", 1e-6),
                                      kw.get("silu_mul", False))
            r["err_stream_fused"] = (sg.stream_gemm(x, ws[0], **kw).float() - fref.float()).abs().max().item()
            # (a) times: one GEMM of a graph over every copy; rounds interleave the implementations
            wbytes = nw * K * dt.itemsize
            impls = {"cublas": lambda: [F.linear(x, w) for w in ws],
                     "stream": lambda: [sg.stream_gemm(x, w) for w in ws],
                     "stream_fused": lambda: [sg.stream_gemm(x, w, **kw) for w in ws],
                     "cublas_fused": lambda: [sg.stream_gemm(x, w, **kw, config=sg.CUBLAS_CONFIG) for w in ws],
                     "auto_fused": lambda: [sg.stream_gemm(x, w, **kw) for w in ws]}
            if PDL_ON and sg.pdl_supported(device) and M in PDL_ROWS:
                impls["stream_pdl"] = lambda: [sg.stream_gemm(x, w) for w in ws]

            def pre(impl):
                sg.PDL = impl == "stream_pdl"
                sg.CUBLAS_CANDIDATE = impl == "auto_fused"
            times, errors = _interleaved(impls, device, pre)
            for impl, exc in errors.items():
                r[f"{impl}_error"] = exc
            for impl, ms_rounds in times.items():
                st = _stats([ms / copies for ms in ms_rounds])
                ms = st["median"]
                io = (M * K + M * (nout if impl.endswith("_fused") else nw)) * dt.itemsize
                r[f"{impl}_us"] = round(ms * 1e3, 2)
                r[f"{impl}_us_min_max"] = [round(st["min"] * 1e3, 2), round(st["max"] * 1e3, 2)]
                r[f"{impl}_GBps"] = round((wbytes + io) / ms / 1e6, 1)
                r[f"{impl}_frac_copy"] = round((wbytes + io) / (ms * 1e-3) / copy_bw, 3)
                per_step = 1 if name == "lm_head" else _n_layers()
                total.setdefault(f"{impl}_M{M}_ms", 0.0)
                total[f"{impl}_M{M}_ms"] += ms * per_step
            tuned = sg.tuned_configs()
            r["stream_config"] = tuned.get(sg.tuned_key(sg.m_bucket(M), nw, K, 0, False, DTYPE))
            fe = 2 if fused.get("silu") else (1 if fused.get("res") else 0)
            r["auto_fused_config"] = tuned.get(sg.tuned_key(sg.m_bucket(M), nout, K, fe, bool(fused.get("norm")),
                                                            DTYPE, True))
            # the tuner's own time for the plain stream GEMM's chosen config, against the table's (sanity check)
            r["tuned_us"] = (r["stream_config"] or {}).get("us")
            if "stream_pdl_us" in r:  # the PDL launch gives the same numbers
                sg.PDL = True
                try:
                    with_pdl = sg.stream_gemm(x, ws[0], **kw).float()
                    sg.PDL = False
                    r["err_stream_pdl_vs_stream"] = (with_pdl - sg.stream_gemm(x, ws[0], **kw).float()
                                                     ).abs().max().item()
                except Exception as exc:  # noqa: BLE001
                    r["stream_pdl_error"] = repr(exc)[:300]
                finally:
                    sg.PDL = False
            rows.append(r)
            _save("gemm", rows)
        ws.clear()  # free this shape's weights before the next
    w_all = sum(nw * K * (1 if n == "lm_head" else _n_layers()) for n, (nw, K, _) in gemm_shapes().items())
    total["weight_bytes"] = w_all * dt.itemsize
    for k in list(total):
        if k.endswith("_ms"):
            total[k.replace("_ms", "_frac_copy")] = round(total["weight_bytes"] / (total[k] * 1e-3) / copy_bw, 3)
            total[k] = round(total[k], 4)
    _save("gemm_step_total", total)
    _save("tuned_configs", sg.tuned_configs())


def _n_layers() -> int:
    from hpdl.serve.worker import NAMED_CONFIGS

    return NAMED_CONFIGS[MODEL].n_layers


# --- 3. whole decode step ------------------------------------------------------------------------------------
def _kernels(fn, device) -> dict | None:
    """Device kernels of one call of ``fn`` run outside a graph (torch.profiler): their count, the sum of their
    durations (against the graph's step time: what launch gaps cost) and the 8 names that took longest."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return None
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            v = by_name.setdefault(e.name[:60], [0, 0.0])
            v[0] += 1
            v[1] += e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:8]
    return {"count": sum(v[0] for v in by_name.values()),
            "sum_us": round(sum(v[1] for v in by_name.values()), 1),
            "top": [[name, n, round(us, 1)] for name, (n, us) in top]}


def steps(device, copy_bw: float) -> None:
    import torch

    from hpdl.models.gpt import Batch, KVCache
    from hpdl.serve import fused as fz
    from hpdl.serve import stream_gemm as sg
    from hpdl.serve.worker import ModelSpec, build_model

    model = build_model(ModelSpec(config=MODEL, dtype=DTYPE), device)
    cfg = model.cfg
    cache = KVCache(cfg, SLOTS, MAX_LEN, model.embed_tokens.weight.dtype, device)
    torch.manual_seed(1)
    cache.k.normal_(), cache.v.normal_()
    big = 1 << 30
    paths = {"eager": None, "fused_cublas": dict(gemm="cublas"),
             "stream_norm_in_gemm": dict(gemm="stream", norm_prologue_rows=big),
             "stream_norm_kernel": dict(gemm="stream", norm_prologue_rows=0),
             "stream": dict(gemm="stream"),  # the RMSNorm in the GEMMs up to fused.NORM_PROLOGUE_ROWS rows
             "stream_auto": dict(gemm="stream"),  # the same, cuBLAS among each shape's tuned candidates
             "stream_pdl": dict(gemm="stream", pdl=True, cublas_candidate=False),  # PDL, Triton GEMMs only
             # the 19:32 arrangements (rope_kv its own kernel, the split combine loop, torch's argmax; ``pre``
             # sets the flags), to measure what changed since
             "fused_cublas_1932": dict(gemm="cublas", rope_in_attention=False),
             "stream_pdl_1932": dict(gemm="stream", pdl=True, cublas_candidate=False, rope_in_attention=False),
             "auto": "runner"}  # ModelRunner(fused_gemm="auto")'s own graph for the rows' bucket
    with_cublas = sg.CUBLAS_CANDIDATE
    want = STEP_PATHS.split(",")
    paths = {k: v for k, v in paths.items()
             if k in want and (not k.startswith("stream_pdl") or sg.pdl_supported(device))}
    runner = None
    if "auto" in paths:
        from hpdl.serve.worker import ModelRunner

        runner = ModelRunner(model, 1, 1, cuda_graph=device.type == "cuda", fused=True, fused_gemm="auto")
        runner.cache = cache  # the step part's cache (same slots, lengths and contents)
    res = []
    for n in STEP_ROWS:
        if _left() < 25:
            _save(f"step_skipped_{n}", "time budget")
            continue
        toks = torch.randint(0, cfg.vocab_size, (n,), device=device)
        pos = torch.full((n,), CTX, device=device)
        fns, boxes = {}, {}
        for name, kw in paths.items():
            if name.startswith("stream_pdl") and n not in PDL_ROWS:
                continue
            box = boxes[name] = {}
            if kw == "runner":
                fns[name] = _runner_replay(runner, n, toks, box, device)
                continue
            if kw is None:
                def fn(toks=toks, pos=pos):
                    return model(toks[:, None], cache, Batch(positions=pos[:, None], start=0, kv_len=KV_LEN))
            else:
                def fn(toks=toks, pos=pos, kw=kw):
                    return fz.fused_decode(model, cache, toks, pos, 0, KV_LEN, **kw)[0]

            def run(fn=fn, box=box):
                box["out"] = fn()
            fns[name] = run

        def pre(name):  # the flags matter at the warm call (tuning) and the capture
            fz.COMBINE_ONE_SHOT = fz.TRITON_ARGMAX = not (name or "").endswith("_1932")
            sg.PDL = name == "stream_pdl"
            sg.CUBLAS_CANDIDATE = name == "stream_auto" or (name is None and with_cublas)
        with torch.inference_mode():
            times, errors = _interleaved(fns, device, pre)
        for name, exc in errors.items():
            res.append({"rows": n, "path": name, "error": exc})
        outs = {name: boxes[name]["out"].float().clone() for name in times}
        need = fz.step_bytes(model, cache, n, CTX)
        for name, ms_rounds in times.items():
            st = _stats(ms_rounds)
            ms = st["median"]
            kern = None
            if n in (1, 64):
                pre(name)
                try:
                    with torch.inference_mode():
                        kern = _kernels(fns[name], device)
                finally:
                    pre(None)
            r = {"rows": n, "path": name, "step_ms": round(ms, 4),
                 "step_ms_min_max": [round(st["min"], 4), round(st["max"], 4)],
                 "tok_per_s": round(n / ms * 1e3, 1), "min_bytes": need, "GBps": round(need / ms / 1e6, 1),
                 "frac_copy": round(need / (ms * 1e-3) / copy_bw, 3), "kernels": kern}
            if "eager" in outs and name != "eager":
                d = (outs[name] - outs["eager"]).abs()
                r["max_abs_logit_diff_vs_eager"] = d.max().item()
                r["argmax_equal_vs_eager"] = int((outs[name].argmax(-1) == outs["eager"].argmax(-1)).sum())
            res.append(r)
        _save("step", res)
    if runner is not None:
        _save("step_auto_choice", runner.gemm_choice)
        runner.close()
    _save("step_tuned_configs", __import__("hpdl.serve.stream_gemm", fromlist=["x"]).tuned_configs())


def _runner_replay(runner, n: int, toks, box: dict, device):
    """The "auto" step: ``runner.execute`` of an n-row decode at CTX (captures the bucket's graph, measuring the
    paths at its first capture), then a ``_Replay`` of that graph (CPU: the runner's eager decode)."""
    import torch

    from hpdl.serve.scheduler import StepPlan

    plan = StepPlan(start=0, n=n, decode_tokens=toks.tolist(), decode_positions=[CTX] * n)
    with torch.inference_mode():
        runner.execute(plan)
    if not runner.cuda_graph:
        def eager():
            with torch.inference_mode():
                box["out"] = runner.execute(plan)
        return eager
    kb = min(-(-(CTX + 1) // runner.KV_BUCKET) * runner.KV_BUCKET, runner.cache.max_seq_len)
    graph, _, _, out, _ = runner._graphs[(runner._bucket(n), kb)]  # its toks/pos hold the plan's (execute)

    def replay():
        graph.replay()
        box["out"] = out[:n]
    return _Replay(replay)


# --- 5. the engine: batch-1 TPOT and offline throughput, paths interleaved ---------------------------------
def engine_part(device) -> None:
    """``LLMEngine`` per path of ENGINE_PATHS (eager step, fused cuBLAS step, ``fused_gemm="auto"``), all alive at
    once, CUDA graphs captured first (``warm_up``) and every prefill shape run once; then batch-1 TPOT
    (PROMPT-token prompt, B1_TOKENS new tokens) and ENGINE_REQS offline requests (PROMPT-token prompts, outputs
    uniform in OUT_LEN, EOS ignored), the paths interleaved in ENGINE_ROUNDS rounds per workload."""
    import gc
    import math

    import torch

    from hpdl.serve import EngineConfig, LLMEngine, ModelSpec, bench
    from hpdl.serve.worker import NAMED_CONFIGS

    if _left() < 60:
        return _save("engine", "skipped: time budget")
    vocab = NAMED_CONFIGS[MODEL].vocab_size
    kinds = {"eager": dict(fused_decode=False), "fused_cublas": dict(fused_decode=True, fused_gemm="cublas"),
             "auto": dict(fused_decode=True, fused_gemm="auto")}
    engines, setup = {}, {}
    try:
        for name in ENGINE_PATHS.split(","):
            t = time.perf_counter()
            eng = LLMEngine(ModelSpec(config=MODEL, dtype=DTYPE),
                            EngineConfig(num_slots=SLOTS, max_seq_len=MAX_LEN, device=str(device),
                                         cuda_graph=device.type == "cuda", max_prefill_tokens=PROMPT * SLOTS,
                                         **kinds[name]))
            engines[name] = eng
            r = eng.executor.runner
            graphs = r.warm_up()
            for n in [1] + ENGINE_REQS:  # every prefill shape measured below, once
                bench.run_engine(eng, bench.make_workload(n, (PROMPT, PROMPT), (2, 2), math.inf, vocab_size=vocab,
                                                          seed=9))
            setup[name] = {"graphs": graphs, "seconds": round(time.perf_counter() - t, 1), "fused": r.fused,
                           "fused_gemm": r.fused_gemm, "cuda_graph": r.cuda_graph, "graph_error": r.graph_error,
                           "gemm_choice": r.gemm_choice}
            _save("engine_setup", setup)
        loads = [("b1", bench.make_workload(1, (PROMPT, PROMPT), (B1_TOKENS, B1_TOKENS), math.inf,
                                            vocab_size=vocab, seed=0))]
        loads += [(str(n), bench.make_workload(n, (PROMPT, PROMPT), OUT_LEN, math.inf, vocab_size=vocab, seed=0))
                  for n in ENGINE_REQS]
        res: dict = {"workloads": {w: {"requests": len(wl), "output_tokens": sum(x.output_len for x in wl)}
                                   for w, wl in loads}}
        for wname, wl in loads:
            for _ in range(ENGINE_ROUNDS):
                for name, eng in engines.items():
                    if _left() < 8:
                        res.setdefault("skipped", []).append(f"{wname} {name}")
                        continue
                    recs = bench.run_engine(eng, wl)
                    key = "tpot_ms" if wname == "b1" else "output_tok_s"
                    val = recs[0].tpot * 1e3 if wname == "b1" else bench.summarize(recs)["output_throughput"]
                    res.setdefault(name, {}).setdefault(wname, {"metric": key, "rounds": []})["rounds"].append(
                        round(val, 4))
            _save("engine", res)
        for name, eng in engines.items():
            setup[name]["final"] = {"cuda_graph": eng.executor.runner.cuda_graph,
                                    "graph_error": eng.executor.runner.graph_error}
        _save("engine_setup", setup)
    finally:
        for eng in engines.values():
            release_engine(eng)
        engines.clear()
        gc.collect()   # the engines' weights, now that no name holds them
        if device.type == "cuda":
            torch.cuda.empty_cache()


# --- the default decision --------------------------------------------------------------------------------------
def auto_decision() -> dict:
    """Is ``fused_gemm="auto"`` never slower than "cublas" beyond noise? Step level: slower where auto's fastest
    round is slower than cublas's slowest and its median more than 1% slower; engine: where auto's best round is
    worse than cublas's worst and its median more than 2% worse (TPOT higher, tok/s lower)."""
    import statistics

    out: dict = {"checks": [], "slower": []}
    step = {(r["rows"], r["path"]): r for r in RES.get("step", []) if isinstance(r, dict) and "step_ms" in r}
    for n in STEP_ROWS:
        a, c = step.get((n, "auto")), step.get((n, "fused_cublas"))
        if a is None or c is None:
            out["checks"].append(f"step {n} rows: missing")
            continue
        ratio = a["step_ms"] / c["step_ms"]
        slower = a["step_ms_min_max"][0] > c["step_ms_min_max"][1] and ratio > 1.01
        out["checks"].append(f"step {n} rows: auto time ratio {ratio:.3f} (auto / cublas: lower is better)"
                             + (" SLOWER" if slower else ""))
        if slower:
            out["slower"].append(f"step {n}")
    eng = RES.get("engine") if isinstance(RES.get("engine"), dict) else {}
    for w in ["b1"] + [str(n) for n in ENGINE_REQS]:
        a, c = eng.get("auto", {}).get(w), eng.get("fused_cublas", {}).get(w)
        if not a or not c:
            out["checks"].append(f"engine {w}: missing")
            continue
        am, cm = statistics.median(a["rounds"]), statistics.median(c["rounds"])
        if w == "b1":  # TPOT: lower is better
            ratio, slower = am / cm, min(a["rounds"]) > max(c["rounds"]) and am / cm > 1.02
        else:
            ratio, slower = cm / am, max(a["rounds"]) < min(c["rounds"]) and cm / am > 1.02
        out["checks"].append(f"engine {w}: auto time ratio {ratio:.3f} (auto / cublas, per token: lower is better)"
                             + (" SLOWER" if slower else ""))
        if slower:
            out["slower"].append(f"engine {w}")
    complete = not any("missing" in c for c in out["checks"])
    out["make_auto_default"] = complete and not out["slower"]
    out["flip"] = _default_lines()
    return out


def _default_lines() -> list[str]:
    """Where the default "cublas" is set (file:line), for the lead to flip to "auto"."""
    root = Path(__file__).resolve().parents[1] / "src" / "hpdl" / "serve"
    hits = []
    for f, needle in (("engine.py", 'fused_gemm: str = "cublas"'), ("cli.py", '"--fused-gemm", default="cublas"')):
        for i, line in enumerate((root / f).read_text().splitlines(), 1):
            if needle in line:
                hits.append(f"src/hpdl/serve/{f}:{i}")
    return hits


# --- 4. float32 greedy tokens through the engine -----------------------------------------------------------
def greedy_float32(device) -> None:
    from hpdl.serve import stream_gemm as sg

    if _left() < 45:
        return _save("greedy_float32", "skipped: time budget")
    tune = sg.TUNE
    sg.TUNE = False  # the first candidate for float32 (one compile per variant); restored below for later parts
    try:
        _greedy(device, sg)
    finally:
        sg.TUNE = tune


def _greedy(device, sg) -> None:
    import random

    from hpdl.serve import EngineConfig, LLMEngine, ModelSpec, SamplingParams

    rng = random.Random(0)
    vocab = 32000 if MODEL == "llama-1b" else 256
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(8, 60))] for _ in range(8)]
    params = [SamplingParams(max_tokens=48, ignore_eos=True, detokenize=False)] * len(prompts)
    toks, state = {}, {}
    names = [g if g != "stream_pdl" or sg.pdl_supported(device) else "stream" for g in GREEDY.split(",")]
    runs = [(g, dict(fused_decode=True, fused_gemm="stream")) for g in dict.fromkeys(names) if g.startswith("stream")]
    runs += [("fused_cublas", dict(fused_decode=True, fused_gemm="cublas"))] if "fused_cublas" in GREEDY else []
    runs += [("auto", dict(fused_decode=True, fused_gemm="auto"))] if "auto" in GREEDY.split(",") else []
    for name, kw in [("eager", dict(fused_decode=False))] + runs:
        if name != "eager" and _left() < 20:
            state[name] = "skipped: time budget"
            continue
        sg.PDL = name == "stream_pdl"
        eng = LLMEngine(ModelSpec(config=MODEL, dtype="float32"),
                        EngineConfig(num_slots=8, max_seq_len=128, device=str(device),
                                     cuda_graph=device.type == "cuda", **kw))
        toks[name] = [o.token_ids for o in eng.generate(prompts, params)]
        r = eng.executor.runner
        state[name] = {"fused": r.fused, "gemm": r.fused_gemm, "cuda_graph": r.cuda_graph, "graph_error": r.graph_error,
                       "gemm_choice": r.gemm_choice}
        release_engine(eng)
        sg.PDL = False
        del eng
    out = {"requests": len(prompts), "tokens_each": 48, "runners": state}
    for name in toks:
        if name == "eager":
            continue
        out[f"{name}_identical_requests"] = sum(a == b for a, b in zip(toks[name], toks["eager"]))
        out[f"{name}_first_differing_token"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                                for a, b in zip(toks[name], toks["eager"])]
    _save("greedy_float32", out)


# --- report --------------------------------------------------------------------------------------------------
def table() -> str:
    nan = float("nan")
    lines = []
    if RES.get("gemm"):
        rows = []
        for r in RES["gemm"]:
            cfg = r.get("stream_config") or {}
            a = r.get("auto_fused_config") or {}
            row = {"gemm": r["gemm"], "M": r["M"], "pdl_us": r.get("stream_pdl_us"),
                   "cublas_fused_us": r.get("cublas_fused_us"), "stream_fused_us": r.get("stream_fused_us"),
                   "auto_fused_us": r.get("auto_fused_us"),
                   "cfg": f"{cfg.get('BLOCK_N')},{cfg.get('BLOCK_K')},{cfg.get('num_warps')},{cfg.get('SPLIT_K')}"
                   if cfg else "-", "pick": "cublas" if a.get("BACKEND") == "cublas" else ("triton" if a else "-"),
                   "err": f"{r['err_stream']:.2g}/{r['err_stream_fused']:.2g}"}
            for impl in ("cublas", "stream"):
                lo, hi = r.get(f"{impl}_us_min_max", [nan, nan])
                row |= {f"{impl}_us": r.get(f"{impl}_us"), f"{impl}_range": f"{lo:.2f}-{hi:.2f}",
                        f"{impl}_GBps": r.get(f"{impl}_GBps")}
            rows.append(row)
        cols = [Column("gemm", "gemm"), Column("M", "M")]
        for impl in ("cublas", "stream"):
            cols += [Column(f"{impl}_us", impl, "us", ".2f"), Column(f"{impl}_range", f"{impl} min-max", "us"),
                     Column(f"{impl}_GBps", impl, "GB/s", ".0f")]
        cols += [Column("pdl_us", "stream PDL", "us", ".2f"), Column("cublas_fused_us", "fused cublas+epi", "us", ".2f"),
                 Column("stream_fused_us", "fused stream", "us", ".2f"), Column("auto_fused_us", "fused auto", "us", ".2f"),
                 Column("cfg", "stream cfg (BN,BK,warps,split)"), Column("pick", "auto pick"),
                 Column("err", "max abs err stream/fused")]
        lines += format_table(rows, cols).splitlines()
    tot = RES.get("gemm_step_total")
    if isinstance(tot, dict):
        for M in ROWS:
            if f"cublas_M{M}_ms" in tot:
                lines.append(f"89 GEMMs of a step, M={M}: " + ", ".join(
                    f"{impl} {tot[f'{impl}_M{M}_ms']:.3f} ms ({tot[f'{impl}_M{M}_frac_copy']:.2f} of copy)"
                    for impl in ("cublas", "stream", "stream_pdl", "cublas_fused", "stream_fused", "auto_fused")
                    if f"{impl}_M{M}_ms" in tot))
    if RES.get("step"):
        rows, best = [], {}
        for r in RES["step"]:
            if "error" in r:
                lines.append(f"step {r['rows']} rows {r['path']}: ERROR {r['error'][:80]}")
                continue
            k = r.get("kernels") or {}
            lo, hi = r.get("step_ms_min_max", [nan, nan])
            rows.append(r | {"range": f"{lo:.3f}-{hi:.3f}", "kernels": k.get("count"), "kernel_us": k.get("sum_us")})
            if r["path"] != "eager" and r["step_ms"] < best.get(r["rows"], ("", 1e9))[1]:
                best[r["rows"]] = (r["path"], r["step_ms"])
        lines += format_table(rows, [Column("rows", "rows"), Column("path", "path"),
                                     Column("step_ms", "step", "ms", ".3f"), Column("range", "min-max", "ms"),
                                     Column("tok_per_s", "throughput", "tok/s", ".0f"),
                                     Column("GBps", "bytes moved", "GB/s", ".0f"),
                                     Column("frac_copy", "of copy bandwidth", fmt=".2f"),
                                     Column("kernels", "kernels"), Column("kernel_us", "kernel time", "us")]).splitlines()
        lines.append("fastest fused step: " + ", ".join(f"{n} rows {p} {ms:.3f} ms" for n, (p, ms) in best.items()))
        roof = [r for r in RES["step"] if "step_ms" in r and r["rows"] in (1, 64, 256)
                and r["path"] in ("eager", "fused_cublas", "auto")]
        if roof:
            lines += format_table(roof, [Column("rows", "rows"), Column("path", "path"),
                                         Column(lambda r: r["min_bytes"] / 1e9, "bytes a step must move", "GB",
                                                ".3f"), Column("step_ms", "step", "ms", ".3f"),
                                         Column("GBps", "achieved", "GB/s", ".0f"),
                                         Column("frac_copy", "of copy bandwidth", fmt=".2f")],
                                  title=f"roofline: vs copy {RES.get('copy_bandwidth_GBps')} GB/s").splitlines()
    ch = RES.get("step_auto_choice")
    if isinstance(ch, dict) and ch:
        lines.append("auto picks (step part): " + ", ".join(f"{n}: {c['path']} {c.get('ms', c.get('by'))}"
                                                            for n, c in ch.items()))
    es = RES.get("engine_setup")
    if isinstance(es, dict) and isinstance(es.get("auto"), dict):
        lines.append("auto picks (engine warm-up): " + ", ".join(
            f"{n}: {c['path']}" + (f" {c['ms']}" if "ms" in c else "") for n, c in es["auto"]["gemm_choice"].items()))
    e = RES.get("engine")
    if isinstance(e, dict):
        import statistics

        loads = list(e.get("workloads", {}))
        rows = [{"path": name} | {w: statistics.median(e[name][w]["rounds"]) for w in loads if e.get(name, {}).get(w)}
                for name in ENGINE_PATHS.split(",")]
        rounds = max((len(c["rounds"]) for name in ENGINE_PATHS.split(",") for c in e.get(name, {}).values()
                      if isinstance(c, dict) and "rounds" in c), default=0)
        cols = [Column("path", "engine path")] + [
            Column(w, "batch-1 TPOT" if w == "b1" else f"{w} requests", "ms" if w == "b1" else "tok/s", ".4g")
            for w in loads]
        lines += format_table(rows, cols, title=f"engine: median of {rounds} rounds").splitlines()
    g = RES.get("greedy_float32")
    if isinstance(g, dict):
        lines.append("greedy float32 identical to eager: " + ", ".join(
            f"{k.replace('_identical_requests', '')} {v}/{g['requests']}" for k, v in g.items()
            if k.endswith("_identical_requests")))
    d = RES.get("auto_default_decision")
    if isinstance(d, dict):
        lines.append("auto vs cublas: " + "; ".join(d["checks"]))
        lines.append(("MAKE AUTO THE DEFAULT: yes (never slower than cublas beyond noise): set \"auto\" at "
                      if d["make_auto_default"] else "MAKE AUTO THE DEFAULT: no (slower or incomplete: "
                      + ", ".join(d["slower"] or ["missing measurements"]) + "); the default \"cublas\" is at ")
                     + " and ".join(d["flip"]))
    return "\n".join(lines)


def plot(d: Path) -> None:
    plt = pyplot()
    res = json.loads((d / "decode_kernels.json").read_text())
    fig, axs = plt.subplots(1, 2, figsize=(11, 4))
    g = res.get("gemm", [])
    e = res.get("engine")
    if not g and isinstance(e, dict):  # the --auto run: the engine's numbers, relative to the fused cuBLAS path
        import statistics

        loads = list(e.get("workloads", {}))
        names = [n for n in ("eager", "fused_cublas", "auto") if n in e]
        for i, name in enumerate(names):
            vals = []
            for w in loads:
                mine, ref = e[name].get(w), e.get("fused_cublas", {}).get(w)
                if not mine or not ref:
                    vals.append(0.0)
                    continue
                m, r = statistics.median(mine["rounds"]), statistics.median(ref["rounds"])
                vals.append(r / m if mine["metric"] == "tpot_ms" else m / r)  # > 1: faster than fused cuBLAS
            axs[0].bar([x + (i - 1) * 0.25 for x in range(len(loads))], vals, width=0.25, label=name)
        axs[0].set_xticks(range(len(loads)), [("batch-1 TPOT" if w == "b1" else f"{w} requests") for w in loads])
        axs[0].axhline(1.0, color="k", lw=0.5)
        axs[0].set(ylabel="speed relative to fused cuBLAS (higher: faster)", title="engine (CUDA graphs)")
        axs[0].legend(fontsize=7)
    else:
        labels = [f"{r['gemm']}\nM={r['M']}" for r in g]
        xs = range(len(g))
        impls = ("cublas", "stream", "cublas_fused", "stream_fused", "auto_fused")
        for i, impl in enumerate(impls):
            axs[0].bar([x + (i - 2) * 0.16 for x in xs], [r.get(f"{impl}_frac_copy", 0) for r in g], width=0.16,
                       label=impl)
        axs[0].set_xticks(list(xs), labels, fontsize=6)
        axs[0].set(ylabel="fraction of copy bandwidth", title="decode GEMMs (graph of weight copies)")
        axs[0].legend(fontsize=7)
    st = [r for r in res.get("step", []) if "step_ms" in r]
    for path in dict.fromkeys(r["path"] for r in st):
        pts = [(r["rows"], r["step_ms"]) for r in st if r["path"] == path]
        axs[1].plot(*zip(*pts), "o-", label=path)
    axs[1].set(xscale="log", yscale="log", xlabel="rows", ylabel="decode step ms (CUDA graph, median of rounds)",
               title=f"{res.get('versions', {}).get('model')} decode step")
    axs[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(d / "decode_kernels.png", dpi=110)
    print(f"wrote {d / 'decode_kernels.png'}")


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path, help="only make the PNG from DIR/decode_kernels.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (plumbing check)")
    ap.add_argument("--tiny", action="store_true", help="--smoke's tiny shapes on the device (CUDA when present): "
                    "the one-minute GPU check")
    ap.add_argument("--parts", default=None, help="comma-separated subset of compile, step, engine, "
                    "gemm, greedy; compile runs first, the others in the order given")
    ap.add_argument("--quick", action="store_true", help="the ~2-minute device check: rows 1 and 64, fewer paths")
    ap.add_argument("--full", action="store_true", help="rows up to 256, both RMSNorm placements (over 4 minutes)")
    ap.add_argument("--auto", action="store_true", help="the --fused-gemm auto decision run: steps at 1/16/64/256 "
                    "rows, the engine (TPOT, 64 and 256 requests) and float32 greedy; eager / fused_cublas / auto")
    args = ap.parse_args()
    if args.plot:
        return plot(args.plot)
    if args.out is None:
        ap.error("--out DIR is required")
    if args.full:
        globals().update(FULL)
    if args.quick:
        globals().update(QUICK)
    if args.auto:
        globals().update(AUTO)
    if args.smoke or args.tiny:
        globals().update(SMOKE)
    if args.tiny:
        globals().update(TINY)
    OUT = args.out
    OUT.mkdir(parents=True, exist_ok=True)
    import torch

    from hpdl.serve.bench import hbm_bandwidth

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    _save("versions", run_metadata(device=str(device), versions=("triton",), model=MODEL, dtype=DTYPE, ctx=CTX,
                                   kv_len=KV_LEN, budget_s=BUDGET_S))
    parts = (args.parts or PARTS_DEFAULT).split(",")
    globals()["PARTS"] = parts
    from hpdl.serve import fused as fz

    if fz.NORM_PROLOGUE_ROWS != NORM_PROLOGUE_ROWS:
        raise SystemExit(f"update NORM_PROLOGUE_ROWS here to {fz.NORM_PROLOGUE_ROWS} (the compile pool's variants)")
    if "compile" in parts:
        try:
            compile_all(device)
        except Exception:  # noqa: BLE001 - the main process compiles what the pool did not
            _save("compile_error", traceback.format_exc()[-2000:])
    copy_bw = hbm_bandwidth(device)
    _save("copy_bandwidth_GBps", round(copy_bw / 1e9, 1))
    fns = {"step": lambda: steps(device, copy_bw), "gemm": lambda: gemms(device, copy_bw),
           "engine": lambda: engine_part(device),
           "greedy": lambda: greedy_float32(device)}
    for part in parts:
        fn = fns.get(part)
        if fn is None:
            continue
        try:
            fn()
        except Exception:  # noqa: BLE001 - keep the other parts' results
            _save(f"{part}_error", traceback.format_exc()[-3000:])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "engine" in parts or "auto" in STEP_PATHS.split(","):
        _save("auto_default_decision", auto_decision())
    try:
        plot(OUT)
    except Exception:  # noqa: BLE001
        _log(traceback.format_exc()[-1000:])
    _log("done\n" + table())


if __name__ == "__main__":
    main()
