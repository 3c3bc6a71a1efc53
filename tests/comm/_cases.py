"""Rank-side bodies for the comm tests (module-level so spawned ranks can unpickle them)."""

import hashlib

import torch

import hpdl.comm as hc
from hpdl.bench.verify import expected, make_input

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
OPS = ["sum", "avg", "min", "max", "product"]


def counts_for(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), p + 1, 97, 127, 129})


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def all_reduce_matrix(ctx, algorithm):
    """Every dtype x op x count; returns (failures, digests) so the parent can compare ranks bitwise."""
    p, r = ctx.world_size, ctx.rank
    failures, digests = [], []
    for dtype in DTYPES:
        for op in OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue
            for count in counts_for(p):
                x = make_input(r, count, op, dtype, seed=count)
                # the argument check costs a round; run it on one count per case, the schedules on all
                hc.all_reduce(x, op=op, algorithm=algorithm, check=count == p + 1)
                want = expected(p, count, op, dtype, seed=count)
                wrong = int((x != want).sum())
                if wrong:
                    failures.append(f"{algorithm} {dtype} {op} count={count}: {wrong} wrong")
                digests.append(digest(x))
    return failures, digests


def all_reduce_large(ctx, algorithm, count, dtype, op):
    x = make_input(ctx.rank, count, op, dtype, seed=3)
    hc.all_reduce(x, op=op, algorithm=algorithm)
    return int((x != expected(ctx.world_size, count, op, dtype, seed=3)).sum()), digest(x)


def non_contiguous(ctx, algorithm):
    """A strided view inside a larger tensor: the view is reduced, the elements around it stay untouched."""
    p, r = ctx.world_size, ctx.rank
    base = torch.full((9, 14), -77.0)
    view = base[1:8, 2:13:2].t()  # shape (6, 7), not contiguous
    n = view.numel()
    view.copy_(make_input(r, n, "sum", torch.float32, seed=1).view(view.shape))
    guard = base.clone()
    hc.all_reduce(view, op="sum", algorithm=algorithm)
    want = expected(p, n, "sum", torch.float32, seed=1).view(view.shape)
    mask = torch.ones_like(base, dtype=torch.bool)
    mask[1:8, 2:13:2] = False
    return int((view != want).sum()), int((base[mask] != guard[mask]).sum())


def back_to_back(ctx, algorithm, calls=25):
    p, r = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(1234)  # same sequence of sizes on every rank
    wrong = 0
    for i in range(calls):
        count = int(torch.randint(0, 5000, (1,), generator=g))
        dtype = DTYPES[i % len(DTYPES)]
        x = make_input(r, count, "max" if i % 3 else "sum", dtype, seed=i)
        hc.all_reduce(x, op="max" if i % 3 else "sum", algorithm=algorithm)
        wrong += int((x != expected(p, count, "max" if i % 3 else "sum", dtype, seed=i)).sum())
    return wrong


def async_ops(ctx, algorithm):
    p, r = ctx.world_size, ctx.rank
    xs = [make_input(r, 1000 + i, "sum", torch.float32, seed=i) for i in range(4)]
    works = [hc.all_reduce(x, algorithm=algorithm, async_op=True) for x in xs]
    y = make_input(r, 10, "sum", torch.float32, seed=9)
    hc.all_reduce(y, algorithm=algorithm)  # a sync call after async ones runs after them, in order
    done_before = all(w.is_completed() for w in works)
    for w in works:
        assert w.wait() is True
    wrong = sum(int((x != expected(p, 1000 + i, "sum", torch.float32, seed=i)).sum()) for i, x in enumerate(xs))
    wrong += int((y != expected(p, 10, "sum", torch.float32, seed=9)).sum())
    return wrong, done_before


def reduce_scatter_all_gather(ctx, algorithm):
    p, r = ctx.world_size, ctx.rank
    failures = []
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        for op in ("sum", "max", "product"):
            for m in (0, 1, 17):
                inp = make_input(r, m * p, op, dtype, seed=m)
                out = torch.empty(m, dtype=dtype)
                hc.reduce_scatter(out, inp, op=op, algorithm=algorithm)
                want = expected(p, m * p, op, dtype, seed=m)[r * m:(r + 1) * m]
                if (out != want).any():
                    failures.append(f"reduce_scatter {algorithm} {dtype} {op} m={m}")
                if (inp != make_input(r, m * p, op, dtype, seed=m)).any():
                    failures.append(f"reduce_scatter {algorithm} modified its input")
            m = 5
            mine = make_input(r, m, "max", dtype, seed=r)
            out = torch.empty(m * p, dtype=dtype)
            hc.all_gather(out, mine, algorithm=algorithm)
            want = torch.cat([make_input(q, m, "max", dtype, seed=q) for q in range(p)])
            if (out != want).any():
                failures.append(f"all_gather {algorithm} {dtype}")
    return failures
