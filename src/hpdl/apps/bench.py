"""The application benchmark: CG, pencil 3-D FFT and nanoGPT training, hpdl against the native collectives.

One job per process count runs every case on the same ranks, repeating the variants in interleaved rounds
(native, hpdl, ..., native, hpdl, ...) so that machine noise hits them alike; each round checks its numbers
against the round's native variant (CG residuals, FFT output bit for bit, GPT loss curve). :class:`AppsBenchmark`
is the harness plug-in (``hpdl bench apps``; ``benchmarks/apps_cpu.py`` is its launch recipe): the table is
:func:`summarize`'s, one row per case and variant, and :func:`plot` the figure.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

import torch

from hpdl.apps import cg, fft3d
from hpdl.apps.comm import TorchComm
from hpdl.bench.common import Benchmark, Column, command, format_table as _format_table, pyplot
from hpdl.runtime.errors import CLIUsageError


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
    """Run the plan on this job's ranks; rank 0 returns the rows (one per case, variant and round) and, with
    ``log``, shows a step of progress per case on stderr."""
    from hpdl.apps.train import train
    from hpdl.bench.common import Progress

    rows: list[dict] = []
    steps = len(plan.cg_sizes) + len(plan.fft_shapes) + plan.rounds
    bar = Progress(steps, f"apps np={ctx.world_size}", enabled=log and ctx.rank == 0)

    def say(msg):
        bar.advance(f"apps np={ctx.world_size} ({bar.elapsed:.0f} s): {msg}")

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
    bar.close()
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


_UNITS = {"cg": ("us/iter", 1e6), "fft3d": ("ms/FFT", 1e3), "gpt": ("ms/step", 1e3)}


def _scaled(key):
    return lambda s: s[key] * _UNITS[s["app"]][1]


def _check(s: dict) -> str:
    return (f"#wrong {s['wrong']}" if "wrong" in s else f"rel {s['max_rel_diff']:.1e}" if "max_rel_diff" in s
            else "")


COLUMNS = (Column("app", "app"), Column("np", "np"), Column("case", "case"), Column("variant", "variant"),
           Column(_scaled("median_s"), "median", fmt=".1f"), Column(_scaled("min_s"), "min", fmt=".1f"),
           Column(_scaled("max_s"), "max", fmt=".1f"), Column(lambda s: _UNITS[s["app"]][0], "unit"),
           Column("vs_native", "vs native", fmt=".2f", ratio="time ratio"), Column(_check, "check"))


def format_table(summary: list[dict]) -> str:
    """:func:`summarize`'s rows as a table: times in each app's unit (the ``unit`` column), ``vs native`` the
    time ratio to native's (lower is better), ``check`` the FFT's #wrong or the largest relative difference of
    the CG residuals / GPT losses from native's."""
    return _format_table(summary, COLUMNS)


def plot(summary: list[dict], rows: list[dict], path: str, title: str) -> None:
    """Time relative to native per case (bars, one panel per app) and the GPT loss curves."""
    plt = pyplot()
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


class AppsBenchmark(Benchmark):
    """``hpdl bench apps``: CG, pencil 3-D FFT and nanoGPT training, hpdl.comm against the native collectives,
    one spawned gloo job per process count; exit status 1 when a check fails (FFT output not bit-identical to
    native's, or a CG / GPT curve off native's by more than 1e-4)."""

    name, stem = "apps", "apps_cpu"
    title = "hpdl apps vs native (gloo)"
    columns = COLUMNS

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument("--np", default="4,8", help="comma-separated process counts (default: 4,8)")
        parser.add_argument("--rounds", type=int, default=None, help="interleaved repetitions (default 3; quick 2)")
        size = parser.add_mutually_exclusive_group()
        size.add_argument("--small", action="store_true", help="smaller cases for a 2-core machine")
        size.add_argument("--quick", action="store_true", help="tiny sizes: checks the logic in seconds per job")

    def validate(self, args) -> None:
        try:
            self.nps = [int(x) for x in args.np.split(",") if x.strip()]
        except ValueError:
            raise CLIUsageError(f"--np must be comma-separated process counts such as 4,8, got {args.np!r}") from None
        if not self.nps or min(self.nps) < 1:
            raise CLIUsageError(f"--np must name process counts >= 1, got {args.np!r}")
        if args.rounds is not None and args.rounds < 1:
            raise CLIUsageError(f"--rounds must be >= 1, got {args.rounds}")
        self.plan = Plan.quick() if args.quick else Plan.small() if args.small else Plan()
        if args.rounds is not None:
            self.plan.rounds = args.rounds

    def metadata(self, args) -> dict:
        return {"nps": self.nps, "plan": asdict(self.plan)}

    def run(self, ctx) -> list[dict]:
        from hpdl.runtime import spawn

        rows: list[dict] = []
        for n in self.nps:
            rows += spawn(job, n, args=(self.plan,), timeout=300)[0]
        ctx.extra["rounds"] = rows   # every round's row; the table's rows are their summary
        return summarize(rows)

    def table(self, rows, ctx) -> str:
        m = ctx.meta
        return (f"# {self.invocation(ctx)}: np {self.nps}, {m['cores']} cores, torch {m['torch']}, {m['date']}, "
                f"{m.get('seconds', 0):.0f} s\n" + format_table(rows))

    def plot(self, rows, path, ctx) -> list[str]:
        from pathlib import Path

        target = Path(path) / f"{self.stem}.png" if Path(path).is_dir() else Path(path)
        m = ctx.meta
        plot(rows, ctx.extra["rounds"], str(target),
             f"{self.title}, {m['cores']} cores, torch {m['torch']}, {m['date']}")
        return [str(target)]

    def failed(self, rows, ctx) -> bool:
        return any(s.get("wrong") or s.get("max_rel_diff", 0.0) > 1e-4 for s in rows)


AppsBenchCommand = command(AppsBenchmark)
