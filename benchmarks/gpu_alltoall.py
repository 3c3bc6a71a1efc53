"""Intra-node GPU Alltoall through a shared (symmetric / IPC) buffer, PUSH and PULL, against NCCL's
all_to_all_single, 1 KiB to 1 GiB per rank, exact #wrong per row, all in one run (seed 2's intra-node part).

Run with the device tool from the repository root (one process per GPU is spawned here):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=src python3 benchmarks/gpu_alltoall.py
Writes gpu_alltoall.json, gpu_alltoall.md and gpu_alltoall.png to $OUT (or --out) and prints the table.

Design (docs/comm_two_level.md): every rank allocates one persistent buffer of 2 x max-bytes, mapped into every
peer (torch symmetric memory: ``symm_mem.empty`` + ``rendezvous``; fallback CUDA IPC handles with an NCCL
1-element all-reduce as barrier). Calls alternate between the two halves, so one barrier per call suffices
(a peer reuses a half only after the next call's barrier, which every rank reaches after reading it).
* PUSH: rank r copies its block for q straight into q's buffer (slot r) over NVLink; barrier; each rank copies
  the blocks that arrived into its output (local HBM copy).
* PULL: rank r copies (exposes) its input into its own buffer; barrier; each rank reads its block from every
  peer's buffer into its output over NVLink.
Copies are cudaMemcpyAsync on UVA peer pointers (copy engines); the barrier is symm_mem's device barrier.
Times: CUDA events around back-to-back calls, max over ranks, median of ``--repeat`` runs.
``auto`` = the rule chosen from a first pass (NCCL below the smallest size from which the best of push/pull beats
NCCL at every larger size, that method above), then measured in the second pass with the others.
busbw = size / time * (W-1)/W (nccl-tests alltoall). #wrong counts elements off the exact expected output,
summed over ranks, checked for every method at every size before timing.
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


# ----------------------------------------------------------------------------------------------- buffers
class SharedBuffer:
    """2 x ``nbytes`` per rank, visible to every rank of the (one-node) world: ``peer(q, half)`` views."""

    def __init__(self, nbytes: int, rank: int, world: int, device: torch.device):
        self.nbytes, self.rank, self.world = nbytes, rank, world
        self.backend = None
        errors = []
        try:
            import torch.distributed._symmetric_memory as symm_mem

            self.local = symm_mem.empty(2 * nbytes, dtype=torch.uint8, device=device)
            self.handle = symm_mem.rendezvous(self.local, dist.group.WORLD.group_name)
            # the tensor may sit inside a larger symmetric allocation: same offset on every rank
            offset = self.local.data_ptr() - int(self.handle.buffer_ptrs[rank])
            if offset < 0 or offset + 2 * nbytes > int(self.handle.buffer_size):
                raise RuntimeError(f"symmetric tensor at offset {offset} outside its allocation")
            self.peers = [self.local if q == rank else
                          self.handle.get_buffer(q, (2 * nbytes,), torch.uint8, storage_offset=offset)
                          for q in range(world)]
            self.backend = "symm_mem"
        except Exception as exc:  # noqa: BLE001 - fall back to plain CUDA IPC
            errors.append(f"symm_mem: {exc!r}")
            from torch.multiprocessing.reductions import reduce_tensor

            self.local = torch.empty(2 * nbytes, dtype=torch.uint8, device=device)
            torch.cuda.synchronize()
            handles: list = [None] * world
            dist.all_gather_object(handles, reduce_tensor(self.local))
            self.peers = [self.local if q == rank else fn(*args) for q, (fn, args) in enumerate(handles)]
            self.handle = None
            self._flag = torch.zeros(1, device=device)
            self.backend = "cuda_ipc"
        self.errors = errors

    def view(self, q: int, half: int) -> torch.Tensor:
        return self.peers[q][half * self.nbytes:(half + 1) * self.nbytes]

    def barrier(self) -> None:
        """Stream-ordered barrier: work queued before it on every rank is done before work queued after it."""
        if self.handle is not None:
            self.handle.barrier(channel=0)
        else:
            dist.all_reduce(self._flag)


class Alltoall:
    """Equal-split all_to_all_single through :class:`SharedBuffer`, ``push`` or ``pull``."""

    def __init__(self, buf: SharedBuffer):
        self.buf, self.calls = buf, 0

    def __call__(self, out: torch.Tensor, inp: torch.Tensor, mode: str) -> None:
        r, w, buf = self.buf.rank, self.buf.world, self.buf
        src, dst = inp.view(torch.uint8), out.view(torch.uint8)
        b = src.numel() // w
        half = self.calls % 2
        self.calls += 1
        dst[r * b:(r + 1) * b].copy_(src[r * b:(r + 1) * b])
        if mode == "push":
            for d in range(1, w):
                q = (r + d) % w  # start at a different peer on every rank: spread the NVLink load
                buf.view(q, half)[r * b:(r + 1) * b].copy_(src[q * b:(q + 1) * b])
            buf.barrier()
            for d in range(1, w):
                q = (r - d) % w
                dst[q * b:(q + 1) * b].copy_(buf.view(r, half)[q * b:(q + 1) * b])
        elif mode == "pull":
            buf.view(r, half)[: src.numel()].copy_(src)
            buf.barrier()
            for d in range(1, w):
                q = (r - d) % w
                dst[q * b:(q + 1) * b].copy_(buf.view(q, half)[r * b:(r + 1) * b])
        else:
            raise ValueError(f"mode must be 'push' or 'pull', got {mode!r}")


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


def auto_rule(rows: list[dict]) -> tuple[int | None, str]:
    """(threshold, method): NCCL below the threshold, ``method`` (push or pull) from it on."""
    best = {}
    for method in ("push", "pull"):
        wins = [r["size"] for r in rows if r[f"{method}_us"] < r["nccl_us"]]
        start = next((s for s in wins if all(r[f"{method}_us"] < r["nccl_us"] for r in rows if r["size"] >= s)),
                     None)
        best[method] = start
    cands = [(s, m) for m, s in best.items() if s is not None]
    return min(cands) if cands else (None, "nccl")


# ----------------------------------------------------------------------------------------------- worker
def worker(rank: int, world: int, cfg: Config, meta: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg.port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    buf = SharedBuffer(cfg.max_bytes, rank, world, dev)
    a2a = Alltoall(buf)
    import hpdl.comm as hc

    methods = {
        "nccl": lambda o, i: dist.all_to_all_single(o, i),
        "push": lambda o, i: a2a(o, i, "push"),
        "pull": lambda o, i: a2a(o, i, "pull"),
        # the public API as wired now (auto -> NCCL on CUDA): its overhead over the raw call
        "api_auto": lambda o, i: hc.all_to_all_single(o, i, check=False),
    }
    passes = []
    rule = (None, "nccl")
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
                thr, meth = rule
                todo["auto"] = methods[meth] if thr is not None and n * 4 >= thr else methods["nccl"]
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
            rule = auto_rule(rows)
    if rank == 0:
        meta.update(backend=buf.backend, backend_errors=buf.errors, auto_rule={"threshold": rule[0],
                                                                               "method": rule[1]},
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
             f"(float32); busbw = size/time x (W-1)/W. auto rule from pass 1: {meta['auto_rule']}. #wrong: elements "
             "off the exact expected output, all methods of the row, summed over ranks.", "",
             "`api_auto` = `hpdl.comm.all_to_all_single(algorithm=\"auto\")` as wired at the time of the run.", "",
             "| size | nccl us | push us | pull us | auto us | api_auto us | auto busbw GB/s | push vs nccl | "
             "pull vs nccl | auto vs nccl | #wrong |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bw = r["size"] / (r["auto_us"] * 1e-6) / 1e9 * factor if r["auto_us"] > 0 else 0.0
        lines.append(f"| {fmt_size(r['size'])} | {r['nccl_us']:.1f} | {r['push_us']:.1f} | {r['pull_us']:.1f} | "
                     f"{r['auto_us']:.1f} | {r['api_auto_us']:.1f} | {bw:.1f} | {r['nccl_us'] / r['push_us']:.2f}x | "
                     f"{r['nccl_us'] / r['pull_us']:.2f}x | {r['nccl_us'] / r['auto_us']:.2f}x | {r['wrong']} |")
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
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
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
