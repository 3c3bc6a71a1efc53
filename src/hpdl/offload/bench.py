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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

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


def _setup(pattern: str, mode: str, size: int, ctx, timeout: float):
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

    torch.set_num_threads(1)
    dummy = Dummy()
    rows = []

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
                start, wait, check, req = _setup(cfg["pattern"], mode, size, ctx, cfg["timeout"])
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
                if ctx.rank == 0 and cfg["progress"]:
                    print(f"  {mode:>7} {size:>9} B  overlap {overlap:5.1f}%", file=sys.stderr, flush=True)
    finally:
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


def format_table(rows) -> str:
    lines = [f"# {'Size(B)':>10} {'mode':>7} {'Overall(us)':>12} {'Compute(us)':>12} {'Pure Comm(us)':>14} "
             f"{'Overlap(%)':>11} {'alone(us)':>10} {'Eff.ovl(%)':>11} {'#wrong':>7}"]
    for r in rows:
        eff = r.get("effective_overlap_pct")
        eff = overlap_pct(r["overall_us"], r["compute_alone_us"], r["pure_comm_us"]) if eff is None else eff
        lines.append(f"  {r['size']:>10} {r['mode']:>7} {r['overall_us']:>12.1f} {r['compute_us']:>12.1f} "
                     f"{r['pure_comm_us']:>14.1f} {r['overlap_pct']:>11.1f} {r['compute_alone_us']:>10.1f} "
                     f"{eff:>11.1f} {r['wrong']:>7}")
    lines.append("# alone: the same compute without communication (Compute above it = slowed down by progress)")
    lines.append("# Eff.ovl: overlap against the compute alone, 100 - 100 (Overall - alone) / Pure Comm (OSU's "
                 "Overlap credits a slowed compute)")
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["size"])
        ax1.plot([r["size"] for r in pts], [r["overlap_pct"] for r in pts], marker="o", ms=4, label=mode)
        ax2.plot([r["size"] for r in pts], [r["pure_comm_us"] for r in pts], marker="o", ms=4, label=mode)
    ax1.axhline(90, color="grey", ls="--", lw=0.8)
    ax1.set_ylim(0, 105)
    ax1.set_ylabel("overlap (%)")
    ax2.set_ylabel("pure comm (us)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class OverlapBenchCommand:
    """`hpdl bench overlap`: OSU-style overlap of native non-blocking ops, the progress thread and the agent."""

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        from hpdl.bench.cli import parse_size

        p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
        p.add_argument("--np", type=count(1, 1024), default=4, help="ranks to spawn")
        p.add_argument("--pattern", default="alltoall", choices=PATTERNS,
                       help="alltoall (size = bytes per peer, as osu_ialltoall) or allreduce (bytes of the buffer)")
        p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated from {', '.join(MODES)}")
        p.add_argument("--min", dest="min_size", type=parse_size, default=1 << 10, help="smallest size (bytes)")
        p.add_argument("--max", dest="max_size", type=parse_size, default=1 << 20, help="largest size (bytes)")
        p.add_argument("--factor", type=count(2, 1 << 40), default=4, help="size step factor")
        p.add_argument("--iters", type=count(1, 1 << 24), default=50, help="most timed iterations per loop")
        p.add_argument("--time-per-point", type=real(0, 600), default=0.6, help="seconds aimed at per point")
        p.add_argument("--compute-factor", type=real(0, 1000, strict=True), default=1.0, help="compute = this x Pure Comm")
        p.add_argument("--agent-threads", type=count(1, 1024), default=4, help="copy threads of the agent (its cores)")
        p.add_argument("--timeout", type=real(0, 7 * 86400, strict=True), default=120.0, help="seconds any wait may take")
        p.add_argument("--out", default=None, help="folder for overlap.json and overlap.png")
        p.add_argument("--json", dest="json_path", default=None, help="write rows and metadata as JSON")
        p.add_argument("--plot", dest="plot_path", default=None, help="write the overlap plot (PNG)")
        p.add_argument("--format", choices=["table", "json"], default="table")

    def run(self, args) -> int:
        from hpdl.bench.cli import sizes_between
        from hpdl.bench.report import source_commit
        from hpdl.runtime.launch import spawn

        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise CLIUsageError(f"--modes must be from {MODES}, got {bad or modes}")
        if args.np < 2:
            raise CLIUsageError(f"--np must be >= 2, got {args.np}")
        try:
            sizes = sizes_between(args.min_size, args.max_size, args.factor, names=("--min", "--max"))
        except ValueError as exc:
            raise CLIUsageError(str(exc)) from None
        try:   # each rank's send and receive buffers and the agent's shared segments for them, before spawning
            check_fits(args.np * (4 * max(sizes) + (300 << 20)), "--max/--np",
                       what=f"{args.np} ranks with buffers of the largest size {max(sizes)} B")
        except MemoryError as exc:
            raise CLIUsageError(str(exc)) from None
        cfg = {"pattern": args.pattern, "modes": modes, "sizes": sizes, "iters": args.iters,
               "time_per_point": args.time_per_point, "compute_factor": args.compute_factor,
               "agent_threads": args.agent_threads, "timeout": args.timeout, "progress": True}
        t0 = time.perf_counter()
        rows = spawn(overlap_rank, args.np, args=(cfg,), timeout=args.timeout)[0]
        meta = {"benchmark": "hpdl bench overlap", "np": args.np, "pattern": args.pattern,
                "compute_factor": args.compute_factor, "agent_threads": args.agent_threads,
                "torch": torch.__version__, "cpus": os.cpu_count(),
                "loadavg_after": [round(x, 2) for x in os.getloadavg()], "date": time.strftime("%Y-%m-%d %H:%M"),
                "commit": source_commit(), "seconds": round(time.perf_counter() - t0, 1),
                "command": "hpdl bench overlap " + " ".join(sys.argv[3:])}
        if args.format == "json":
            print(json.dumps({"meta": meta, "rows": rows}, indent=1))
        else:
            print(f"# hpdl bench overlap: {args.pattern}, {args.np} ranks, torch {meta['torch']}, {meta['date']}, "
                  f"{meta['seconds']}s")
            print(format_table(rows))
        json_path, plot_path = args.json_path, args.plot_path
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            json_path = json_path or str(Path(args.out) / "overlap.json")
            plot_path = plot_path or str(Path(args.out) / "overlap.png")
        if json_path:
            Path(json_path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        if plot_path:
            plot(rows, plot_path, f"overlap, {args.pattern}, {args.np} ranks (OSU method)")
        return 1 if any(r["wrong"] for r in rows) else 0
