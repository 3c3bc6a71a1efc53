"""Plot of benchmarks/offload_device.py's JSON: the OSU overlap of 8 CPU ranks and the GPU part's modes.

Left: effective overlap (against the compute timed alone) and OSU's overlap (against the compute inside the
overlapped loop) per message size, for plain torch.distributed (``native``) and the agent, median with the
per-repeat min-max. Right: the GPU part's effective overlap per mode (4 ranks on one GPU), without and with MPS,
median with the min-max. Both panels draw issue 41's 80% goal. Only what the JSON holds is drawn; a mode that
failed (a string in the JSON) is left out and named in the title.

    python3 benchmarks/offload_plot.py docs/benchmarks/data/offload/2026-12-04_1929/offload.json OUT.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def _overlap(overall: float, compute: float, pure: float) -> float:
    """OSU's formula, max(0, 100 - 100 (Overall - Compute) / Pure Comm); hpdl.offload.bench.overlap_pct's."""
    return 0.0 if pure <= 0 else max(0.0, 100.0 - 100.0 * (overall - compute) / pure)


def osu_series(doc: dict) -> dict:
    """{mode: {"sizes": [B], "eff": [(value, min, max)], "osu": [(value, min, max)]}} from ``results.osu``: the
    value from the median Overall / compute / Pure Comm (as offload_device.py's table and goal line), min-max
    over the repeats' own overlaps."""
    out: dict = {}
    for size in sorted(doc["results"].get("osu", {}), key=int):
        for mode, d in doc["results"]["osu"][size]["us"].items():
            med = {k: statistics.median(v) for k, v in d.items()}
            s = out.setdefault(mode, {"sizes": [], "eff": [], "osu": []})
            s["sizes"].append(int(size))
            for key, comp in (("eff", "alone"), ("osu", "compute")):
                per = [_overlap(o, c, p) for o, c, p in zip(d["overall"], d[comp], d["pure"])]
                # the point as offload_device.py's table and goal line: from the median times
                s[key].append((_overlap(med["overall"], med[comp], med["pure"]), min(per), max(per)))
    return out


def gpu_series(doc: dict) -> tuple[dict, list[str]]:
    """({setting: {mode: (median, min, max, matmuls)}}, ["setting mode: why not measured"])."""
    got, missing = {}, []
    gpu = doc["results"].get("gpu")
    for setting, modes in (gpu.items() if isinstance(gpu, dict) else ()):
        if not isinstance(modes, dict):
            missing.append(f"{setting}: {str(modes)[:60]}")
            continue
        for mode, m in modes.items():
            if not isinstance(m, dict):
                missing.append(f"{setting} {mode}: {str(m)[:60]}")
                continue
            xs = m["overlap_pct"]
            got.setdefault(setting, {})[mode] = (statistics.median(xs), min(xs), max(xs), m["kernel_iters"])
    return got, missing


def plot(doc: dict, path: str | Path, goal: float = 80.0) -> None:
    from hpdl.bench.common import pyplot

    plt = pyplot()
    osu = osu_series(doc)
    gpu, missing = gpu_series(doc)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (mode, s) in enumerate(osu.items()):
        color = f"C{i}"
        for key, style, label in (("eff", "-", "effective (vs compute alone)"),
                                  ("osu", ":", "OSU (vs compute in loop)")):
            med = [x[0] for x in s[key]]
            err = [[x[0] - x[1] for x in s[key]], [x[2] - x[0] for x in s[key]]]
            ax1.errorbar(s["sizes"], med, yerr=err, color=color, ls=style, marker="o", ms=4, capsize=3,
                         label=f"{mode}: {label}")
    ax1.axhline(goal, color="grey", ls="--", lw=0.8)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("bytes per peer (ialltoall)")
    ax1.set_ylabel("overlap (%)")
    ax1.set_ylim(0, 105)
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7, loc="lower right")
    ax1.set_title(f"OSU ialltoall, {doc['config']['np']} CPU ranks (from median times; bars: per-repeat min-max)",
                  fontsize=9)

    modes = list(dict.fromkeys(m for s in gpu.values() for m in s))
    width = 0.8 / max(1, len(gpu))
    for j, (setting, s) in enumerate(gpu.items()):
        xs = [i + (j - (len(gpu) - 1) / 2) * width for i, m in enumerate(modes) if m in s]
        vals = [s[m] for m in modes if m in s]
        bars = ax2.bar(xs, [v[0] for v in vals], width=width * 0.95, color=f"C{j + 2}", label=setting,
                       yerr=[[v[0] - v[1] for v in vals], [v[2] - v[0] for v in vals]], capsize=3)
        for b, v in zip(bars, vals):
            ax2.annotate(f"{v[0]:.1f}%\n{v[3]} mm", (b.get_x() + b.get_width() / 2, 2), ha="center", va="bottom",
                         fontsize=7, color="white")
    ax2.axhline(goal, color="grey", ls="--", lw=0.8)
    # offload_device.py measures agent-ce on a second agent after the other modes (not interleaved with them)
    ax2.set_xticks(range(len(modes)), [m + ("\n(2nd agent, after the rest)" if m == "agent-ce" else "")
                                       for m in modes])
    ax2.set_ylim(0, 105)
    ax2.set_ylabel("effective overlap (%)")
    ax2.grid(True, axis="y", alpha=0.3)
    ax2.legend(fontsize=8, loc="upper left")
    title = "4 ranks on one GPU, 4 MiB/peer alltoall vs fp32 matmuls (mm: matmuls per overlapped step)"
    ax2.set_title(title + (f"\nnot measured: {'; '.join(missing)}" if missing else ""), fontsize=9)
    meta = doc.get("meta", {})
    # runs before the harness's metadata said date_utc (no " UTC") and cpus
    date = meta.get("date") or f"{meta.get('date_utc', '?')} UTC"
    fig.suptitle(f"hpdl.offload, {date}, {meta.get('cores', meta.get('cpus', '?'))} cpus, "
                 f"torch {meta.get('torch', '?')}; dashed: the {goal:.0f}% goal", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="offload.json written by benchmarks/offload_device.py")
    p.add_argument("png", help="the plot to write")
    args = p.parse_args(argv)
    try:
        doc = json.loads(Path(args.json).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        p.error(f"json: cannot read {args.json!r} as offload_device.py's JSON ({exc})")
    if "results" not in doc or "config" not in doc:
        p.error(f"json: {args.json!r} has no 'results' / 'config' (expected offload_device.py's offload.json)")
    plot(doc, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
