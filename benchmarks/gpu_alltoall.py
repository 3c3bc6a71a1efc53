"""Intra-node GPU Alltoall through a shared (symmetric / IPC) buffer, PUSH and PULL, against NCCL's
all_to_all_single, 1 KiB to 1 GiB per rank, exact #wrong per row, all in one run (seed 2's intra-node part).

Run with the device tool from the repository root (one process per GPU is spawned here):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=src python3 benchmarks/gpu_alltoall.py
Writes gpu_alltoall.json, gpu_alltoall.md and gpu_alltoall.png to $OUT (or --out) and prints the table.

Methods, all in one run on the same tensors: ``nccl`` = torch.distributed.all_to_all_single; ``push`` and
``pull`` = ``hpdl.comm.all_to_all_single(algorithm="push"|"pull")``, which on one node runs the peer-memory kernel
(hpdl.comm.algorithms.peer_alltoall: persistent buffer mapped into every GPU, one launch per call);
``push_kernel`` = that kernel called directly (the API's overhead is push - push_kernel); ``auto`` =
``hpdl.comm.all_to_all_single()`` with the auto table derived from pass 1 (at each size the fastest of push/pull
if it beats NCCL by more than 3 %, else NCCL), which pass 2 measures through the API.
Times: CUDA events around back-to-back calls, max over ranks, median of ``--repeat`` runs.
busbw = size / time * (W-1)/W (nccl-tests alltoall). #wrong counts elements off the exact expected output,
summed over ranks, checked for every method at every size before timing. Before the sweep, uneven splits
(zero-length blocks included) are checked for push and pull over float32, bfloat16, int64 and uint8.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


@dataclass
class Config:
    out: str = os.environ.get("OUT", "out")
    min_bytes: int = 1 << 10
    max_bytes: int = 1 << 30
    factor: int = 4
    repeat: int = 3
    point_seconds: float = 0.05
    port: int = 29541
    window: int = 0          # peers a block serves before it syncs its threads (0 = all): the throttle sweep
    direct: bool = False     # also time hpdl's NCCL-p2p throttled "direct" algorithm (Python-driven)


# ----------------------------------------------------------------------------------------------- helpers
def block(src: int, dst: int, n: int, device) -> torch.Tensor:
    """Elements ``src`` sends to ``dst``: integers below 2^24, exact in float32, distinct per (src, dst, i)."""
    i = torch.arange(n, device=device, dtype=torch.int64)
    return ((i * 7 + src * 1009 + dst * 131) % 65521).to(torch.float32)


def total(x: float) -> float:
    t = torch.tensor([x], device="cuda", dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_us(fn, iters: int, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        dist.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(max_over_ranks(start.elapsed_time(stop) * 1e3 / iters))
    return statistics.median(times)


def sizes(cfg: Config) -> list[int]:
    out, s = [], cfg.min_bytes
    while s <= cfg.max_bytes:
        out.append(s)
        s *= cfg.factor
    return out


def auto_rules(rows: list[dict], margin: float = 1.03) -> list[tuple[int, str]]:
    """(largest bytes per rank, method) ranges for auto: at each measured size the fastest of push/pull if it
    beats NCCL by more than ``margin`` (noise), else NCCL; adjacent sizes with one winner merge. Sizes between
    two measured points take the larger point's winner."""
    rules: list[tuple[int, str]] = []
    for r in rows:
        best = min(("push", "pull"), key=lambda m: r[f"{m}_us"])
        win = best if r["nccl_us"] > margin * r[f"{best}_us"] else "native"
        if rules and rules[-1][1] == win:
            rules[-1] = (r["size"], win)
        else:
            rules.append((r["size"], win))
    if rules:
        rules[-1] = (1 << 62, rules[-1][1])
    return rules


# ----------------------------------------------------------------------------------------------- worker
def uneven_check(rank: int, world: int, dev) -> int:
    """#wrong of push and pull against NCCL over uneven splits with zero-length blocks, four dtypes."""
    import hpdl.comm as hc

    wrong = 0
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        split = torch.randint(0, 3000, (world, world), generator=g)
        split[seed % world, (seed + 1) % world] = 0
        isp, osp = split[rank].tolist(), split[:, rank].tolist()
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
            inp = torch.randint(0, 100, (sum(isp), 3), generator=g).to(dtype).to(dev)
            want = torch.empty(sum(osp), 3, dtype=dtype, device=dev)
            dist.all_to_all_single(want, inp, osp, isp)
            for algo in ("push", "pull"):
                for _ in range(2):
                    out = torch.full_like(want, 7)
                    hc.all_to_all_single(out, inp, osp, isp, algorithm=algo)
                    torch.cuda.synchronize()
                    wrong += int((out != want).sum())
    return int(total(wrong))


def graph_check(rank: int, world: int, dev, methods: dict) -> list[dict]:
    """Each method captured 10 times in a CUDA graph (after a warm-up call registered it), replayed: #wrong
    after replay and microseconds per call inside the graph."""
    rows = []
    for size in (4 << 10, 4 << 20):
        n = size // 4
        m = n // world
        inp = torch.cat([block(rank, q, m, dev) for q in range(world)])
        want = torch.cat([block(q, rank, m, dev) for q in range(world)])
        row = {"size": size}
        wrong = 0
        for name in ("nccl", "push", "pull"):
            out = torch.empty_like(inp)
            methods[name](out, inp)   # registers buffers / plans outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(10):
                    methods[name](out, inp)
            out.fill_(-1)
            graph.replay()
            torch.cuda.synchronize()
            wrong += int((out != want).sum())
            row[f"{name}_us"] = time_us(graph.replay, 20, 3) / 10
        row["wrong"] = int(total(wrong))
        rows.append(row)
    return rows


def worker(rank: int, world: int, cfg: Config, meta: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg.port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    import hpdl.comm as hc
    from hpdl.comm.algorithms import alltoall as a2a
    from hpdl.comm.algorithms.peer_alltoall import peer_all_to_all

    uneven_wrong = uneven_check(rank, world, dev)
    if rank == 0:
        print(f"uneven splits, push+pull, 4 dtypes: #wrong {uneven_wrong}", flush=True)
    layouts = {}
    win = cfg.window or None

    def kernel(o, i):
        key = (o.numel(), i.numel())
        if key not in layouts:
            layouts[key] = a2a.make_layout(o, i, None, None, world)[0]
        peer_all_to_all(o.view(torch.uint8), i.view(torch.uint8), layouts[key], None, "push", win)

    methods = {
        "nccl": lambda o, i: dist.all_to_all_single(o, i),
        "push": lambda o, i: hc.all_to_all_single(o, i, algorithm="push", window=win),
        "pull": lambda o, i: hc.all_to_all_single(o, i, algorithm="pull", window=win),
        "push_kernel": kernel,
    }
    if cfg.direct:
        methods["direct"] = lambda o, i: hc.all_to_all_single(o, i, algorithm="direct", window=win)
    passes = []
    rule: list[tuple[int, str]] = []
    for pass_no in (1, 2):
        rows = []
        for size in sizes(cfg):
            n = size // 4  # float32 elements per rank
            n -= n % world
            m = n // world
            inp = torch.cat([block(rank, q, m, dev) for q in range(world)])
            want = torch.cat([block(q, rank, m, dev) for q in range(world)])
            out = torch.empty_like(inp)
            row = {"size": n * 4, "count": n}
            todo = dict(methods)
            if pass_no == 2:
                todo["auto"] = lambda o, i: hc.all_to_all_single(o, i)
            wrong = 0
            for name, fn in todo.items():
                try:
                    for _ in range(2):  # twice: both halves of the double buffer
                        out.fill_(-1)
                        fn(out, inp)
                        torch.cuda.synchronize()
                        wrong += int((out != want).sum())
                    iters = max(3, min(2000, int(cfg.point_seconds / max(size / 100e9, 5e-6))))
                    row[f"{name}_us"] = time_us(lambda: fn(out, inp), iters, cfg.repeat)
                except Exception as exc:  # noqa: BLE001 - recorded in the row, the sweep goes on
                    row[f"{name}_us"] = float("nan")
                    row.setdefault("errors", []).append(f"{name}: {exc!r}"[:200])
            row["wrong"] = int(total(wrong))
            rows.append(row)
            if rank == 0:
                print(f"pass {pass_no} {size:>11} B " + " ".join(f"{k}={v:.1f}" for k, v in row.items()
                                                                if k.endswith("_us")) + f" wrong={row['wrong']}",
                      flush=True)
        passes.append(rows)
        if pass_no == 1:
            rule = auto_rules(rows)
            # the library's auto table for this run, as it would be committed
            from hpdl.comm import tuning

            tuning.set_table(tuning.TuningTable(
                [tuning.Rule("cuda", b, m, max_world=world, collective="all_to_all") for b, m in rule]
                + tuning.default_table().rules, source="gpu_alltoall.py pass 1"))
            hc.reset()
    graph_rows = graph_check(rank, world, dev, methods)
    if rank == 0:
        from hpdl.comm.algorithms.peer_alltoall import _COMMS

        meta["graph"] = graph_rows
        print("CUDA graph:", graph_rows, flush=True)

        comm = next(iter(_COMMS.values()))
        meta.update(backend=comm.buffer.backend, grid=comm.grid, slot_bytes=comm.slot, uneven_wrong=uneven_wrong,
                    auto_rules=rule,
                    gpu=torch.cuda.get_device_name(dev), nccl=".".join(map(str, torch.cuda.nccl.version())),
                    torch=torch.__version__)
        report(passes[1], passes[0], world, cfg, meta)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- report
def fmt_size(n: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):g} {unit}"
    return f"{n} B"


def report(rows, first, world, cfg, meta) -> None:
    os.makedirs(cfg.out, exist_ok=True)
    factor = (world - 1) / world
    lines = [f"# GPU Alltoall on one host: shared-buffer PUSH / PULL vs NCCL all_to_all_single ({world} ranks)", "",
             f"Device: {world} x {meta['gpu']}, torch {meta['torch']}, NCCL {meta['nccl']}, buffer backend "
             f"{meta['backend']}; date {meta['date']}.", "",
             "Command: `NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=src python3 "
             "benchmarks/gpu_alltoall.py` (device tool).", "",
             f"Microseconds per call (median of {cfg.repeat} runs, max over ranks); size = bytes each rank sends "
             f"(float32); busbw = size/time x (W-1)/W. auto rules from pass 1 (bytes per rank, method): {meta['auto_rules']}. #wrong: elements "
             "off the exact expected output, all methods of the row, summed over ranks.", "",
             f"Peer buffer: backend {meta['backend']}, grid {meta['grid']} blocks, slot {meta['slot_bytes']} B; "
             f"uneven splits (push and pull, 4 dtypes, zero-length blocks): #wrong {meta['uneven_wrong']}.", "",
             "| size | nccl us | push us | pull us | push_kernel us | auto us | auto busbw GB/s | push vs nccl | "
             "pull vs nccl | auto vs nccl | #wrong |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bw = r["size"] / (r["auto_us"] * 1e-6) / 1e9 * factor if r["auto_us"] > 0 else 0.0
        lines.append(f"| {fmt_size(r['size'])} | {r['nccl_us']:.1f} | {r['push_us']:.1f} | {r['pull_us']:.1f} | "
                     f"{r['push_kernel_us']:.1f} | {r['auto_us']:.1f} | {bw:.1f} | {r['nccl_us'] / r['push_us']:.2f}x | "
                     f"{r['nccl_us'] / r['pull_us']:.2f}x | {r['nccl_us'] / r['auto_us']:.2f}x | {r['wrong']} |")
    lines += ["", "In a CUDA graph (10 calls captured, replayed; us per call, #wrong after replay):", "",
              "| size | nccl us | push us | pull us | #wrong |", "|---|---|---|---|---|"]
    lines += [f"| {fmt_size(g['size'])} | {g['nccl_us']:.1f} | {g['push_us']:.1f} | {g['pull_us']:.1f} | {g['wrong']} |"
              for g in meta.get("graph", [])]
    errs = [e for r in rows + first for e in r.get("errors", [])]
    if errs:
        lines += ["", "Errors:", *[f"- {e}" for e in errs]]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(cfg.out, "gpu_alltoall.md"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(cfg.out, "gpu_alltoall.json"), "w") as fh:
        json.dump({"meta": meta, "config": asdict(cfg), "pass1": first, "pass2": rows}, fh, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        xs = [r["size"] for r in rows]
        for name in ("nccl", "push", "pull", "auto"):
            ax1.plot(xs, [r[f"{name}_us"] for r in rows], marker="o", ms=3, label=name)
            ax2.plot(xs, [r["nccl_us"] / r[f"{name}_us"] for r in rows], marker="o", ms=3, label=name)
        for ax, lab in ((ax1, "latency (us)"), (ax2, "speed-up over NCCL")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("bytes per rank")
            ax.set_ylabel(lab)
            ax.grid(True, alpha=0.3)
            ax.legend()
        ax1.set_yscale("log")
        fig.suptitle(f"Alltoall, {world} x {meta['gpu']}")
        fig.tight_layout()
        fig.savefig(os.path.join(cfg.out, "gpu_alltoall.png"), dpi=120)
    except Exception as exc:  # noqa: BLE001 - the table is the result; the plot is a convenience
        print(f"plot failed: {exc!r}", file=sys.stderr)


def main(argv=None) -> int:
    from datetime import datetime, timezone

    cfg = Config()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for k, v in asdict(cfg).items():
        kind = (lambda x: x.lower() in ("1", "true", "yes")) if isinstance(v, bool) else type(v)
        ap.add_argument("--" + k.replace("_", "-"), type=kind, default=v)
    cfg = Config(**vars(ap.parse_args(argv)))
    world = torch.cuda.device_count()
    if world < 2:
        print("needs at least 2 GPUs", file=sys.stderr)
        return 2
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "world": world}
    mp.spawn(worker, args=(world, cfg, meta), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
