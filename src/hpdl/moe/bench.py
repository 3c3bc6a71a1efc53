"""``hpdl moe bench``: tokens/s of ExFlow vs the 2-Alltoall expert-parallel baseline on gloo ranks.

For each expert count E a GPT-MoE (byte-level, random init: routing of an untrained byte model already follows
the bytes, so it has inter-layer affinity; pass ``model`` for a trained checkpoint) is profiled on stdlib text,
an ILP placement is computed from that trace (held-out text is used for the prompts), and then, for every batch
size (requests per rank), three engines generate the same tokens:

* ``baseline``: contiguous placement, dispatch + combine Alltoalls per MoE layer (DeepSpeed-MoE style),
* ``exflow_contiguous``: context-coherent, one Alltoall per layer, contiguous placement,
* ``exflow``: context-coherent with the ILP placement,
* ``baseline_padded`` / ``exflow_padded``: the same with ``capacity="worst_case"`` (no count exchange; every rank
  sends the agreed worst-case row count to every peer, pad rows flagged and skipped).

Reported per run: tokens/s (all ranks' generated tokens over the slowest rank's wall time, median of
``repeats``, every repeat kept), prefill and decode time apart (decode tokens/s), payload Alltoall bytes sent
off-rank and seconds per MoE layer per forward (rank mean), count exchange and all-gather seconds, and the
cross-rank share of dispatched rows (sums over ranks; decode apart). The modes are interleaved within every
repeat; the headline is padded vs padded (``exflow_padded`` over ``baseline_padded``, decode, per-repeat ratio
median and IQR). hpdl.comm's argument check is off while timing. The tokens of all five are compared and the run
fails if they differ.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hpdl.bench.common import Benchmark, Column, Panel, PlotSpec, Progress, command
from hpdl.moe.errors import MoEError
from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.limits import count

PROFILE_SEQ = 64  # tokens per routing-profile window (the model's max_position must cover it)


@dataclass
class BenchSpec:
    """One sweep: world size, expert counts, batch sizes (requests per rank), model and generation shape."""

    world_size: int = 4
    experts: list[int] = field(default_factory=lambda: [8, 16, 32])
    batches: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    hidden_size: int = 256
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 2
    expert_size: int = 512
    prompt_len: int = 16
    new_tokens: int = 16
    repeats: int = 10
    profile_tokens: int = 8192
    time_limit: float = 30.0
    model: str | None = None
    seed: int = 0


def check_spec(spec: BenchSpec) -> None:
    """Refuse a sweep that would fail inside the spawned ranks (or divide by zero) before anything starts.

    Raises:
        MoEError: a count below 1, an expert count the world size does not divide, or a ``model`` whose expert
            count, top_k or max_position does not fit (the argument is named).
    """
    for name in ("world_size", "hidden_size", "n_layers", "expert_size", "prompt_len", "new_tokens", "repeats",
                 "profile_tokens"):
        if getattr(spec, name) < 1:
            raise MoEError(f"{name} must be >= 1, got {getattr(spec, name)}")
    if not spec.experts or not spec.batches or min(spec.batches) < 1:
        raise MoEError(f"experts and batches need at least one value, batches each >= 1; got experts="
                       f"{spec.experts}, batches={spec.batches}")
    for E in spec.experts:
        if E < 1 or E % spec.world_size:
            raise MoEError(f"world_size={spec.world_size} must divide every expert count, got E={E}")
    if spec.model:
        from hpdl.models.gpt_moe import load_model

        cfg = load_model(spec.model).cfg
        if spec.experts != [cfg.n_experts]:
            raise MoEError(f"model={spec.model} has n_experts={cfg.n_experts}; pass experts=[{cfg.n_experts}], "
                           f"got {spec.experts}")
        if cfg.top_k != 1:
            raise MoEError(f"model={spec.model} has top_k={cfg.top_k}; ExFlow mode needs top_k=1")
        if cfg.vocab_size < 256:
            raise MoEError(f"model={spec.model} has vocab_size={cfg.vocab_size} < 256 (prompts are bytes)")
        if spec.prompt_len + spec.new_tokens > cfg.max_position:
            raise MoEError(f"prompt_len + new_tokens = {spec.prompt_len + spec.new_tokens} exceeds the model's "
                           f"max_position={cfg.max_position}")


def _model(spec: BenchSpec, E: int):
    import torch

    from hpdl.models.gpt_moe import MoEConfig, MoEDecoder, load_model

    if spec.model:
        return load_model(spec.model)
    torch.manual_seed(spec.seed)
    cfg = MoEConfig(vocab_size=256, hidden_size=spec.hidden_size, n_layers=spec.n_layers, n_heads=spec.n_heads,
                    n_kv_heads=spec.n_kv_heads, n_experts=E, top_k=1, expert_size=spec.expert_size,
                    max_position=max(PROFILE_SEQ, spec.prompt_len + spec.new_tokens + 8))
    return MoEDecoder(cfg).eval()


def prepare(spec: BenchSpec, E: int) -> dict:
    """Pure CPU part (parent process): profile trace -> ILP placement, and the prompts of every rank."""
    from hpdl.moe import affinity, placement
    from hpdl.moe.trace import collect_trace
    from hpdl.moe.train import heldout_windows, stdlib_corpus

    model = _model(spec, E)
    if model.cfg.n_experts != E:
        raise MoEError(f"model has n_experts={model.cfg.n_experts}, the sweep asks for E={E}")
    data, source = stdlib_corpus(2_000_000, part="tail")  # never the text `hpdl moe train` reads
    prof = heldout_windows(data[: len(data) // 2], spec.profile_tokens, PROFILE_SEQ)
    tr = collect_trace(model, prof, source=source)
    C = affinity.transition_counts(tr.experts, E)
    res = placement.place(C, spec.world_size, time_limit=spec.time_limit)
    rng = np.random.default_rng(spec.seed)
    tail = data[len(data) // 2:]
    nmax = max(spec.batches)
    starts = rng.integers(0, len(tail) - spec.prompt_len, size=(spec.world_size, nmax))
    prompts = [[tail[s:s + spec.prompt_len].astype(int).tolist() for s in row] for row in starts]
    return {"ranks": res.ranks, "placement": {"method": res.method, "status": res.status,
                                              "profile_cross_share": res.objective, "seconds": res.seconds},
            "prompts": prompts, "model_config": asdict(model.cfg)}


def bench_rank(ctx, spec_d: dict, E: int, prep: dict, show: bool = False) -> list[dict]:
    """Per-rank body (run by ``hpdl.runtime.launch.spawn`` or a test pool): every mode x batch size. With
    ``show``, rank 0 prints a progress line per point on stderr (stdout holds only the table or the JSON).

    Modes are interleaved: each repeat runs every mode once, in an order rotated per repeat, so drift of the
    machine over the sweep (other jobs, frequency, caches) falls on all modes alike instead of on whichever mode
    ran last. Every run's slowest-rank time is kept (whole generate, prefill and decode apart)."""
    import torch
    import torch.distributed as dist

    from hpdl.moe.engine import MoEEngine
    from hpdl.moe.placement import contiguous

    spec = BenchSpec(**spec_d)
    model = _model(spec, E)
    L = len(model.cfg.moe_layers)
    cont, ilp = contiguous(L, E, ctx.world_size), np.asarray(prep["ranks"])
    modes = {"baseline": ("baseline", cont, "exchange"), "exflow_contiguous": ("exflow", cont, "exchange"),
             "exflow": ("exflow", ilp, "exchange"), "baseline_padded": ("baseline", cont, "worst_case"),
             "exflow_padded": ("exflow", ilp, "worst_case")}
    names = list(modes)
    rows = []
    # a spawned process cannot draw on the parent's bar: flushed lines on stderr (the harness's line mode)
    steps = Progress(len(spec.batches) * len(names), f"E={E}", enabled=show and ctx.rank == 0, mode="lines")
    for b in spec.batches:
        prompts = prep["prompts"][ctx.rank][:b]
        tokens, times, stats = {}, {n: [] for n in names}, {}
        for rep in range(spec.repeats + 1):  # repeat 0 warms up allocators and gloo pairs (not kept)
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                mode, ranks, capacity = modes[name]
                eng = MoEEngine(model, ranks, mode=mode, check=False, capacity=capacity, device="cpu")
                dist.barrier()
                t0 = time.perf_counter()
                out = eng.generate(prompts, spec.new_tokens)
                t = torch.tensor([time.perf_counter() - t0, eng.timings["prefill_s"], eng.timings["decode_s"]],
                                 dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if rep:
                    times[name].append(t.tolist())
                tokens[name], stats[name] = out, eng.stats.as_dict()
        forwards = spec.new_tokens  # 1 prefill + new_tokens - 1 decode forwards
        for name in names:
            st = stats[name]
            tt = np.asarray(times[name])  # [repeats, 3]
            med = np.median(tt, 0)
            q1, q3 = np.percentile(tt[:, 0], [25, 75])
            rows.append({"experts": E, "batch_per_rank": b, "mode": name, "rank": ctx.rank,
                         "seconds": float(med[0]), "seconds_all": tt[:, 0].tolist(),
                         "seconds_iqr": [float(q1), float(q3)],
                         "tokens_per_s": ctx.world_size * b * spec.new_tokens / float(med[0]),
                         "prefill_seconds": float(med[1]), "decode_seconds": float(med[2]),
                         "decode_seconds_all": tt[:, 2].tolist(),
                         "decode_tokens_per_s": ctx.world_size * b * max(1, spec.new_tokens - 1) / float(med[2]),
                         "a2a_calls_per_layer": st["a2a_calls"].get(0, 0) / forwards,
                         "a2a_bytes_per_layer": [st["a2a_bytes"].get(li, 0) / forwards for li in range(L)],
                         "a2a_seconds_per_layer": [st["a2a_seconds"].get(li, 0.0) / forwards for li in range(L)],
                         "count_seconds": st["count_seconds"], "gather_seconds": st["gather_seconds"],
                         "gather_bytes": st["gather_bytes"], "gather_calls": st["gather_calls"],
                         # raw row counts, summed over ranks in summarise (a share of sums, not a mean of shares)
                         "rows_dispatched": sum(st["rows_dispatched"].values()),
                         "rows_cross": sum(st["rows_cross"].values()),
                         "rows_dispatched_decode": sum(st["rows_dispatched_decode"].values()),
                         "rows_cross_decode": sum(st["rows_cross_decode"].values())})
            if steps.mode != "off":
                r = rows[-1]
                steps.advance(f"E={E} batch/rank={b} {name}: {r['tokens_per_s']:.0f} tok/s (decode "
                              f"{r['decode_tokens_per_s']:.0f}), rank 0's a2a "
                              f"{np.mean(r['a2a_bytes_per_layer']) / 1024:.1f} KiB per layer")
        if any(t != tokens["baseline"] for t in tokens.values()):
            raise MoEError(f"rank {ctx.rank}: E={E} batch={b}: ExFlow tokens differ from the baseline's")
    return rows


def run(spec: BenchSpec, ctx=None, progress=None) -> list[dict]:
    """The whole sweep; one spawned job of ``world_size`` gloo ranks per expert count; returns the merged rows
    (:func:`summarise`). With a harness ``ctx`` (:class:`hpdl.bench.common.RunContext`) the placements and
    model configs go to ``ctx.extra`` and the JSON is saved after every expert count, so a sweep stopped by a
    time limit keeps what it measured; ``progress`` (a :class:`hpdl.bench.common.Progress`) gets a step per E."""
    from hpdl.runtime.launch import spawn

    check_spec(spec)
    rows: list[dict] = []
    extra = ctx.extra if ctx is not None else {}
    extra.setdefault("placements", {})
    extra.setdefault("models", {})
    for E in spec.experts:
        if progress is not None:
            progress.note(f"E={E}: profiling and placing ({spec.world_size} ranks)")
        prep = prepare(spec, E)
        extra["placements"][E] = prep["placement"]
        extra["models"][E] = prep["model_config"]   # what ran (a --model checkpoint overrides the spec's shape)
        show = progress is not None and progress.mode != "off"
        per_rank = spawn(bench_rank, spec.world_size, args=(asdict(spec), E, prep, show))
        rows.extend(summarise(per_rank))
        if progress is not None:
            progress.advance(f"E={E} done ({progress.elapsed:.0f} s)")
        if ctx is not None:
            ctx.save(rows)
    return rows


def summarise(per_rank: list[list[dict]]) -> list[dict]:
    """Merge the ranks' rows: times from rank 0 (already the max over ranks); bytes and seconds per layer averaged
    over ranks; row counts summed over ranks, and the cross-rank shares computed from those sums (all forwards,
    and decode forwards apart). Adds ``speedup_vs_baseline`` (vs the exact-count baseline) and, for the padded
    modes, ``speedup_vs_baseline_padded`` (padded vs padded: the headline, both without count exchanges), each
    also per repeat (``decode_speedup_*``: decode time ratios of the interleaved repeats, their median and IQR)."""
    merged = []
    for rows in zip(*per_rank):
        r0 = dict(rows[0])
        r0.pop("rank")
        for k in ("a2a_bytes_per_layer", "a2a_seconds_per_layer"):
            r0[k] = np.mean([r[k] for r in rows], axis=0).tolist()
        for k in ("count_seconds", "gather_seconds", "gather_bytes", "gather_calls"):
            r0[k] = float(np.mean([r[k] for r in rows]))
        for k in ("rows_dispatched", "rows_cross", "rows_dispatched_decode", "rows_cross_decode"):
            r0[k] = int(sum(r[k] for r in rows))
        r0["cross_share"] = r0["rows_cross"] / max(1, r0["rows_dispatched"])
        r0["cross_share_decode"] = r0["rows_cross_decode"] / max(1, r0["rows_dispatched_decode"])
        merged.append(r0)
    key = lambda r: (r["experts"], r["batch_per_rank"])  # noqa: E731
    by = {(key(r), r["mode"]): r for r in merged}
    for r in merged:
        for ref in ("baseline", "baseline_padded"):
            if ref == "baseline_padded" and not r["mode"].endswith("_padded"):
                continue
            b = by[(key(r), ref)]
            suf = "" if ref == "baseline" else "_padded"
            r[f"speedup_vs_baseline{suf}"] = r["tokens_per_s"] / b["tokens_per_s"]
            per = np.asarray(b["decode_seconds_all"]) / np.asarray(r["decode_seconds_all"])
            r[f"decode_speedup_vs_baseline{suf}"] = float(np.median(per))
            r[f"decode_speedup_vs_baseline{suf}_iqr"] = np.percentile(per, [25, 75]).tolist()
    return merged


def _kib_per_layer(r: dict) -> float:
    return float(np.mean(r["a2a_bytes_per_layer"])) / 1024


def _pad_cell(r: dict) -> str | None:
    if "decode_speedup_vs_baseline_padded" not in r:
        return None
    lo, hi = r["decode_speedup_vs_baseline_padded_iqr"]
    return f"{r['decode_speedup_vs_baseline_padded']:.2f}x [{lo:.2f},{hi:.2f}]"


class MoEBenchmark(Benchmark):
    """``hpdl moe bench`` (also ``hpdl bench moe``): the sweep of :func:`run` on the harness. ``--out`` is a
    folder (``moe_bench.json`` and ``moe_bench.png``); ``--out FILE.json``, the older spelling, still names
    the JSON file, with the figure beside it (``FILE.png``). With neither ``--out`` nor ``--json`` the files
    are ``moe_bench.json`` / ``moe_bench.png`` here."""

    name, stem = "moe", "moe_bench"
    out_metavar = "DIR|FILE.json"
    out_help = ("a folder for moe_bench.json and moe_bench.png (made if missing), or a FILE.json: the JSON file, "
                "with the figure FILE.png beside it (default: both in the current folder)")
    title = "ExFlow vs the 2-Alltoall baseline (gloo ranks)"
    columns = (Column("experts", "E"), Column("batch_per_rank", "batch/rank"), Column("mode", "mode"),
               Column("tokens_per_s", "throughput", "tok/s", ".0f"),
               Column("speedup_vs_baseline", "vs baseline", fmt=".2f", ratio="speed-up"),
               Column(_pad_cell, "decode vs padded baseline [IQR]", fmt=str, ratio="speed-up"),
               Column(_kib_per_layer, "Alltoall", "KiB/layer", ".1f"),
               Column("cross_share_decode", "cross-rank share (decode)", fmt=".2f"))
    plot_spec = PlotSpec(x="batch_per_rank", xlabel="requests per rank", xscale="log2", series="mode",
                         facet="experts", panels=(Panel("tokens_per_s", "tokens/s"),
                                                  Panel(_kib_per_layer, "Alltoall KiB / layer / forward")))

    @classmethod
    def add_arguments(cls, b) -> None:
        b.add_argument("--world-size", "--np", type=count(1, 64), default=4, help="gloo ranks (processes) spawned "
                       "(--np, as in every other bench); must divide every expert count")
        b.add_argument("--experts", default="8,16,32", help="comma-separated expert counts E, one model each")
        b.add_argument("--batches", default="1,4,16,64", help="comma-separated requests per rank (each >= 1)")
        b.add_argument("--hidden", type=count(8, 1 << 16), default=256, help="hidden size (8 query / 2 KV heads)")
        b.add_argument("--layers", type=count(1, 1024), default=8, help="decoder layers, every one MoE")
        b.add_argument("--expert-size", type=count(1, 1 << 18), default=512, help="hidden units of each expert's "
                       "SwiGLU")
        b.add_argument("--prompt-len", type=count(1, 1 << 16), default=16, help="prompt length in tokens (bytes of "
                       "stdlib text)")
        b.add_argument("--new-tokens", type=count(1, 1 << 16), default=16, help="greedy tokens generated per "
                       "request (>= 1)")
        b.add_argument("--repeats", type=count(1, 10_000), default=10, help="timed runs per point after one "
                       "warm-up, modes interleaved (median and IQR)")
        b.add_argument("--model", default=None, help="checkpoint dir instead of random init; top-1, and --experts "
                       "must be its expert count")

    def validate(self, args) -> None:
        if args.out_dir and args.out_dir.endswith(".json") and not args.json_path:   # the older spelling
            args.json_path, args.out_dir = args.out_dir, None
        if not args.out_dir and not args.json_path:
            args.json_path = f"{self.stem}.json"
        if args.json_path and not args.plot_path and not args.out_dir:
            args.plot_path = str(Path(args.json_path).with_suffix(".png"))
        try:
            experts = [int(x) for x in args.experts.split(",")]
            batches = [int(x) for x in args.batches.split(",")]
        except ValueError:
            raise CLIUsageError(f"--experts and --batches are comma-separated integers, got {args.experts!r} and "
                                f"{args.batches!r}") from None
        self.spec = BenchSpec(world_size=args.world_size, experts=experts, batches=batches, hidden_size=args.hidden,
                              n_layers=args.layers, expert_size=args.expert_size, prompt_len=args.prompt_len,
                              new_tokens=args.new_tokens, repeats=args.repeats, model=args.model)
        try:
            check_spec(self.spec)
        except MoEError as exc:   # say it with the flags' names (the spec's world_size is --world-size)
            flags = {"world_size": "--world-size", "experts": "--experts", "batches": "--batches", "model": "--model",
                     "hidden_size": "--hidden", "n_layers": "--layers", "expert_size": "--expert-size",
                     "prompt_len": "--prompt-len", "new_tokens": "--new-tokens", "repeats": "--repeats"}
            text = re.sub(r"\b(" + "|".join(flags) + r")\b=?", lambda m: flags[m[1]] + (" " if m[0][-1] == "=" else ""),
                          str(exc))
            raise CLIUsageError(text) from None

    def metadata(self, args) -> dict:
        return {"device": "cpu", "spec": asdict(self.spec)}

    def run(self, ctx) -> list[dict]:
        with ctx.progress(len(self.spec.experts), header=f"# {self.invocation(ctx)}: E in {self.spec.experts}, "
                          f"{self.spec.world_size} gloo ranks") as bar:
            return run(self.spec, ctx, bar)

    def plot_title(self, ctx) -> str:
        return f"{self.title}: {self.spec.world_size} ranks, torch {ctx.meta['torch']}, {ctx.meta['date']}"


MoEBenchCommand = command(MoEBenchmark)
