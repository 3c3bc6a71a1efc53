"""How much GPU memory a trial of the hpdl.hpo CNN workload needs, as the profiler sees it and as it is used.

The profiler (:mod:`hpdl.hpo.profiler`) records ``max_memory_reserved`` (what the caching allocator holds),
which includes blocks that are cached but free. This script measures, per configuration and allocator
setting (``PYTORCH_CUDA_ALLOC_CONF``), each in a fresh process on one GPU: the peak allocated and reserved
bytes over the profiler's window (2 warm-up steps, then 5 steps) and over the whole run (10 steps and one
evaluation), and the mean step time. Then, per setting, it starts ``--stack`` processes of the largest
configuration at once on the same GPU and records whether each ran out of memory and the peaks it
reached: whether trials whose peaks alone sum to more than the GPU still run together (cuDNN's workspace
is elastic). Which convolution algorithms ran is not recorded.

``--capped``: instead, each configuration of the batch-16384 tail runs alone under the cap ``pack`` gives an
unprofiled trial (its static bound, :func:`hpdl.hpo.worker.cap_memory`), next to a run without the cap:
does it finish within the cap, at what peak and step time.

    PYTHONPATH=src python3 benchmarks/hpo_memory.py --out $OUT/memory.json
    PYTHONPATH=src python3 benchmarks/hpo_memory.py --capped --out $OUT/memory_capped.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

CONFIGS = [  # (width, depth, batch_size): the mixed space's batch-16384 tail and two light ones
    (32, 3, 16384), (64, 3, 16384), (32, 2, 16384), (16, 2, 16384), (64, 1, 16384), (8, 1, 16384),
    (64, 3, 512), (32, 1, 64),
]
SETTINGS = ["", "expandable_segments:True"]
GIB = 1 << 30


def _measure(cfg, alloc_conf: str, barrier, q, capped: bool = False) -> None:
    if alloc_conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    import torch

    from hpdl.hpo.profiler import CONTEXT_BYTES, static_profile
    from hpdl.hpo.worker import cap_memory
    from hpdl.hpo.workloads import get_workload

    dev = torch.device("cuda:0")
    w, d, b = cfg
    wl = get_workload("cnn")
    p = wl.resolve({"width": w, "depth": d, "batch_size": b, "image_size": 32, "val_size": 2048, "noise": 4.0})
    out = {"width": w, "depth": d, "batch_size": b, "alloc_conf": alloc_conf, "oom": False}
    if capped:  # what pack holds an unprofiled trial to: its static bound, CUDA context included
        out["cap_bytes"] = static_profile(wl, p, "static", CONTEXT_BYTES).memory_bytes
        cap_memory(dev, out["cap_bytes"], CONTEXT_BYTES)
    try:
        parts = wl.build(p, dev)
        if barrier is not None:
            barrier.wait(120)

        def step(s):
            x, y = parts.batch(s)
            loss = parts.loss(parts.model(x), y)
            parts.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            parts.optimizer.step()

        for s in range(2):
            step(s)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        t = time.perf_counter()
        for s in range(2, 7):
            step(s)
        torch.cuda.synchronize(dev)
        out["step_s"] = (time.perf_counter() - t) / 5
        out["window_allocated"] = torch.cuda.max_memory_allocated(dev)
        out["window_reserved"] = torch.cuda.max_memory_reserved(dev)
        for s in range(7, 10):
            step(s)
        parts.evaluate()
        torch.cuda.synchronize(dev)
        out["run_allocated"] = torch.cuda.max_memory_allocated(dev)
        out["run_reserved"] = torch.cuda.max_memory_reserved(dev)
    except torch.cuda.OutOfMemoryError as exc:
        out["oom"], out["error"] = True, str(exc).splitlines()[0][:200]
    except Exception as exc:  # noqa: BLE001 - reported, so the parent never waits on a dead child
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    q.put(out)


def _run(cfgs, alloc_conf: str, together: bool, capped: bool = False) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(len(cfgs)) if together else None
    procs = [ctx.Process(target=_measure, args=(c, alloc_conf, barrier, q, capped)) for c in cfgs]
    res = []
    if together:
        for p in procs:
            p.start()
        res = [q.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(60)
    else:
        for p in procs:
            p.start()
            res.append(q.get(timeout=300))
            p.join(60)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="hpo_memory.json")
    ap.add_argument("--stack", type=int, default=3, help="processes of the largest configuration at once")
    ap.add_argument("--capped", action="store_true", help="the batch-16384 tail alone, with and without the cap")
    args = ap.parse_args()
    import torch

    from hpdl.bench.common import run_metadata

    total = torch.cuda.get_device_properties(0).total_memory
    doc = run_metadata(device="cuda", total_bytes=total, solo=[], stacked=[])
    if args.capped:
        doc["capped"] = []
        for cfg in [c for c in CONFIGS if c[2] == 16384]:
            for capped in (True, False):
                r = _run([cfg], "", together=False, capped=capped)[0]
                doc["capped"].append(r)
                print(f"w{cfg[0]:2d} d{cfg[1]} b{cfg[2]} cap {r.get('cap_bytes', 0) / GIB:6.2f} GiB: "
                      f"{'OOM' if r['oom'] else r.get('error') or 'ok'}, run reserved "
                      f"{r.get('run_reserved', 0) / GIB:6.2f} GiB, step {r.get('step_s', float('nan')) * 1e3:7.1f} ms",
                      flush=True)
    settings = [] if args.capped else SETTINGS
    for conf in settings:
        for r in _run(CONFIGS, conf, together=False):
            doc["solo"].append(r)
            if r["oom"] or r.get("error"):
                print(f"{conf or 'default':28s} w{r['width']} d{r['depth']} b{r['batch_size']}: "
                      f"{'OOM' if r['oom'] else r['error']}", flush=True)
                continue
            print(f"{conf or 'default':28s} w{r['width']:2d} d{r['depth']} b{r['batch_size']:5d}: "
                  f"window alloc {r['window_allocated'] / GIB:6.2f} reserved {r['window_reserved'] / GIB:6.2f} GiB, "
                  f"run alloc {r['run_allocated'] / GIB:6.2f} reserved {r['run_reserved'] / GIB:6.2f} GiB, "
                  f"step {r['step_s'] * 1e3:7.1f} ms", flush=True)
    for conf in settings:
        big = max((r for r in doc["solo"] if "run_reserved" in r and not r["alloc_conf"]),
                  key=lambda r: r["run_reserved"])
        cfg = (big["width"], big["depth"], big["batch_size"])
        rs = _run([cfg] * args.stack, conf, together=True)
        doc["stacked"].append({"config": cfg, "alloc_conf": conf, "n": args.stack, "results": rs})
        print(f"stacked {args.stack} x w{cfg[0]} d{cfg[1]} b{cfg[2]} ({conf or 'default'}): "
              f"{sum(r['oom'] for r in rs)} OOM, run reserved "
              f"{[round(r.get('run_reserved', 0) / GIB, 1) for r in rs]} GiB of {total / GIB:.0f}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
