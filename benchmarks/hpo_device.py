"""Device benchmark of hpdl.hpo placement policies: the same 64 configurations (Optuna RandomSampler, seed 0,
no pruner) of the small CNN trained to a fixed number of samples, run under ``pack``, ``fixed_fraction``
(0.125 GPU per trial, Ray Tune style) and ``one_per_gpu`` on 2 x H200, then on 1 x H200. Wall time to finish
the budget, OOM failures, best value; per-configuration profiles for the simulator.

Launch (repository root; results land in $OUT, default ./out/hpo_device):
    PYTHONPATH=src python3 benchmarks/hpo_device.py
    PYTHONPATH=src python3 benchmarks/hpo_device.py --n-trials 16 --pools 0 --policies pack,one_per_gpu
The runs stop being started once ``--budget-s`` is nearly spent (each run also has a timeout), so a
partial result is still written.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict

# ---- defaults (one visible block) ----
N_TRIALS = 64
POLICIES = "pack,fixed_fraction,one_per_gpu"
POOLS = "0,1;0"                      # ';' separates pools, ',' GPU ids
BUDGET_S = 330.0
SPACE = {
    "lr": {"type": "float", "low": 0.01, "high": 0.3, "log": True},
    "momentum": {"type": "float", "low": 0.5, "high": 0.95},
    "width": {"type": "categorical", "choices": [16, 32, 64]},
    "depth": {"type": "categorical", "choices": [1, 2, 3]},
    "batch_size": {"type": "categorical", "choices": [64, 256, 1024, 4096]},
    "image_size": {"type": "categorical", "choices": [32, 64]},
}
FIXED = {"samples": 16384, "min_steps": 16, "evals": 4, "val_size": 1024}
RUN_TIMEOUT_S = 100.0                # cap per run; a run that hits it reports what finished


SMOKE_SPACE = {**SPACE, **{k: {"type": "categorical", "choices": [v]} for k, v in
                           (("width", 8), ("depth", 1), ("batch_size", 32), ("image_size", 16))}}


def run_one(policy: str, gpus: list[int], n_trials: int, scratch: str, timeout_s: float, smoke: bool = False) -> dict:
    from hpdl.hpo.driver import Driver
    from hpdl.hpo.errors import HpoError
    from hpdl.hpo.spec import StudySpec

    tag = f"{policy}-{len(gpus)}gpu"
    pol = {"name": policy, **({"fraction": 0.125} if policy == "fixed_fraction" else {})}
    spec = StudySpec.from_dict({
        "study": tag, "workload": "cnn", "n_trials": n_trials, "run_dir": os.path.join(scratch, tag),
        "sampler": {"name": "random", "seed": 0}, "pruner": {"name": "none"},
        "space": SMOKE_SPACE if smoke else SPACE, "fixed": {**FIXED, "samples": 960} if smoke else FIXED,
        "pool": {"fake": len(gpus)} if smoke else {"cuda": gpus}, "policy": pol, "max_retries": 2,
        "timeout_s": timeout_s})
    drv = Driver(spec)
    error = None
    try:
        res = drv.run()
    except HpoError as exc:  # timeout: keep what finished
        error, res = str(exc), drv.result()
    trials = []
    for t in drv.study.get_trials(deepcopy=False):
        trials.append({"number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
                       "device": t.user_attrs.get("hpdl_device"), "failure": t.user_attrs.get("hpdl_failure"),
                       "lineage": t.user_attrs.get("hpdl_lineage"),
                       "start": t.user_attrs.get("hpdl_started_at"),
                       "end": t.datetime_complete.timestamp() if t.datetime_complete else None})
    return {"tag": tag, "policy": policy, "gpus": gpus, "error": error, "result": asdict(res),
            "trials": trials, "profiles": {k: asdict(v) for k, v in drv.profiles.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-trials", type=int, default=N_TRIALS)
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--pools", default=POOLS)
    ap.add_argument("--budget-s", type=float, default=BUDGET_S)
    ap.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S)
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/hpo_device")
    ap.add_argument("--scratch", default="/tmp/hpo_bench", help="run dirs (checkpoints, SQLite stores)")
    ap.add_argument("--smoke", action="store_true", help="tiny configurations on fake CPU devices (no GPU)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import optuna
    import torch

    t0 = time.monotonic()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "optuna": optuna.__version__, "python": platform.python_version(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], "smoke": args.smoke,
            "cpus": os.cpu_count(), "n_trials": args.n_trials, "space": SPACE, "fixed": FIXED}
    runs = []
    for i, pool in enumerate(args.pools.split(";")):
        gpus = [int(g) for g in pool.split(",")]
        order = args.policies.split(",")
        if i > 0:  # later pools run the baseline first, so a spent budget drops a policy, not the baseline
            order.sort(key=lambda p: p != "one_per_gpu")
        for policy in order:
            left = args.budget_s - (time.monotonic() - t0)
            if left < 25:
                runs.append({"tag": f"{policy}-{len(gpus)}gpu", "skipped": f"device budget spent ({left:.0f} s left)"})
                continue
            timeout = min(left - 10, args.run_timeout_s)
            print(f"[{time.monotonic() - t0:6.1f} s] {policy} on GPUs {gpus} (timeout {timeout:.0f} s)", flush=True)
            try:
                r = run_one(policy, gpus, args.n_trials, args.scratch, timeout, args.smoke)
            except Exception as exc:  # noqa: BLE001 - record and go on to the next run
                r = {"tag": f"{policy}-{len(gpus)}gpu", "error": f"{type(exc).__name__}: {exc}"}
            runs.append(r)
            res = r.get("result", {})
            print(f"    wall {res.get('wall_s', float('nan')):.1f} s complete {res.get('complete')} "
                  f"failures {res.get('failures')} best {res.get('best_value')} error {r.get('error')}", flush=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump({"meta": meta, "runs": runs}, f, indent=1)
    print(f"done in {time.monotonic() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
