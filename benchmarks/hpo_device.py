"""Device benchmark of hpdl.hpo placement policies: the same 64 configurations (Optuna RandomSampler, seed 0,
no pruner) of the small CNN, run under ``pack``, ``fixed_fraction`` (0.125 GPU per trial, Ray Tune style) and
``one_per_gpu`` on 2 x H200, then on 1 x H200. Wall time to finish the budget, OOM failures, best value;
per-configuration profiles for the simulator.

The space is an ordinary small-CNN search on 32x32 images: most configurations are lightweight (width 8-64,
batch 32-512, 37 to 600 SGD steps: launch-bound, the GPU mostly idle), and a large-batch tail (batch 16384,
one configuration in six, a minimum of 10 steps) needs up to tens of GB of activations. Every policy runs with the same
warm worker pool machinery (``warm_workers: auto``: as many pre-started workers per GPU as the policy runs
at once, at most 8); wall time starts once the pool is ready, and the pool's start-up is reported apart.

Launch (repository root; results land in $OUT, default ./out/hpo_device):
    PYTHONPATH=src python3 benchmarks/hpo_device.py
    PYTHONPATH=src python3 benchmarks/hpo_device.py --n-trials 16 --pools 0 --policies pack,one_per_gpu
    PYTHONPATH=src python3 benchmarks/hpo_device.py --smoke --n-trials 6   # CPU, fake devices
    PYTHONPATH=src python3 benchmarks/hpo_device.py --space launch --policies pack@mps,pack,fixed_fraction
``<policy>@mps`` runs that policy with a private MPS daemon (the study's ``mps: start``); the others run
without MPS (processes time-slice each GPU).
The runs stop being started once ``--budget-s`` is nearly spent (each run also has a timeout), so a
partial result is still written after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict

# ---- defaults (one visible block) ----
N_TRIALS = 64
POLICIES = "one_per_gpu,pack,fixed_fraction"
POOLS = "0,1;0"                      # ';' separates pools, ',' GPU ids
BUDGET_S = 235.0
SPACE = {
    "lr": {"type": "float", "low": 0.003, "high": 0.3, "log": True},
    "momentum": {"type": "float", "low": 0.5, "high": 0.95},
    "width": {"type": "categorical", "choices": [8, 16, 32, 64]},
    "depth": {"type": "categorical", "choices": [1, 2, 3]},
    "batch_size": {"type": "categorical", "choices": [32, 64, 128, 256, 512, 16384]},
}
# 19,200 samples per trial (600 steps at batch 32, 37 at 512); batch 16384 gets the minimum of 10 steps
FIXED = {"image_size": 32, "samples": 19200, "min_steps": 10, "evals": 4, "val_size": 2048, "noise": 4.0}
RUN_TIMEOUT_S = 80.0                 # cap per run; a run that hits it reports what finished


# "launch": a lighter head (width <= 32, batch 32-64: a GPU busy fraction of about 0.1-0.3 alone, the
# regime of the 8-trial measurement) with the same batch-16384 tail, one configuration in six
SPACE_LAUNCH = {**SPACE, "width": {"type": "categorical", "choices": [8, 16, 32]},
                "batch_size": {"type": "categorical", "choices": [32, 40, 48, 56, 64, 16384]}}
FIXED_LAUNCH = {**FIXED, "samples": 40000}   # 625-1250 steps for the head, 10 for the tail
SPACES = {"mixed": (SPACE, FIXED), "launch": (SPACE_LAUNCH, FIXED_LAUNCH)}

SMOKE_SPACE = {**SPACE, **{k: {"type": "categorical", "choices": [v]} for k, v in
                           (("width", 8), ("depth", 1), ("batch_size", 32))}}


def run_tag(policy: str, n_gpus: int, repeat: int = 1) -> str:
    """Name of a run and of its study: ``pack@mps-2gpu``; a policy's second run ``pack@mps[2]-2gpu``."""
    return f"{policy}{f'[{repeat}]' if repeat > 1 else ''}-{n_gpus}gpu"


def run_one(policy: str, gpus: list[int], n_trials: int, scratch: str, timeout_s: float, smoke: bool = False,
            warm: str = "auto", space: str = "mixed", repeat: int = 1) -> dict:
    from hpdl.hpo.driver import Driver
    from hpdl.hpo.errors import HpoError
    from hpdl.hpo.spec import StudySpec

    tag = run_tag(policy, len(gpus), repeat)
    policy, _, sharing = policy.partition("@")  # "pack@mps": the same policy with a private MPS daemon
    if sharing not in ("", "mps"):
        raise SystemExit(f"--policies: {policy}@{sharing}: expected <policy> or <policy>@mps")
    policy, *opts = policy.split(":")  # "pack:max_compute=8:order=longest@mps": policy options
    try:
        extra = {k: v if k == "order" else bool(float(v)) if k in ("memory_caps", "sm_caps") else float(v)
                 for k, _, v in (o.partition("=") for o in opts)}
    except ValueError:
        raise SystemExit(f"--policies: {tag}: expected <policy>[:<option>=<value>...][@mps]") from None
    pol = {"name": policy, **({"fraction": 0.125} if policy == "fixed_fraction" else {}), **extra}
    spec = StudySpec.from_dict({
        "study": tag, "workload": "cnn", "n_trials": n_trials, "run_dir": os.path.join(scratch, tag),
        "sampler": {"name": "random", "seed": 0}, "pruner": {"name": "none"},
        "space": SMOKE_SPACE if smoke else SPACES[space][0],
        "fixed": {**FIXED, "samples": 960, "image_size": 16, "val_size": 256} if smoke else SPACES[space][1],
        "pool": {"fake": len(gpus)} if smoke else {"cuda": gpus}, "policy": pol, "max_retries": 2,
        "timeout_s": timeout_s, "warm_workers": warm if warm == "auto" else int(warm),
        "mps": "start" if sharing == "mps" else False})
    drv = Driver(spec)
    error = None
    try:
        res = drv.run()
    except HpoError as exc:  # timeout: keep what finished
        error, res = str(exc), drv.result()
    cap = getattr(drv.policy, "cap", None)
    trials = []
    for t in drv.study.get_trials(deepcopy=False):
        trials.append({"number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
                       "device": t.user_attrs.get("hpdl_device"), "failure": t.user_attrs.get("hpdl_failure"),
                       "lineage": t.user_attrs.get("hpdl_lineage"),
                       "start": t.user_attrs.get("hpdl_started_at"),
                       "end": t.datetime_complete.timestamp() if t.datetime_complete else None})
    return {"tag": tag, "policy": policy, "mps": sharing == "mps", "gpus": gpus, "error": error, "result": asdict(res), "cap": cap,
            "max_compute": getattr(drv.policy, "max_compute", None),
            "memory_caps": getattr(drv.policy, "memory_caps", None),
            "order": getattr(drv.policy, "order", None),
            "trials": trials, "profiles": {k: asdict(v) for k, v in drv.profiles.items()}}


class GpuMonitor:
    """``nvidia-smi dmon`` in the background for the whole invocation: once a second per GPU, ``sm`` (share of
    the second in which any kernel ran) and, on Hopper and later, the GPM metrics SM utilisation (share of
    SMs busy) and SM occupancy (resident warps against the maximum). :meth:`window` averages every column over
    a run. A missing ``nvidia-smi`` or unsupported metric leaves the file with its error and the windows empty."""

    def __init__(self, path: str):
        import subprocess

        self.path, self._out = path, open(path, "w")
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "dmon", "-s", "u", "--gpm-metrics", "2,3", "-d", "1",
                                          "-o", "DT"], stdout=self._out, stderr=subprocess.STDOUT)
        except OSError as exc:
            self.proc = None
            self._out.write(f"# nvidia-smi dmon did not start: {exc}\n")
            self._out.flush()

    def window(self, t0: float, t1: float, gpus: list[int]) -> dict[str, dict[str, float]]:
        """Mean of each numeric column per GPU over samples taken between Unix times ``t0`` and ``t1``."""
        cols, rows = None, []
        with open(self.path) as f:
            for line in f:
                parts = line.lstrip("#").split()
                if line.startswith("#") and "gpu" in parts and cols is None:
                    cols = parts  # the first header line names the columns
                elif cols and not line.startswith("#") and len(parts) == len(cols):
                    row = dict(zip(cols, parts))
                    try:
                        ts = time.mktime(time.strptime(row["Date"] + " " + row["Time"], "%Y%m%d %H:%M:%S"))
                    except (KeyError, ValueError):
                        continue
                    if t0 <= ts <= t1 and row.get("gpu", "").isdigit() and int(row["gpu"]) in gpus:
                        rows.append(row)
        out: dict[str, dict[str, float]] = {}
        for g in gpus:
            mine = [r for r in rows if int(r["gpu"]) == g]
            vals = {c: [float(r[c]) for r in mine if r[c].replace(".", "", 1).isdigit()]
                    for c in (cols or []) if c not in ("Date", "Time", "gpu")}
            out[str(g)] = {c: round(sum(v) / len(v), 1) for c, v in vals.items() if v} | {"samples": len(mine)}
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)
        self._out.close()


def _start_worker_server() -> float:
    """Start the workers' forkserver (its imports) before the first run, so that no policy's pool start-up
    includes it; return its seconds (0 under ``spawn``). A user's first study in a process pays it once."""
    from hpdl.hpo.launch import worker_context

    t = time.monotonic()
    ctx = worker_context()
    if ctx.get_start_method() == "forkserver":
        p = ctx.Process(target=time.sleep, args=(0,))
        p.start()
        p.join()
    return time.monotonic() - t


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
    ap.add_argument("--warm", default="auto", help="warm workers per device: auto or an int")
    ap.add_argument("--gpu-monitor", action="store_true",
                    help="sample SM activity with nvidia-smi dmon (1 s) and average it over each run")
    ap.add_argument("--space", default="mixed", choices=sorted(SPACES),
                    help="mixed: the 01:35 UTC run's space; launch: a launch-bound head with the same heavy tail")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import torch

    from hpdl.bench.common import run_metadata
    from hpdl.hpo.policies import mps_active

    t0 = time.monotonic()
    meta = run_metadata(versions=("optuna",),
                        gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                        smoke=args.smoke, cpus=os.cpu_count(), n_trials=args.n_trials, space=SPACES[args.space][0],
                        fixed=SPACES[args.space][1], space_name=args.space, mps=mps_active(),
                        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    meta["worker_server_start_s"] = _start_worker_server()
    print(f"worker forkserver started in {meta['worker_server_start_s']:.1f} s", flush=True)
    runs = []
    monitor = GpuMonitor(os.path.join(args.out, "dmon.txt")) if args.gpu_monitor else None
    if monitor is not None:
        import atexit

        atexit.register(monitor.stop)  # also when a run raises out of main()
    for i, pool in enumerate(args.pools.split(";")):
        gpus = [int(g) for g in pool.split(",")]
        order = args.policies.split(",")
        for k, policy in enumerate(order):
            repeat = order[:k + 1].count(policy)  # a policy listed twice runs twice, each its own study
            left = args.budget_s - (time.monotonic() - t0)
            tag = run_tag(policy, len(gpus), repeat)
            if left < 25:
                runs.append({"tag": tag, "skipped": f"device budget spent ({left:.0f} s left)"})
                continue
            timeout = min(left - 10, args.run_timeout_s)
            print(f"[{time.monotonic() - t0:6.1f} s] {policy} on GPUs {gpus} (timeout {timeout:.0f} s)", flush=True)
            try:
                r = run_one(policy, gpus, args.n_trials, args.scratch, timeout, args.smoke, args.warm, args.space,
                            repeat)
            except Exception as exc:  # noqa: BLE001 - record and go on to the next run
                import traceback
                r = {"tag": tag, "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc()[-1500:]}
                print(r["traceback"], flush=True)
            res = r.get("result", {})
            if monitor is not None and res:
                time.sleep(1.2)  # the last sample of the run
                r["gpu_util"] = monitor.window(res["started_at"], res["started_at"] + res["wall_s"], gpus)
                print(f"    GPU utilisation over the run (means): {r['gpu_util']}", flush=True)
            runs.append(r)
            print(f"    wall {res.get('wall_s', float('nan')):.1f} s (pool warm-up {res.get('warmup_s', 0):.1f} s, teardown "
                  f"{res.get('teardown_s', 0):.1f} s) "
                  f"complete {res.get('complete')} "
                  f"failures {res.get('failures')} best {res.get('best_value')} error {r.get('error')}", flush=True)
            if res.get("driver_s"):
                print("    driver s: " + ", ".join(f"{k} {v:.2f}" for k, v in res["driver_s"].items()), flush=True)
            if res.get("warmup_phases"):
                print("    worker start-up s (median/max): " + ", ".join(
                    f"{k} {v['median']:.1f}/{v['max']:.1f}" for k, v in res["warmup_phases"].items()), flush=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump({"meta": meta, "runs": runs}, f, indent=1)
    print(f"done in {time.monotonic() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
