"""``hpdl bench model``: the alpha-beta-gamma cost model (:mod:`hpdl.comm.model`) fitted to ``hpdl bench --json``
files and its labelled predictions, printed with the harness's tables, metadata and plot backend."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

from hpdl.bench.common import (EXIT_USAGE, Column, add_output_arguments, check_outputs, format_table, pyplot,
                               run_metadata)
from hpdl.comm.model import (FIT, PRESETS, Machine, allreduce_time, calibrate, compare_table, fmt_bytes,
                             load_samples, predict_table, speedup_table)
from hpdl.runtime.errors import CLIUsageError

WORLDS = [2 ** k for k in range(1, 13)]  # 2 .. 4096


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``hpdl bench model``."""
    p.add_argument("--calibrate", nargs="*", default=[], metavar="JSON",
                   help="hpdl bench --json files to fit and compare against (CPU, emulated nodes)")
    p.add_argument("--machine", choices=sorted(PRESETS), default="h100-ndr", help="preset for the predictions")
    p.add_argument("--gpus-per-node", type=int, default=None, help="override the preset's GPUs per node")
    p.add_argument("--rails", type=int, default=None, help="override the preset's rails (NICs) per node")
    p.add_argument("--size", default="1G", help="message size of the speed-up table (e.g. 1G, 4M)")
    add_output_arguments(p, ("format", "json", "plot"))


def _cell(key: str):
    def text(v) -> str:
        return f"{v:.3g}" if isinstance(v, float) else fmt_bytes(v) if key == "bytes" else str(v)
    return text


# the model's fields that are ratios or carry a unit, as labelled columns (the JSON keeps the field names)
_LABELLED = {"two_level_us": Column("two_level_us", "two_level", "us", ".3g"),
             "vs_ring_1_rail": Column("vs_ring_1_rail", "vs ring 1 rail", fmt=".3g", ratio="speed-up"),
             "vs_ring_all_rails": Column("vs_ring_all_rails", "vs ring all rails", fmt=".3g",
                                         ratio="speed-up"),
             "two_level_beats_ring_1_rail": Column("two_level_beats_ring_1_rail", "two_level beats ring, 1 rail, at",
                                                   fmt=str),
             "two_level_beats_ring_all_rails": Column("two_level_beats_ring_all_rails",
                                                      "two_level beats ring, all rails, at", fmt=str),
             "push_beats_pairwise": Column("push_beats_pairwise", "push beats pairwise at", fmt=str),
             "push_speedup_4MiB": Column("push_speedup_4MiB", "push vs pairwise at 4 MiB", fmt=".3g",
                                         ratio="speed-up")}


def _table(rows: list[dict], title: str) -> str:
    if not rows:
        return f"# {title}\n# (no rows)"
    return format_table(rows, [_LABELLED.get(k) or Column(k, k, fmt=_cell(k)) for k in rows[0]], title)


def run_model_command(args, size: int) -> int:
    """``hpdl bench model``: measured vs model (calibrated), then predictions, each section labelled.

    ``args`` from :func:`add_model_arguments`; ``size`` (bytes) is ``--size`` parsed by ``hpdl bench``."""
    try:
        check_outputs(args)
    except CLIUsageError as exc:
        exc.exit_status = EXIT_USAGE   # a usage error before the run, as in every harness benchmark
        raise
    out: dict = {"meta": run_metadata()}
    if args.calibrate:
        samples = load_samples(args.calibrate)
        fitted = calibrate(samples)
        out["calibrated_machine"] = asdict(fitted)
        out["measured_vs_model"] = compare_table(fitted, samples)
    m = PRESETS[args.machine]
    m = replace(m, gpus_per_node=args.gpus_per_node or m.gpus_per_node, rails=args.rails or m.rails)
    configs = sorted({(m.gpus_per_node, m.rails), (4, 4), (8, 4), (8, 8)})
    out["prediction_machine"] = asdict(m)
    out["prediction_speedup"] = speedup_table(m, [size], [32, 256, 1024], configs)
    out["prediction_crossovers"] = predict_table(m, WORLDS)
    if args.plot_path:
        _plot(m, size, configs, args.plot_path)
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(out, fh, indent=1)
    if args.format == "json":
        print(json.dumps(out, indent=1))
        return 0
    if args.calibrate:
        errs = [abs(r["error_pct"]) for r in out["measured_vs_model"]]
        print(f"# MEASURED vs MODEL: {len(errs)} rows from {', '.join(args.calibrate)}; fitted "
              + ", ".join(f"{k}={out['calibrated_machine'][k]:.3g}" for k in FIT)
              + f"; median |error| {sorted(errs)[len(errs) // 2]:.0f}%")
        print(_table(out["measured_vs_model"], "measured on this host (emulated nodes) vs calibrated model"))
        print()
    print(f"# PREDICTION (not measured): machine {m.name}: {m.source}")
    print(_table(out["prediction_speedup"], f"PREDICTION: two_level Allreduce speed-up at "
                 f"{fmt_bytes(size)} (seed 2 abstract reports 2.8x at 1 GB on 32 NVIDIA GPUs)"))
    print()
    print(_table(out["prediction_crossovers"], f"PREDICTION: where two-level wins (crossovers), {m.gpus_per_node} "
                 f"GPUs and {m.rails} rails per node"))
    return 0


def _plot(m: Machine, size: int, configs, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for g, rails in configs:
        ws = [p for p in WORLDS if p % g == 0 and p > g]
        for base, style in (("ring", "-"), ("ring_all_rails", "--")):
            ax.plot(ws, [allreduce_time(m, base, p, size, g, rails) / allreduce_time(m, "two_level", p, size, g, rails)
                         for p in ws], style, marker="o", ms=3, label=f"g={g} rails={rails} vs {base}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel("predicted speed-up of two_level")
    ax.set_title(f"PREDICTION ({m.name}, {fmt_bytes(size)} Allreduce)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
