"""``hpdl bench``: collective benchmarks with nccl-tests / OSU columns, exact #wrong, plots and tuning."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from hpdl.bench.common import EXIT_USAGE, Benchmark, Panel, PlotSpec, add_output_arguments, main
from hpdl.bench.harness import BenchConfig, run_sweep
from hpdl.bench.specs import SPECS
from hpdl.runtime.commands import attach
from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.limits import count, real

_COLLECTIVES = {"allreduce": "allreduce", "reduce_scatter": "reduce_scatter", "all_gather": "all_gather",
                "alltoall": "alltoall"}
_DEFAULT_ALGORITHMS = {"alltoall": "native,pairwise,direct,push,pull"}
# the other spellings of each name (hpdl.comm's and nccl-tests'), so that neither convention is an error
_ALIASES = {"allreduce": ["all_reduce"], "reduce_scatter": ["reducescatter"], "all_gather": ["allgather"],
            "alltoall": ["all_to_all", "all_to_all_single"]}
_CANONICAL = {alias: name for name, aliases in _ALIASES.items() for alias in aliases}


def parse_size(text: str) -> int:
    """'8', '64K', '1M', '1G' (powers of 1024) or '1KiB' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    try:
        value = int(float(num) * mult)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"size must look like 8, 64K, 1M or 1G, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size must be >= 0, got {text!r}")
    return value


def sizes_between(lo: int, hi: int, factor: int = 2, names: tuple[str, str] = ("-b/--min-bytes", "-e/--max-bytes")
                  ) -> list[int]:
    """Sizes lo, lo*factor, ... up to hi (bytes). Raises ValueError on lo > hi or factor < 2, naming the flags
    ``names`` (the command's own spelling of the smallest and largest size)."""
    if lo > hi:
        raise ValueError(f"{names[0]} ({lo}) must not exceed {names[1]} ({hi})")
    if factor < 2:
        raise ValueError(f"--factor must be >= 2, got {factor}")
    out, s = [], max(lo, 1)
    while s <= hi:
        out.append(s)
        s *= factor
    return out


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where there is a value to show (not None or False) and the help does not
    already say what the default means."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# What each collective's --algorithms may name (hpdl.comm's registry; checked again in _validate).
_ALGORITHM_HELP = {
    "allreduce": "auto, native, direct, ring, recursive_doubling, staged, two_level (with --ranks-per-node), "
                 "one_shot, two_shot (--device cuda, one node)",
    "reduce_scatter": "auto, native, direct, ring",
    "all_gather": "auto, native, direct, ring",
    "alltoall": "auto, native, pairwise, direct, push, pull (push/pull: two-level through the node's shared "
                "buffer; with --device cuda on one host, the peer-memory kernel)",
}
_REDUCES = ("allreduce", "reduce_scatter")  # collectives with a reduction op
_GRAPH = ("allreduce", "alltoall")  # collectives with --graph (the README's GPU tables)


class BenchCommand:
    name = "bench"
    help = ("every benchmark, on one harness: collectives (nccl-tests columns, exact #wrong, speed-up over native), "
            "the cost model, and each subsystem's (serve, moe, apps, jacobi, overlap, attention)")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="collective", metavar="{" + ",".join([*_COLLECTIVES, "model", *PLUGINS]) + "}")
        for name in _COLLECTIVES:
            p = sub.add_parser(name, aliases=_ALIASES[name], help=f"benchmark {name}", description=f"benchmark {name}: every size x "
                               "algorithm, checked exactly, timed, with native (torch.distributed) as the baseline",
                               formatter_class=_HelpFormatter)
            p.set_defaults(_parser=p, op="sum", tune_path=None, graph=False, graph_calls=None)
            p.add_argument("--np", type=count(1, 4096), default=4,
                           help="ranks to spawn; under torchrun/mpirun the launcher's ranks are used (pass no "
                                "--np there: torchrun reads it as its --nproc-per-node)")
            p.add_argument("--algorithms", default=_DEFAULT_ALGORITHMS.get(name, "native,auto,direct,ring"),
                           help=f"comma-separated, from: {_ALGORITHM_HELP[name]}; native is the baseline")
            # -b/-e/-f as nccl-tests; long names that no torchrun option starts with (--max was ambiguous there)
            p.add_argument("-b", "--min-bytes", dest="min_size", type=parse_size, default=8, metavar="SIZE",
                           help="smallest size in bytes (suffixes K, M, G)")
            p.add_argument("-e", "--max-bytes", dest="max_size", type=parse_size, default=64 << 20, metavar="SIZE",
                           help="largest size in bytes (suffixes K, M, G; default: 64M)")
            p.add_argument("-f", "--factor", type=count(2, 1 << 40), default=2, help="size step factor (>= 2)")
            p.add_argument("--dtype", default="float32",
                           choices=["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8"],
                           help="element type")
            if name in _REDUCES:
                p.add_argument("--op", default="sum", choices=["sum", "avg", "min", "max", "product"],
                               help="reduction")
            p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                           help="cpu: gloo; cuda: NCCL and hpdl's peer-memory kernels, one GPU per rank")
            p.add_argument("--ranks-per-gpu", type=count(1, 64), default=None, metavar="N",
                           help="with --device cuda: N ranks share each GPU (rank r on cuda:(r // N); gloo, no "
                                "NCCL) to run the multi-GPU code paths on fewer GPUs. Correctness only: its "
                                "timings are not multi-GPU performance (default: HPDL_RANKS_PER_GPU, 1)")
            p.add_argument("--iters", type=count(1, 1 << 24), default=50, help="most timed calls per point")
            p.add_argument("--warmup", type=count(0, 10_000), default=2, help="untimed calls per point (after the checked one)")
            p.add_argument("--time-per-point", type=real(0, 600), default=0.1,
                           help="seconds of timing aimed at per point (iterations adapt down to 3)")
            if name in _GRAPH:
                p.add_argument("--graph", action="store_true",
                               help="time CUDA-graph replays (calls captured once, replayed; launch overhead "
                                    "excluded, as nccl-tests -G); needs --device cuda")
                p.add_argument("--graph-calls", type=count(1, 10_000), default=None, metavar="N",
                               help="calls captured per graph (default 20 up to 16 MiB, 4 up to 256 MiB, then 1)")
            p.add_argument("--window", type=count(1, 1 << 20), default=None,
                           help="throttle window k of direct: peers in flight (default: the tuned value)")
            p.add_argument("--ranks-per-node", type=count(1, 4096), default=None, metavar="G",
                           help="emulate nodes of G ranks (what two-level algorithms see: "
                                + {"allreduce": "two_level", "alltoall": "push, pull"}.get(name, "the topology")
                                + ")")
            if name == "allreduce":
                p.add_argument("--tune", dest="tune_path", default=None, metavar="JSON",
                               help="write a tuning table for algorithm='auto' from this sweep (JSON; activate it "
                                    "with HPDL_TUNING_FILE)")
            add_output_arguments(p, stem=name)
            p.add_argument("--timeout", type=real(0, 7 * 86400, strict=True), default=None,
                           help="seconds a collective may wait for a peer before the run fails (default: "
                                "HPDL_TIMEOUT)")
        from hpdl.bench.model import add_model_arguments

        add_model_arguments(sub.add_parser("model", help="alpha-beta-gamma cost model: calibrate on bench JSON, "
                                           "predict 2..4096 ranks (labelled predictions)"))
        _add_plugins(sub)

    def run(self, args) -> int:
        if args.collective == "model":
            from hpdl.bench.model import run_model_command

            try:
                return run_model_command(args, parse_size(args.size))
            except ModuleNotFoundError as exc:
                if (exc.name or "").split(".")[0] != "scipy":
                    raise
                raise CLIUsageError("hpdl bench model --calibrate fits the model with scipy's least squares, which "
                                    "is not installed: pip install 'hpdl[comm]' (or pip install scipy)") from None
        args.collective = _CANONICAL.get(args.collective, args.collective)
        if args.collective is None:
            exc = CLIUsageError("choose a collective: " + ", ".join(_COLLECTIVES)
                                + " (or " + ", ".join(["model", *PLUGINS]) + ")")
            exc.exit_status = EXIT_USAGE   # as argparse's missing argument
            raise exc
        if args.collective in PLUGINS:
            if getattr(args, "_plugin_missing", None):
                raise CLIUsageError(args._plugin_missing)
            return int(args._plugin_cls().run(args) or 0)
        return main(CollectiveBenchmark(args.collective), args)


class CollectiveBenchmark(Benchmark):
    """One collective's sweep as a harness plug-in (nccl-tests' ``<collective>_perf``): every size x algorithm
    on spawned ranks (or a launcher's), checked exactly, timed; nccl-tests' table; latency/busbw plot."""

    plot_spec = PlotSpec(x="size", xlabel="size (bytes)", xscale="log2", series="algorithm",
                         panels=(Panel("avg_us", "latency (us)", "log"), Panel("busbw", "busbw (GB/s)")),
                         keep=lambda r: r["size"] > 0)

    def __init__(self, collective: str):
        self.name = self.stem = collective
        super().__init__()

    def validate(self, args) -> None:
        if args.np < 1:
            raise CLIUsageError(f"--np must be >= 1, got {args.np}")
        try:
            self.cfg = BenchConfig(collective=_COLLECTIVES[args.collective],
                                   sizes=sizes_between(args.min_size, args.max_size, args.factor),
                                   algorithms=[a.strip() for a in args.algorithms.split(",") if a.strip()],
                                   dtype=args.dtype, op=args.op, iters=args.iters, warmup=args.warmup,
                                   window=args.window, time_per_point=args.time_per_point,
                                   progress="bar" if sys.stderr.isatty() else "lines", graph=args.graph,
                                   graph_calls=args.graph_calls)
        except ValueError as exc:
            raise CLIUsageError(str(exc)) from None
        if args.tune_path and "native" not in self.cfg.algorithms:
            raise CLIUsageError("--tune needs 'native' among --algorithms (auto must never lose to it)")
        _check_ranks_per_gpu(args)
        _validate(self.cfg, args)

    def output_files(self, args) -> list:
        return [("--tune", args.tune_path)]

    def metadata(self, args) -> dict:
        cfg = self.cfg
        return {"collective": cfg.collective, "dtype": cfg.dtype, "op": cfg.op, "ranks_per_node": args.ranks_per_node,
                "timing": "cuda-graph" if cfg.graph else "eager", "ranks_per_gpu": args.ranks_per_gpu}

    def run(self, ctx):
        rows, world = _launch(self.cfg, ctx.args)
        ctx.meta["world_size"] = world
        return rows

    def table(self, rows, ctx) -> str:
        from hpdl.bench.report import format_table

        meta = ctx.meta
        lines = [f"# {self.invocation(ctx)}: {meta['world_size']} ranks, device {meta['device']}, "
                 f"torch {meta['torch']}, {meta['timing']} timing, {meta['date']}"]
        if meta.get("ranks_per_gpu", 1) > 1:
            lines.append(f"# NOTE: {meta['ranks_per_gpu']} ranks share each GPU: these timings check correctness "
                         "and are NOT multi-GPU performance (no NCCL; native runs over gloo through host memory)")
        return "\n".join([*lines, format_table(rows)])

    def plot_title(self, ctx) -> str:
        cfg, meta = self.cfg, ctx.meta
        return (f"{cfg.collective} {cfg.dtype}" + (f" {cfg.op}" if cfg.collective in _REDUCES else "")
                + f", {meta['world_size']} ranks, {meta['device']}" + (", CUDA graph" if cfg.graph else ""))

    def finish(self, rows, ctx) -> int:
        path = ctx.args.tune_path
        if not path:
            return 0
        from hpdl.bench.report import NoisySweepError, tuned_table

        try:
            table = tuned_table(rows, ctx.meta["world_size"], ctx.args.device)
        except NoisySweepError as exc:   # the footer above called it noisy: refuse, leave any old file
            print(f"# --tune: no tuning table written to {path}: {exc}", file=sys.stderr)
            return 1
        with open(path, "w") as fh:
            fh.write(table.to_json())
        # stdout holds only the JSON document with --format json
        print(f"# tuning table written to {path}; use it with HPDL_TUNING_FILE={path}",
              file=sys.stderr if ctx.args.format == "json" else sys.stdout)
        return 0


# Benchmarks owned by other subsystems, under `hpdl bench` too: name -> ("module:Class", help, extra). The class
# has add_arguments(parser) and run(args) -> int (hpdl.bench.common.command(plug-in) makes one from a Benchmark); only the one being run is imported, so a missing optional
# dependency breaks that command alone, with an install hint.
PLUGINS: dict[str, tuple[str, str, str | None]] = {
    "serve": ("hpdl.serve.cli:ServeBenchCommand",
              "serving benchmark (alias of `hpdl serve bench`): TTFT, TPOT, ITL, throughput vs baselines", "serve"),
    "overlap": ("hpdl.offload.bench:OverlapBenchCommand", "OSU-style overlap: torch.distributed async, hpdl.offload thread, agent", None),
    "jacobi": ("hpdl.offload.jacobi:JacobiCommand", "3-D Jacobi step time, offloaded vs blocking halo exchange "
               "(alias of `hpdl offload jacobi`)", None),
    "attention": ("hpdl.vision.bench:AttentionBenchCommand", "SOFT vs SDPA/Nystrom attention, SOFT vs ViT/PVT", "vision"),
    "apps": ("hpdl.apps.bench:AppsBenchCommand", "CG, pencil 3-D FFT and nanoGPT training: hpdl.comm vs native "
             "collectives (gloo ranks)", None),
    "moe": ("hpdl.moe.bench:MoEBenchCommand", "ExFlow MoE inference vs the 2-Alltoall baseline (alias of "
            "`hpdl moe bench`): tokens/s, Alltoall bytes per layer", None),
}


def _add_plugins(sub) -> None:
    for name, (path, help_, extra) in PLUGINS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_parser=p)
        attach(p, path, f"hpdl bench {name}", extra, "_plugin_missing", "_plugin_cls")


def _validate(cfg: BenchConfig, args) -> None:
    """Everything the ranks would reject, checked before any process starts (one-line errors)."""
    from hpdl.comm.algorithms.base import PEER, REGISTRY, canonical
    from hpdl.comm.ops import check_dtype

    try:
        if cfg.collective in ("allreduce", "reduce_scatter"):
            check_dtype(cfg.torch_dtype, cfg.op)
    except ValueError as exc:
        raise CLIUsageError(str(exc)) from None
    if args.window is not None and args.window < 1:
        raise CLIUsageError(f"--window must be >= 1, got {args.window}")
    if args.iters < 1 or args.warmup < 0:
        raise CLIUsageError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    if args.graph and args.device != "cuda":
        raise CLIUsageError(f"--graph times CUDA-graph replays and needs --device cuda (got --device {args.device}); "
                            "drop --graph for eager timing")
    if args.graph_calls is not None and args.graph_calls < 1:
        raise CLIUsageError(f"--graph-calls must be >= 1, got {args.graph_calls}")
    if args.graph and args.ranks_per_gpu > 1:
        # ranks sharing a GPU have no NCCL: every algorithm but the peer-memory kernels stages through host
        # memory over gloo, which a CUDA graph cannot capture (found here, not after the ranks started)
        from hpdl.comm.algorithms.base import Algorithm, get_class

        def stages(name: str) -> bool:
            n = canonical(name)
            return n in REGISTRY and get_class(n).runs_kernel.__func__ is Algorithm.runs_kernel.__func__

        host = [a for a in cfg.algorithms if stages(a)]
        if host:
            raise CLIUsageError(f"--graph with --ranks-per-gpu {args.ranks_per_gpu}: algorithms {host} run over gloo "
                                "through host memory, which a CUDA graph cannot capture; pass --algorithms with "
                                "peer-memory ones only (e.g. auto,one_shot,two_shot; push,pull for alltoall)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIUsageError("--device cuda needs a CUDA build of torch and a visible GPU")
    from hpdl.comm.algorithms.base import algorithms_for
    from hpdl.comm.tuning import canonical_collective

    names = [canonical(a) for a in cfg.algorithms]
    fits = set(algorithms_for(canonical_collective(cfg.collective))) | {"auto"}
    bad = [a for a, n in zip(cfg.algorithms, names) if n not in fits]
    if bad:
        raise CLIUsageError(f"algorithms {bad} do not implement {cfg.collective}")
    if os.environ.get("HPDL_TUNING_FILE") and "auto" in names:
        try:
            from hpdl.comm import tuning

            tuning.active_table()
        except ValueError as exc:
            raise CLIUsageError(str(exc)) from None
    peer = [a for a in cfg.algorithms if canonical(a) in PEER]
    if peer and args.device != "cuda":
        raise CLIUsageError(f"algorithms {peer} need --device cuda")
    if peer and cfg.collective != "allreduce":
        raise CLIUsageError(f"algorithms {peer} implement allreduce only")
    _check_memory(cfg, args)


# host memory of one spawned rank before any buffer (Python, torch, gloo): measured RSS is 250-400 MB
_RANK_OVERHEAD = 300 << 20


def _check_memory(cfg: BenchConfig, args) -> None:
    """Refuse, naming the flag, a sweep whose largest point cannot fit (issue 37: `--np 2 -b 32G -e 32G` ended
    in a worker traceback after allocating). Each rank holds its input and the expected result of the largest
    size at once (out-of-place collectives also an output), on the device the data lives on; the algorithms'
    scratch comes on top, so this is a lower bound that only catches what cannot fit."""
    from hpdl.runtime import detect_launcher
    from hpdl.runtime.limits import check_fits

    ranks = args.np if detect_launcher() is None else 1   # under a launcher only this process's share is known
    size = max(cfg.sizes) if cfg.sizes else 0
    per_rank = (3 if SPECS[cfg.collective].count_multiple_of_world else 2) * size   # those are out of place
    try:
        if args.device == "cuda":
            local = max(1, -(-ranks // max(1, torch.cuda.device_count())))   # ranks sharing one GPU
            check_fits(local * per_rank, "-e/--max-bytes", device="cuda",
                       what=f"{local} rank(s) on one GPU with buffers of the largest size {size} B")
        host = ranks * (_RANK_OVERHEAD + (size if args.device == "cuda" else per_rank))
        flag = "-e/--max-bytes" if ranks * _RANK_OVERHEAD < host / 2 else "--np"
        check_fits(host, flag, what=f"{ranks} ranks with buffers of the largest size {size} B")
    except MemoryError as exc:
        raise CLIUsageError(str(exc)) from None


def _bench_worker(ctx, cfg):
    import hpdl.comm as hc

    hc.set_topology(ctx.topology)  # nodes for the two-level algorithms (emulated with --ranks-per-node)
    rows = run_sweep(ctx, cfg)
    return rows if ctx.rank == 0 else None


def _check_ranks_per_gpu(args) -> None:
    """--ranks-per-gpu: an int >= 1, CUDA only, never the source of a tuning table."""
    from hpdl.runtime.launch import ranks_per_gpu_of

    if args.device != "cuda":
        if args.ranks_per_gpu not in (None, 1):
            raise CLIUsageError(f"--ranks-per-gpu needs --device cuda (got --device {args.device})")
        args.ranks_per_gpu = 1
        return
    try:
        args.ranks_per_gpu = ranks_per_gpu_of(args.ranks_per_gpu)
    except ValueError as exc:
        raise CLIUsageError(str(exc).replace("ranks_per_gpu must", "--ranks-per-gpu must")) from None
    if args.ranks_per_gpu > 1 and getattr(args, "tune_path", None):
        raise CLIUsageError(f"--tune with --ranks-per-gpu {args.ranks_per_gpu}: ranks sharing a GPU time "
                            "correctness runs, not multi-GPU performance, so no tuning table is written from them")


def _launch(cfg: BenchConfig, args):
    from hpdl.runtime import detect_launcher, init_from_env, spawn

    if detect_launcher() is not None:
        ctx = init_from_env(args.device, args.ranks_per_node, args.timeout, ranks_per_gpu=args.ranks_per_gpu)
        import hpdl.comm as hc

        hc.set_topology(ctx.topology)
        import torch.distributed as dist

        try:
            rows = run_sweep(ctx, cfg)
            dist.barrier()  # no rank tears down while a peer still finishes its last exchange
        finally:
            # Tear the group down on every rank before exiting: left to interpreter exit, gloo's threads can
            # abort a rank ("terminate called without an active exception") and fail the torchrun job.
            if dist.is_initialized():
                dist.destroy_process_group()
        if ctx.rank != 0:
            sys.exit(1 if any(r.wrong for r in rows) else 0)
        return rows, ctx.world_size
    results = spawn(_bench_worker, args.np, args=(cfg,), device=args.device, ranks_per_node=args.ranks_per_node,
                    timeout=args.timeout, ranks_per_gpu=args.ranks_per_gpu)
    return results[0], args.np
