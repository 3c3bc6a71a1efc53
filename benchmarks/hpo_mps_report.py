"""Tables and plots of hpo_device.py runs that compare policies with and without MPS (``<policy>@mps``).

For each results file: wall time to finish the budget, speed-ups against ``one_per_gpu``,
``fixed_fraction`` and ``fixed_fraction@mps`` of the same run, the same wall time with the warm pool's
start-up and the teardown added, failures, best accuracy, concurrency, and the median slowdown of each
trial against the same configuration alone (the ``one_per_gpu`` run), split into the batch-16384 tail and
the rest; where the run recorded them, the GPUs' mean SM activity (``--gpu-monitor``) and the seconds the
driver's loop was busy while the clock ran (``driver_s`` without ``wait`` and ``prepare``, the asks and
estimates made while the pool started). Writes a markdown table to stdout and a PNG of wall
times (plus best-vs-time curves) per file.

    PYTHONPATH=src python3 benchmarks/hpo_mps_report.py --png-dir docs/benchmarks/data/hpo \\
        "1 x H200, launch=docs/benchmarks/data/hpo/hpo_mps_2026-11-30_1xh200_launch.json" ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import numpy as np

from hpdl.hpo.report import plot_best_vs_time

TAIL_BATCH = 16384


def _key(t: dict) -> str:
    return json.dumps(t["params"], sort_keys=True)


def rows(doc: dict) -> list[dict]:
    """One dict per finished run of ``doc`` (a results.json of benchmarks/hpo_device.py)."""
    runs = [r for r in doc["runs"] if "result" in r]
    base = next((r for r in runs if r["tag"].startswith("one_per_gpu")), None)
    solo = {_key(t): t["end"] - t["start"] for t in (base or {}).get("trials", [])
            if t["state"] == "COMPLETE" and t["start"] and t["end"]}
    walls = {r["tag"].rsplit("-", 1)[0]: r["result"]["wall_s"] for r in runs if not r.get("error")}
    out = []
    for r in runs:
        res, name = r["result"], r["tag"].rsplit("-", 1)[0]
        done = [t for t in r["trials"] if t["start"] and t["end"]]
        t0 = res.get("started_at") or min(t["start"] for t in done)
        t1 = max(t["end"] for t in done)
        grid = np.linspace(t0, t1, 600)
        conc = [sum(t["start"] <= g < t["end"] for t in done) / len(r["gpus"]) for g in grid]

        def slow(tail: bool) -> float:
            xs = [(t["end"] - t["start"]) / solo[_key(t)] for t in done if t["state"] == "COMPLETE"
                  and _key(t) in solo and (t["params"]["batch_size"] == TAIL_BATCH) == tail]
            return statistics.median(xs) if xs else float("nan")

        fails = dict(res["failures"])
        oom = fails.pop("oom", 0)
        out.append({"policy": name, "gpus": len(r["gpus"]), "wall": res["wall_s"],
                    "inclusive": res["wall_s"] + res.get("warmup_s", 0) + res.get("teardown_s", 0),
                    "warmup": res.get("warmup_s", 0), "teardown": res.get("teardown_s", 0),
                    "speedup": {b: walls[b] / res["wall_s"] for b in ("one_per_gpu", "fixed_fraction",
                                                                       "fixed_fraction@mps") if b in walls},
                    "complete": res["complete"], "oom": oom, "other": sum(fails.values()),
                    "best": res["best_value"], "conc": float(np.mean(conc)), "conc_max": max(conc),
                    "head": slow(False), "tail": slow(True), "history": res["history"],
                    "smutil": _mean_gpu(r.get("gpu_util"), "smutil"), "sm": _mean_gpu(r.get("gpu_util"), "sm"),
                    "driver_busy": sum(v for k, v in res.get("driver_s", {}).items() if k not in ("wait", "prepare"))
                    if res.get("driver_s") else float("nan")})
    return out


def _mean_gpu(util: dict | None, col: str) -> float:
    """Mean over the run's GPUs of one ``--gpu-monitor`` column (NaN when it was not recorded)."""
    vals = [g[col] for g in (util or {}).values() if col in g]
    return sum(vals) / len(vals) if vals else float("nan")


def _x(v: float) -> str:
    return "-" if v != v else f"{v:.2f}x"


def table(label: str, rs: list[dict]) -> list[str]:
    extra = any(r["smutil"] == r["smutil"] or r["driver_busy"] == r["driver_busy"] for r in rs)
    lines = [f"**{label}**", "",
             "| policy | wall s | vs one_per_gpu | vs fixed_fraction | vs fixed_fraction@mps | wall + pool start-up + "
             "teardown s | complete | OOM | other failures | best accuracy | trials per GPU mean / max | "
             "slowdown vs alone, head / tail (median) |"
             + (" SM busy % (GPM smutil) / any kernel % | driver busy s |" if extra else ""),
             "|---" * (14 if extra else 12) + "|"]
    for r in rs:
        sp = [f"{r['speedup'][b]:.2f}x" if b in r["speedup"] else "-"
              for b in ("one_per_gpu", "fixed_fraction", "fixed_fraction@mps")]
        lines.append(f"| {r['policy']} | {r['wall']:.1f} | {sp[0]} | {sp[1]} | {sp[2]} | "
                     f"{r['inclusive']:.1f} ({r['warmup']:.1f} + {r['teardown']:.1f}) | {r['complete']} | {r['oom']} | "
                     f"{r['other']} | {r['best']:.4f} | {r['conc']:.1f} / {r['conc_max']:.0f} | "
                     f"{_x(r['head'])} / {_x(r['tail'])} |"
                     + (f" {_f(r['smutil'], 0)} / {_f(r['sm'], 0)} | {_f(r['driver_busy'], 1)} |" if extra else ""))
    return lines


def _f(v: float, digits: int) -> str:
    return "-" if v != v else f"{v:.{digits}f}"


def plot(label: str, rs: list[dict], path: str) -> None:
    from hpdl.bench.common import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    names = [r["policy"] for r in rs]
    ax.barh(names, [r["wall"] for r in rs], color="tab:blue", label="wall time to finish the budget")
    ax.barh(names, [r["warmup"] + r["teardown"] for r in rs], left=[r["wall"] for r in rs], color="tab:gray",
            alpha=0.5, label="+ pool start-up and teardown")
    for i, r in enumerate(rs):
        ax.text(r["wall"] / 2, i, f"{r['wall']:.1f} s", va="center", ha="center", color="white", fontsize=8)
    ax.set_xlabel("seconds (measured)")
    ax.set_title(label.replace(" (", "\n(", 1), fontsize=9)
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def simulate_pools(docs: list[dict], png: str) -> list[str]:
    """SIMULATION. Replays the launch-bound trace (solo times of the 1 x H200 ``one_per_gpu`` run, profiles of
    every run) under both sharing models of :mod:`hpdl.hpo.simulator`: the time-slicing overhead is fitted to
    the measured rows without MPS, the MPS capacity and overhead to the ``@mps`` rows, each by least squares
    on log ratios over the 1 and 2 x H200 runs given; then 512 trials (32 per GPU) on 12 A100 + 4 H100."""
    from hpo_report import STARTUP_S, build_trace, scaled

    from hpdl.hpo.simulator import pool_from_spec, simulate

    trace = build_trace(docs[0])
    with open(os.path.join(os.path.dirname(png), "hpo_mps_trace.json"), "w") as f:  # for `hpdl hpo simulate`
        json.dump([t.__dict__ for t in trace], f, indent=0)

    def run(tr, pool, policy, mps, ov, cap):  # the simulator samples ahead as the driver does
        devs = pool_from_spec(pool)
        return simulate(tr, devs, policy, startup_s=STARTUP_S, overhead=ov, mps=mps, mps_capacity=cap,
                        **({"fraction": 0.125} if policy == "fixed_fraction" else {}))

    meas = {}
    for doc in docs:
        for r in doc["runs"]:
            if "result" in r and not r.get("error") and doc["meta"]["space_name"] == "launch":
                name = r["tag"].rsplit("-", 1)[0]
                meas[(f"{len(r['gpus'])}xH200", name)] = r["result"]["wall_s"]

    def fit(rows, grid):
        best = (math.inf, None)
        for ov, cap in grid:
            err = sum(math.log(run(trace, pool, name.partition("@")[0], "@mps" in name, ov, cap).makespan_s / w) ** 2
                      for (pool, name), w in rows.items())
            best = min(best, (err, (ov, cap)), key=lambda x: x[0])
        return best[1]

    sliced = {k: v for k, v in meas.items() if "@mps" not in k[1] and k[1] != "one_per_gpu"}
    on_mps = {k: v for k, v in meas.items() if "@mps" in k[1]}
    ov_ts, _ = fit(sliced, [(o, 1.0) for o in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)])
    ov_mps, cap = fit(on_mps, [(o, c) for o in (0.0, 0.02, 0.05, 0.1) for c in (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)])
    lines = [f"Fitted: time-slicing overhead {ov_ts} per extra co-located trial; MPS capacity {cap} (summed busy "
             f"fraction served at full speed), MPS overhead {ov_mps}.", "",
             "| pool | policy | measured wall s | simulated s |", "|---|---|---|---|"]
    for (pool, name), w in sorted(meas.items()):
        mps = "@mps" in name
        sim_s = run(trace, pool, name.partition("@")[0], mps, ov_mps if mps else ov_ts, cap).makespan_s
        lines.append(f"| {pool} | {name} | {w:.1f} | {sim_s:.1f} |")
    big = scaled(trace, 32 * 16)
    lines += ["", "| pool | trials | policy | makespan s | speed-up vs one_per_gpu | OOM | max trials/GPU |",
              "|---|---|---|---|---|---|---|"]
    curves = {}
    base = run(big, "12xA100,4xH100", "one_per_gpu", False, ov_ts, 1.0).makespan_s
    for name in ("one_per_gpu", "fixed_fraction", "pack", "pack_hetero", "fixed_fraction@mps", "pack@mps",
                 "pack_hetero@mps"):
        mps = "@mps" in name
        r = run(big, "12xA100,4xH100", name.partition("@")[0], mps, ov_mps if mps else ov_ts, cap)
        curves[name] = r.history + [(r.makespan_s, r.history[-1][1])] if r.history else []
        lines.append(f"| 12xA100,4xH100 | {len(big)} | {name} | {r.makespan_s:.1f} | {base / r.makespan_s:.2f}x | "
                     f"{r.oom} | {r.max_colocated} |")
    plot_best_vs_time(curves, png, "SIMULATION: 512 launch-bound CNN trials\non 12 A100 + 4 H100",
                      "best validation accuracy")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="'label=path/to/results.json'")
    ap.add_argument("--png-dir", default="out")
    ap.add_argument("--simulate", action="store_true",
                    help="also fit the simulator to the launch-bound runs and replay 12 A100 + 4 H100 (SIMULATION)")
    args = ap.parse_args()
    docs = []
    os.makedirs(args.png_dir, exist_ok=True)
    for spec in args.runs:
        label, _, path = spec.rpartition("=")
        with open(path) as f:
            doc = json.load(f)
        docs.append(doc)
        rs = rows(doc)
        m = doc["meta"]
        label = f"{label} ({m['cpus']} cores, {m['date']}, {m['n_trials']} configurations, space {m['space_name']})"
        print("\n".join(table(label, rs)) + "\n")
        stem = os.path.join(args.png_dir, os.path.splitext(os.path.basename(path))[0])
        plot(label, rs, stem + ".png")
        # each line runs on to the moment its budget finished (history holds improvements only)
        curves = {r["policy"]: r["history"] + [(r["wall"], r["history"][-1][1])] for r in rs if r["history"]}
        plot_best_vs_time(curves, stem + "_best.png", label.replace(" (", "\n(", 1), "best validation accuracy")

    if args.simulate:
        launch = sorted((d for d in docs if d["meta"]["space_name"] == "launch"), key=lambda d: len(d["meta"]["gpus"]))
        png = os.path.join(args.png_dir, "hpo_mps_simulation.png")
        print("SIMULATION\n\n" + "\n".join(simulate_pools(launch, png)))


if __name__ == "__main__":
    main()
