"""CPU (gloo) application benchmark, one command: CG on 3-D Poisson, pencil 3-D FFT and nanoGPT training, each
with hpdl.comm against torch.distributed's own collectives, at several process counts.

    PYTHONPATH=src python3 benchmarks/apps_cpu.py OUT_DIR                 # 4 and 8 ranks (16-core host, ~2 min)
    PYTHONPATH=src python3 benchmarks/apps_cpu.py OUT_DIR --np 2,4 --small  # 2-core machine (smaller cases)
    PYTHONPATH=src python3 benchmarks/apps_cpu.py OUT_DIR --np 2 --quick    # tiny: checks the logic only

Each process count is one spawned job (intra-op threads = cores / ranks) that runs every case in `--rounds`
interleaved rounds. Writes OUT_DIR/apps_cpu.json (meta, every row, the summary), OUT_DIR/apps_cpu.png and
prints the summary table last. Exit status 1 if a check failed (FFT output not bit-identical to native's, or
a CG / GPT curve off native's by more than rounding).
"""

import argparse
import json
import os
import sys
import time

from hpdl.apps import bench
from hpdl.runtime import spawn


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder for apps_cpu.json and apps_cpu.png")
    p.add_argument("--np", default="4,8", help="comma-separated process counts")
    p.add_argument("--rounds", type=int, default=None, help="interleaved repetitions (default 3; quick 2)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help="smaller cases for a 2-core machine")
    size.add_argument("--quick", action="store_true", help="tiny sizes: checks the logic in seconds per job")
    a = p.parse_args()
    nps = [int(x) for x in a.np.split(",") if x.strip()]
    plan = bench.Plan.quick() if a.quick else bench.Plan.small() if a.small else bench.Plan()
    if a.rounds is not None:
        plan.rounds = a.rounds
    os.makedirs(a.out, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    for n in nps:
        rows += spawn(bench.job, n, args=(plan,), timeout=300)[0]
    summary = bench.summarize(rows)
    meta = bench.meta(plan, nps, "python3 benchmarks/apps_cpu.py " + " ".join(sys.argv[1:]))
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(a.out, "apps_cpu.json"), "w") as fh:
        json.dump({"meta": meta, "summary": summary, "rows": rows}, fh, indent=1)
    bench.plot(summary, rows, os.path.join(a.out, "apps_cpu.png"),
               f"hpdl apps vs native (gloo), {meta['cores']} cores, torch {meta['torch']}, {meta['date']}")
    print(f"# apps_cpu: np {nps}, {meta['cores']} cores, torch {meta['torch']}, {meta['date']}, "
          f"{meta['wall_s']} s; vs native = time / native's time (lower is better)")
    print(bench.format_table(summary))
    bad = [s for s in summary if s.get("wrong") or s.get("max_rel_diff", 0.0) > 1e-4]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
