"""The application benchmark: CG, pencil 3-D FFT and nanoGPT training, hpdl against the native collectives.

One job per process count runs every case on the same ranks, repeating the variants in interleaved rounds
(native, hpdl, ..., native, hpdl, ...) so that machine noise hits them alike; each round checks its numbers
against the round's native variant (CG residuals, FFT output bit for bit, GPT loss curve). ``benchmarks/
apps_cpu.py`` is the command line; :func:`summarize` and :func:`plot` make the table and the figure.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from hpdl.apps import cg, fft3d
from hpdl.apps.comm import TorchComm


@dataclass
class Plan:
    """What one job measures (sizes per rank count are fixed so that 4 and 8 processes compare)."""

    cg_sizes: list[int] = field(default_factory=lambda: [32, 96])   # grid points per dimension
    cg_iters: int = 200
    cg_variants: list[str] = field(default_factory=lambda: ["nccl", "hpdl:auto", "hpdl:direct"])
    fft_shapes: list[list[int]] = field(default_factory=lambda: [[64, 64, 64], [128, 128, 128]])
    fft_iters: int = 5
    fft_variants: list[str] = field(default_factory=lambda: ["nccl", "hpdl:auto", "hpdl:pairwise", "hpdl:direct"])
    gpt_steps: int = 20
    gpt_variants: list[str] = field(default_factory=lambda: ["nccl", "nccl:small", "hpdl", "hpdl-ddp"])
    gpt_bucket_mb: float = 0.5    # hpdl's buckets and "nccl:small" (plain "nccl" keeps DDP's 25 MiB)
    gpt: dict = field(default_factory=lambda: {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128,
                                               "batch_size": 8})
    rounds: int = 3

    @classmethod
    def small(cls) -> "Plan":
        """Sizes for a 2-core machine (2-4 ranks): the same cases, about a quarter of the work each."""
        return cls(cg_sizes=[16, 48], cg_iters=100, fft_shapes=[[32, 32, 32], [64, 64, 64]], fft_iters=3,
                   gpt_steps=10, gpt={"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "batch_size": 4})

    @classmethod
    def quick(cls) -> "Plan":
        return cls(cg_sizes=[16], cg_iters=30, fft_shapes=[[16, 16, 16]], fft_iters=2, gpt_steps=4,
                   gpt={"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 2}, rounds=2)


def _comm(ctx, variant: str, a2a: bool = False) -> TorchComm:
    kind, _, algo = variant.partition(":")
    algo = algo or "auto"
    return TorchComm(kind == "hpdl", ctx.device, algorithm="auto" if a2a else algo,
                     alltoall_algorithm=algo if a2a else "auto")


def _gpt_config(plan: Plan, variant: str):
    from hpdl.apps.train import TrainConfig

    comm, _, mode = variant.partition(":")
    small = comm != "nccl" or mode == "small"
    return TrainConfig(comm=comm, steps=plan.gpt_steps, log_interval=plan.gpt_steps, warmup_steps=5,
                       bucket_mb=plan.gpt_bucket_mb if small else 25.0,
                       first_bucket_mb=min(1.0, plan.gpt_bucket_mb) if small else 1.0, **plan.gpt)


def job(ctx, plan: Plan, log: bool = True) -> list[dict] | None:
    """Run the plan on this job's ranks; rank 0 returns the rows (one per case, variant and round)."""
    from hpdl.apps.train import train

    rows: list[dict] = []
    t_start = time.perf_counter()

    def say(msg):
        if log and ctx.rank == 0:
            print(f"[apps np={ctx.world_size} {time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    comms = {}  # one communicator per variant, reused by every round

    def comm_of(variant, a2a=False):
        key = (variant, a2a)
        if key not in comms:
            comms[key] = _comm(ctx, variant, a2a)
        return comms[key]

    for n in plan.cg_sizes:
        for rnd in range(plan.rounds):
            ref = None
            for v in plan.cg_variants:
                res = cg.solve(comm_of(v), n, plan.cg_iters, warmup=10, breakdown=True)
                hist = torch.tensor(res.residuals)
                ref = hist if ref is None else ref
                live = ref > 1e-6 * ref[0]  # once converged, residuals are rounding noise: compare before that
                rows.append({"app": "cg", "np": ctx.world_size, "case": f"{n}^3", "variant": v, "round": rnd,
                             "time_s": res.time_s, "allreduce_s": res.allreduce_s, "halo_s": res.halo_s,
                             "max_rel_diff": float(((hist - ref).abs() / ref)[live].max()),
                             "final_residual": res.residuals[-1] / res.residuals[0]})
        say(f"cg {n}^3 done")
    for shape in plan.fft_shapes:
        for rnd in range(plan.rounds):
            ref = None
            for v in plan.fft_variants:
                res = fft3d.run(comm_of(v, a2a=True), tuple(shape), plan.fft_iters, warmup=1, breakdown=True)
                ref = res.y if ref is None else ref
                wrong = int((res.y != ref).sum())
                wrong_all = torch.tensor([wrong])
                if ctx.world_size > 1:
                    torch.distributed.all_reduce(wrong_all)
                rows.append({"app": "fft3d", "np": ctx.world_size, "case": "x".join(map(str, shape)), "variant": v,
                             "round": rnd, "time_s": res.time_s, "fft_s": res.fft_s, "pack_s": res.pack_s,
                             "alltoall_s": res.alltoall_s, "grid": res.meta["grid"], "wrong": int(wrong_all)})
        say(f"fft3d {shape} done")
    for rnd in range(plan.rounds):
        ref = None
        for v in plan.gpt_variants:
            out = train(_gpt_config(plan, v), log=None)
            losses = torch.tensor(out["losses"])
            ref = losses if ref is None else ref
            rows.append({"app": "gpt", "np": ctx.world_size, "case": f"{out['params'] / 1e6:.2f}M params",
                         "variant": v, "round": rnd, "time_s": out["median_step_ms"] / 1e3,
                         "tokens_per_s": out["tokens_per_s"], "buckets": out["buckets"], "losses": out["losses"],
                         "max_rel_diff": float(((losses - ref).abs() / ref).max())})
        say(f"gpt round {rnd + 1}/{plan.rounds} done")
    return rows if ctx.rank == 0 else None


def summarize(rows: list[dict]) -> list[dict]:
    """Per (app, np, case, variant): median/min/max seconds over rounds and the median ratio to native's."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["app"], r["np"], r["case"], r["variant"]), []).append(r)
    out = []
    for (app, np_, case, variant), rs in groups.items():
        times = [r["time_s"] for r in rs]
        native = groups.get((app, np_, case, "nccl"), [])
        ratios = [r["time_s"] / n["time_s"] for r in rs for n in native if n["round"] == r["round"]]
        s = {"app": app, "np": np_, "case": case, "variant": variant, "median_s": statistics.median(times),
             "min_s": min(times), "max_s": max(times), "rounds": len(rs),
             "vs_native": statistics.median(ratios) if ratios else None}
        for key in ("allreduce_s", "halo_s", "fft_s", "pack_s", "alltoall_s"):
            if rs[0].get(key) is not None:
                s[key] = statistics.median(r[key] for r in rs)
        if "wrong" in rs[0]:
            s["wrong"] = sum(r["wrong"] for r in rs)
        if "max_rel_diff" in rs[0]:
            s["max_rel_diff"] = max(r["max_rel_diff"] for r in rs)
        out.append(s)
    return out


def format_table(summary: list[dict]) -> str:
    unit = {"cg": ("us/iter", 1e6), "fft3d": ("ms/FFT", 1e3), "gpt": ("ms/step", 1e3)}
    lines = [f"{'app':6} {'np':>3} {'case':>14} {'variant':>16} {'median':>10} {'min':>10} {'max':>10} "
             f"{'unit':>8} {'vs native':>9} {'check':>12}"]
    for s in summary:
        u, k = unit[s["app"]]
        check = (f"#wrong {s['wrong']}" if "wrong" in s else
                 f"rel {s['max_rel_diff']:.1e}" if "max_rel_diff" in s else "")
        ratio = f"{s['vs_native']:.2f}x" if s["vs_native"] is not None else "-"
        lines.append(f"{s['app']:6} {s['np']:>3} {s['case']:>14} {s['variant']:>16} {s['median_s'] * k:>10.1f} "
                     f"{s['min_s'] * k:>10.1f} {s['max_s'] * k:>10.1f} {u:>8} {ratio:>9} {check:>12}")
    return "\n".join(lines)


def plot(summary: list[dict], rows: list[dict], path: str, title: str) -> None:
    """Time relative to native per case (bars, one panel per app) and the GPT loss curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, app, label in zip(axes, ("cg", "fft3d", "gpt"), ("CG time / iteration", "3-D FFT time / transform",
                                                             "GPT step time")):
        items = [s for s in summary if s["app"] == app]
        cases = sorted({(s["np"], s["case"]) for s in items})
        variants = list(dict.fromkeys(s["variant"] for s in items))
        width = 0.8 / max(1, len(variants))
        for i, v in enumerate(variants):
            ys = []
            for c in cases:
                m = [s for s in items if (s["np"], s["case"]) == c and s["variant"] == v]
                ys.append(m[0]["vs_native"] if m and m[0]["vs_native"] is not None else 0.0)
            ax.bar([j + i * width for j in range(len(cases))], ys, width, label=v)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels([f"np={n}\n{c}" for n, c in cases], fontsize=8)
        ax.set_ylabel("time / native's (lower is better)")
        ax.set_title(label)
        ax.legend(fontsize=7)
    ax = axes[3]
    for r in rows:
        if r["app"] == "gpt" and r["round"] == 0:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"np={r['np']} {r['variant']}",
                    ls="-" if r["variant"].startswith("nccl") else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global mean)")
    ax.set_title("GPT loss curves (round 0)")
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def meta(plan: Plan, nps: list[int], command: str) -> dict:
    import os
    from datetime import datetime, timezone

    from hpdl.bench.report import source_commit

    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "host": platform.node(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "commit": source_commit(), "nps": nps, "command": command,
            "plan": asdict(plan)}
