"""Application kernel: a 3-D Jacobi solver whose halo exchange is offloaded, against the blocking version.

Each rank owns a block of a ``(pz*nz, py*ny, px*nx)`` grid (periodic across ranks in decomposed dimensions,
zero Dirichlet halos in the others) and iterates the 7-point update ``u' = (sum of 6 neighbours + b) / 6``.

Modes (one step each):
- ``blocking``: torch.distributed ``isend``/``irecv`` of every face (through hpdl.comm's ``TorchTransport``),
  wait for all, update the whole block (what an MPI code without overlap does).
- ``agent-blocking``: the offloaded exchange started and waited at once, then the whole update (the agent's
  communication time, with no overlap).
- ``agent``: start the offloaded exchange, update the interior (which needs no halo), wait, update the
  boundary shell: communication hidden behind the interior update.
- ``thread``: the same overlap with the in-process progress thread.

Every mode computes bit-identical fields (same operations in the same order per point; ``#wrong`` counts
differences from ``blocking``). :class:`JacobiBenchmark` is the harness plug-in (``hpdl offload jacobi``, also
``hpdl bench jacobi``); the kernels (:func:`stencil`, :func:`boxes`) are also ``benchmarks/offload_device.py``'s.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

from hpdl.bench.common import Benchmark, Column, Panel, PlotSpec, command
from hpdl.comm.transport.torch_p2p import TorchTransport
from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.limits import count, real

MODES = ("blocking", "agent-blocking", "agent", "thread")


def parse_shape(text: str, n: int = 3) -> tuple[int, ...]:
    parts = tuple(int(x) for x in text.lower().split("x"))
    if len(parts) != n or any(v < 1 for v in parts):
        raise ValueError(f"expected {n} positive extents like 8x256x256, got {text!r}")
    return parts


def boxes(shape, exchanged) -> tuple[tuple[slice, ...], list[tuple[slice, ...]]]:
    """The interior box (needs no halo) and the boundary slabs covering the rest of the owned block, disjoint;
    owned cells are ``[1, n+1)`` per dimension. A dimension not ``exchanged`` has no boundary slab."""
    d = len(shape)
    inner = [slice(2, n) if e else slice(1, n + 1) for n, e in zip(shape, exchanged)]
    full = [slice(1, n + 1) for n in shape]
    shell = []
    for i in range(d):
        if not exchanged[i]:
            continue
        for k, (lo, hi) in enumerate(((1, 2), (shape[i], shape[i] + 1))):
            if k == 1 and shape[i] == 1:
                continue  # one layer: the first slab already covers it
            box = [inner[j] if j < i else full[j] for j in range(d)]
            box[i] = slice(lo, hi)
            shell.append(tuple(box))
    return tuple(inner), shell


def stencil(u: torch.Tensor, out: torch.Tensor, b: torch.Tensor, box: tuple[slice, ...]) -> None:
    """``out[box] = (6 neighbours of u + b) / 6`` on ``box`` of the padded arrays (same order everywhere)."""
    z, y, x = box
    if any(s.stop <= s.start for s in box):
        return
    o = out[z, y, x]
    sh = lambda a, dz, dy, dx: a[z.start + dz:z.stop + dz, y.start + dy:y.stop + dy, x.start + dx:x.stop + dx]
    torch.add(sh(u, -1, 0, 0), sh(u, 1, 0, 0), out=o)
    o.add_(sh(u, 0, -1, 0)).add_(sh(u, 0, 1, 0)).add_(sh(u, 0, 0, -1)).add_(sh(u, 0, 0, 1))
    o.add_(b[z.start - 1:z.stop - 1, y.start - 1:y.stop - 1, x.start - 1:x.stop - 1]).mul_(1.0 / 6.0)


def initial_field(shape, grid, rank, dtype):
    """This rank's ``shape`` block of the Jacobi problem on process ``grid``: the initial field ``u`` (smooth
    sines of the global coordinates) and the constant right-hand side ``b`` = 0.01, both as ``dtype``."""
    from hpdl.offload.plans import grid_coords

    c = grid_coords(rank, grid)
    gz, gy, gx = (torch.arange(ci * n, (ci + 1) * n, dtype=torch.float64) for ci, n in zip(c, shape))
    u = torch.sin(0.1 * gz)[:, None, None] + torch.cos(0.07 * gy)[None, :, None] * torch.sin(0.05 * gx)[None, None, :]
    b = 0.01 * torch.ones(shape, dtype=torch.float64)
    return u.to(dtype), b.to(dtype)


def blocking_exchange(u, plan_data, comm, tmp):
    """The blocking baseline's halo exchange: every face posted on ``comm`` (a
    :class:`~hpdl.comm.transport.torch_p2p.TorchTransport` of the plan's group), waited, unpacked."""
    works, unpack, sent = [], [], []
    for op in plan_data.ops:
        view = u[op.src.slices()] if op.kind == "send" else u[op.dst.slices()]
        if op.kind == "send":
            sent.append(view.contiguous())  # alive until its wait
            works.append(comm.isend(sent[-1], op.peer, op.tag))
        else:
            buf = tmp[op.name]
            works.append(comm.irecv(buf, op.peer, op.tag))
            unpack.append((view, buf))
    for w in works:
        w.wait()
    for view, buf in unpack:
        view.copy_(buf.view(view.shape))


def run_rank(ctx, shapes, grid, modes, steps, repeats, dtype_name, agent_threads, timeout):
    """One rank's measurement of every mode at every block shape: ``{shape: {mode: timings and checks}}``."""
    import hpdl.offload as ho

    from hpdl.bench.common import Progress

    torch.set_num_threads(1)
    bar = Progress(len(shapes), "jacobi", enabled=ctx.rank == 0)
    agent = ho.Agent(threads=agent_threads, timeout=timeout).start() if any(m.startswith("agent") for m in modes) \
        else None
    try:
        out = {}
        for shape in shapes:
            t0 = time.perf_counter()
            out[shape] = _measure(ctx, shape, grid, modes, steps, repeats, getattr(torch, dtype_name), timeout)
            bar.advance(f"jacobi {'x'.join(map(str, shape))}: {time.perf_counter() - t0:.1f} s")
        return out
    finally:
        bar.close()
        if agent is not None:
            agent.stop()


def _measure(ctx, shape, grid, modes, steps, repeats, dtype, timeout):
    import torch.distributed as dist

    import hpdl.offload as ho
    from hpdl.offload import plans

    r = ctx.rank
    periodic = tuple(g > 1 for g in grid)
    plan = plans.halo3d(shape, grid, r, dtype, periodic=periodic)
    inner, shell = boxes(shape, periodic)
    u0, b = initial_field(shape, grid, r, dtype)
    padded = tuple(n + 2 for n in shape)
    comm = TorchTransport(None, timeout)
    tmp = {op.name: torch.empty(op.dst.numel, dtype=dtype) for op in plan.ops if op.kind == "recv"}
    results, reference = {}, None
    for mode in modes:
        alloc = ho.empty if mode.startswith("agent") else (lambda s, d: torch.zeros(s, dtype=d))
        us = [alloc(padded, dtype), alloc(padded, dtype)]
        reqs = None
        if mode != "blocking":
            progress = "agent" if mode.startswith("agent") else "thread"
            reqs = [ho.compile(plan, {"u": t}, progress=progress, timeout=timeout) for t in us]

        def reset():
            for t in us:
                t.zero_()
            us[0][1:-1, 1:-1, 1:-1] = u0

        def step(k, comm_t):
            cur, nxt = us[k % 2], us[(k + 1) % 2]
            if mode == "blocking":
                t0 = time.perf_counter()
                blocking_exchange(cur, plan.data(), comm, tmp)
                comm_t[0] += time.perf_counter() - t0
                stencil(cur, nxt, b, tuple(slice(1, n + 1) for n in shape))
            elif mode == "agent-blocking":
                t0 = time.perf_counter()
                reqs[k % 2].start()
                reqs[k % 2].wait()
                comm_t[0] += time.perf_counter() - t0
                stencil(cur, nxt, b, tuple(slice(1, n + 1) for n in shape))
            else:
                reqs[k % 2].start()
                stencil(cur, nxt, b, inner)
                t0 = time.perf_counter()
                reqs[k % 2].wait()
                comm_t[0] += time.perf_counter() - t0  # exposed (not hidden) communication
                for box in shell:
                    stencil(cur, nxt, b, box)

        times, comms = [], []
        for rep in range(repeats + 1):  # the first repeat warms up and gives the checked field
            reset()
            comm_t = [0.0]
            dist.barrier()
            t0 = time.perf_counter()
            for k in range(steps):
                step(k, comm_t)
            elapsed = time.perf_counter() - t0
            if rep == 0:
                final = us[steps % 2][1:-1, 1:-1, 1:-1].clone()
                continue
            t = torch.tensor([elapsed / steps, comm_t[0] / steps], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            times.append(float(t[0]))
            comms.append(float(t[1]))
        if reference is None:
            reference = final
        wrong = torch.tensor([float((final != reference).sum())])
        dist.all_reduce(wrong)
        results[mode] = {"step_ms": sorted(times)[len(times) // 2] * 1e3, "steps_ms": [x * 1e3 for x in times],
                         "comm_ms": sorted(comms)[len(comms) // 2] * 1e3, "wrong": int(wrong.item()),
                         "reference": modes[0],
                         # which executor ran the exchange (the agent falls back to Python without a C compiler)
                         "executor": "torch.distributed" if reqs is None else reqs[0].executor}
        for q in reqs or ():
            q.free()
    return results


class JacobiBenchmark(Benchmark):
    """``hpdl offload jacobi`` (also ``hpdl bench jacobi``): step time of a 3-D Jacobi solver per halo-exchange
    mode and block shape, one spawned gloo job of ``--np`` ranks; exit status 1 when a mode's field differs
    from the first mode's (``#wrong``). ``vs <first mode>`` is a time ratio: lower is better."""

    name = "jacobi"
    title = "3-D Jacobi step time"
    plot_spec = PlotSpec(x="cells", xlabel="owned cells per rank", series="mode",
                         panels=(Panel("step_ms", "step time (ms), median of repeats"),
                                 Panel("comm_ms", "exchange time per step (ms)")))

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        from hpdl.bench.cli import _HelpFormatter

        p.formatter_class = _HelpFormatter
        p.add_argument("--np", type=count(1, 1024), default=4, help="ranks to spawn")
        p.add_argument("--sizes", default="4x256x256,6x256x256,8x256x256",
                       help="comma-separated owned block shapes ZxYxX per rank")
        p.add_argument("--grid", default=None, help="process grid PZxPYxPX (default NPx1x1: slabs along z)")
        p.add_argument("--steps", type=count(1, 1 << 24), default=30, help="timed steps per repeat")
        p.add_argument("--repeats", type=count(1, 10_000), default=3, help="timed repeats per mode (median reported)")
        p.add_argument("--modes", default=",".join(MODES),
                       help=f"comma-separated from {', '.join(MODES)}; the first is the reference of the ratio")
        p.add_argument("--agent-threads", type=count(1, 1024), default=4, help="copy threads of the agent (its cores)")
        p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="element type")
        p.add_argument("--timeout", type=real(0, 7 * 86400, strict=True), default=120.0,
                       help="seconds any wait may take")

    def validate(self, args) -> None:
        try:
            self.shapes = [parse_shape(s) for s in args.sizes.split(",") if s.strip()]
            self.grid = parse_shape(args.grid) if args.grid else (args.np, 1, 1)
        except ValueError as exc:
            raise CLIUsageError(f"--sizes/--grid: {exc}") from None
        if not self.shapes:
            raise CLIUsageError(f"--sizes must name at least one block shape ZxYxX, got {args.sizes!r}")
        if math.prod(self.grid) != args.np:
            raise CLIUsageError(f"--grid {self.grid} has {math.prod(self.grid)} ranks but --np is {args.np}")
        self.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise CLIUsageError(f"--modes must be from {MODES}, got {bad or self.modes}")
        base = self.modes[0]
        self.title = f"3-D Jacobi step time, {args.np} ranks, grid {'x'.join(map(str, self.grid))}, {args.dtype}"
        self.columns = (
            Column("shape", "block"), Column("mode", "mode"), Column("step_ms", "step", "ms", ".3f"),
            Column("comm_ms", "comm", "ms", ".3f"),
            Column(lambda r: None if r["comm_fraction"] is None else 100 * r["comm_fraction"], "comm", "%", ".0f"),
            Column("vs_" + base, "vs " + base, fmt=".2f", ratio="time ratio"), Column("wrong", "#wrong"),
            Column("executor", "executor"))

    def metadata(self, args) -> dict:
        return {"np": args.np, "grid": self.grid, "modes": self.modes, "steps": args.steps,
                "repeats": args.repeats, "dtype": args.dtype, "agent_threads": args.agent_threads}

    def run(self, ctx) -> list[dict]:
        from hpdl.runtime.launch import spawn

        a, modes = ctx.args, self.modes
        res_all = spawn(run_rank, a.np, args=(self.shapes, self.grid, modes, a.steps, a.repeats, a.dtype,
                                              a.agent_threads, a.timeout), timeout=a.timeout)[0]
        ctx.meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]   # a shared host's load, for the reader
        rows = []
        for shape in self.shapes:
            res, base = res_all[shape], res_all[shape][modes[0]]
            for m in modes:
                rows.append({"shape": "x".join(map(str, shape)), "cells": math.prod(shape), "mode": m, **res[m],
                             "vs_" + modes[0]: res[m]["step_ms"] / base["step_ms"],
                             "comm_fraction": res[m]["comm_ms"] / res[m]["step_ms"] if m.endswith("blocking")
                             else None})
        return rows

    def table(self, rows, ctx) -> str:
        return super().table(rows, ctx) + "\n" + COMM_NOTE


COMM_NOTE = ("# comm: exchange time per step (blocking modes: all of it, and its % of the step; overlapped modes: "
             "the exposed part left after the interior update)")

JacobiCommand = command(JacobiBenchmark)
