"""Tables and plots of hpo_device.py runs that compare policies with and without MPS (``<policy>@mps``).

For each results file: wall time to finish the budget, speed-ups against ``one_per_gpu``,
``fixed_fraction`` and ``fixed_fraction@mps`` of the same run, the same wall time with the warm pool's
start-up and the teardown added, failures, best accuracy, concurrency, and the median slowdown of each
trial against the same configuration alone (the ``one_per_gpu`` run), split into the batch-16384 tail and
the rest. Writes a markdown table to stdout and a PNG of wall times (plus best-vs-time curves) per file.

    PYTHONPATH=src python3 benchmarks/hpo_mps_report.py --png-dir docs/benchmarks \\
        "1 x H200, launch=docs/benchmarks/hpo_mps_2026-11-30_1xh200_launch.json" ...
"""

from __future__ import annotations

import argparse
import json
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
                    "head": slow(False), "tail": slow(True), "history": res["history"]})
    return out


def _x(v: float) -> str:
    return "-" if v != v else f"{v:.2f}x"


def table(label: str, rs: list[dict]) -> list[str]:
    lines = [f"**{label}**", "",
             "| policy | wall s | vs one_per_gpu | vs fixed_fraction | vs fixed_fraction@mps | wall + pool start-up + "
             "teardown s | complete | OOM | other failures | best accuracy | trials per GPU mean / max | "
             "slowdown vs alone, head / tail (median) |", "|---" * 12 + "|"]
    for r in rs:
        sp = [f"{r['speedup'][b]:.2f}x" if b in r["speedup"] else "-"
              for b in ("one_per_gpu", "fixed_fraction", "fixed_fraction@mps")]
        lines.append(f"| {r['policy']} | {r['wall']:.1f} | {sp[0]} | {sp[1]} | {sp[2]} | "
                     f"{r['inclusive']:.1f} ({r['warmup']:.1f} + {r['teardown']:.1f}) | {r['complete']} | {r['oom']} | "
                     f"{r['other']} | {r['best']:.4f} | {r['conc']:.1f} / {r['conc_max']:.0f} | "
                     f"{_x(r['head'])} / {_x(r['tail'])} |")
    return lines


def plot(label: str, rs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="'label=path/to/results.json'")
    ap.add_argument("--png-dir", default="out")
    args = ap.parse_args()
    os.makedirs(args.png_dir, exist_ok=True)
    for spec in args.runs:
        label, _, path = spec.rpartition("=")
        with open(path) as f:
            doc = json.load(f)
        rs = rows(doc)
        m = doc["meta"]
        label = f"{label} ({m['cpus']} cores, {m['date']}, {m['n_trials']} configurations, space {m['space_name']})"
        print("\n".join(table(label, rs)) + "\n")
        stem = os.path.join(args.png_dir, os.path.splitext(os.path.basename(path))[0])
        plot(label, rs, stem + ".png")
        # each line runs on to the moment its budget finished (history holds improvements only)
        curves = {r["policy"]: r["history"] + [(r["wall"], r["history"][-1][1])] for r in rs if r["history"]}
        plot_best_vs_time(curves, stem + "_best.png", label.replace(" (", "\n(", 1), "best validation accuracy")


if __name__ == "__main__":
    main()
