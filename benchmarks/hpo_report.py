"""Turn a device run of benchmarks/hpo_device.py into docs/benchmarks/hpo_device.md (+ PNGs), and replay its
profiled trial costs on simulated pools (12 A100 + 4 H100, and the measured 1/2 x H200 as a check) into
docs/benchmarks/hpo_simulation.md (+ PNG). Runs on CPU.

    PYTHONPATH=src python3 benchmarks/hpo_report.py --results out/hpo_device/results.json --docs docs/benchmarks

Trace construction (one SimTrial per configuration): solo seconds per step = the configuration's wall time
in the ``one_per_gpu`` run (alone on its GPU, model build and evaluation included) / its steps; GPU busy
fraction and peak memory = the in-place profile measured by the ``pack`` run (per structure); static
memory bound = the meta-device bound the driver used before profiling.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random

from hpdl.hpo.report import plot_best_vs_time
from hpdl.hpo.scheduler import GIB
from hpdl.hpo.simulator import SimTrial, pool_from_spec, simulate
from hpdl.hpo.workloads import get_workload

POLICIES = ("one_per_gpu", "fixed_fraction", "pack", "pack_hetero")


def build_trace(doc: dict) -> list[SimTrial]:
    runs = {r["tag"]: r for r in doc["runs"] if "trials" in r}
    fixed = doc["meta"]["fixed"]
    w = get_workload("cnn")
    solo = next((r for t, r in runs.items() if t.startswith("one_per_gpu")), None)
    prof_run = next((r for t, r in runs.items() if t.startswith("pack")), None) or solo
    if solo is None or prof_run is None:
        raise SystemExit("results need a one_per_gpu run and a pack run")
    profiles = {}
    for r in runs.values():
        profiles.update(r["profiles"])
    by_lineage = {}
    for t in solo["trials"]:
        if t["state"] == "COMPLETE" and t["start"] and t["end"]:
            by_lineage[t["lineage"]] = t
    out = []
    for k, t in sorted(by_lineage.items()):
        p = w.resolve({**fixed, **t["params"]})
        skey = w.structural_key(p)
        steps = w.schedule(p)[0]
        step_s = (t["end"] - t["start"]) / steps
        meas = [v for key, v in profiles.items() if key.endswith("|" + skey) and v["source"] != "static"]
        static = profiles.get("static|" + skey, {}).get("memory_bytes", 0)
        busy = meas[0]["compute"] if meas else 1.0
        mem = max(v["memory_bytes"] for v in meas) if meas else static
        out.append(SimTrial(k, step_s, busy * step_s, int(mem), steps, float(t["value"]), skey, int(static)))
    return out


def device_table(doc: dict, docs: str) -> list[str]:
    m = doc["meta"]
    lines = [f"Device: {', '.join(m['gpus'])} ({m['cpus']} CPU cores); torch {m['torch']}, optuna {m['optuna']}, "
             f"Python {m['python']}; {m['date']}; one run each, same 64 configurations (RandomSampler seed 0, "
             "no pruner).", "",
             "| GPUs | policy | wall s | speed-up vs one_per_gpu | complete | OOM failures | other failures | "
             "best accuracy |", "|---|---|---|---|---|---|---|---|"]
    for ngpu in (2, 1):
        runs = {r["tag"].rsplit("-", 1)[0]: r for r in doc["runs"] if r["tag"].endswith(f"-{ngpu}gpu")}
        base = runs.get("one_per_gpu", {}).get("result", {}).get("wall_s")
        curves = {}
        for pol in ("one_per_gpu", "fixed_fraction", "pack"):
            r = runs.get(pol)
            if r is None or "result" not in r:
                note = (r or {}).get("skipped") or (r or {}).get("error") or "not run"
                lines.append(f"| {ngpu} | {pol} | - | - | - | - | - | {note} |")
                continue
            res = r["result"]
            fails = dict(res["failures"])
            oom = fails.pop("oom", 0)
            sp = f"{base / res['wall_s']:.2f}x" if base and not r.get("error") else "-"
            wall = f"{res['wall_s']:.1f}" + (" (timed out)" if r.get("error") else "")
            lines.append(f"| {ngpu} | {pol} | {wall} | {sp} | {res['complete']} | {oom} | {sum(fails.values())} | "
                         f"{res['best_value']:.4f} |" if res["best_value"] is not None else
                         f"| {ngpu} | {pol} | {wall} | {sp} | {res['complete']} | {oom} | {sum(fails.values())} | - |")
            curves[pol] = res["history"]
        if curves:
            plot_best_vs_time(curves, os.path.join(docs, f"hpo_device_{ngpu}xh200.png"),
                              f"64 CNN configurations on {ngpu} x H200 (measured)", "best validation accuracy")
    return lines


def scaled(trace: list[SimTrial], n: int, seed: int = 0) -> list[SimTrial]:
    """``n`` trials drawn with replacement (seeded) from the profiled configurations, new keys."""
    rng = random.Random(seed)
    return [SimTrial(**{**rng.choice(trace).__dict__, "key": k}) for k in range(n)]


def measured(doc: dict) -> dict[tuple[str, str], float]:
    """{(pool, policy): wall s} of the device runs that finished."""
    out = {}
    for r in doc["runs"]:
        if "result" in r and not r.get("error"):
            out[(f"{len(r['gpus'])}xH200", r["policy"])] = r["result"]["wall_s"]
    return out


def calibrate(trace: list[SimTrial], doc: dict) -> tuple[float, list[str]]:
    """Co-location overhead that best matches the measured wall times (least squares on log ratios)."""
    meas = measured(doc)
    best, rows = (math.inf, 0.0), []
    for ov in [0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5]:
        err = 0.0
        for (pool, pol), wall in meas.items():
            sim = simulate(trace, pool_from_spec(pool), pol, startup_s=0.2, overhead=ov,
                           **({"fraction": 0.125} if pol == "fixed_fraction" else {})).makespan_s
            err += math.log(sim / wall) ** 2
        best = min(best, (err, ov))
    for (pool, pol), wall in sorted(meas.items()):
        sim = simulate(trace, pool_from_spec(pool), pol, startup_s=0.2, overhead=best[1],
                       **({"fraction": 0.125} if pol == "fixed_fraction" else {})).makespan_s
        rows.append(f"| {pool} | {pol} | {wall:.1f} | {sim:.1f} |")
    return best[1], rows


def simulation_table(trace: list[SimTrial], doc: dict | None, docs: str, overhead: float = 0.0) -> list[str]:
    lines = ["| pool | trials | policy | makespan s | speed-up vs one_per_gpu | OOM | max trials/GPU |",
             "|---|---|---|---|---|---|---|"]
    # 1 and 2 x H200 replay the measured budget (a check of the model against the device table); the
    # 16-GPU pool gets the same budget per GPU (32), drawn from the profiled configurations
    for pool, tr in (("1xH200", trace), ("2xH200", trace), ("12xA100,4xH100", scaled(trace, 32 * 16))):
        devs = pool_from_spec(pool)
        # start-up is already inside the measured per-step time; 0.2 s is the driver's dispatch
        res = {p: simulate(tr, devs, p, startup_s=0.2, overhead=overhead, **({"fraction": 0.125} if p == "fixed_fraction" else {}))
               for p in POLICIES}
        base = res["one_per_gpu"].makespan_s
        for p, r in res.items():
            lines.append(f"| {pool} | {len(tr)} | {p} | {r.makespan_s:.1f} | {base / r.makespan_s:.2f}x | {r.oom} | "
                         f"{r.max_colocated} |")
        if pool.startswith("12x"):
            plot_best_vs_time({p: r.history for p, r in res.items()}, os.path.join(docs, "hpo_simulation.png"),
                              f"SIMULATION: {len(tr)} profiled CNN trials on 12 A100 + 4 H100",
                              "best validation accuracy")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True)
    ap.add_argument("--docs", default="docs/benchmarks")
    args = ap.parse_args()
    doc = json.load(open(args.results))
    os.makedirs(args.docs, exist_ok=True)
    lines = device_table(doc, args.docs)
    with open(os.path.join(args.docs, "hpo_device_table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    trace = build_trace(doc)
    with open(os.path.join(args.docs, "hpo_trace.json"), "w") as f:
        json.dump([t.__dict__ for t in trace], f, indent=0)
    ov, cal = calibrate(trace, doc)
    cal = [f"Calibrated co-location overhead: {ov} per extra co-located trial.", "",
           "| pool | policy | measured wall s | simulated s |", "|---|---|---|---|"] + cal
    sim = simulation_table(trace, doc, args.docs, ov)
    with open(os.path.join(args.docs, "hpo_simulation_table.md"), "w") as f:
        f.write("\n".join(cal + [""] + sim) + "\n")
    print("\n".join(lines + [""] + cal + [""] + sim))
    print(f"trace: {len(trace)} trials, {sum(t.memory_bytes for t in trace) / GIB:.0f} GiB total peak memory")


if __name__ == "__main__":
    main()
