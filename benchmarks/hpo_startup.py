"""Where a study's warm-pool start-up goes, and what starting the workers' forkserver first saves.

Each variant runs in a fresh Python process (a forkserver lives as long as the process that started it),
``--studies`` studies one after another, each with a warm pool of ``--workers`` processes on one device and
``--workers`` trials of ``--workload`` (``gpt``: the shipped tiny byte-level GPT; ``cnn``). Variants:

- ``late``: the forkserver starts when the first worker starts (hpdl before 2026-12-02): its imports
  (torch, ``torch._dynamo``, optuna, sqlalchemy) come after the driver's own imports and set-up.
- ``prestart``: what ``hpdl hpo run`` does now: the forkserver starts before the driver imports torch
  (:mod:`hpdl.hpo._prestart`), so the two import at once on two cores.
- ``spawn``: every worker a fresh interpreter (``HPDL_HPO_START_METHOD=spawn``).

Per study: seconds from the process's start to the end of the driver's imports (``import_s``, first study
only), the driver's construction (``init_s``: store, study, first meta-device trace), the pool's start-up
(``warmup_s``), the study from a ready pool (``wall_s``), the teardown, the total from the process's start,
and per worker start-up phase (``spawn``: fork or interpreter start until the worker runs; ``import``,
``cuda``, ``optimizer``, ``study``, ``ready``; see :class:`hpdl.hpo.worker._Env`) the median and largest
seconds over the pool.

    # device (1 x H200): 8 workers, gpt
    PYTHONPATH=src python3 benchmarks/hpo_startup.py --cuda 0 --workers 8 --workload gpt --studies 2 \
        --out $OUT/hpo_startup_1xh200.json
    # CPU, fake device (the imports are host work)
    PYTHONPATH=src python3 benchmarks/hpo_startup.py --workers 4 --workload gpt --studies 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("late", "prestart", "spawn")


def _study(args, k: int) -> dict:
    pool = {"cuda": [int(i) for i in args.cuda.split(",")]} if args.cuda else {"fake": 1, "memory_gb": 8}
    if args.workload == "gpt":
        space = {"lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}}
        fixed = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "batch_size": 16, "steps": 20,
                 "eval_every": 10}
    else:
        space = {"lr": {"type": "float", "low": 0.01, "high": 0.1}}
        fixed = {"width": 8, "depth": 1, "batch_size": 32, "image_size": 16, "steps": 20, "eval_every": 10,
                 "val_size": 64}
    return {"study": f"s{k}", "workload": args.workload, "n_trials": args.workers, "run_dir": tempfile.mkdtemp(),
            "sampler": {"name": "random", "seed": k}, "space": space, "fixed": fixed, "pool": pool,
            "policy": {"name": "fixed_fraction", "fraction": 1 / args.workers}, "warm_workers": args.workers,
            "mps": False}


def _child(args) -> None:
    """Child mode: one variant, JSON lines on stdout."""
    t_proc = float(args.t0)
    if args.variant == "prestart":
        from hpdl.hpo._prestart import start_forkserver

        start_forkserver()
    elif args.variant == "late":  # the server starts with the first worker, as before
        import multiprocessing as mp

        import hpdl.hpo._prestart as pre

        def preload_only() -> bool:
            mp.get_context("forkserver").set_forkserver_preload(["hpdl.hpo._preload"])
            return True

        pre.start_forkserver = preload_only  # before driver and launch import the name
    from hpdl.hpo.driver import Driver
    from hpdl.hpo.spec import StudySpec

    import_s = time.time() - t_proc
    for k in range(args.studies):
        t = time.time()
        drv = Driver(StudySpec.from_dict(_study(args, k)))
        init_s = time.time() - t
        res = drv.run()
        print(json.dumps({"study": k, "import_s": import_s if k == 0 else 0.0, "init_s": init_s,
                          "warmup_s": res.warmup_s, "wall_s": res.wall_s, "teardown_s": res.teardown_s,
                          "from_process_start_s": time.time() - t_proc, "complete": res.complete,
                          "phases": res.warmup_phases}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=8, help="warm workers (and trials) per study (default: 8)")
    ap.add_argument("--studies", type=int, default=2, help="studies one after another in one process (default: 2)")
    ap.add_argument("--workload", default="gpt", choices=("gpt", "cnn"), help="trial workload (default: gpt)")
    ap.add_argument("--cuda", default="", help="GPU ids, e.g. 0 (default: one fake CPU device)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--timeout-s", type=float, default=300, help="per variant (default: %(default)s)")
    ap.add_argument("--out", default="", help="JSON file for the results (default: none)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="prestart", help=argparse.SUPPRESS)
    ap.add_argument("--t0", default="0", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    from hpdl.bench.common import run_metadata

    doc = run_metadata(cpus=os.cpu_count(), workers=args.workers, workload=args.workload,
                       pool=args.cuda or "fake cpu", runs={})
    for v in args.variants.split(","):
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "HPDL_HPO_START_METHOD": "spawn" if v == "spawn" else "forkserver"}
        cmd = [sys.executable, __file__, "--child", "--variant", v, "--workers", str(args.workers), "--studies",
               str(args.studies), "--workload", args.workload, "--t0", repr(time.time())]
        try:
            out = subprocess.run(cmd + (["--cuda", args.cuda] if args.cuda else []), env=env, capture_output=True,
                                 text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            doc["runs"][v] = {"error": f"timeout after {args.timeout_s} s"}
            continue
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        doc["runs"][v] = rows if out.returncode == 0 else {"error": out.stderr[-3000:], "rows": rows}
        print(f"{v}: exit {out.returncode}", file=sys.stderr, flush=True)
    print("| variant | study | import s | driver init s | pool start-up s | wall s | from process start s | "
          "worker phases, median (max) s |\n|---|---|---|---|---|---|---|---|")
    for v, rows in doc["runs"].items():
        if isinstance(rows, dict):
            print(f"| {v} | error: {rows['error'][-200:]!r} |")
            continue
        for r in rows:
            ph = ", ".join(f"{k} {p['median']:.2f} ({p['max']:.2f})" for k, p in r["phases"].items())
            print(f"| {v} | {r['study'] + 1} | {r['import_s']:.1f} | {r['init_s']:.1f} | {r['warmup_s']:.1f} | "
                  f"{r['wall_s']:.1f} | {r['from_process_start_s']:.1f} | {ph} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
