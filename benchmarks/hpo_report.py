"""Turn a device run of benchmarks/hpo_device.py into docs/benchmarks/hpo_device.md (+ PNGs), and replay its
profiled trial costs on simulated pools (12 A100 + 4 H100, and the measured 1/2 x H200 as a check) into
docs/benchmarks/hpo_simulation.md (+ PNG). Runs on CPU.

    PYTHONPATH=src python3 benchmarks/hpo_report.py --results out/hpo_device/results.json --docs docs/benchmarks/data/hpo

Trace construction: see :func:`build_trace` (solo time from the ``one_per_gpu`` run, busy fraction and
memory from the in-place profiles, static bound and FLOPs from the meta-device trace).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict

from hpdl.hpo.profiler import static_profile
from hpdl.hpo.report import plot_best_vs_time
from hpdl.hpo.policies import GIB
from hpdl.hpo.simulator import SimTrial, pool_from_spec, resample, simulate
from hpdl.hpo.workloads import get_workload

POLICIES = ("one_per_gpu", "fixed_fraction", "pack", "pack_hetero")
STARTUP_S = 0.05  # dispatch to a warm worker; model build and evaluation are inside the measured solo time


def sim(trace, pool: str, policy: str, overhead: float):
    devs = pool_from_spec(pool)
    return simulate(trace, devs, policy, startup_s=STARTUP_S, overhead=overhead,
                    **({"fraction": 0.125} if policy == "fixed_fraction" else {}))


def build_trace(doc: dict) -> list[SimTrial]:
    """One SimTrial per configuration of the ``one_per_gpu`` run (the largest pool that has one): solo
    seconds per step from its wall time alone on a GPU; GPU busy fraction, peak memory and FLOPs from the
    profiles of every run. A structure that no run profiled borrows the busy fraction of the profiled
    structure nearest in FLOPs per step (what ``pack`` assumes), and its memory is its static bound times
    the median measured/static ratio of the profiled structures whose static bound exceeds 2 GiB (for
    small ones the allocator's granularity and the context dominate, not activations)."""
    runs = {r["tag"]: r for r in doc["runs"] if "trials" in r}
    fixed = doc["meta"]["fixed"]
    w = get_workload("cnn")
    solo = next((runs[t] for t in sorted(runs, key=lambda t: -len(runs[t]["gpus"])) if t.startswith("one_per_gpu")),
                None)
    if solo is None:
        raise SystemExit("results need a one_per_gpu run")
    profiles, static = {}, {}
    for r in runs.values():
        for key, v in r["profiles"].items():
            kind, _, skey = key.partition("|")
            (static if kind == "static" else profiles)[skey] = v
    measured = {k: v for k, v in profiles.items() if v["source"] != "static"}
    ratios = sorted(v["memory_bytes"] / static[k]["memory_bytes"] for k, v in measured.items()
                    if k in static and static[k]["memory_bytes"] > 2 * GIB)
    ratio = ratios[len(ratios) // 2] if ratios else 1.0
    flops_busy = [(v["flops"], v["compute"]) for v in measured.values() if v["flops"] > 0]
    out = []
    for t in sorted(solo["trials"], key=lambda t: t["lineage"]):
        if t["state"] != "COMPLETE" or not (t["start"] and t["end"]):
            continue
        p = w.resolve({**fixed, **t["params"]})
        skey = w.structural_key(p)
        steps = w.schedule(p)[0]
        step_s = (t["end"] - t["start"]) / steps
        st = static.get(skey) or asdict(static_profile(w, p, "static"))
        m = measured.get(skey)
        if m is not None:
            busy, mem = m["compute"], m["memory_bytes"]
        else:
            busy = min(flops_busy, key=lambda fb: abs(math.log(fb[0] / st["flops"])))[1] if flops_busy else 1.0
            mem = int(st["memory_bytes"] * ratio)
        out.append(SimTrial(t["lineage"], step_s, busy * step_s, int(mem), steps, float(t["value"]), skey,
                            int(st["memory_bytes"]), float(st["flops"])))
    return out


def device_table(doc: dict, docs: str) -> list[str]:
    m = doc["meta"]
    lines = [f"Device: {', '.join(m['gpus'])} ({m['cpus']} CPU cores, MPS {'on' if m.get('mps') else 'off'}); "
             f"torch {m['torch']}, optuna {m['optuna']}, Python {m['python']}; {m['date']}; one run each, "
             f"same {m['n_trials']} configurations (RandomSampler seed 0, no pruner).", "",
             "| GPUs | policy | wall s | speed-up vs one_per_gpu | speed-up vs fixed_fraction | complete | "
             "OOM failures | other failures | best accuracy | warm pool start-up s (not in wall) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for ngpu in (2, 1):
        runs = {r["tag"].rsplit("-", 1)[0]: r for r in doc["runs"] if r["tag"].endswith(f"-{ngpu}gpu")}
        walls = {p: r["result"]["wall_s"] for p, r in runs.items() if "result" in r and not r.get("error")}
        curves = {}
        for pol in ("one_per_gpu", "fixed_fraction", "pack"):
            r = runs.get(pol)
            if r is None or "result" not in r:
                note = (r or {}).get("skipped") or (r or {}).get("error") or "no result: device time ran out"
                lines.append(f"| {ngpu} | {pol} | - | - | - | - | - | - | {note} | - |")
                continue
            res = r["result"]
            fails = dict(res["failures"])
            oom = fails.pop("oom", 0)
            sp = [f"{walls[b] / walls[pol]:.2f}x" if b in walls and pol in walls else "-"
                  for b in ("one_per_gpu", "fixed_fraction")]
            wall = f"{res['wall_s']:.1f}" + (" (timed out)" if r.get("error") else "")
            best = f"{res['best_value']:.4f}" if res["best_value"] is not None else "-"
            lines.append(f"| {ngpu} | {pol} | {wall} | {sp[0]} | {sp[1]} | {res['complete']} | {oom} | "
                         f"{sum(fails.values())} | {best} | {res.get('warmup_s', 0):.1f} |")
            curves[pol] = res["history"]
        if curves:
            plot_best_vs_time(curves, os.path.join(docs, f"hpo_device_{ngpu}xh200.png"),
                              f"{m['n_trials']} CNN configurations on {ngpu} x H200 (measured)",
                              "best validation accuracy")
    return lines


def colocation_table(doc: dict) -> list[str]:
    """Measured cost of sharing a GPU: for each trial of a packed run, its wall time divided by the same
    configuration's wall time alone (``one_per_gpu`` run of the same pool) and the mean number of other
    trials on its GPU meanwhile, grouped by the busy fraction its structure was profiled at."""
    fixed = doc["meta"]["fixed"]
    w = get_workload("cnn")
    busy = {}
    for r in doc["runs"]:
        for key, v in r.get("profiles", {}).items():
            if v["source"] != "static":
                busy[key.partition("|")[2]] = v["compute"]
    bins = [("<= 0.2", 0, 0.2), ("0.2-0.5", 0.2, 0.5), ("0.5-0.9", 0.5, 0.9), (">= 0.9", 0.9, 1.01)]
    lines = ["| pool | policy | busy fraction alone | trials | median slowdown vs alone | "
             "median other trials on its GPU |", "|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        if "trials" not in r or r["policy"] == "one_per_gpu":
            continue
        base = next((b for b in doc["runs"] if b.get("policy") == "one_per_gpu" and b.get("gpus") == r["gpus"]
                     and "trials" in b), None)
        if base is None:
            continue
        alone = {json.dumps(t["params"], sort_keys=True): t["end"] - t["start"] for t in base["trials"]
                 if t["state"] == "COMPLETE" and t["start"] and t["end"]}
        tr = [t for t in r["trials"] if t["start"] and t["end"]]
        groups: dict[str, list[tuple[float, float]]] = {}
        for t in tr:
            solo = alone.get(json.dumps(t["params"], sort_keys=True))
            if t["state"] != "COMPLETE" or not solo:
                continue
            b = busy.get(w.structural_key({**fixed, **t["params"]}))
            label = "not profiled" if b is None else next(n for n, lo, hi in bins if lo <= b < hi)
            dur = t["end"] - t["start"]
            others = sum(max(0.0, min(o["end"], t["end"]) - max(o["start"], t["start"])) for o in tr
                         if o is not t and o["device"] == t["device"]) / dur
            groups.setdefault(label, []).append((dur / solo, others))
        for label in [n for n, _, _ in bins] + ["not profiled"]:
            g = sorted(groups.get(label, []))
            if g:
                med_o = sorted(o for _, o in g)[len(g) // 2]
                lines.append(f"| {len(r['gpus'])}xH200 | {r['policy']} | {label} | {len(g)} | "
                             f"{g[len(g) // 2][0]:.2f}x | {med_o:.1f} |")
    return lines


def scaled(trace: list[SimTrial], n: int, seed: int = 0) -> list[SimTrial]:
    """``n`` trials drawn with replacement (seeded) from the profiled configurations, new keys."""
    return resample(trace, n, seed)


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
    for ov in [0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0]:
        err = 0.0
        for (pool, pol), wall in meas.items():
            err += math.log(sim(trace, pool, pol, ov).makespan_s / wall) ** 2
        best = min(best, (err, ov))
    for (pool, pol), wall in sorted(meas.items()):
        rows.append(f"| {pool} | {pol} | {wall:.1f} | {sim(trace, pool, pol, best[1]).makespan_s:.1f} |")
    return best[1], rows


def simulation_table(trace: list[SimTrial], doc: dict | None, docs: str, overhead: float = 0.0) -> list[str]:
    lines = ["| pool | trials | policy | makespan s | speed-up vs one_per_gpu | OOM | max trials/GPU |",
             "|---|---|---|---|---|---|---|"]
    # 1 and 2 x H200 replay the measured budget (a check of the model against the device table); the
    # 16-GPU pool gets the same budget per GPU (32), drawn from the profiled configurations
    for pool, tr in (("1xH200", trace), ("2xH200", trace), ("12xA100,4xH100", scaled(trace, 32 * 16))):
        res = {p: sim(tr, pool, p, overhead) for p in POLICIES}
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
    ap.add_argument("--docs", default="docs/benchmarks/data/hpo")
    args = ap.parse_args()
    doc = json.load(open(args.results))
    os.makedirs(args.docs, exist_ok=True)
    lines = device_table(doc, args.docs) + [""] + colocation_table(doc)
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
