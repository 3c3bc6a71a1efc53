"""Issue 41's offload measurement, in one command: does the offload engine make programs faster?

On the 16-core host of the 1 x H200 machine, 8 ranks (CPU; the agent runs single-node plans on the native
executor when gcc exists, which the log says), one spawn and one agent for everything, every point repeated
``--repeats`` times with the modes interleaved inside each repeat (so a noisy minute hits all modes alike):

1. 3-D Jacobi (7-point stencil, slabs along z, ``hpdl.offload.jacobi``'s kernels): ``blocking``
   (torch.distributed isend/irecv of the halos, wait, whole update), ``agent-blocking`` (the offloaded
   exchange started and waited at once: the engine's communication time) and ``agent`` (start, interior,
   wait, boundary shell). Median step time per mode and the per-repeat ratio agent / blocking (median,
   min-max). Every mode's final field is compared bit for bit with ``blocking`` (#wrong).
2. 3-D FFT 128^3 (``hpdl.apps.fft3d``): ``PencilFFT`` with blocking gloo all-to-alls against
   ``OffloadPencilFFT`` (both transposes offloaded to the agent and pipelined by slabs), bit-identical.
3. OSU ``osu_ialltoall`` at 64 KiB / 256 KiB / 1 MiB per peer: plain torch.distributed
   (``all_to_all_single(async_op=True)``, gloo) against the agent's persistent Alltoall: Pure Comm, Overall
   (start, compute, wait), the compute timed alone, OSU's overlap and the effective overlap (against the
   compute alone). Checked against torch.distributed (#wrong).

The agent runs ``--agent-threads`` native threads pinned to the last cores (``Agent(reserve_cores=True)``):
the offloaded modes run the ranks on the other cores, the baselines (``blocking``, ``native``) on all of them.

Writes ``offload.json`` (every repeat's numbers), ``offload.log`` (the table) under ``--out``; prints the goal
lines last.
4. Where a GPU is visible: 4 ranks on one GPU (``ranks_per_gpu=4``), a persistent Alltoall of 4 MiB per peer
   on device buffers, run by the agent (CUDA IPC, device-to-device copies), by ``progress="graph"`` with the
   pulls captured in a CUDA graph (``graph``: ``cudaMemcpyAsync``, which the driver may run on the SMs) and
   with one ``cudaMemcpyBatchAsync`` preferring the copy engines (``graph-ce``), and by a second agent whose
   copies prefer the copy engines (``agent-ce``), against 1024^2 fp32 matmuls
   on each rank's stream: Pure Comm, the compute alone, Overall and the effective overlap. One matmul count
   for every mode (the compute alone lasts at least the slowest mode's Pure Comm), modes interleaved per
   repeat. Run twice, without MPS (the ranks' contexts time-slice the GPU) and under a private MPS daemon
   (their kernels share the SMs), side by side. Correctness and overlap only (not a multi-GPU bandwidth).
5. ``comm``: ``benchmarks/comm_apps_device.py`` (hpdl.comm ``auto`` against gloo from 8 B to 4 MiB, CG, GPT
   with ``BucketAllReduce``; 8 ranks) into ``OUT/comm``; its goal lines are copied to the end.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 benchmarks/offload_device.py --out $OUT/offload --repeats 5
        # every part, about 3-4 minutes on the 1 x H200 machine; at most 5 files under $OUT/offload
    ... --parts fft,gpu      # only some parts (jacobi, fft, osu, gpu, comm); the goal lines of the others say NOT RUN
    ... --gpu-mps off        # the GPU part without MPS only (on: only under MPS)
    PYTHONPATH=src python3 benchmarks/offload_device.py --smoke --out /tmp/offload   # CPU plumbing check (~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

GOAL_JACOBI = 0.8      # agent step <= 0.8x blocking at every block size
GOAL_PURE_64K = 1.2    # agent Pure Comm at 64 KiB <= 1.2x native's
GOAL_EFFECTIVE = 80.0  # effective overlap (vs compute alone) >= 80 % at >= 64 KiB
_AFFINITY: dict[str, set] = {}  # "all": every core of the rank; "app": without the agent's reserved cores


def _cores_for(mode: str) -> None:
    """Baselines (no offload) run on every core; offloaded modes leave the agent's reserved cores alone."""
    if _AFFINITY:
        os.sched_setaffinity(0, _AFFINITY["all" if mode in ("blocking", "native") else "app"])


def _jacobi_modes(ctx, shape, steps, repeats, timeout):
    """{mode: [step seconds per repeat]} and #wrong per mode for one block shape, modes interleaved."""
    import torch.distributed as dist

    import hpdl.offload as ho
    from hpdl.offload import plans
    from hpdl.comm.transport.torch_p2p import TorchTransport
    from hpdl.offload.jacobi import blocking_exchange, initial_field, boxes, stencil

    P, r = ctx.world_size, ctx.rank
    grid = (P, 1, 1)
    dtype = torch.float32
    periodic = tuple(g > 1 for g in grid)
    plan = plans.halo3d(shape, grid, r, dtype, periodic=periodic)
    inner, shell = boxes(shape, periodic)
    full = tuple(slice(1, n + 1) for n in shape)
    u0, b = initial_field(shape, grid, r, dtype)
    padded = tuple(n + 2 for n in shape)
    tmp = {op.name: torch.empty(op.dst.numel, dtype=dtype) for op in plan.ops if op.kind == "recv"}
    comm = TorchTransport(None, timeout)
    modes = ("blocking", "agent-blocking", "agent")
    fields = {m: [ho.empty(padded, dtype), ho.empty(padded, dtype)] for m in modes}
    reqs = {m: [ho.compile(plan, {"u": t}, progress="agent", timeout=timeout) for t in fields[m]]
            for m in modes if m != "blocking"}
    native = all(q._handle in q._backend.native for m in reqs for q in reqs[m])

    def run(mode):
        _cores_for(mode)
        us = fields[mode]
        for t in us:
            t.zero_()
        us[0][1:-1, 1:-1, 1:-1] = u0
        dist.barrier()
        t0 = time.perf_counter()
        for k in range(steps):
            cur, nxt = us[k % 2], us[(k + 1) % 2]
            if mode == "blocking":
                blocking_exchange(cur, plan.data(), comm, tmp)
                stencil(cur, nxt, b, full)
            elif mode == "agent-blocking":
                q = reqs[mode][k % 2]
                q.start()
                q.wait()
                stencil(cur, nxt, b, full)
            else:
                q = reqs[mode][k % 2]
                q.start()
                stencil(cur, nxt, b, inner)
                q.wait()
                for bx in shell:
                    stencil(cur, nxt, b, bx)
        t = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        return float(t), us[steps % 2][1:-1, 1:-1, 1:-1].clone()

    times = {m: [] for m in modes}
    finals = {}
    for m in modes:  # warm-up, and the checked fields
        finals[m] = run(m)[1]
    for _ in range(repeats):
        for m in modes:
            times[m].append(run(m)[0])
    wrong = {}
    for m in modes:
        w = torch.tensor([float((finals[m] != finals["blocking"]).sum())])
        dist.all_reduce(w)
        wrong[m] = int(w.item())
    for m in reqs:
        for q in reqs[m]:
            q.free()
    return times, wrong, native


def _osu(ctx, size, repeats, iters, timeout):
    """{mode: {pure, overall, compute, alone: [us per repeat]}} for one size, modes interleaved per repeat."""
    import torch.distributed as dist

    from hpdl.offload.bench import Dummy, setup_point

    def avg(v):
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / ctx.world_size

    def med(xs):
        return statistics.median(xs)

    dummy = Dummy()
    modes = ("native", "agent")
    setups = {m: setup_point("alltoall", m, size, ctx, timeout) for m in modes}
    wrong = {m: int(avg(setups[m][2]()) * ctx.world_size) for m in modes}
    out = {m: {"pure": [], "overall": [], "compute": [], "alone": []} for m in modes}
    n_compute = {}
    for m in modes:
        start, wait = setups[m][0], setups[m][1]
        for _ in range(5):
            start()
            wait()
    for _ in range(repeats):
        for m in modes:
            _cores_for(m)
            start, wait = setups[m][0], setups[m][1]
            pure = []
            for _ in range(iters):
                dist.barrier()
                t0 = time.perf_counter()
                start()
                wait()
                pure.append(time.perf_counter() - t0)
            pure_us = avg(med(pure)) * 1e6
            # OSU: the compute lasts this mode's Pure Comm (of the first repeat, then fixed)
            n = n_compute.setdefault(m, None) or dummy.iterations(pure_us)
            n_compute[m] = n
            alone, both = [], []
            for _ in range(iters):
                dist.barrier()
                t0 = time.perf_counter()
                dummy.run(n)
                alone.append(time.perf_counter() - t0)
            for _ in range(iters):
                dist.barrier()
                t0 = time.perf_counter()
                start()
                c0 = time.perf_counter()
                dummy.run(n)
                c1 = time.perf_counter()
                wait()
                both.append((time.perf_counter() - t0, c1 - c0))
            out[m]["pure"].append(pure_us)
            out[m]["alone"].append(avg(med(alone)) * 1e6)
            out[m]["overall"].append(avg(med([o for o, _ in both])) * 1e6)
            out[m]["compute"].append(avg(med([c for _, c in both])) * 1e6)
    for m in modes:
        if setups[m][3] is not None:
            setups[m][3].free()
    return out, wrong


def _fft(ctx, shape, repeats, iters, chunks, timeout):
    """{mode: [seconds per forward transform, per repeat]} for blocking PencilFFT (gloo all-to-all) against
    OffloadPencilFFT on the agent, modes interleaved; #wrong: elements differing from the blocking result."""
    import torch.distributed as dist

    from hpdl.apps import fft3d
    from hpdl.apps.comm import TorchComm

    comm = TorchComm(use_hpdl=False)
    blocking = fft3d.PencilFFT(shape, comm)
    off = fft3d.OffloadPencilFFT(shape, blocking.grid, chunks=chunks, progress="agent", timeout=timeout)
    native = all(r._handle in r._backend.native for r in off.row_reqs + off.col_reqs)
    x = fft3d.global_input(shape, blocking.input_box(), torch.complex64)
    fns = {"blocking": blocking.forward, "offload": off.forward}
    ys = {m: f(x) for m, f in fns.items()}  # warm-up and the checked results
    w = torch.tensor([float((ys["offload"] != ys["blocking"]).sum())])
    dist.all_reduce(w)
    times = {m: [] for m in fns}
    for _ in range(repeats):
        for m, f in fns.items():
            _cores_for(m)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                f(x)
            t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[m].append(float(t))
    off.free()
    return times, int(w.item()), native


GPU_MODES = ("agent", "graph", "graph-ce", "agent-ce")
# HPDL_OFFLOAD_CUDA_COPY per mode: graph-ce pulls and agent-ce's agent copies on the copy engines
_COPY = {"agent": "kernel", "graph": "kernel", "graph-ce": "ce", "agent-ce": "ce"}


def gpu_rank(ctx, cfg):
    """4 ranks on one GPU (``ranks_per_gpu``): a persistent Alltoall on device buffers, while each rank's stream
    runs matmuls, run by

    - ``agent``: the agent process (CUDA IPC, ``cudaMemcpyAsync`` in its own context, host-side completion);
    - ``graph``: each rank's CUDA graph of captured ``cudaMemcpyAsync`` pulls (start/wait as stream events);
    - ``graph-ce``: the same pulls issued as one ``cudaMemcpyBatchAsync`` preferring the copy engines;
    - ``agent-ce``: a second agent, started with ``HPDL_OFFLOAD_CUDA_COPY=ce`` (measured after the others with
      the same compute: an agent reads the variable when it starts).

    OSU's numbers per repeat with the compute timed alone; #wrong against gloo on host copies. A mode that
    fails is reported with its error; the others stand. One matmul count for every mode, sized so that the
    compute alone lasts at least the slowest mode's Pure Comm (OSU's rule), and the first three modes are
    interleaved inside each repeat, so ``alone`` is one computation measured for each mode."""
    import math

    import torch.distributed as dist

    import hpdl.offload as ho
    from hpdl.offload.bench import overlap_pct

    dev = ctx.device
    torch.cuda.set_device(dev)
    P, r = ctx.world_size, ctx.rank
    count = cfg["gpu_count"]

    def all_max(v):
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    a = torch.randn(cfg["gpu_matmul"], cfg["gpu_matmul"], device=dev)
    c = torch.empty_like(a)

    def kernel(n):
        for _ in range(n):
            torch.mm(a, a, out=c)

    def timed(fn):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return all_max(time.perf_counter() - t0) * 1e6

    def pure_of(req):
        def pure():
            req.start()
            req.wait()
        return pure

    def both_of(req, n):
        def both():
            req.start()
            kernel(n)
            req.wait()
        return both

    res, reqs = {}, {}

    def build(mode):
        """Compile and check ``mode``'s request (collective; a failure anywhere is this mode's result)."""
        err = None
        try:
            inp = (torch.arange(P * count, dtype=torch.float32, device=dev) % 4093 + 10000 * r).view(P, count)
            out = torch.zeros_like(inp)
            req = ho.alltoall_init(inp, out, progress="graph" if mode.startswith("graph") else "agent",
                                   timeout=cfg["timeout"])
            reqs[mode] = req
            req.start()
            req.wait()
            want = torch.empty(P * count)
            dist.all_to_all_single(want, inp.view(-1).cpu())
            res[mode] = {"pure_us": [], "alone_us": [], "overall_us": [], "overlap_pct": [],
                         "wrong": int((out.view(-1).cpu() != want).sum())}
        except Exception as exc:  # noqa: BLE001 - reported in the goal line
            err = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
        ok = [None] * P
        dist.all_gather_object(ok, err)
        bad = next((e for e in ok if e), None)
        if bad:
            res[mode] = err or f"failed on another rank: {bad}"
            if mode in reqs:
                try:
                    reqs.pop(mode).free()
                except Exception:  # noqa: BLE001 - an active request after a failed wait: dropped
                    pass
        dist.barrier()
        if mode in reqs:
            for _ in range(3):
                pure_of(reqs[mode])()

    def measure(modes, n):
        for _ in range(cfg["repeats"]):
            for m in modes:
                q = reqs[m]
                p = statistics.median([timed(pure_of(q)) for _ in range(cfg["iters"])])
                al = statistics.median([timed(lambda: kernel(n)) for _ in range(cfg["iters"])])
                ov = statistics.median([timed(both_of(q, n)) for _ in range(cfg["iters"])])
                res[m]["pure_us"].append(p)
                res[m]["alone_us"].append(al)
                res[m]["overall_us"].append(ov)
                res[m]["overlap_pct"].append(overlap_pct(ov, al, p))
        for m in modes:
            res[m]["kernel_iters"] = n
            res[m]["matmul_us"] = one
            reqs.pop(m).free()

    kernel(3)
    torch.cuda.synchronize()
    one = statistics.median([timed(lambda: kernel(20)) for _ in range(3)]) / 20
    first = [m for m in GPU_MODES if m != "agent-ce"]
    with ho.Agent(threads=1, timeout=cfg["timeout"], reserve_cores=True):
        for mode in first:
            os.environ["HPDL_OFFLOAD_CUDA_COPY"] = _COPY[mode]
            build(mode)
        live = [m for m in first if m in reqs]
        pure0 = [statistics.median([timed(pure_of(reqs[m])) for _ in range(5)]) for m in live]
        n = max(1, math.ceil(max(pure0, default=one) / max(one, 1e-3)))
        measure(live, n)
        dist.barrier()
    os.environ["HPDL_OFFLOAD_CUDA_COPY"] = "ce"  # the second agent inherits it
    try:
        with ho.Agent(threads=1, timeout=cfg["timeout"], reserve_cores=True):
            build("agent-ce")
            if "agent-ce" in reqs:
                p0 = statistics.median([timed(pure_of(reqs["agent-ce"])) for _ in range(5)])
                measure(["agent-ce"], max(n, math.ceil(p0 / max(one, 1e-3))))  # compute >= its Pure Comm too
            dist.barrier()
    except Exception as exc:  # noqa: BLE001 - the agent did not start: the other modes stand
        res["agent-ce"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
    finally:
        os.environ["HPDL_OFFLOAD_CUDA_COPY"] = "kernel"
    return res


def _gpu_run(cfg, mps: bool):
    """gpu_rank's results under one MPS setting, or why there are none."""
    from hpdl.runtime.launch import spawn

    try:  # the CPU results stand whatever happens here
        return spawn(gpu_rank, 4, args=(cfg,), device="cuda", ranks_per_gpu=4, mps=mps,
                     timeout=min(cfg["timeout"], 100.0))[0]  # a hung mode must leave time for the rest
    except Exception as exc:  # noqa: BLE001 - reported in the goal line and the JSON
        return f"failed: {type(exc).__name__}: {str(exc)[:400]}"


def rank_main(ctx, cfg):
    import hpdl.offload as ho

    torch.set_num_threads(1)
    res = {"jacobi": {}, "osu": {}}
    every = set(os.sched_getaffinity(0))
    with ho.Agent(threads=cfg["agent_threads"], timeout=cfg["timeout"], reserve_cores=True) as agent:
        if agent.client.cores:
            _AFFINITY.update({"all": every, "app": set(os.sched_getaffinity(0))})
        res["agent_cores"] = list(agent.client.cores)
        for shape in cfg["sizes"] if "jacobi" in cfg["parts"] else ():
            t0 = time.perf_counter()
            times, wrong, native = _jacobi_modes(ctx, shape, cfg["steps"], cfg["repeats"], cfg["timeout"])
            res["jacobi"]["x".join(map(str, shape))] = {"times_s": times, "wrong": wrong, "native": native}
            if ctx.rank == 0:
                print(f"# jacobi {shape}: {time.perf_counter() - t0:.1f}s (native executor: {native})", flush=True)
        for shape in cfg["fft_shapes"] if "fft" in cfg["parts"] else ():
            t0 = time.perf_counter()
            times, wrong, native = _fft(ctx, shape, cfg["repeats"], cfg["fft_iters"], cfg["fft_chunks"],
                                        cfg["timeout"])
            res.setdefault("fft", {})["x".join(map(str, shape))] = {"times_s": times, "wrong": wrong,
                                                                    "native": native}
            if ctx.rank == 0:
                print(f"# fft {shape}: {time.perf_counter() - t0:.1f}s (native executor: {native})", flush=True)
        for size in cfg["osu_sizes"] if "osu" in cfg["parts"] else ():
            t0 = time.perf_counter()
            out, wrong = _osu(ctx, size, cfg["repeats"], cfg["iters"], cfg["timeout"])
            res["osu"][str(size)] = {"us": out, "wrong": wrong}
            if ctx.rank == 0:
                print(f"# osu {size} B: {time.perf_counter() - t0:.1f}s", flush=True)
    return res


def _spread(xs):
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def _overlap(overall, compute, pure):
    from hpdl.offload.bench import overlap_pct

    return overlap_pct(overall, compute, pure)


def report(res, cfg) -> tuple[list[str], dict]:
    lines, goals = [], {}
    lines.append(f"# Jacobi, {cfg['np']} ranks, slabs along z, {cfg['steps']} steps x {cfg['repeats']} interleaved "
                 "repeats: step ms median [min-max]; ratio = agent / blocking per repeat")
    lines.append(f"  {'block':>12} {'mode':>15} {'step ms':>24} {'vs blocking':>24} {'#wrong':>7}")
    ratios_all = {}
    for shape, r in res["jacobi"].items():
        t = r["times_s"]
        for m, xs in t.items():
            ratio = [a / b for a, b in zip(xs, t["blocking"])]
            ratios_all.setdefault(shape, {})[m] = ratio
            lines.append(f"  {shape:>12} {m:>15} {_spread([x * 1e3 for x in xs]):>24} {_spread(ratio):>24} "
                         f"{r['wrong'][m]:>7}")
    lines.append(f"# OSU ialltoall, {cfg['np']} ranks: us median [min-max] over repeats; Ovl = OSU's overlap, "
                 "Eff = against the compute alone")
    lines.append(f"  {'size':>8} {'mode':>7} {'Pure Comm':>24} {'Overall':>24} {'Compute':>10} {'alone':>10} "
                 f"{'Ovl%':>6} {'Eff%':>6} {'#wrong':>7}")
    osu_summary = {}
    for size, r in res["osu"].items():
        for m, d in r["us"].items():
            pm, om, cm, am = (statistics.median(d[k]) for k in ("pure", "overall", "compute", "alone"))
            ovl, eff = _overlap(om, cm, pm), _overlap(om, am, pm)
            effs = [_overlap(o, a, p) for o, a, p in zip(d["overall"], d["alone"], d["pure"])]
            osu_summary.setdefault(size, {})[m] = {"pure": pm, "overall": om, "eff": eff, "effs": effs,
                                                   "pures": d["pure"]}
            lines.append(f"  {size:>8} {m:>7} {_spread(d['pure']):>24} {_spread(d['overall']):>24} {cm:>10.1f} "
                         f"{am:>10.1f} {ovl:>6.1f} {eff:>6.1f} {r['wrong'][m]:>7}")
    lines.append(f"# 3-D FFT, {cfg['np']} ranks, {cfg['fft_iters']} transforms x {cfg['repeats']} interleaved repeats, "
                 f"{cfg['fft_chunks']} slabs: ms per transform median [min-max]; ratio = offload / blocking per repeat")
    fft_ratio = {}
    for shape, r in res.get("fft", {}).items():
        t = r["times_s"]
        for m, xs in t.items():
            ratio = [a / b for a, b in zip(xs, t["blocking"])]
            if m == "offload":
                fft_ratio[shape] = statistics.median(ratio)
            lines.append(f"  {shape:>12} {m:>15} {_spread([x * 1e3 for x in xs]):>24} {_spread(ratio):>24} "
                         f"{r['wrong'] if m == 'offload' else 0:>7}")
    jac = {s: statistics.median(v["agent"]) for s, v in ratios_all.items()}
    if jac:
        goals["jacobi"] = all(x <= GOAL_JACOBI for x in jac.values())
        lines.append(f"GOAL Jacobi agent <= {GOAL_JACOBI}x blocking at every block: "
                     f"{'MET' if goals['jacobi'] else 'MISSED'} ("
                     + ", ".join(f"{s} {x:.2f}x" for s, x in jac.items()) + ")")
    else:
        lines.append("GOAL Jacobi: NOT RUN (--parts)")
    if fft_ratio:
        goals["fft"] = all(x <= 0.8 for x in fft_ratio.values())
        lines.append("GOAL FFT with offloaded pipelined transposes <= 0.8x blocking: "
                     f"{'MET' if goals['fft'] else 'MISSED'} ("
                     + ", ".join(f"{s} {x:.2f}x" for s, x in fft_ratio.items()) + ")")
    else:
        lines.append("GOAL FFT: NOT RUN (--parts)")
    if osu_summary:
        k64 = str(64 * 1024) if str(64 * 1024) in osu_summary else min(osu_summary, key=int)
        per = [a / n for a, n in zip(osu_summary[k64]["agent"]["pures"], osu_summary[k64]["native"]["pures"])]
        pr = statistics.median(per)
        goals["pure_64k"] = pr <= GOAL_PURE_64K
        lines.append(f"GOAL agent Pure Comm at {k64} B <= {GOAL_PURE_64K}x native: "
                     f"{'MET' if goals['pure_64k'] else 'MISSED'} ({pr:.2f}x, per repeat {min(per):.2f}-{max(per):.2f})")
        effs = {s: v["agent"]["eff"] for s, v in osu_summary.items() if int(s) >= 64 * 1024 or cfg["smoke"]}
        goals["effective"] = all(e >= GOAL_EFFECTIVE for e in effs.values())
        lines.append(f"GOAL agent effective overlap >= {GOAL_EFFECTIVE:.0f}% at >= 64 KiB: "
                     f"{'MET' if goals['effective'] else 'MISSED'} ("
                     + ", ".join(f"{s} B {e:.1f}%" for s, e in effs.items()) + ")")
    else:
        lines.append("GOAL OSU: NOT RUN (--parts)")
    g = res.get("gpu")
    gpu_ok = []
    settings = g if isinstance(g, dict) else {}
    for setting, sres in settings.items():
        for mode in GPU_MODES:
            m = sres.get(mode) if isinstance(sres, dict) else sres
            if not isinstance(m, dict):
                lines.append(f"# GPU {setting:>6} {mode:>8}: NOT MEASURED ({m})")
                continue
            ovl = statistics.median(m["overlap_pct"])
            gpu_ok.append((setting, mode, ovl, m["wrong"]))
            lines.append(f"# GPU {setting:>6} {mode:>8}: Pure {_spread(m['pure_us']):>26} us, alone "
                         f"{_spread(m['alone_us']):>26} us ({m['kernel_iters']} x {m['matmul_us']:.0f} us matmuls), "
                         f"Overall {_spread(m['overall_us']):>26} us, effective overlap {ovl:.1f}% "
                         f"({min(m['overlap_pct']):.1f}-{max(m['overlap_pct']):.1f}), #wrong {m['wrong']}")
    goals["gpu"] = any(o >= GOAL_EFFECTIVE and w == 0 for _, _, o, w in gpu_ok)
    head = (f"4 ranks on one GPU, Alltoall {cfg['gpu_count'] * 4} B per peer on device buffers vs "
            f"{cfg['gpu_matmul']}^2 fp32 matmuls, effective overlap >= {GOAL_EFFECTIVE:.0f}%: ")
    if gpu_ok:
        lines.append("GOAL " + head + ("MET" if goals["gpu"] else "MISSED") + " ("
                     + ", ".join(f"{st} {md} {o:.1f}%" for st, md, o, _ in gpu_ok) + ")")
    else:
        lines.append("GOAL " + head + f"NOT MEASURED ({g if not settings else settings})")
    wrong = sum(m["wrong"] for sres in settings.values() if isinstance(sres, dict) for m in sres.values()
                if isinstance(m, dict)) + \
        sum(r["wrong"] for r in res.get("fft", {}).values()) + \
        sum(sum(r["wrong"].values()) for r in res["jacobi"].values()) + \
        sum(sum(r["wrong"].values()) for r in res["osu"].values())
    lines.append(f"# #wrong total: {wrong}")
    goals["wrong"] = wrong
    # the tables first, the goal lines last
    return [x for x in lines if not x.startswith("GOAL")] + [x for x in lines if x.startswith("GOAL")], goals


def _comm_part(out: Path, smoke: bool, timeout: float) -> list[str]:
    """Run benchmarks/comm_apps_device.py (its own spawn of 8 ranks, ~60-100 s) into ``out``; its goal lines,
    prefixed, or why there are none."""
    import subprocess

    script = Path(__file__).resolve().parent / "comm_apps_device.py"
    cmd = [sys.executable, str(script), "--out", str(out)] + (["--smoke"] if smoke else [])
    t0 = time.perf_counter()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 240.0))
    except subprocess.TimeoutExpired:
        return [f"GOAL comm: NOT MEASURED (comm_apps_device.py ran past {max(timeout, 240.0):.0f} s)"]
    got = [f"GOAL comm: {x[5:]}" for x in run.stdout.splitlines() if x.startswith("GOAL ")]
    print(f"# comm: comm_apps_device.py exit {run.returncode}, {time.perf_counter() - t0:.1f}s, see {out}", flush=True)
    if run.returncode or not got:
        got.append(f"GOAL comm: comm_apps_device.py exit {run.returncode}: {run.stderr.strip()[-300:]}")
    return got


def main(argv=None) -> int:
    from hpdl.bench.common import run_metadata
    from hpdl.offload import native
    from hpdl.runtime.launch import spawn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for offload.json and offload.log")
    p.add_argument("--np", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--iters", type=int, default=15, help="timed iterations per OSU loop and repeat")
    p.add_argument("--agent-threads", type=int, default=4)
    p.add_argument("--fft-iters", type=int, default=5, help="timed FFTs per repeat")
    p.add_argument("--fft-chunks", type=int, default=4, help="slabs of the pipelined transposes")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--gpu-mps", choices=("both", "on", "off"), default="both",
                   help="gpu part: without MPS, under a private MPS daemon, or both side by side (default)")
    p.add_argument("--gpu-matmul", type=int, default=1024, help="gpu part: the compute's square fp32 matmul size")
    p.add_argument("--smoke", action="store_true", help="tiny CPU plumbing check (2 ranks, small blocks)")
    p.add_argument("--parts", default="jacobi,fft,osu,gpu,comm",
                   help="comma-separated parts to run: jacobi, fft, osu (8 CPU ranks), gpu (4 ranks on one GPU, "
                        "with and without MPS), comm (benchmarks/comm_apps_device.py: hpdl.comm auto against native, "
                        "CG, GPT; into OUT/comm)")
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if not parts or parts - {"jacobi", "fft", "osu", "gpu", "comm"}:
        p.error(f"--parts takes a comma-separated subset of jacobi,fft,osu,gpu,comm, got {args.parts!r}")
    sizes = [(4, 256, 256), (6, 256, 256), (8, 256, 256)]
    osu_sizes = [64 << 10, 256 << 10, 1 << 20]
    fft_shapes = [(128, 128, 128)]
    if args.smoke:
        args.np, args.repeats, args.steps, args.iters, args.agent_threads = 2, 2, 3, 3, 2
        sizes, osu_sizes, fft_shapes = [(2, 16, 16), (3, 16, 16)], [1 << 10, 4 << 10], [(8, 8, 8)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    built = native.load() is not None
    cfg = {"np": args.np, "repeats": args.repeats, "steps": args.steps, "iters": args.iters,
           "agent_threads": args.agent_threads, "timeout": args.timeout, "sizes": sizes, "osu_sizes": osu_sizes,
           "fft_shapes": fft_shapes, "gpu_count": 1 << 20, "gpu_matmul": args.gpu_matmul,
           "fft_iters": args.fft_iters, "fft_chunks": args.fft_chunks,
           "smoke": args.smoke, "parts": sorted(parts)}
    t0 = time.perf_counter()
    if parts & {"jacobi", "fft", "osu"}:
        res = spawn(rank_main, args.np, args=(cfg,), timeout=args.timeout)[0]
    else:
        res = {"jacobi": {}, "osu": {}}
    if "gpu" not in parts:
        res["gpu"] = "not run (--parts)"
    elif not torch.cuda.is_available():
        res["gpu"] = "no CUDA GPU here"
    else:  # side by side: the ranks' contexts time-sliced (no MPS) and sharing the SMs (a private MPS daemon)
        res["gpu"] = {name: _gpu_run(cfg, on) for name, on in (("no-MPS", False), ("MPS", True))
                      if args.gpu_mps in ("both", "on" if on else "off")}
    comm_goals = (_comm_part(out / "comm", args.smoke, args.timeout) if "comm" in parts
                  else ["GOAL comm: NOT RUN (--parts)"])
    lines, goals = report(res, cfg)
    lines += comm_goals
    goals["comm"] = comm_goals
    meta = run_metadata(device="cuda" if torch.cuda.is_available() else "cpu", np=args.np, native_built=built,
                        seconds=round(time.perf_counter() - t0, 1), loadavg_after=list(os.getloadavg()))
    (out / "offload.json").write_text(json.dumps({"meta": meta, "config": cfg, "results": res, "goals": goals},
                                                 indent=1, default=str))
    head = f"# offload_device: {meta['date']}, commit {meta['commit']}, {meta['cores']} cpus, " \
           f"native executor built: {built}, agent cores {res.get('agent_cores') or 'not pinned'}, {meta['seconds']}s"
    (out / "offload.log").write_text("\n".join([head, *lines]) + "\n")
    print(head)
    print("\n".join(lines))
    return 1 if goals["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
