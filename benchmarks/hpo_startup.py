"""Warm worker pool start-up of hpdl.hpo per worker start method (forkserver with preloaded imports, spawn).

For each start method, in a fresh Python process (a forkserver lives as long as the process that started
it): ``--studies`` small studies one after another, each with a warm pool of ``--workers`` processes per
device, and per study the pool's start-up (``warmup_s``), the median seconds of each worker start-up phase
(``warmup_phases``) and the study's wall time. Fake CPU devices by default (the imports are host work);
``--cuda 0,1`` uses GPUs, where each worker also creates its CUDA context.

    PYTHONPATH=src python3 benchmarks/hpo_startup.py --workers 4 --studies 2 --out docs/benchmarks/data/hpo/hpo_startup_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

METHODS = ("spawn", "forkserver")


def _one(args) -> None:
    """Child mode: run the studies with the start method set in the environment, print JSON lines."""
    from hpdl.hpo.driver import run_study
    from hpdl.hpo.spec import StudySpec

    pool = {"cuda": [int(i) for i in args.cuda.split(",")]} if args.cuda else {"fake": 1, "memory_gb": 8}
    for k in range(args.studies):
        spec = StudySpec.from_dict({
            "study": f"s{k}", "workload": "cnn", "n_trials": args.workers, "run_dir": tempfile.mkdtemp(),
            "space": {"lr": {"type": "float", "low": 0.01, "high": 0.1}},
            "fixed": {"width": 8, "depth": 1, "batch_size": 32, "image_size": 16, "steps": 20, "eval_every": 10,
                      "val_size": 64},
            "pool": pool, "policy": {"name": "fixed_fraction", "fraction": 1 / args.workers},
            "warm_workers": args.workers})
        t = time.monotonic()
        res = run_study(spec)
        print(json.dumps({"study": k, "warmup_s": res.warmup_s, "wall_s": res.wall_s,
                          "total_s": time.monotonic() - t, "complete": res.complete,
                          "phases": {p: v["median"] for p, v in res.warmup_phases.items()}}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="warm workers per device")
    ap.add_argument("--studies", type=int, default=2, help="studies one after another in one process")
    ap.add_argument("--cuda", default="", help="GPU ids, e.g. 0,1 (default: one fake CPU device)")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _one(args)
    import torch

    from hpdl.bench.report import source_commit

    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "commit": source_commit(),
           "python": sys.version.split()[0], "cpus": os.cpu_count(), "workers": args.workers,
           "pool": args.cuda or "fake cpu", "command": " ".join(sys.argv), "runs": {}}
    for m in METHODS:
        env = {**os.environ, "HPDL_HPO_START_METHOD": m, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--child", "--workers", str(args.workers), "--studies", str(args.studies)]
        out = subprocess.run(cmd + (["--cuda", args.cuda] if args.cuda else []), env=env, capture_output=True,
                             text=True, timeout=900)
        if out.returncode != 0:
            raise SystemExit(f"{m}: exit {out.returncode}\n{out.stderr[-3000:]}")
        doc["runs"][m] = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    print("| start method | study | pool start-up s | wall s | phases (median s) |\n|---|---|---|---|---|")
    for m, rows in doc["runs"].items():
        for r in rows:
            ph = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
            print(f"| {m} | {r['study'] + 1} | {r['warmup_s']:.1f} | {r['wall_s']:.1f} | {ph} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
