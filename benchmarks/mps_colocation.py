"""How co-located training processes slow each other on one GPU, with and without MPS: the measurement
behind ``pack``'s co-location rules under MPS (hpdl.hpo.policies.Pack) and a check of the simulator's
MPS model (hpdl.hpo.simulator).

Each mix starts its processes (small CNNs of hpdl.hpo.workloads on synthetic 32x32 images), builds and
warms each model, releases all of them at once, and counts the training steps each one completes in a
fixed window. Slowdown = step time in the mix / step time alone (same mode), per class (heavy: batch
16384; light: batch 48), median over the class's processes.

Limits (as committed, 2026-11-30): one window per mix, no repeats (a time-sliced heavy process completes
about 7 steps); the device is synchronised after every step, which the trial loop does not do; torch's
intra-op threads are left at their default (hpo workers use 1) and up to 15 processes share the host's
cores, so light numbers include CPU contention; a process that finishes its window early leaves the
others less contended for the rest of theirs.

    PYTHONPATH=src python3 benchmarks/mps_colocation.py --out out/mps_colocation.json [--window-s 3]

Needs one CUDA GPU and nvidia-cuda-mps-control (the MPS daemon is private to the run and stopped after).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time

HEAVY = {"width": 16, "depth": 2, "batch_size": 16384, "image_size": 32}
LIGHT = {"width": 16, "depth": 2, "batch_size": 48, "image_size": 32}
MIXES = [  # (heavy processes, light processes)
    (1, 0), (0, 1), (2, 0), (4, 0), (0, 8), (0, 14), (1, 8), (1, 14), (2, 13),
]


def worker(env: dict, params: dict, barrier, window_s: float, q) -> None:
    os.environ.update(env)
    import torch

    from hpdl.hpo.workloads import get_workload

    wl = get_workload("cnn")
    dev = torch.device("cuda:0")
    p = wl.resolve(params)
    parts = wl.build(p, dev)

    def step(s: int) -> None:
        x, y = parts.batch(s)
        loss = parts.loss(parts.model(x), y)
        parts.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        parts.optimizer.step()
        torch.cuda.synchronize()

    for s in range(3):  # cuDNN algorithm choice and allocator warm-up
        step(s)
    barrier.wait(timeout=300)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < window_s:
        step(n)
        n += 1
    q.put((params["batch_size"], (time.perf_counter() - t0) / n))


def run_mix(heavy: int, light: int, env: dict, window_s: float) -> list[tuple]:
    ctx = mp.get_context("spawn")
    n = heavy + light
    barrier, q = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(env, HEAVY if i < heavy else LIGHT, barrier, window_s, q))
             for i in range(n)]
    for p in procs:
        p.start()
    try:
        out = [q.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/mps_colocation.json")
    ap.add_argument("--window-s", type=float, default=3.0)
    args = ap.parse_args()
    from hpdl.hpo.mps import MpsDaemon

    rows, solo = [], {}
    for mode in ("time-sliced", "mps"):
        daemon = MpsDaemon(tempfile.mkdtemp(prefix="mpscoloc-")).start() if mode == "mps" else None
        try:
            for heavy, light in MIXES:
                t = time.monotonic()
                res = run_mix(heavy, light, daemon.env if daemon else {}, args.window_s)
                cls = {"heavy": [s for b, s in res if b == HEAVY["batch_size"]],
                       "light": [s for b, s in res if b == LIGHT["batch_size"]]}
                if heavy + light == 1:
                    solo[(mode, "heavy" if heavy else "light")] = (cls["heavy"] or cls["light"])[0]
                row = {"mode": mode, "heavy": heavy, "light": light, "wall_s": round(time.monotonic() - t, 1)}
                for k, v in cls.items():
                    if v:
                        row[f"{k}_step_ms"] = statistics.median(v) * 1e3
                        row[f"{k}_slowdown"] = statistics.median(v) / solo[(mode, k)] if (mode, k) in solo else None
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            if daemon:
                daemon.stop()
    from hpdl.bench.common import run_metadata

    meta = run_metadata(device="cuda", cpus=os.cpu_count(), window_s=args.window_s, heavy=HEAVY, light=LIGHT)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("| mode | heavy | light | heavy step ms | heavy slowdown | light step ms | light slowdown |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        def f(k):
            v = r.get(k)
            return "-" if v is None else f"{v:.2f}"
        print(f"| {r['mode']} | {r['heavy']} | {r['light']} | {f('heavy_step_ms')} | {f('heavy_slowdown')} | "
              f"{f('light_step_ms')} | {f('light_slowdown')} |")


if __name__ == "__main__":
    main()
