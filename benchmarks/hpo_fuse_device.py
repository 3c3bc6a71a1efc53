"""Device benchmark of fused trials (hpdl.hpo.fusion, issue 39): a 64-configuration sweep of one fixed
architecture (the small CNN: learning rate, weight decay and warm-up searched; width, depth and batch size
fixed), run through the study driver as ``pack`` with MPS and fused groups (``fuse: {max_trials: K}``),
against one trial per GPU and today's ``pack`` with MPS, on one GPU. Then the equality check on the device:
fused trials' loss curves against the same trials alone (float32, TF32 off).

Each run is its own ``hpdl hpo run`` process, as a user runs it. A fused run starts one warm worker per group
it will run (``warm_workers``: ``ceil(64 / K)``, at most 8); ``pack@mps`` starts the 8-worker pool of the
start-up goal; ``one_per_gpu`` keeps ``auto`` (one). Steps per trial are sized from the equality check's
step probe so that one trial per GPU takes about 100 s on the ready clock (the command's start-up is then a
share of it as in a real sweep); the choice is in results.json (``meta.steps_chosen``).

Clocks per run, both from the run's own summary (``hpdl hpo run --out``): **ready** (``wall_s``: from a
ready warm pool to the budget's end) and **counted in** (``counted_s``: from the ``hpdl`` process's start,
so the interpreter, imports, study set-up, MPS daemon and pool start-up are in it, to the end of its
teardown); ``setup_phases`` splits what lies before ready. A run cut by its timeout is kept with what
finished and marked ``capped``: its clocks are lower bounds, and so is a speed-up over it. The last lines
printed are the issue's goals (met / NOT met / not shown) and a table.

The mixed-shape GPT space (goal: >= 3x one trial per GPU counted in) is not in this script: its
one-trial-per-GPU run alone took 85.5 s counted in (issue 39), and with the CNN sweep's three commands and
the equality check it does not fit the 240 s of one device call.

The equality check reports, per trial, the relative loss difference at the first step, step 10 and the last
step, under cuDNN's default algorithm choice and under ``cudnn.deterministic`` (TF32 off in both), and for the CNN with cuDNN off: rounding
that grows from ~1e-7 at step 1 (the grouped convolution of K trials may run other algorithms than one
trial's; then equal or much closer with cuDNN off) or a divergence from the start. The goal line checks the deterministic setting when it alone is
within 1e-5, and says which setting it checked.

Launch (repository root; results in --out, 3 files: results.json, times.png, log.txt):
    NCCL_NVLS_ENABLE=0 PYTHONPATH=src:/tmp/site python3 benchmarks/hpo_fuse_device.py --out $OUT/hpo_fuse  # ~3.5 min
    # the equality check (cnn + gpt) and one short pack@mps start-up (8-worker pool) only, about a minute:
    NCCL_NVLS_ENABLE=0 PYTHONPATH=src:/tmp/site python3 benchmarks/hpo_fuse_device.py --only equality,startup --out $OUT/hpo
    PYTHONPATH=src python3 benchmarks/hpo_fuse_device.py --smoke --out /tmp/hpo_fuse_smoke    # CPU, fake device
Runs are named ``<policy>[+fuse<K>][@mps]``; one that would not fit what is left of ``--budget-s`` is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# ---- defaults (one visible block) ----
N_TRIALS = 64
RUNS = "pack+fuse16@mps,pack@mps,one_per_gpu"  # one_per_gpu last: the budget cuts it first (then a lower bound)
BUDGET_S = 225.0          # the whole script, s (the lead's limit: 240 s on 1 x H200)
RUN_TIMEOUT_S = 130.0     # ready clock of one_per_gpu at most, s
PACKED_TIMEOUT_S = 60.0   # ready clock of any other run at most (a stuck one must leave the budget to the rest), s
START_MARGIN_S = 35.0     # a run's process start, imports, pool start-up and teardown beside its ready clock, s
MIN_RUN_S = 10.0          # a run with less ready-clock time left than this is skipped
EQ_TIMEOUT_S = 75.0       # the equality check (three numerics settings) and step probe, s
TARGET_ONE_PER_GPU_S = 100.0 # one trial per GPU's ready clock that the steps per trial are sized for, s
TRIAL_OVERHEAD_S = 0.3    # a trial's cost besides its steps under one_per_gpu (model, evaluations, storage), s
MIN_STEPS, MAX_STEPS = 200, 3000
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
STARTUP_RUN, STARTUP_TRIALS, STARTUP_STEPS = "pack@mps", 16, 40  # --only startup: one short run, 8 workers
STARTUP_TIMEOUT_S = 30.0  # its ready clock at most, s
STEP_PROBE, STEP_PROBE_K = 100, (1, 4, 16, 64)  # timed steps; trials per model (1: the solo loop)
EQ_GPT = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "batch_size": 16, "val_batches": 2}
EQ_GPT_TRIALS = [{"lr": 3e-3, "seed": 0}, {"lr": 1e-3, "weight_decay": 0.1, "beta1": 0.8, "warmup_steps": 10,
                                          "seed": 1}]


def log(out: str, msg: str) -> None:
    print(msg, flush=True)
    with open(os.path.join(out, "log.txt"), "a") as f:
        f.write(msg + "\n")


def set_numerics(deterministic: bool, cudnn: bool = True) -> dict:
    """Float32 numerics of the equality check: TF32 off for matmul and convolution always, no cuDNN
    autotuning (``cudnn.benchmark=False``); with ``deterministic`` cuDNN's deterministic algorithms
    (``cudnn.deterministic=True``); without ``cudnn`` torch's own convolution kernels
    (``cudnn.enabled=False``: a diagnosis, whether cuDNN's choice of algorithm makes the difference).
    Returns the settings."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.enabled = cudnn
    return {"allow_tf32": False, "cudnn.benchmark": False, "cudnn.deterministic": deterministic,
            "cudnn.enabled": cudnn}


def equality(device: str, fixed: dict, probe: bool = True) -> dict:
    """Loss curves of EQ_TRIALS (CNN) and EQ_GPT_TRIALS trained alone and fused on ``device`` (float32, TF32
    off), once with cuDNN's default algorithm choice and once with ``cudnn.deterministic`` (on CUDA also the
    CNN with cuDNN off, a diagnosis) (``settings``): per
    trial the relative training-loss difference at the first step, step 10 and the last step and the largest
    over all steps (rounding that grows step by step vs a divergence from the start), and the final
    validation metric. The top-level CNN keys are those of the deterministic setting when it is within 1e-5
    and the default's is not (``check_setting`` says which). ``probe``: also time the step of the benchmark's
    architecture alone and fused (TF32 on, as in the workers)."""
    import contextlib

    import torch

    from hpdl.hpo.fusion import train_fused
    from hpdl.hpo.trial import LocalTrial
    from hpdl.hpo.workloads import get_workload

    if device == "cpu":
        torch.set_num_threads(1)

    def Ctx(params):  # the trial alone, in memory, with every step's loss
        return LocalTrial(params, device)

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
        rel, at = [], {"step1": [], "step10": [], "last": []}
        for a, f in zip(alone, fused):
            la, lf = torch.stack(a.losses).double().cpu(), torch.stack(f.losses).double().cpu()
            r = ((la - lf).abs() / la.abs().clamp_min(1e-12)).tolist()
            rel.append(max(r))
            at["step1"].append(r[0])
            at["step10"].append(r[min(9, len(r) - 1)])
            at["last"].append(r[-1])
        return {"trials": trials, "steps": p["steps"], "max_rel_loss_diff": rel, "rel_loss_diff_at": at,
                "passes_1e-5": max(rel) <= 1e-5, "final_metric_alone": [a.reports[-1][1] for a in alone],
                "final_metric_fused": [f.reports[-1][1] for f in fused], "alone_s": t1 - t0, "fused_s": t2 - t1}

    settings = {}
    # the GPT has no convolution: cuDNN off says nothing about it
    for tag, det, cudnn in (("default", False, True), ("deterministic", True, True), ("no_cudnn", False, False)):
        if not cudnn and not device.startswith("cuda"):
            continue
        numerics = set_numerics(det, cudnn)
        cnn = check("cnn", {**fixed, "steps": EQ_STEPS, "evals": 0, "eval_every": EQ_STEPS // 4}, EQ_TRIALS)
        settings[tag] = {"numerics": numerics, "cnn": cnn}
        if not cudnn:
            continue
        try:  # the GPT under vmap (attention on this device) on the same terms
            settings[tag]["gpt"] = check("gpt", {**EQ_GPT, "steps": 30, "evals": 0, "eval_every": 10}, EQ_GPT_TRIALS)
        except Exception as exc:  # noqa: BLE001 - recorded; the CNN check stands
            settings[tag]["gpt"] = {"error": f"{type(exc).__name__}: {exc}"}
    set_numerics(False)
    use = ("deterministic" if settings["deterministic"]["cnn"]["passes_1e-5"]
           and not settings["default"]["cnn"]["passes_1e-5"] else "default")
    out = {**settings[use]["cnn"], "gpt": settings[use]["gpt"], "check_setting": use, "settings": settings,
           "device": device, "tf32": False,
           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
           if device.startswith("cuda") else []}
    if not probe:
        return out
    # step time of the benchmark's architecture alone and fused K at a time (TF32 on, as in the workers)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    w = get_workload("cnn")
    p = {**fixed, "steps": STEP_PROBE + 10, "evals": 0, "eval_every": 10 ** 6}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    probe_out = {}
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
        probe_out[f"{'alone' if k == 1 else 'fused'}{k}"] = {"ms_per_step": ms, "trial_steps_per_s": k * 1e3 / ms}
    out["step_probe"] = probe_out
    return out


def equality_lines(eq: dict) -> list[str]:
    """One line per setting and workload: the relative loss difference per trial at step 1, 10 and the last."""
    lines = []
    for tag, st in (eq.get("settings") or {}).items():
        for name in ("cnn", "gpt"):
            if name not in st:
                continue
            r = st[name]
            if "error" in r:
                lines.append(f"    {tag:<13} {name}: {r['error']}")
                continue
            at = r.get("rel_loss_diff_at", {})
            fmt = lambda xs: "[" + ", ".join(f"{x:.1e}" for x in xs) + "]"  # noqa: E731
            lines.append(f"    {tag:<13} {name}: rel loss diff step 1 {fmt(at.get('step1', []))}, step 10 "
                         f"{fmt(at.get('step10', []))}, last (step {r.get('steps')}) {fmt(at.get('last', []))}; "
                         f"max {max(r.get('max_rel_loss_diff') or [float('nan')]):.1e} "
                         f"({'within' if r.get('passes_1e-5') else 'NOT within'} 1e-5)")
    return lines


def study_file(tag: str, n_trials: int, scratch: str, fixed: dict, timeout_s: float, smoke: bool,
               warm: int | str | None = None) -> str:
    """Write the study file of run ``tag`` (``<policy>[+fuse<K>][@mps]``); return its path."""
    import yaml

    name, _, sharing = tag.partition("@")
    policy, _, fuse = name.partition("+fuse")
    if warm is not None:
        pass
    elif fuse:  # a fused run needs a warm worker per group, not per trial
        warm = max(1, min(8, -(-n_trials // int(fuse))))
    else:  # pack: the 8-worker pool of the start-up goal; one_per_gpu: its one trial per GPU
        warm = "auto" if smoke or policy == "one_per_gpu" else 8
    study = {"study": tag, "workload": "cnn", "n_trials": n_trials, "run_dir": os.path.join(scratch, tag),
             "sampler": {"name": "random", "seed": 0}, "pruner": {"name": "none"}, "space": SPACE, "fixed": fixed,
             "pool": {"fake": 1, "memory_gb": 8} if smoke else {"cuda": "all"}, "policy": {"name": policy},
             "max_retries": 2, "timeout_s": timeout_s, "warm_workers": warm,
             "fuse": {"max_trials": int(fuse), "wait_s": 0.5} if fuse else False,
             "mps": "start" if sharing == "mps" and not smoke else False}
    os.makedirs(study["run_dir"], exist_ok=True)
    path = os.path.join(scratch, f"{tag}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(study, f, sort_keys=False)
    return path


def preload_imports() -> dict[str, float]:
    """Seconds to import each module the workers' forkserver preloads (``hpdl.hpo._preload.MODULES``, in its
    order) in a fresh process: where the server's start-up goes on this host, which is what is left before
    the ready clock of a cold ``hpdl hpo run`` (with one CUDA context per worker)."""
    import importlib

    t, out = time.perf_counter(), {}
    for name in ("torch", "torch._dynamo", "optuna", "sqlalchemy", "alembic.migration", "hpdl.hpo.worker",
                 "hpdl.hpo.workloads"):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            out[name + " (error)"] = repr(exc)[:200]
        now = time.perf_counter()
        out[name], t = round(now - t, 3), now
    return out


def run_one(tag: str, n_trials: int, scratch: str, fixed: dict, timeout_s: float, smoke: bool,
            warm: int | str | None = None) -> dict:
    """Run ``tag`` as its own ``hpdl hpo run`` process (the counted-in clock starts at that process's start).
    The study's ``timeout_s`` bounds its ready clock; a run cut by it is kept with what finished (its clocks
    are then lower bounds, ``capped``)."""
    import optuna

    os.makedirs(scratch, exist_ok=True)
    path = study_file(tag, n_trials, scratch, fixed, timeout_s, smoke, warm)
    out = os.path.join(scratch, f"{tag}.json")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}
    t0 = time.time()
    try:  # the hard limit: the ready clock's plus what a command needs around it
        proc = subprocess.run([sys.executable, "-m", "hpdl.cli", "hpo", "run", path, "--no-progress", "--out", out],
                              env=env, capture_output=True, text=True, timeout=timeout_s + START_MARGIN_S + 10)
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:  # killed: its workers exit with it, its MPS daemon's reaper stops it
        code, stdout, stderr = None, str(exc.stdout or ""), f"killed after {exc.timeout:.0f} s; " + str(exc.stderr or "")
    command = time.time() - t0
    r: dict = {"tag": tag, "exit_code": code, "command_s": command, "stdout": stdout[-1500:],
               "stderr": stderr[-1500:] if code else ""}
    if os.path.exists(out):
        with open(out) as f:
            r["result"] = json.load(f)
    db = os.path.join(scratch, tag, "study.db")
    if os.path.exists(db):
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.load_study(study_name=tag, storage=f"sqlite:///{db}")
        r["trials"] = [{"number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
                        "fused": t.user_attrs.get("hpdl_fused", 1), "failure": t.user_attrs.get("hpdl_failure")}
                       for t in study.get_trials(deepcopy=False)]
    prof = os.path.join(scratch, tag, "profiles.json")
    if os.path.exists(prof):
        with open(prof) as f:
            r["profiles"] = json.load(f)
    if "result" in r:
        res = r["result"]
        r["ready_s"], r["counted_in_s"], r["capped"] = res["wall_s"], res["counted_s"], False
    else:  # cut by timeout_s (or failed): the time it ran is a lower bound of its clocks
        done = sum(t["state"] == "COMPLETE" for t in r.get("trials", []))
        r["ready_s"], r["counted_in_s"], r["capped"] = timeout_s, command, True
        r["error"] = f"exit {code} with {done}/{n_trials} complete: {stderr.strip()[-300:]}"
    return r


def plot(runs: list[dict], path: str, title: str) -> None:
    from hpdl.bench.common import pyplot

    plt = pyplot()

    ok = [r for r in runs if "counted_in_s" in r]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ys = range(len(ok))
    ax.barh([y + 0.2 for y in ys], [r["ready_s"] for r in ok], 0.4, label="ready")
    ax.barh([y - 0.2 for y in ys], [r["counted_in_s"] for r in ok], 0.4, label="counted in")
    ax.set_yticks(list(ys), [r["tag"] + (" (cut: >=)" if r["capped"] else "") for r in ok])
    ax.set_xlabel("seconds to finish the budget")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def choose_steps(eq: dict, smoke: bool) -> tuple[int, str]:
    """Training steps per trial: sized from the equality check's step probe so that one trial per GPU takes
    about TARGET_ONE_PER_GPU_S on the ready clock (64 trials one after another), so that the start-up of
    each command is amortised as in a real sweep; FIXED's steps when there is no probe (or ``--smoke``)."""
    ms = (eq.get("step_probe") or {}).get("alone1", {}).get("ms_per_step")
    if smoke or not ms:
        return int((SMOKE_FIXED if smoke else FIXED)["steps"]), "fixed (no probe)" if not smoke else "smoke"
    per_trial = TARGET_ONE_PER_GPU_S / N_TRIALS - TRIAL_OVERHEAD_S
    steps = int(min(MAX_STEPS, max(MIN_STEPS, round(per_trial / (ms / 1e3), -1))))
    return steps, f"probe: alone {ms:.3f} ms/step -> {steps} steps for ~{TARGET_ONE_PER_GPU_S:.0f} s one per GPU"


def goals(runs: list[dict], eq: dict, sweep: bool = True) -> list[dict]:
    """The issue's goal lines, from the runs' counted-in clocks (``hpdl hpo run``'s own: from its process's
    start to the end of its teardown) and the equality check. A capped run (cut by its timeout) gives a
    lower bound of its clocks, so a speed-up over it is a lower bound too."""
    by = {r["tag"]: r for r in runs if "counted_in_s" in r}
    fused = [r for t, r in by.items() if "+fuse" in t and not r["capped"]]
    best = min(fused, key=lambda r: r["counted_in_s"], default=None)
    one = next((r for t, r in by.items() if t.startswith("one_per_gpu")), None)
    pack = next((r for t, r in by.items() if t.startswith("pack") and "+fuse" not in t), None)  # pack[@mps]
    out = []

    def speedup(name: str, base, need: float) -> None:
        if best is None or base is None:
            out.append({"goal": name, "value": None, "met": None, "note": "a run is missing"})
            return
        x = base["counted_in_s"] / best["counted_in_s"]
        met = x >= need if not base["capped"] or x >= need else None  # a lower bound below the goal shows nothing
        out.append({"goal": name, "value": x, "lower_bound": base["capped"], "met": met,
                    "note": f"{best['tag']} {best['counted_in_s']:.1f} s vs {base['tag']} "
                            f"{'>= ' if base['capped'] else ''}{base['counted_in_s']:.1f} s counted in"})

    if sweep:
        speedup("fused+packed >= 8x one trial per GPU, counted in", one, 8.0)
        speedup("fused+packed >= 2x pack@mps, counted in", pack, 2.0)
    if pack is not None and not pack["capped"]:
        gap = pack["counted_in_s"] - pack["ready_s"]
        out.append({"goal": "counted in - ready <= 4 s, 8-worker pool", "value": gap, "met": gap <= 4.0,
                    "note": f"{pack['tag']}: {pack['result']['setup_phases']} before ready, teardown "
                            f"{pack['result']['teardown_s']:.1f} s"})
    if not eq:
        return out
    rel = eq.get("max_rel_loss_diff")
    other = {t: max(st["cnn"]["max_rel_loss_diff"]) for t, st in (eq.get("settings") or {}).items()
             if "max_rel_loss_diff" in st.get("cnn", {})}
    out.append({"goal": "fused loss curves equal alone within 1e-5 relative (float32), cnn",
                "value": max(rel) if rel else None, "met": bool(rel) and max(rel) <= 1e-5,
                "note": f"on {eq.get('device')}, {len(rel or [])} trials, {eq.get('steps')} steps, "
                        f"{eq.get('check_setting')} numerics checked; max per setting {other}"})
    gpt = eq.get("gpt") or {}
    grel = gpt.get("max_rel_loss_diff")
    out.append({"goal": "fused loss curves equal alone within 1e-5 relative (float32), gpt",
                "value": max(grel) if grel else None, "met": bool(grel) and max(grel) <= 1e-5,
                "note": gpt.get("error") or f"{len(grel or [])} trials, {gpt.get('steps')} steps, "
                                            f"{eq.get('check_setting')} numerics"})
    return out


def main() -> None:
    t0 = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-trials", type=int, default=N_TRIALS)
    ap.add_argument("--runs", default=RUNS, help="comma-separated <policy>[+fuse<K>][@mps], in the order run; the "
                                                  "last one is cut first by the budget (default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="whole script (default: %(default)s)")
    ap.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S,
                    help="ready clock of one_per_gpu at most; the other runs: at most the smaller of this and "
                         "%d s (default: %%(default)s)" % PACKED_TIMEOUT_S)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "hpo_fuse"))
    ap.add_argument("--scratch", default="/tmp/hpo_fuse_bench", help="run dirs (checkpoints, SQLite stores)")
    ap.add_argument("--smoke", action="store_true", help="tiny trials on a fake CPU device (no GPU), 8 trials")
    ap.add_argument("--only", default="equality,sweep",
                    help="comma-separated parts, in this order: equality (cnn and gpt, fused vs alone; with sweep "
                         "also the step probe), startup (one short %s run of %d trials: the time before ready of "
                         "an 8-worker pool), sweep (the --runs) (default: %%(default)s; 'equality,startup' takes "
                         "about a minute on 1 x H200)" % (STARTUP_RUN, STARTUP_TRIALS))
    ap.add_argument("--equality-only", metavar="DEVICE", help=argparse.SUPPRESS)  # the check's subprocess
    ap.add_argument("--no-probe", action="store_true", help=argparse.SUPPRESS)  # the check's subprocess
    args = ap.parse_args()
    if args.equality_only:
        imports = preload_imports()  # first: this is a fresh process, as the workers' server is
        out = equality(args.equality_only, SMOKE_FIXED if args.smoke else FIXED, probe=not args.no_probe)
        print(json.dumps({**out, "preload_import_s": imports}))
        return
    parts = [x.strip() for x in args.only.split(",") if x.strip()]
    bad = sorted(set(parts) - {"equality", "startup", "sweep"})
    if bad or not parts:
        ap.error(f"--only={args.only!r}: expected a comma-separated subset of equality, startup, sweep")
    if args.smoke:
        args.n_trials = min(args.n_trials, 8)
        if args.runs == RUNS:
            args.runs = "pack+fuse4,pack,one_per_gpu"
    os.makedirs(args.out, exist_ok=True)
    import shutil

    shutil.rmtree(args.scratch, ignore_errors=True)  # a study name runs once per store
    os.makedirs(args.scratch)
    from hpdl.bench.common import run_metadata

    meta = run_metadata(versions=("optuna",), cpus=os.cpu_count(), smoke=args.smoke, n_trials=args.n_trials,
                        space=SPACE)
    # the equality check in its own process: this one never touches CUDA (each run starts its own MPS daemon)
    dev = "cpu" if args.smoke else "cuda:0"
    eq: dict = {}
    if "equality" in parts:
        cmd = ([sys.executable, os.path.abspath(__file__), "--equality-only", dev] + (["--smoke"] if args.smoke else [])
               + ([] if "sweep" in parts else ["--no-probe"]))
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=EQ_TIMEOUT_S, check=True)
            meta["equality"] = json.loads(out.stdout.strip().splitlines()[-1])
        except Exception as exc:  # noqa: BLE001 - record it and go on with the studies
            meta["equality"] = {"error": f"{type(exc).__name__}: {exc}",
                                "stderr": getattr(exc, "stderr", "")[-1500:] if getattr(exc, "stderr", "") else ""}
        eq = meta["equality"]
        meta["gpus"] = eq.get("gpus", [])
        log(args.out, f"[{time.monotonic() - t0:6.1f} s] equality on {dev} ({eq.get('check_setting')} numerics "
                      f"checked): cnn max rel loss diff {eq.get('max_rel_loss_diff')}, alone "
                      f"{eq.get('alone_s', 0):.1f} s / fused {eq.get('fused_s', 0):.1f} s; error {eq.get('error')}; "
                      f"step probe {eq.get('step_probe')}; preload imports s {eq.get('preload_import_s')}")
        for line in equality_lines(eq):
            log(args.out, line)
    startup = None
    if "startup" in parts:
        tag = "pack" if args.smoke else STARTUP_RUN
        log(args.out, f"[{time.monotonic() - t0:6.1f} s] start-up: {tag}, {STARTUP_TRIALS} trials of "
                      f"{STARTUP_STEPS} steps, 8-worker pool (hpdl hpo run)")
        try:
            startup = run_one(tag, STARTUP_TRIALS, os.path.join(args.scratch, "startup"),
                              {**(SMOKE_FIXED if args.smoke else FIXED), "steps": STARTUP_STEPS}, STARTUP_TIMEOUT_S,
                              args.smoke, warm=2 if args.smoke else 8)
        except Exception as exc:  # noqa: BLE001 - recorded
            startup = {"tag": tag, "error": f"{type(exc).__name__}: {exc}"}
        meta["startup"] = startup
        res = startup.get("result", {})
        gap = startup["counted_in_s"] - startup["ready_s"] if "result" in startup else None
        log(args.out, f"    ready {startup.get('ready_s', float('nan')):.1f} s, counted in "
                      f"{startup.get('counted_in_s', float('nan')):.1f} s, counted in - ready "
                      f"{gap if gap is not None else float('nan'):.1f} s; before ready {res.get('setup_phases')}, "
                      f"teardown {res.get('teardown_s', float('nan')):.1f} s; worker phases (median/max s) "
                      f"{ {k: (round(v['median'], 2), round(v['max'], 2)) for k, v in res.get('warmup_phases', {}).items()} }; "
                      f"complete {res.get('complete')} failures {res.get('failures')} error {startup.get('error')}")
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta}, f, indent=1)
    if "sweep" not in parts:
        meta["wall_s"] = time.monotonic() - t0
        goal_rows = goals([startup] if startup and "result" in startup else [], eq, sweep=False)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "goals": goal_rows}, f, indent=1)
        log(args.out, f"done in {meta['wall_s']:.1f} s")
        for g in goal_rows:
            v = "-" if g["value"] is None else f"{g['value']:.3g}"
            verdict = {True: "met", False: "NOT met", None: "not shown"}[g["met"]]
            log(args.out, f"GOAL {g['goal']}: {v} -> {verdict} ({g['note']})")
        return
    steps, why = choose_steps(eq, args.smoke)
    fixed = {**(SMOKE_FIXED if args.smoke else FIXED), "steps": steps}
    meta.update(fixed=fixed, steps_chosen=why)
    log(args.out, f"steps per trial: {why}")
    runs: list[dict] = []
    for tag in args.runs.split(","):
        left = args.budget_s - (time.monotonic() - t0)
        cap = args.run_timeout_s if tag.startswith("one_per_gpu") else min(args.run_timeout_s, PACKED_TIMEOUT_S)
        timeout = min(cap, left - START_MARGIN_S)
        if timeout < MIN_RUN_S:
            runs.append({"tag": tag, "skipped": f"budget spent ({left:.0f} s left)"})
            log(args.out, f"skipped {tag}: {left:.0f} s left")
            continue
        log(args.out, f"[{time.monotonic() - t0:6.1f} s] {tag}: hpdl hpo run (ready clock at most {timeout:.0f} s)")
        try:
            r = run_one(tag, args.n_trials, args.scratch, fixed, timeout, args.smoke)
        except Exception as exc:  # noqa: BLE001 - record and go on to the next run
            import traceback
            r = {"tag": tag, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-1500:]}
        runs.append(r)
        res = r.get("result", {})
        log(args.out, f"    ready {r.get('ready_s', float('nan')):.1f} s, counted in {r.get('counted_in_s', float('nan')):.1f} s"
                      f"{' (capped: lower bounds)' if r.get('capped') else ''}; before ready {res.get('setup_phases')}, "
                      f"teardown {res.get('teardown_s', float('nan')):.1f} s; command {r.get('command_s', float('nan')):.1f} s; "
                      f"complete {res.get('complete')} failures {res.get('failures')} best {res.get('best_value')} "
                      f"error {r.get('error')}")
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=1)
    # same configurations under every policy (RandomSampler, seed 0): compare their values
    ok = [r for r in runs if "counted_in_s" in r]
    by = {r["tag"]: {json.dumps(t["params"], sort_keys=True): t["value"] for t in r.get("trials", [])
                     if t["value"] is not None} for r in ok}
    base = next((r for r in ok if r["tag"].startswith("one_per_gpu")), None)
    summary = []
    for r in ok:
        res = r.get("result", {})
        row = {"run": r["tag"], "ready_s": r["ready_s"], "counted_in_s": r["counted_in_s"], "capped": r["capped"],
               "outside_s": r["counted_in_s"] - r["ready_s"] if not r["capped"] else None,
               "pool_s": res.get("warmup_s"), "command_s": r["command_s"], "complete": res.get("complete"),
               "failures": res.get("failures"), "best": res.get("best_value")}
        if base is not None:
            row["x_ready"] = base["ready_s"] / r["ready_s"]
            row["x_counted_in"] = base["counted_in_s"] / r["counted_in_s"]
            common = set(by[r["tag"]]) & set(by[base["tag"]])
            row["max_abs_value_diff_vs_one_per_gpu"] = max(
                (abs(by[r["tag"]][k] - by[base["tag"]][k]) for k in common), default=None)
        summary.append(row)
    goal_rows = goals(runs, eq)
    meta["wall_s"] = time.monotonic() - t0
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "runs": runs, "summary": summary, "goals": goal_rows}, f, indent=1)
    try:
        plot(runs, os.path.join(args.out, "times.png"),
             f"{args.n_trials} CNN configurations, one architecture, {', '.join(meta['gpus'][:1]) or 'CPU'}")
    except Exception as exc:  # noqa: BLE001 - no matplotlib: the table and JSON are the result
        log(args.out, f"no plot: {type(exc).__name__}: {exc}")
    log(args.out, f"done in {meta['wall_s']:.1f} s")
    for g in goal_rows:
        v = "-" if g["value"] is None else f"{'>= ' if g.get('lower_bound') else ''}{g['value']:.3g}"
        verdict = {True: "met", False: "NOT met", None: "not shown"}[g["met"]]
        log(args.out, f"GOAL {g['goal']}: {v} -> {verdict} ({g['note']})")
    log(args.out, f"{'run':<20}{'ready s':>9}{'counted s':>11}{'outside s':>11}{'pool s':>8}{'x ready':>9}"
                  f"{'x counted':>11}{'done':>6}{'best':>8}")
    for row in summary:
        cap = "+" if row["capped"] else " "
        log(args.out, f"{row['run']:<20}{row['ready_s']:>8.1f}{cap}{row['counted_in_s']:>10.1f}{cap}"
                      f"{(row['outside_s'] if row['outside_s'] is not None else float('nan')):>11.1f}"
                      f"{(row['pool_s'] if row['pool_s'] is not None else float('nan')):>8.1f}"
                      f"{row.get('x_ready', float('nan')):>9.2f}{row.get('x_counted_in', float('nan')):>11.2f}"
                      f"{(row['complete'] if row['complete'] is not None else -1):>6}"
                      f"{(row['best'] if row['best'] is not None else float('nan')):>8.4f}")


if __name__ == "__main__":
    main()
