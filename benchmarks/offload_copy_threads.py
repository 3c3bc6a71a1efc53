"""Micro-benchmark of the offload executor's copy path, without processes: one executor thread serves P
alltoall ranks (one mailbox each, as an agent serves a node) and the caller starts all of them at once and
waits. It times one Alltoall per start for copy threads 1 (every copy inline on the dispatcher) and N, and
prints the executor's counters per start (dispatcher passes, passes while tasks were out, wake-ups, copy
tasks), the numbers that exposed issue 23's 64 KiB cliff: one pool task per copy and a dispatcher spinning
against the copy threads for the GIL.

    PYTHONPATH=src python3 benchmarks/offload_copy_threads.py --np 8 --threads 1,4 --sizes 16K,64K,256K,1M
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch

from hpdl.bench.cli import parse_size
from hpdl.offload import plans, shm
from hpdl.offload.compiler import compile_group
from hpdl.offload.executor import Executor, Instance


def measure(P: int, size: int, threads: int, iters: int, spin_us: float) -> dict:
    count = max(1, size // 4)
    comp = compile_group([plans.alltoall(r, P, count, "float32").data() for r in range(P)], key=1,
                         endpoints=[0] * P)
    ex = Executor(copy_threads=threads, spin_us=spin_us, name="bench-copy-threads")
    done = threading.Semaphore(0)
    boxes, insts = [], []
    for r in range(P):
        b = shm.Mailboxes(1, shared=False)
        t = {"input": (torch.arange(P * count, dtype=torch.float32) % 1013 + 1000 * r).view(P, count),
             "output": torch.zeros(P, count)}
        inst = Instance(comp[r], t, b.array, 0, None, "bench", f"rank {r}")
        inst.on_done = done.release
        ex.register(inst)
        boxes.append(b)
        insts.append(inst)
    ex.start_thread()
    times = []
    try:
        warm = max(3, iters // 10)
        for g in range(1, warm + iters + 1):
            if g == warm + 1:
                base = dict(getattr(ex, "stats", {}))  # an executor from before the counters has none
            t0 = time.perf_counter()
            for b in boxes:  # ranks start one after another, as their start() calls reach the agent
                b.array[0, shm.START] = g
                ex.bell.ring()
            for _ in range(P):
                if not done.acquire(timeout=60):
                    raise RuntimeError(f"start {g} not done within 60 s")
            times.append(time.perf_counter() - t0)
        stats = {k: (v - base[k]) / iters for k, v in getattr(ex, "stats", {}).items()}
    finally:
        ex.stop()
    wrong = sum(int((insts[r].tensors["output"][q] != insts[q].tensors["input"][r]).sum())
                for r in range(P) for q in range(P))
    ts = sorted(times[-iters:])
    return {"median_us": ts[len(ts) // 2] * 1e6, "p10_us": ts[len(ts) // 10] * 1e6, "wrong": wrong,
            **{k: float("nan") for k in ("passes", "passes_out", "wakeups", "copy_tasks")}, **stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=8, help="ranks served by the executor")
    ap.add_argument("--threads", default="1,4", help="copy thread counts to compare")
    ap.add_argument("--sizes", default="16K,64K,256K,1M", help="bytes per peer")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--spin-us", type=float, default=50.0)
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval (s): a time that grows with it waits for forced GIL switches")
    a = ap.parse_args()
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    torch.set_num_threads(1)  # as the agent: parallel copies come from the copy threads
    print(f"# {a.np} ranks on one executor, torch {torch.__version__}, GIL switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms; per start: passes, passes with tasks out, "
          "wake-ups, copy tasks")
    print(f"# {'size':>8} {'threads':>7} {'median(us)':>10} {'p10(us)':>8} {'passes':>7} {'out':>6} {'wakes':>6} "
          f"{'tasks':>6} {'#wrong':>6}")
    for size in (parse_size(s) for s in a.sizes.split(",")):
        for th in (int(t) for t in a.threads.split(",")):
            m = measure(a.np, size, th, a.iters, a.spin_us)
            print(f"  {size:>8} {th:>7} {m['median_us']:>10.0f} {m['p10_us']:>8.0f} {m['passes']:>7.1f} "
                  f"{m['passes_out']:>6.1f} {m['wakeups']:>6.1f} {m['copy_tasks']:>6.1f} {m['wrong']:>6}")


if __name__ == "__main__":
    main()
