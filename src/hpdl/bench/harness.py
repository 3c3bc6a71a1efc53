"""The benchmark harness (nccl-tests' common.cu split): sweep, warm-up, timing, exact verification, rows.

Every rank runs :func:`run_sweep`; timings are per-rank means over the timed iterations, combined across
ranks as OSU does (avg / min / max of the per-rank means). ``#wrong`` comes from a separate checked call on
fresh exact data before the timed loop (the timed loop itself runs with argument checks off).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from hpdl.bench.specs import SPECS
from hpdl.comm.algorithms.base import canonical
from hpdl.comm import tuning
from hpdl.runtime.launch import Context


@dataclass
class BenchConfig:
    """What to sweep. Sizes are bytes of the largest buffer of the call (as nccl-tests reports them)."""

    collective: str = "allreduce"
    sizes: list[int] = field(default_factory=lambda: [8 << k for k in range(24)])
    algorithms: list[str] = field(default_factory=lambda: ["native", "auto", "direct", "ring"])
    dtype: str = "float32"
    op: str = "sum"
    iters: int = 50
    warmup: int = 2
    window: int | None = None
    seed: int = 0
    time_per_point: float = 0.1  # seconds of timed loop aimed at per (size, algorithm)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.collective not in SPECS:
            raise ValueError(f"collective must be one of {sorted(SPECS)}, got {self.collective!r}")
        for a in self.algorithms:
            canonical(a)
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"iters must be >= 1 and warmup >= 0, got iters={self.iters} warmup={self.warmup}")
        if any(s < 0 for s in self.sizes):
            raise ValueError(f"sizes must be >= 0 bytes, got {self.sizes}")
        self.torch_dtype  # validates the name

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"dtype must be a torch dtype name such as float32 or bfloat16, got {self.dtype!r}")
        return dt


@dataclass
class Row:
    size: int
    count: int
    dtype: str
    op: str
    algorithm: str
    resolved: str
    window: int | None
    avg_us: float
    min_us: float
    max_us: float
    algbw: float
    busbw: float
    wrong: int
    iters: int
    speedup: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_group(ctx: Context):
    return ctx.cpu_group if ctx.cpu_group is not None else ctx.group


def _reduce_scalar(value: float, op, ctx: Context) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=_host_group(ctx))
    return float(t.item())


def _barrier(ctx: Context) -> None:
    _sync(ctx.device)
    _reduce_scalar(0.0, dist.ReduceOp.SUM, ctx)


def _resolved_name(algorithm: str, nbytes: int, world: int, device: str,
                   collective: str = "allreduce") -> tuple[str, int | None]:
    """What ``auto`` resolves to for this row (all_to_all_single has its own table)."""
    name = canonical(algorithm)
    if name != "auto":
        return name, None
    if collective == "alltoall":
        from hpdl.comm.algorithms.alltoall import select

        return select(nbytes, world, device), None
    return tuning.select(nbytes, world, device)


def run_sweep(ctx: Context, cfg: BenchConfig) -> list[Row]:
    """Benchmark ``cfg`` on this rank's group; every rank returns the same rows."""
    spec = SPECS[cfg.collective]
    p, dtype = ctx.world_size, cfg.torch_dtype
    esize = torch.tensor([], dtype=dtype).element_size()
    points = [(s, a) for s in cfg.sizes for a in cfg.algorithms]
    progress = _progress(ctx.rank == 0 and cfg.progress, len(points), cfg)
    rows: list[Row] = []
    for size in cfg.sizes:
        count = size // esize
        if spec.count_multiple_of_world:
            count = count // p * p
        if count == 0 and size > 0:  # too small for this dtype (and world): nothing would be timed
            for _ in cfg.algorithms:
                progress.advance(f"{cfg.collective} {size} B skipped")
            continue
        size_rows = []
        for algorithm in cfg.algorithms:
            args, result, want = spec.setup(ctx.rank, p, count, dtype, cfg.op, ctx.device, cfg.seed)
            spec.run(args, cfg.op, algorithm, cfg.window)  # verified call: fresh exact data, #wrong below
            _sync(ctx.device)
            wrong = _reduce_scalar(float((result().reshape(-1).cpu() != want).sum()), dist.ReduceOp.SUM, ctx)
            for _ in range(max(cfg.warmup - 1, 0)):
                spec.run(args, cfg.op, algorithm, cfg.window)
            _barrier(ctx)
            t0 = time.perf_counter()
            spec.run(args, cfg.op, algorithm, cfg.window)
            _sync(ctx.device)
            one = _reduce_scalar(time.perf_counter() - t0, dist.ReduceOp.MAX, ctx)
            iters = int(max(REPEATS, min(cfg.iters, cfg.time_per_point / max(one, 1e-9))))
            _barrier(ctx)
            mean = _time_loop(ctx, spec, args, cfg, algorithm, iters)
            avg = _reduce_scalar(mean, dist.ReduceOp.SUM, ctx) / p
            lo = _reduce_scalar(mean, dist.ReduceOp.MIN, ctx)
            hi = _reduce_scalar(mean, dist.ReduceOp.MAX, ctx)
            nbytes = count * esize
            algbw = nbytes / (avg * 1e-6) / 1e9 if avg > 0 else 0.0
            resolved, window = _resolved_name(algorithm, nbytes, p, ctx.device.type, cfg.collective)
            size_rows.append(Row(nbytes, count, cfg.dtype, cfg.op, algorithm, resolved,
                                 cfg.window if cfg.window is not None else window, avg, lo, hi, algbw,
                                 algbw * spec.busbw_factor(p), int(wrong), iters))
            progress.advance(f"{cfg.collective} {nbytes} B {algorithm}")
        native = next((r for r in size_rows if canonical(r.algorithm) == "native"), None)
        for r in size_rows:
            r.speedup = native.avg_us / r.avg_us if native is not None and r.avg_us > 0 else None
        rows.extend(size_rows)
    progress.close()
    return rows


REPEATS = 3  # the timed iterations run in this many back-to-back batches; the median batch is reported


def _time_loop(ctx: Context, spec, args, cfg: BenchConfig, algorithm: str, iters: int) -> float:
    """Mean microseconds per call on this rank: the median over :data:`REPEATS` batches (robust to a
    descheduled batch on a shared host)."""
    per = max(1, iters // REPEATS)
    means = []
    for _ in range(REPEATS):
        if ctx.device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per):
                spec.run(args, cfg.op, algorithm, cfg.window)
            stop.record()
            torch.cuda.synchronize(ctx.device)
            means.append(start.elapsed_time(stop) * 1e3 / per)
        else:
            t0 = time.perf_counter()
            for _ in range(per):
                spec.run(args, cfg.op, algorithm, cfg.window)
            means.append((time.perf_counter() - t0) * 1e6 / per)
    return sorted(means)[len(means) // 2]


class _progress:
    """A rich progress bar on stderr on rank 0, nothing elsewhere."""

    def __init__(self, enabled: bool, total: int, cfg: BenchConfig):
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description:<40}"), BarColumn(), TextColumn("{task.completed}/"
                                 "{task.total}"), TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(cfg.collective, total=total)

    def advance(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
