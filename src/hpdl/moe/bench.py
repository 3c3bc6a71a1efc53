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

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hpdl.moe.errors import MoEError


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
                    max_position=spec.prompt_len + spec.new_tokens + 8)
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
    prof = heldout_windows(data[: len(data) // 2], spec.profile_tokens, 64)
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


def bench_rank(ctx, spec_d: dict, E: int, prep: dict) -> list[dict]:
    """Per-rank body (run by ``hpdl.runtime.launch.spawn`` or a test pool): every mode x batch size.

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
            if ctx.rank == 0:
                r = rows[-1]
                print(f"E={E} batch/rank={b} {name}: {r['tokens_per_s']:.0f} tok/s (decode "
                      f"{r['decode_tokens_per_s']:.0f}), rank 0's a2a {np.mean(r['a2a_bytes_per_layer']) / 1024:.1f} "
                      f"KiB per layer", flush=True)
        if any(t != tokens["baseline"] for t in tokens.values()):
            raise MoEError(f"rank {ctx.rank}: E={E} batch={b}: ExFlow tokens differ from the baseline's")
    return rows


def run(spec: BenchSpec, out: str | Path | None = None, plot: str | Path | None = None, progress=print) -> dict:
    """The whole sweep; one spawned job of ``world_size`` gloo ranks per expert count. Returns the JSON dict."""
    import platform

    import torch

    from hpdl.runtime.launch import spawn

    check_spec(spec)
    result = {"spec": asdict(spec), "torch": torch.__version__, "host": platform.node(),
              "cpus": __import__("os").cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "rows": [], "placements": {}, "models": {}}
    for E in spec.experts:
        if progress:
            progress(f"E={E}: profiling and placing ({spec.world_size} ranks)")
        prep = prepare(spec, E)
        result["placements"][E] = prep["placement"]
        result["models"][E] = prep["model_config"]   # what ran (a --model checkpoint overrides the spec's shape)
        per_rank = spawn(bench_rank, spec.world_size, args=(asdict(spec), E, prep))
        result["rows"].extend(summarise(per_rank))
        if out:  # after every expert count, so a sweep stopped by a time limit keeps what it measured
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(result, indent=1))
    if plot:
        plot_result(result, plot)
    return result


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


def plot_result(result: dict, path) -> None:
    """tokens/s vs batch (one panel per E) and Alltoall KiB per layer per forward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Es = sorted({r["experts"] for r in result["rows"]})
    fig, axes = plt.subplots(2, len(Es), figsize=(4 * len(Es), 6.5), squeeze=False)
    for c, E in enumerate(Es):
        for mode, style in (("baseline", "o-"), ("exflow_contiguous", "s--"), ("exflow", "^-"),
                            ("baseline_padded", "o:"), ("exflow_padded", "^:")):
            rs = [r for r in result["rows"] if r["experts"] == E and r["mode"] == mode]
            bs = [r["batch_per_rank"] for r in rs]
            axes[0, c].plot(bs, [r["tokens_per_s"] for r in rs], style, label=mode)
            axes[1, c].plot(bs, [np.mean(r["a2a_bytes_per_layer"]) / 1024 for r in rs], style, label=mode)
        axes[0, c].set_title(f"{E} experts, {result['spec']['world_size']} gloo ranks")
        for a in axes[:, c]:
            a.set_xscale("log", base=2)
            a.set_xlabel("requests per rank")
        axes[0, c].set_ylabel("tokens/s")
        axes[1, c].set_ylabel("Alltoall KiB / layer / forward")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
