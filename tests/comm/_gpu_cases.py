"""Rank-side bodies of test_comm_gpu.py (2+ CUDA GPUs of one node, NCCL), ported from the former
benchmarks/cuda_api_check.py and benchmarks/cuda_alltoall_check.py: exact results against torch.distributed
(NCCL) on the same inputs, #wrong summed over ranks."""

import torch
import torch.distributed as dist

import hpdl.comm as hc
from hpdl.bench.verify import expected, make_input


def all_reduce_cases(ctx):
    """Every CUDA path of all_reduce through the public API over dtypes, ops and odd sizes; async on the side
    stream beside a matmul; async beside torch's own all_reduce (call order). Returns a list of failures."""
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
    a = torch.randn(2048, 2048, device=dev)
    xs = [make_input(r, 1 << 22, "sum", torch.bfloat16, seed=i, device=dev) for i in range(4)]
    works = [hc.all_reduce(x, async_op=True) for x in xs]
    a @ a
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    for i, x in enumerate(xs):
        w = int((x.cpu() != expected(p, 1 << 22, "sum", torch.bfloat16, seed=i)).sum())
        if w:
            bad.append(("async", i, w))
    for algo in ("auto", "native", "one_shot", "two_shot"):
        for i in range(30):
            a = torch.full((1 << 18,), float(r + 1 + i), device=dev)
            b = torch.full((1 << 18,), float(10 * (r + 1) + i), device=dev)
            w = hc.all_reduce(a, async_op=True, algorithm=algo)
            dist.all_reduce(b)
            w.wait()
            torch.cuda.synchronize()
            if (a != sum(q + 1 + i for q in range(p))).any() or (b != sum(10 * (q + 1) + i for q in range(p))).any():
                bad.append(("interleaved with torch", algo, i))
    return bad


def rows_for(rank: int, world: int, seed: int, big: bool) -> list[int]:
    g = torch.Generator().manual_seed(seed * 131 + rank)
    hi = 400_000 if big else 3000
    out = torch.randint(0, hi, (world,), generator=g).tolist()
    out[(rank + seed) % world] = 0   # a zero-length block in every layout
    return out


def layout(rank: int, world: int, seed: int, big: bool = False) -> tuple[list[int], list[int]]:
    """(input_split_sizes, output_split_sizes) of this rank; consistent across ranks (the matrix is shared)."""
    m = [rows_for(q, world, seed, big) for q in range(world)]   # m[q][p]: rows rank q sends to rank p
    return m[rank], [m[q][rank] for q in range(world)]


def make(isp, row, dtype, rank, seed, dev):
    n = sum(isp)
    x = torch.arange(n * row, device=dev, dtype=torch.int64).view(n, row)
    return ((x * 7 + rank * 1009 + seed * 31) % 251).to(dtype)


def nccl_ref(inp, isp, osp):
    """torch.distributed's all_to_all_single (NCCL; gloo on host copies when ranks share a GPU)."""
    if dist.get_backend() == "gloo":
        want = torch.empty((sum(osp),) + tuple(inp.shape[1:]), dtype=inp.dtype)
        dist.all_to_all_single(want, inp.cpu(), osp, isp)
        return want.to(inp.device)
    want = torch.empty((sum(osp),) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    dist.all_to_all_single(want, inp, osp, isp)
    return want


def wrong(out, want) -> int:
    return int((out != want).sum())


def alltoall_cases(ctx):
    r, w, dev = ctx.rank, ctx.world_size, ctx.device
    res = {}

    def case(name, fn):
        try:
            bad = fn()
        except Exception as exc:  # noqa: BLE001 - a failing case is reported, the others still run
            bad = f"error {exc!r}"[:160]
        res[name] = bad

    def empty_input():
        bad = 0
        for algo in ("auto", "push", "pull"):
            isp = [0] * w if r == 0 else [5] * w   # rank 0 sends nothing but receives from everyone
            isp[r] = 0
            osp = [0 if q == 0 or q == r else 5 for q in range(w)]
            inp = make(isp, 3, torch.float32, r, 1, dev)
            want = nccl_ref(inp, isp, osp)
            out = torch.full_like(want, -1)
            hc.all_to_all_single(out, inp, osp, isp, algorithm=algo)
            torch.cuda.synchronize()
            bad += wrong(out, want)
        return bad

    def uneven_multi_round():
        bad = 0
        for seed in range(3):
            isp, osp = layout(r, w, seed, big=True)
            for dtype, row in ((torch.float32, 3), (torch.bfloat16, 5), (torch.int64, 1), (torch.uint8, 7)):
                inp = make(isp, row, dtype, r, seed, dev)
                want = nccl_ref(inp, isp, osp)
                for algo in ("push", "pull"):
                    for _ in range(2):
                        out = torch.full_like(want, 3)
                        hc.all_to_all_single(out, inp, osp, isp, algorithm=algo)
                        torch.cuda.synchronize()
                        bad += wrong(out, want)
        return bad

    def hot_path_shapes_dtypes():
        bad = 0
        for i in range(12):
            seed = i % 3
            dtype = (torch.float32, torch.bfloat16)[i % 2]
            isp, osp = layout(r, w, seed)
            inp = make(isp, 2, dtype, r, seed, dev)
            want = nccl_ref(inp, isp, osp)
            out = torch.full_like(want, 9)
            hc.all_to_all_single(out, inp, osp, isp)
            bad += wrong(out, want)
        torch.cuda.synchronize()
        return bad

    def non_contiguous_output():
        inp = make([4] * w, 6, torch.float32, r, 2, dev)
        want = nccl_ref(inp, [4] * w, [4] * w)
        base = torch.zeros(6, 4 * w, device=dev)
        out = base.t()   # (4w, 6), not contiguous
        hc.all_to_all_single(out, inp, algorithm="push")
        torch.cuda.synchronize()
        return wrong(out, want)

    def async_mixes():
        bad = 0
        isp, osp = layout(r, w, 0)
        inp = make(isp, 4, torch.float32, r, 0, dev)
        want = nccl_ref(inp, isp, osp)
        outs = [torch.full_like(want, -2) for _ in range(4)]
        hc.all_to_all_single(outs[0], inp, osp, isp, algorithm="push")               # registers the hot path
        work = hc.all_to_all_single(outs[1], inp, osp, isp, algorithm="push", async_op=True)
        hc.all_to_all_single(outs[2], inp, osp, isp, algorithm="push")               # after the async one
        work.wait()
        x = torch.full((1 << 16,), float(r + 1), device=dev)
        ar = hc.all_reduce(x, async_op=True)                                          # side-stream all-reduce
        hc.all_to_all_single(outs[3], inp, osp, isp, algorithm="push")               # ordered after it
        ar.wait()
        torch.cuda.synchronize()
        bad += sum(wrong(o, want) for o in outs)
        bad += int((x != w * (w + 1) / 2).sum())
        return bad

    def graph_uneven():
        isp, osp = layout(r, w, 1, big=True)
        inp = make(isp, 2, torch.bfloat16, r, 1, dev)
        want = nccl_ref(inp, isp, osp)
        out = torch.full_like(want, 1)
        hc.all_to_all_single(out, inp, osp, isp, algorithm="push")   # registers outside capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(3):
                hc.all_to_all_single(out, inp, osp, isp, algorithm="push")
        out.fill_(0)
        g.replay()
        g.replay()
        torch.cuda.synchronize()
        return wrong(out, want)

    def push_pull_alternating_window1():
        bad = 0
        for i in range(8):
            isp, osp = layout(r, w, i % 3, big=i % 2 == 0)
            inp = make(isp, 1, torch.float32, r, i, dev)
            want = nccl_ref(inp, isp, osp)
            out = torch.full_like(want, 4)
            hc.all_to_all_single(out, inp, osp, isp, algorithm=("push", "pull")[i % 2], window=1 if i > 3 else None)
            torch.cuda.synchronize()
            bad += wrong(out, want)
        return bad

    def release_and_reuse():
        from hpdl.comm.algorithms import peer_alltoall

        isp, osp = layout(r, w, 2)
        inp = make(isp, 2, torch.float32, r, 2, dev)
        want = nccl_ref(inp, isp, osp)
        out = torch.full_like(want, 5)
        hc.all_to_all_single(out, inp, osp, isp, algorithm="push")
        torch.cuda.synchronize()
        peer_alltoall.release(None)
        out.fill_(5)
        hc.all_to_all_single(out, inp, osp, isp, algorithm="push")   # cached call steps aside, re-registers
        torch.cuda.synchronize()
        return wrong(out, want)

    for name, fn in [("empty input (auto, push, pull)", empty_input),
                     ("uneven multi-round, 4 dtypes, odd rows", uneven_multi_round),
                     ("hot path, changing shapes and dtypes (auto)", hot_path_shapes_dtypes),
                     ("non-contiguous output", non_contiguous_output),
                     ("async, sync after async, after async all_reduce", async_mixes),
                     ("CUDA graph, uneven splits", graph_uneven),
                     ("push/pull alternating, window 1", push_pull_alternating_window1),
                     ("release and reuse", release_and_reuse)]:
        case(name, fn)
        t = torch.tensor([res[name] if isinstance(res[name], int) else -1], device=dev, dtype=torch.int64)
        dist.all_reduce(t)   # a failing rank shows as a negative sum
        res[name] = res[name] if isinstance(res[name], str) else int(t.item())
    return res
