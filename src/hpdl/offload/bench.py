"""``hpdl bench overlap``: communication/computation overlap, measured as the OSU non-blocking benchmarks do.

For every message size and mode (c/util/osu_util_mpi.c, ``osu_ialltoall``):
- Pure Comm: ``start(); wait()`` alone;
- Overall: ``start(); compute(); wait()`` with a compute of at least Pure Comm (``--compute-factor``);
- Compute: the compute's own time inside that loop;
- Overlap % = max(0, 100 - 100 * (Overall - Compute) / Pure Comm).

The application never calls ``test()`` during the compute (OSU's test_time is 0 here): whatever overlap
shows up is progress made without it. Modes: ``native`` (torch.distributed's non-blocking collective with
``async_op=True``, the host busy computing), ``thread`` (hpdl.offload's in-process progress thread) and
``agent`` (the progress agent). Every point is checked once against torch.distributed (``#wrong``).
:class:`OverlapBenchmark` is the harness plug-in (:mod:`hpdl.bench.common`); :class:`Dummy`, :func:`setup_point` and
:func:`overlap_pct` are also ``benchmarks/offload_device.py``'s.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

from hpdl.bench.common import Benchmark, Column, Panel, PlotSpec, command, format_table as _format_table
from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.limits import check_fits, count, real

MODES = ("native", "thread", "agent")
PATTERNS = ("alltoall", "allreduce")


class Dummy:
    """A busy host: ``run(us)`` multiplies 64x64 matrices (one thread) for about ``us`` microseconds, by a
    calibrated iteration count (so a slowed-down host takes longer, as OSU's dummy_compute)."""

    def __init__(self):
        self.a, self.b = torch.rand(64, 64), torch.rand(64, 64)
        self.c = torch.empty(64, 64)
        for _ in range(50):
            torch.mm(self.a, self.b, out=self.c)
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                torch.mm(self.a, self.b, out=self.c)
            best = min(best, (time.perf_counter() - t0) / 200)
        self.us_per_iter = best * 1e6

    def iterations(self, us: float) -> int:
        return max(1, int(math.ceil(us / self.us_per_iter)))

    def run(self, n: int) -> None:
        a, b, c = self.a, self.b, self.c
        for _ in range(n):
            torch.mm(a, b, out=c)


def setup_point(pattern: str, mode: str, size: int, ctx, timeout: float):
    """(start, wait, check) for one point: check() runs once on exact data and returns #wrong on this rank."""
    import torch.distributed as dist

    import hpdl.offload as ho

    P, r = ctx.world_size, ctx.rank
    alloc = ho.empty if mode == "agent" else (lambda s, d: torch.zeros(s, dtype=d))
    if pattern == "alltoall":
        count = max(1, size // 4)
        inp, out = alloc((P, count), torch.float32), alloc((P, count), torch.float32)
        inp.copy_(torch.arange(P * count, dtype=torch.float32).view(P, count) % 1000 + 1000 * r)
        if mode == "native":
            work = []
            start = lambda: work.append(dist.all_to_all_single(out.view(-1), inp.view(-1), async_op=True))
            wait = lambda: work.pop().wait()
            req = None
        else:
            req = ho.alltoall_init(inp, out, progress=mode, timeout=timeout)
            start, wait = req.start, req.wait

        def check():
            out.zero_()
            start()
            wait()
            want = torch.empty(P * count)
            dist.all_to_all_single(want, inp.view(-1).clone())
            return int((out.view(-1) != want).sum())
    else:
        count = max(1, size // 4)
        data = alloc((count,), torch.float32)
        if mode == "native":
            work = []
            start = lambda: work.append(dist.all_reduce(data, async_op=True))
            wait = lambda: work.pop().wait()
            req = None
        else:
            req = ho.allreduce_init(data, progress=mode, timeout=timeout)
            start, wait = req.start, req.wait

        def check():
            x = torch.arange(count, dtype=torch.float32) % 1000 * (r + 1)
            data.copy_(x)
            start()
            wait()
            want = x.clone()
            dist.all_reduce(want)
            return int((data != want).sum())
    return start, wait, check, req


def overlap_rank(ctx, cfg: dict) -> list[dict]:
    """Every point of the sweep on this rank; the returned rows (rank 0's) hold averages over ranks."""
    import torch.distributed as dist

    import hpdl.offload as ho

    from hpdl.bench.common import Progress

    torch.set_num_threads(1)
    dummy = Dummy()
    rows = []
    bar = Progress(len(cfg["modes"]) * len(cfg["sizes"]), "overlap", enabled=ctx.rank == 0 and cfg["progress"])

    def avg(v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / ctx.world_size

    def loop(iters, body) -> list[float]:
        out = []
        for _ in range(iters):
            dist.barrier()
            out.append(body())
        return out

    agent = ho.Agent(threads=cfg["agent_threads"], timeout=cfg["timeout"]).start() if "agent" in cfg["modes"] \
        else None
    try:
        for mode in cfg["modes"]:
            for size in cfg["sizes"]:
                start, wait, check, req = setup_point(cfg["pattern"], mode, size, ctx, cfg["timeout"])
                wrong = int(avg(check()) * ctx.world_size)
                for _ in range(3):
                    start()
                    wait()

                def pure():
                    t0 = time.perf_counter()
                    start()
                    wait()
                    return time.perf_counter() - t0

                first = avg(min(loop(3, pure)))
                iters = int(min(cfg["iters"], max(5, cfg["time_per_point"] / 3 / max(first, 1e-6))))
                pure_us = avg(_median(loop(iters, pure))) * 1e6
                n = dummy.iterations(pure_us * cfg["compute_factor"])

                def alone():
                    t0 = time.perf_counter()
                    dummy.run(n)
                    return time.perf_counter() - t0

                def overlapped():
                    t0 = time.perf_counter()
                    start()
                    c0 = time.perf_counter()
                    dummy.run(n)
                    c1 = time.perf_counter()
                    wait()
                    return time.perf_counter() - t0, c1 - c0

                alone_us = avg(_median(loop(iters, alone))) * 1e6
                both = loop(iters, overlapped)
                overall_us = avg(_median([o for o, _ in both])) * 1e6
                compute_us = avg(_median([c for _, c in both])) * 1e6
                overlap = overlap_pct(overall_us, compute_us, pure_us)
                effective = overlap_pct(overall_us, alone_us, pure_us)
                rows.append({"pattern": cfg["pattern"], "mode": mode, "size": size, "overall_us": overall_us,
                             "compute_us": compute_us, "pure_comm_us": pure_us, "overlap_pct": overlap,
                             "compute_alone_us": alone_us, "effective_overlap_pct": effective, "iters": iters,
                             "wrong": wrong})
                if req is not None:
                    req.free()
                bar.advance(f"{mode} {size} B: overlap {overlap:.1f}%")
    finally:
        bar.close()
        if agent is not None:
            agent.stop()
    return rows


def overlap_pct(overall_us: float, compute_us: float, pure_us: float) -> float:
    """OSU's overlap: ``max(0, 100 - 100 (Overall - Compute) / Pure Comm)`` in percent (0 when Pure Comm is 0).

    With ``compute_us`` the compute measured inside the overlapped loop this is OSU's number, which credits a
    compute that progress slowed down; with the compute timed *alone* (no communication) it is the effective
    overlap: how much of the communication time the application really got back.
    """
    if pure_us <= 0:
        return 0.0
    return max(0.0, 100.0 - 100.0 * (overall_us - compute_us) / pure_us)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _effective(r: dict) -> float:
    """A row's effective overlap (rows written before it was recorded get it from their times)."""
    eff = r.get("effective_overlap_pct")
    return overlap_pct(r["overall_us"], r["compute_alone_us"], r["pure_comm_us"]) if eff is None else eff


COLUMNS = (Column("size", "size", "B"), Column("mode", "mode"), Column("overall_us", "Overall", "us", ".1f"),
           Column("compute_us", "Compute", "us", ".1f"), Column("pure_comm_us", "Pure Comm", "us", ".1f"),
           Column("overlap_pct", "Overlap", "%", ".1f"), Column("compute_alone_us", "alone", "us", ".1f"),
           Column(_effective, "Eff.ovl", "%", ".1f"), Column("wrong", "#wrong"))

NOTES = ("# alone: the same compute without communication (Compute above it = slowed down by progress)",
         "# Eff.ovl: overlap against the compute alone, 100 - 100 (Overall - alone) / Pure Comm (OSU's Overlap "
         "credits a slowed compute)")


def format_table(rows) -> str:
    """The overlap table (OSU's columns, then the compute alone and the effective overlap), with its notes."""
    return "\n".join([_format_table(rows, COLUMNS), *NOTES])


class OverlapBenchmark(Benchmark):
    """``hpdl bench overlap``: OSU-style overlap of native non-blocking ops, the progress thread and the agent,
    one spawned gloo job of ``--np`` ranks; exit status 1 when a point's result differs from
    torch.distributed's (``#wrong``)."""

    name = "overlap"
    title = "OSU-style overlap"
    columns = COLUMNS
    plot_spec = PlotSpec(x="size", xlabel="message size (bytes)", xscale="log2", series="mode",
                         panels=(Panel("overlap_pct", "overlap (%)"),
                                 Panel(_effective, "effective overlap (%)"),
                                 Panel("pure_comm_us", "pure comm (us)", "log")))

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        from hpdl.bench.cli import _HelpFormatter, parse_size

        p.formatter_class = _HelpFormatter
        p.add_argument("--np", type=count(1, 1024), default=4, help="ranks to spawn")
        p.add_argument("--pattern", default="alltoall", choices=PATTERNS,
                       help="alltoall (size = bytes per peer, as osu_ialltoall) or allreduce (bytes of the buffer)")
        p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated from {', '.join(MODES)}")
        # -b/-e/-f as nccl-tests (and hpdl bench allreduce); --min/--max are this command's older spellings
        p.add_argument("-b", "--min-bytes", "--min", dest="min_size", type=parse_size, default=1 << 10,
                       metavar="SIZE", help="smallest size in bytes (suffixes K, M, G)")
        p.add_argument("-e", "--max-bytes", "--max", dest="max_size", type=parse_size, default=1 << 20,
                       metavar="SIZE", help="largest size in bytes (suffixes K, M, G)")
        p.add_argument("-f", "--factor", type=count(2, 1 << 40), default=4, help="size step factor")
        p.add_argument("--iters", type=count(1, 1 << 24), default=50, help="most timed iterations per loop")
        p.add_argument("--time-per-point", type=real(0, 600), default=0.6, help="seconds aimed at per point")
        p.add_argument("--compute-factor", type=real(0, 1000, strict=True), default=1.0, help="compute = this x Pure Comm")
        p.add_argument("--agent-threads", type=count(1, 1024), default=4, help="copy threads of the agent (its cores)")
        p.add_argument("--timeout", type=real(0, 7 * 86400, strict=True), default=120.0, help="seconds any wait may take")

    def validate(self, args) -> None:
        from hpdl.bench.cli import sizes_between

        self.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise CLIUsageError(f"--modes must be from {MODES}, got {bad or self.modes}")
        if args.np < 2:
            raise CLIUsageError(f"--np must be >= 2, got {args.np}")
        try:
            self.sizes = sizes_between(args.min_size, args.max_size, args.factor)
        except ValueError as exc:
            raise CLIUsageError(str(exc)) from None
        try:   # each rank's send and receive buffers and the agent's shared segments for them, before spawning
            check_fits(args.np * (4 * max(self.sizes) + (300 << 20)), "-e/--max-bytes/--np",
                       what=f"{args.np} ranks with buffers of the largest size {max(self.sizes)} B")
        except MemoryError as exc:
            raise CLIUsageError(str(exc)) from None
        self.title = f"OSU-style overlap, {args.pattern}, {args.np} ranks"

    def metadata(self, args) -> dict:
        return {"np": args.np, "pattern": args.pattern, "modes": self.modes, "sizes": self.sizes,
                "compute_factor": args.compute_factor, "agent_threads": args.agent_threads, "iters": args.iters,
                "time_per_point": args.time_per_point}

    def run(self, ctx) -> list[dict]:
        from hpdl.runtime.launch import spawn

        a = ctx.args
        cfg = {"pattern": a.pattern, "modes": self.modes, "sizes": self.sizes, "iters": a.iters,
               "time_per_point": a.time_per_point, "compute_factor": a.compute_factor,
               "agent_threads": a.agent_threads, "timeout": a.timeout, "progress": True}
        rows = spawn(overlap_rank, a.np, args=(cfg,), timeout=a.timeout)[0]
        ctx.meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]   # a shared host's load, for the reader
        return rows

    def table(self, rows, ctx) -> str:
        return super().table(rows, ctx) + "\n" + "\n".join(NOTES)


OverlapBenchCommand = command(OverlapBenchmark)
