"""Device benchmark of fused trials (hpdl.hpo.fusion, issue 39): a 64-configuration sweep of one fixed
architecture (the small CNN: learning rate, weight decay and warm-up searched; width, depth and batch size
fixed), run through the study driver as ``pack`` with MPS and fused groups (``fuse: {max_trials: K}``),
against one trial per GPU and today's ``pack`` with MPS, on one GPU. Then the equality check on the device:
fused trials' loss curves against the same trials alone (float32, TF32 off).

A fused run starts one warm worker per group it will run (``warm_workers``: ``ceil(64 / K)``, at most 8); the
others keep ``auto`` (their policy's concurrency, at most 8).

Clocks per run: **ready** (``wall_s``: from a ready warm pool to the budget's end), **counted in** (the pool's
start-up and teardown added: ``warmup_s + wall_s + teardown_s``) and **command** (around the driver's
construction and run: study set-up, pool, run, teardown; not the interpreter's start and imports).

Launch (repository root; results in $OUT/hpo_fuse, at most 4 files: results.json, times.png, log.txt):
    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 benchmarks/hpo_fuse_device.py            # 1 x H200, ~3 min
    PYTHONPATH=src python3 benchmarks/hpo_fuse_device.py --smoke                       # CPU, fake device, ~1 min
Runs are named ``<policy>[+fuse<K>][@mps]``; they stop being started once ``--budget-s`` is nearly spent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict

# ---- defaults (one visible block) ----
N_TRIALS = 64
RUNS = "pack+fuse16@mps,one_per_gpu,pack@mps,pack+fuse8@mps,pack+fuse64@mps"
BUDGET_S = 235.0
RUN_TIMEOUT_S = 100.0
SPACE = {
    "lr": {"type": "float", "low": 0.003, "high": 0.3, "log": True},
    "weight_decay": {"type": "float", "low": 1e-6, "high": 1e-2, "log": True},
    "warmup_steps": {"type": "categorical", "choices": [0, 25, 50, 100]},
}
# one architecture: every configuration has the same shapes, so all 64 can be fused
FIXED = {"width": 16, "depth": 2, "batch_size": 64, "image_size": 32, "steps": 400, "evals": 4, "val_size": 1024,
         "noise": 4.0, "momentum": 0.9}
SMOKE_FIXED = {**FIXED, "width": 8, "depth": 1, "batch_size": 16, "image_size": 8, "steps": 40, "val_size": 64}
EQ_TRIALS = [{"lr": 0.1, "weight_decay": 5e-4, "seed": 0}, {"lr": 0.01, "weight_decay": 0.0, "seed": 1},
             {"lr": 0.2, "weight_decay": 1e-3, "warmup_steps": 50, "seed": 2},
             {"lr": 0.03, "weight_decay": 1e-5, "lr_schedule": "cosine", "seed": 3}]
EQ_STEPS = 100
STEP_PROBE, STEP_PROBE_K = 100, (1, 4, 16, 64)  # timed steps; trials per model (1: the solo loop)
EQ_GPT = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "batch_size": 16, "val_batches": 2}
EQ_GPT_TRIALS = [{"lr": 3e-3, "seed": 0}, {"lr": 1e-3, "weight_decay": 0.1, "beta1": 0.8, "warmup_steps": 10,
                                          "seed": 1}]


def log(out: str, msg: str) -> None:
    print(msg, flush=True)
    with open(os.path.join(out, "log.txt"), "a") as f:
        f.write(msg + "\n")


def equality(device: str, fixed: dict) -> dict:
    """Loss curves of EQ_TRIALS trained alone and fused on ``device`` (float32, TF32 off): the largest
    relative difference of any step's training loss, and of the final validation metric."""
    import contextlib

    import torch

    from hpdl.hpo.fusion import train_fused
    from hpdl.hpo.workloads import get_workload

    if device == "cpu":
        torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    class Ctx:
        def __init__(self, params):
            self.params, self.device, self.lineage, self.checkpoint_every = params, torch.device(device), 0, 0
            self.reports, self.losses = [], []

        def report(self, value, step):
            self.reports.append((step, value))

        def should_prune(self):
            return False

        @contextlib.contextmanager
        def step(self, s):
            yield

        def load_checkpoint(self):
            return None

    def check(name: str, p: dict, trials: list[dict]) -> dict:
        w = get_workload(name)
        t0 = time.monotonic()
        alone = []
        for t in trials:
            c = Ctx({**p, **t})
            w.train(c)
            alone.append(c)
        t1 = time.monotonic()
        fused = [Ctx({**p, **t}) for t in trials]
        train_fused(w, fused, torch.device(device), lambda *a: None)
        t2 = time.monotonic()
        rel = []
        for a, f in zip(alone, fused):
            la, lf = torch.stack(a.losses).double().cpu(), torch.stack(f.losses).double().cpu()
            rel.append(float(((la - lf).abs() / la.abs().clamp_min(1e-12)).max()))
        return {"trials": trials, "steps": p["steps"], "max_rel_loss_diff": rel, "passes_1e-5": max(rel) <= 1e-5,
                "final_metric_alone": [a.reports[-1][1] for a in alone],
                "final_metric_fused": [f.reports[-1][1] for f in fused], "alone_s": t1 - t0, "fused_s": t2 - t1}

    cnn = check("cnn", {**fixed, "steps": EQ_STEPS, "evals": 0, "eval_every": EQ_STEPS // 4}, EQ_TRIALS)
    out = {**cnn, "device": device, "tf32": False}
    # step time of the benchmark's architecture alone and fused K at a time (TF32 on, as in the workers)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    w = get_workload("cnn")
    p = {**fixed, "steps": STEP_PROBE + 10, "evals": 0, "eval_every": 10 ** 6}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    probe = {}
    for k in STEP_PROBE_K:
        ctxs = [Ctx({**p, "lr": 0.01 * (1 + i % 7), "seed": i}) for i in range(k)]
        marks = []

        @contextlib.contextmanager
        def mark(i):
            if i in (10, STEP_PROBE + 10 - 1):
                sync()
                marks.append(time.perf_counter())
            yield

        if k == 1:
            ctxs[0].step = mark
            w.train(ctxs[0])
        else:
            train_fused(w, ctxs, torch.device(device), lambda *a: None, step_ctx=mark)
        ms = (marks[1] - marks[0]) / (STEP_PROBE - 1) * 1e3
        probe[f"{'alone' if k == 1 else 'fused'}{k}"] = {"ms_per_step": ms, "trial_steps_per_s": k * 1e3 / ms}
    out["step_probe"] = probe
    try:  # the GPT under vmap (attention's batching rule on this device) on the same terms
        out["gpt"] = check("gpt", {**EQ_GPT, "steps": 30, "evals": 0, "eval_every": 10}, EQ_GPT_TRIALS)
    except Exception as exc:  # noqa: BLE001 - recorded; the CNN check stands
        out["gpt"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def run_one(tag: str, gpus: list[int], n_trials: int, scratch: str, timeout_s: float, smoke: bool) -> dict:
    from hpdl.hpo.driver import Driver
    from hpdl.hpo.errors import HpoError
    from hpdl.hpo.spec import StudySpec

    name, _, sharing = tag.partition("@")
    policy, _, fuse = name.partition("+fuse")
    spec = StudySpec.from_dict({
        "study": tag, "workload": "cnn", "n_trials": n_trials, "run_dir": os.path.join(scratch, tag),
        "sampler": {"name": "random", "seed": 0}, "pruner": {"name": "none"}, "space": SPACE,
        "fixed": SMOKE_FIXED if smoke else FIXED, "pool": {"fake": 1, "memory_gb": 8} if smoke else {"cuda": gpus},
        "policy": {"name": policy}, "max_retries": 2, "timeout_s": timeout_s,
        "fuse": {"max_trials": int(fuse), "wait_s": 0.5} if fuse else False,
        # a fused run needs a warm worker per group, not per trial (auto: the policy's concurrency, <= 8)
        "warm_workers": max(1, min(8, -(-n_trials // int(fuse)))) if fuse and not smoke else "auto",
        "mps": "start" if sharing == "mps" and not smoke else False})
    t0 = time.monotonic()
    drv = Driver(spec)
    setup = time.monotonic() - t0
    error = None
    try:
        res = drv.run()
    except HpoError as exc:  # timeout: keep what finished
        error, res = str(exc), drv.result()
    command = time.monotonic() - t0
    trials = [{"number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
               "fused": t.user_attrs.get("hpdl_fused", 1), "failure": t.user_attrs.get("hpdl_failure")}
              for t in drv.study.get_trials(deepcopy=False)]
    r = asdict(res)
    return {"tag": tag, "error": error, "result": r, "setup_s": setup, "command_s": command,
            "counted_in_s": r["warmup_s"] + r["wall_s"] + r["teardown_s"], "trials": trials,
            "profiles": {k: asdict(v) for k, v in drv.profiles.items()}}


def plot(runs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in runs if "result" in r]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ys = range(len(ok))
    ax.barh([y + 0.2 for y in ys], [r["result"]["wall_s"] for r in ok], 0.4, label="ready")
    ax.barh([y - 0.2 for y in ys], [r["counted_in_s"] for r in ok], 0.4, label="counted in")
    ax.set_yticks(list(ys), [r["tag"] for r in ok])
    ax.set_xlabel("seconds to finish the budget")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-trials", type=int, default=N_TRIALS)
    ap.add_argument("--runs", default=RUNS, help="comma-separated <policy>[+fuse<K>][@mps] (default: %(default)s)")
    ap.add_argument("--gpus", default="0", help="GPU ids of the pool (default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S)
    ap.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "hpo_fuse"))
    ap.add_argument("--scratch", default="/tmp/hpo_fuse_bench", help="run dirs (checkpoints, SQLite stores)")
    ap.add_argument("--smoke", action="store_true", help="tiny trials on a fake CPU device (no GPU), 8 trials")
    ap.add_argument("--equality-only", metavar="DEVICE", help=argparse.SUPPRESS)  # the check's subprocess
    args = ap.parse_args()
    if args.equality_only:
        print(json.dumps(equality(args.equality_only, SMOKE_FIXED if args.smoke else FIXED)))
        return
    if args.smoke:
        args.n_trials = min(args.n_trials, 8)
        args.runs = "pack+fuse4,one_per_gpu,pack"
    os.makedirs(args.out, exist_ok=True)
    import shutil

    shutil.rmtree(args.scratch, ignore_errors=True)  # a study name runs once per store
    import optuna
    import torch

    from hpdl.bench.report import source_commit
    from hpdl.hpo.launch import worker_context

    t0 = time.monotonic()
    gpus = [int(g) for g in args.gpus.split(",")]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "optuna": optuna.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], "smoke": args.smoke,
            "n_trials": args.n_trials, "space": SPACE, "fixed": SMOKE_FIXED if args.smoke else FIXED,
            "command": " ".join(["benchmarks/hpo_fuse_device.py"] + sys.argv[1:]), "commit": source_commit()}
    # the equality check in its own process: this one never creates a CUDA context (MPS daemons start later)
    dev = "cpu" if args.smoke else f"cuda:{gpus[0]}"
    cmd = [sys.executable, os.path.abspath(__file__), "--equality-only", dev] + (["--smoke"] if args.smoke else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        meta["equality"] = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as exc:  # noqa: BLE001 - record it and go on with the studies
        meta["equality"] = {"error": f"{type(exc).__name__}: {exc}",
                            "stderr": getattr(exc, "stderr", "")[-1500:] if getattr(exc, "stderr", "") else ""}
    eq = meta["equality"]
    log(args.out, f"[{time.monotonic() - t0:6.1f} s] equality on {dev}: cnn max rel loss diff "
                  f"{eq.get('max_rel_loss_diff')}, alone {eq.get('alone_s', 0):.1f} s / fused {eq.get('fused_s', 0):.1f} s; "
                  f"gpt {eq.get('gpt', {}).get('max_rel_loss_diff', eq.get('gpt', eq.get('error')))}; "
                  f"step probe {eq.get('step_probe')}")
    t = time.monotonic()  # the forkserver's imports, before the first study (no run pays them)
    ctx = worker_context()
    if ctx.get_start_method() == "forkserver":
        p = ctx.Process(target=time.sleep, args=(0,))
        p.start()
        p.join()
    meta["worker_server_start_s"] = time.monotonic() - t
    from hpdl.hpo.workloads import get_workload

    get_workload("cnn").estimate(SMOKE_FIXED if args.smoke else FIXED)  # the first meta trace's imports: no run pays them
    runs: list[dict] = []
    for tag in args.runs.split(","):
        left = args.budget_s - (time.monotonic() - t0)
        if left < 20:
            runs.append({"tag": tag, "skipped": f"device budget spent ({left:.0f} s left)"})
            log(args.out, f"skipped {tag}: {left:.0f} s left")
            continue
        timeout = min(left - 10, args.run_timeout_s)
        log(args.out, f"[{time.monotonic() - t0:6.1f} s] {tag} on GPUs {gpus} (timeout {timeout:.0f} s)")
        try:
            r = run_one(tag, gpus, args.n_trials, args.scratch, timeout, args.smoke)
        except Exception as exc:  # noqa: BLE001 - record and go on to the next run
            import traceback
            r = {"tag": tag, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-1500:]}
        runs.append(r)
        res = r.get("result", {})
        log(args.out, f"    ready {res.get('wall_s', float('nan')):.1f} s, counted in {r.get('counted_in_s', float('nan')):.1f} s "
                      f"(pool {res.get('warmup_s', 0):.1f} s, teardown {res.get('teardown_s', 0):.1f} s), command "
                      f"{r.get('command_s', float('nan')):.1f} s; complete {res.get('complete')} failures "
                      f"{res.get('failures')} best {res.get('best_value')} error {r.get('error')}")
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=1)
    # same configurations under every policy (RandomSampler, seed 0): compare their values
    ok = [r for r in runs if "result" in r]
    by = {r["tag"]: {json.dumps(t["params"], sort_keys=True): t["value"] for t in r["trials"] if t["value"] is not None}
          for r in ok}
    base = next((r for r in ok if r["tag"].startswith("one_per_gpu")), None)
    summary = []
    for r in ok:
        res = r["result"]
        row = {"run": r["tag"], "ready_s": res["wall_s"], "counted_in_s": r["counted_in_s"], "command_s": r["command_s"],
               "complete": res["complete"], "failures": res["failures"], "best": res["best_value"]}
        if base is not None:
            row["x_ready"] = base["result"]["wall_s"] / res["wall_s"]
            row["x_counted_in"] = base["counted_in_s"] / r["counted_in_s"]
            common = set(by[r["tag"]]) & set(by[base["tag"]])
            row["max_abs_value_diff_vs_one_per_gpu"] = max(
                (abs(by[r["tag"]][k] - by[base["tag"]][k]) for k in common), default=None)
        summary.append(row)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "runs": runs, "summary": summary}, f, indent=1)
    try:
        plot(runs, os.path.join(args.out, "times.png"),
             f"{args.n_trials} CNN configurations, one architecture, {', '.join(meta['gpus'][:1]) or 'CPU'}")
    except Exception as exc:  # noqa: BLE001 - no matplotlib: the table and JSON are the result
        log(args.out, f"no plot: {type(exc).__name__}: {exc}")
    log(args.out, f"done in {time.monotonic() - t0:.1f} s; equality max rel loss diff "
                  f"{max(meta['equality'].get('max_rel_loss_diff', [float('nan')])):.2e}")
    log(args.out, f"{'run':<22}{'ready s':>9}{'counted s':>11}{'command s':>11}{'x ready':>9}{'x counted':>11}"
                  f"{'done':>6}{'best':>8}")
    for row in summary:
        log(args.out, f"{row['run']:<22}{row['ready_s']:>9.1f}{row['counted_in_s']:>11.1f}{row['command_s']:>11.1f}"
                      f"{row.get('x_ready', float('nan')):>9.2f}{row.get('x_counted_in', float('nan')):>11.2f}"
                      f"{row['complete']:>6}{(row['best'] or float('nan')):>8.4f}")


if __name__ == "__main__":
    main()
