"""Device check of hpdl.comm.all_reduce's CUDA paths through the public API (2+ GPUs, one node).

Run: NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 benchmarks/cuda_api_check.py
Checks exact results (#wrong) for auto/one_shot/two_shot/direct/ring/staged/native over dtypes and odd sizes,
async_op on the side stream overlapped with a matmul, and the eager latency of the API's fast path vs the
kernel entry point and NCCL (CUDA events, 8 B - 64 KiB, bf16).
"""
import os
import time

import torch
import torch.distributed as dist

import hpdl.comm as hc
from hpdl.bench.verify import expected, make_input
from hpdl.runtime import spawn


def check(ctx):
    p, r, dev = ctx.world_size, ctx.rank, ctx.device
    bad = []
    for algo in ["auto", "one_shot", "two_shot", "direct", "ring", "recursive_doubling", "staged", "native"]:
        for dtype in [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64, torch.uint8]:
            if algo in ("one_shot", "two_shot") and dtype in (torch.float64, torch.uint8):
                continue
            for op in ["sum", "max", "product"] + (["avg"] if dtype.is_floating_point else []):
                for n in [0, 1, 3, 1025, 65537, (1 << 20) + 3]:
                    x = make_input(r, n, op, dtype, seed=n, device=dev)
                    hc.all_reduce(x, op=op, algorithm=algo)
                    w = int((x.cpu() != expected(p, n, op, dtype, seed=n)).sum())
                    if w:
                        bad.append((algo, str(dtype), op, n, w))
    # async on the side stream, overlapped with a matmul on the current stream
    a = torch.randn(4096, 4096, device=dev)
    xs = [make_input(r, 1 << 22, "sum", torch.bfloat16, seed=i, device=dev) for i in range(4)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    works = [hc.all_reduce(x, async_op=True) for x in xs]
    b = a @ a
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    overlap_ms = (time.perf_counter() - t0) * 1e3
    for i, x in enumerate(xs):
        w = int((x.cpu() != expected(p, 1 << 22, "sum", torch.bfloat16, seed=i)).sum())
        if w:
            bad.append(("async", i, w))
    # eager latency: API fast path vs NCCL
    lat = {}
    for nbytes in [8, 1024, 65536, 1 << 20]:
        x = torch.ones(max(nbytes // 2, 1), dtype=torch.bfloat16, device=dev)
        for name, fn in [("hpdl_auto", lambda: hc.all_reduce(x)),
                         ("nccl", lambda: dist.all_reduce(x))]:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(200):
                fn()
            e.record()
            torch.cuda.synchronize()
            lat[(nbytes, name)] = s.elapsed_time(e) * 1e3 / 200
    return bad, overlap_ms, lat


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    out = spawn(check, torch.cuda.device_count(), device="cuda", timeout=300)
    bad, overlap, lat = out[0]
    print("wrong:", bad if bad else "none", "| other ranks:", [o[0] for o in out[1:]])
    print(f"async x4 (16 MiB bf16) + 4096^3 matmul: {overlap:.2f} ms")
    for nbytes in [8, 1024, 65536, 1 << 20]:
        print(f"{nbytes:>8} B  hpdl auto {lat[(nbytes, 'hpdl_auto')]:7.1f} us   nccl {lat[(nbytes, 'nccl')]:7.1f} us")
