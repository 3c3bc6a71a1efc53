"""The benchmark harness (nccl-tests' common.cu split): sweep, warm-up, timing, exact verification, rows.

Every rank runs :func:`run_sweep`; timings are per-rank means over the timed iterations, combined across
ranks as OSU does (avg / min / max of the per-rank means). ``#wrong`` comes from a separate checked call on
fresh exact data before the timed loop (the timed loop itself runs with argument checks off).

Two timing modes: *eager* (each call launched from Python, as users make them; CUDA events on GPUs, a wall
clock on CPUs) and *graph* (``BenchConfig.graph``, CUDA only): ``graph_calls`` calls captured once in a CUDA
graph (torch.cuda.CUDAGraph), the replays timed with CUDA events, so launch overhead leaves the number as in
nccl-tests' ``-G`` mode. In graph mode ``#wrong`` also covers a replay: a one-call graph replayed on fresh data.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from hpdl.bench.specs import SPECS
from hpdl.comm.algorithms.base import canonical
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
    progress: str | bool = "auto"  # "bar" (rich, a terminal), "lines" (a flushed line per size), "off"; auto: by stderr
    graph: bool = False  # time CUDA-graph replays instead of eager calls (CUDA only)
    graph_calls: int | None = None  # calls captured per graph; None: 20 up to 16 MiB, 4 above (fewer for huge sizes)

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
        if self.progress is True or self.progress is False:
            self.progress = "auto" if self.progress else "off"
        if self.progress not in ("auto", "bar", "lines", "off"):
            raise ValueError(f"progress must be 'auto', 'bar', 'lines' or 'off', got {self.progress!r}")
        if self.graph_calls is not None and self.graph_calls < 1:
            raise ValueError(f"graph_calls must be >= 1 (or None for the default), got {self.graph_calls}")

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
    rep_min_us: float | None = None  # fastest / slowest of the REPEATS batches (rank-averaged): the noise
    rep_max_us: float | None = None
    speedup_lo: float | None = None  # the speed-up over native these spreads allow (native fastest / this slowest ...)
    speedup_hi: float | None = None
    mode: str = "eager"  # or "graph" (CUDA-graph replays)

    @property
    def noisy(self) -> bool:
        """The repeats of this row or of native spread so wide that the speed-up is within the noise."""
        if self.speedup is None or self.speedup_lo is None or self.speedup_hi is None or self.speedup <= 0:
            return False
        return (self.speedup_hi - self.speedup_lo) / self.speedup > NOISE

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


def _reduce_vector(values: list[float], ctx: Context) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_host_group(ctx))
    return t.tolist()


def _barrier(ctx: Context) -> None:
    _sync(ctx.device)
    _reduce_scalar(0.0, dist.ReduceOp.SUM, ctx)


def resolve_auto(collective: str, nbytes: int, world: int, device: str,
                 dtype: torch.dtype | None = None) -> tuple[str, int | None]:
    """``(algorithm, window)`` that ``algorithm="auto"`` runs for one call of ``collective``: what
    :func:`hpdl.comm.resolve` answers for the call's input bytes (``nbytes`` is the row's size, the largest
    buffer, nccl-tests' convention; all_gather's input is a 1/world block), with this host's GPU count and
    the sweep's ``dtype`` as the facts the peer kernels need.
    """
    import hpdl.comm as hc

    input_bytes = nbytes // world if collective == "all_gather" else nbytes
    from hpdl.runtime.launch import gpu_slots

    return hc.resolve(collective, input_bytes, world, device, dtype=dtype, gpus=gpu_slots())


def _resolved_name(algorithm: str, nbytes: int, world: int, device: str, collective: str = "allreduce",
                   dtype: torch.dtype | None = None) -> tuple[str, int | None]:
    """What this row's algorithm runs (``auto`` resolved by :func:`resolve_auto`)."""
    name = canonical(algorithm)
    if name != "auto":
        return name, None
    return resolve_auto(collective, nbytes, world, device, dtype)


def run_sweep(ctx: Context, cfg: BenchConfig) -> list[Row]:
    """Benchmark ``cfg`` on this rank's group; every rank returns the same rows.

    Raises ValueError when ``cfg.graph`` is set on a non-CUDA device (CUDA graphs capture GPU work only).
    """
    if cfg.graph and ctx.device.type != "cuda":
        raise ValueError(f"graph timing captures CUDA work; this rank's device is {ctx.device} (use --device cuda, "
                         "or drop --graph for eager timing)")
    spec = SPECS[cfg.collective]
    p, dtype = ctx.world_size, cfg.torch_dtype
    esize = torch.tensor([], dtype=dtype).element_size()
    progress = _progress(ctx.rank == 0, cfg)
    rows: list[Row] = []
    for size in cfg.sizes:
        count = size // esize
        if spec.count_multiple_of_world:
            count = count // p * p
        if count == 0 and size > 0:  # too small for this dtype (and world): nothing would be timed
            progress.size_done(size, [], skipped=True)
            continue
        size_rows = []
        for algorithm in cfg.algorithms:
            args, result, want = spec.setup(ctx.rank, p, count, dtype, cfg.op, ctx.device, cfg.seed)
            spec.run(args, cfg.op, algorithm, cfg.window)  # verified call: fresh exact data, #wrong below
            _sync(ctx.device)
            wrong = float((result().reshape(-1).cpu() != want).sum())
            for _ in range(max(cfg.warmup - 1, 0)):
                spec.run(args, cfg.op, algorithm, cfg.window)
            nbytes = count * esize
            if cfg.graph:
                means, wrong_replay, iters = _graph_time(ctx, spec, cfg, algorithm, count, dtype, nbytes)
                wrong += wrong_replay
            else:
                _barrier(ctx)
                t0 = time.perf_counter()
                spec.run(args, cfg.op, algorithm, cfg.window)
                _sync(ctx.device)
                one = _reduce_scalar(time.perf_counter() - t0, dist.ReduceOp.MAX, ctx)
                iters = int(max(REPEATS, min(cfg.iters, cfg.time_per_point / max(one, 1e-9))))
                _barrier(ctx)
                means = _time_loop(ctx, spec, args, cfg, algorithm, iters)
            wrong = _reduce_scalar(wrong, dist.ReduceOp.SUM, ctx)
            mean = sorted(means)[len(means) // 2]  # this rank's median batch
            avg = _reduce_scalar(mean, dist.ReduceOp.SUM, ctx) / p
            lo = _reduce_scalar(mean, dist.ReduceOp.MIN, ctx)
            hi = _reduce_scalar(mean, dist.ReduceOp.MAX, ctx)
            batches = [b / p for b in _reduce_vector(means, ctx)]  # each batch averaged over ranks
            algbw = nbytes / (avg * 1e-6) / 1e9 if avg > 0 else 0.0
            resolved, window = _resolved_name(algorithm, nbytes, p, ctx.device.type, cfg.collective, dtype)
            size_rows.append(Row(nbytes, count, cfg.dtype, cfg.op, algorithm, resolved,
                                 cfg.window if cfg.window is not None else window, avg, lo, hi, algbw,
                                 algbw * spec.busbw_factor(p), int(wrong), iters, rep_min_us=min(batches),
                                 rep_max_us=max(batches), mode="graph" if cfg.graph else "eager"))
        native = next((r for r in size_rows if canonical(r.algorithm) == "native"), None)
        for r in size_rows:
            if native is None or r.avg_us <= 0:
                continue
            r.speedup = native.avg_us / r.avg_us
            if r is not native and r.rep_min_us and r.rep_max_us:
                r.speedup_lo = native.rep_min_us / r.rep_max_us
                r.speedup_hi = native.rep_max_us / r.rep_min_us
        rows.extend(size_rows)
        progress.size_done(size, size_rows)
    progress.close()
    return rows


REPEATS = 3  # the timed iterations run in this many back-to-back batches; the median batch is reported
NOISE = 0.2  # a speed-up whose repeat range is wider than this fraction of it is reported as a range


def _time_loop(ctx: Context, spec, args, cfg: BenchConfig, algorithm: str, iters: int) -> list[float]:
    """Microseconds per call on this rank, one mean per batch of :data:`REPEATS` back-to-back batches (the
    caller reports the median, robust to a descheduled batch on a shared host, and the spread)."""
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
    return means


def graph_calls(cfg: BenchConfig, nbytes: int) -> int:
    """Calls captured in one graph: ``cfg.graph_calls``, else 20 up to 16 MiB, 4 up to 256 MiB, then 1 (a
    graph of many 1 GiB calls takes seconds per replay for no better precision)."""
    if cfg.graph_calls is not None:
        return cfg.graph_calls
    return 20 if nbytes <= 16 << 20 else (4 if nbytes <= 256 << 20 else 1)


def _capture(fn, calls: int):
    """``fn`` called ``calls`` times, captured in a CUDA graph (warmed up once on the capture stream first, as
    torch.cuda.graphs asks: lazy state such as NCCL communicators and peer buffers must exist before capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return graph


def _graph_time(ctx: Context, spec, cfg: BenchConfig, algorithm: str, count: int, dtype, nbytes: int):
    """Graph mode for one point: ``(per-batch means in us per call on this rank, #wrong of a replay, calls)``.

    A one-call graph is replayed on fresh exact data and checked (a captured collective must compute the same
    as an eager one); then ``graph_calls`` calls are captured and the replays timed with CUDA events in
    :data:`REPEATS` batches, as eager mode (replays per batch adapt to ``time_per_point``).
    """
    from hpdl.runtime.errors import HpdlError

    def run(a):
        return lambda: spec.run(a, cfg.op, algorithm, cfg.window)

    p = ctx.world_size
    args, result, want = spec.setup(ctx.rank, p, count, dtype, cfg.op, ctx.device, cfg.seed)
    try:
        one = _capture(run(args), 1)
        fresh, _, _ = spec.setup(ctx.rank, p, count, dtype, cfg.op, ctx.device, cfg.seed)
        for a, f in zip(args, fresh):
            a.copy_(f)  # the graph reads the captured tensors: put fresh data in them
        _barrier(ctx)
        one.replay()
        _sync(ctx.device)
        wrong = float((result().reshape(-1).cpu() != want).sum())
        del one
        calls = graph_calls(cfg, nbytes)
        graph = _capture(run(args), calls)
    except RuntimeError as exc:  # a call that syncs with the host or allocates cannot be captured
        raise HpdlError(f"rank {ctx.rank}: {cfg.collective} algorithm={algorithm!r} at {nbytes} B cannot be "
                        f"captured in a CUDA graph ({str(exc).splitlines()[0][:200]}); time it without --graph") \
            from exc
    _barrier(ctx)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    stop.record()
    torch.cuda.synchronize(ctx.device)
    first = _reduce_scalar(start.elapsed_time(stop) * 1e-3, dist.ReduceOp.MAX, ctx)  # seconds per replay
    # replays per batch: iters calls in all at most (as eager), at least one replay, within time_per_point
    budget = cfg.time_per_point / REPEATS / max(first, 1e-9)
    replays = int(max(1, min(cfg.iters // (calls * REPEATS), budget)))
    means = []
    for _ in range(REPEATS):
        _barrier(ctx)
        start.record()
        for _ in range(replays):
            graph.replay()
        stop.record()
        torch.cuda.synchronize(ctx.device)
        means.append(start.elapsed_time(stop) * 1e3 / (replays * calls))
    del graph
    return means, wrong, replays * calls * REPEATS


class _progress:
    """The sweep's progress (:class:`hpdl.bench.common.Progress`, one step per size) on rank 0's stderr: a rich
    bar on a terminal, else one flushed line per size (``[3/24] allreduce 32 B (12 s): native 25.1 us, direct
    9.8 us 2.56x``)."""

    def __init__(self, enabled: bool, cfg: BenchConfig, stream=None):
        from hpdl.bench.common import Progress

        self._cfg = cfg
        self._p = Progress(len(cfg.sizes), cfg.collective, enabled=enabled, mode=cfg.progress, stream=stream,
                           header=f"# hpdl bench {cfg.collective}: {len(cfg.sizes)} sizes x {len(cfg.algorithms)} "
                                  f"algorithms ({', '.join(cfg.algorithms)})"
                                  f"{', CUDA-graph timing' if cfg.graph else ''}")
        self.mode = self._p.mode

    def size_done(self, size: int, rows: list[Row], skipped: bool = False) -> None:
        if self.mode == "bar":
            self._p.advance(f"{self._cfg.collective} {size} B" + (" skipped" if skipped else ""))
            return
        if skipped:
            body = f"skipped (fewer than one {self._cfg.dtype} element per rank)"
        else:
            body = ", ".join(f"{algo_label(r)} {r.avg_us:.1f} us" + (f" {speedup_text(r)}" if r.speedup and
                             canonical(r.algorithm) != "native" else "") + (f" WRONG {r.wrong}" if r.wrong else "")
                             for r in rows)
        self._p.advance(f"{self._cfg.collective} {size} B ({self._p.elapsed:.0f} s): {body}")

    def close(self) -> None:
        self._p.close()


def algo_label(r: Row) -> str:
    """The algorithm column: ``auto->what it ran`` for auto rows, never cut."""
    return f"auto->{r.resolved}" if canonical(r.algorithm) == "auto" else r.algorithm


def speedup_text(r: Row) -> str:
    """``1.23x``, or ``0.60-1.88x`` (the range the repeats allow) when that range is wider than :data:`NOISE`."""
    if r.speedup is None:
        return "-"
    if r.noisy:
        return f"{r.speedup_lo:.2f}-{r.speedup_hi:.2f}x"
    return f"{r.speedup:.2f}x"
