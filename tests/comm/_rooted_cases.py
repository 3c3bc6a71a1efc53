"""Rank-side bodies for test_comm_rooted.py: broadcast, reduce and barrier against torch.distributed (issue 37)."""

import os
import time

import torch
import torch.distributed as dist

import hpdl.comm as hc
from hpdl.bench.verify import expected, make_input
from hpdl.comm.ops import to_torch_op

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
OPS = ["sum", "avg", "min", "max", "product"]


def counts_for(p: int) -> list[int]:
    return sorted({0, 1, p + 1, 97})


def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return type(exc).__name__, str(exc)
    return None, ""


def broadcast_matrix(ctx, algorithm, dtypes=None):
    """Every dtype (bool and complex64 too) x count x root: each rank ends bitwise equal to the root's input and
    to what torch.distributed.broadcast gives for the same call. Returns the failures."""
    p, r = ctx.world_size, ctx.rank
    fails = []
    for dtype in dtypes or DTYPES + [torch.bool, torch.complex64]:
        for count in counts_for(p):
            for root in sorted({0, p - 1}):
                mine = make_input(r, count, "max", dtype, seed=count)
                x, ref = mine.clone(), mine.clone()
                hc.broadcast(x, root, algorithm=algorithm, check=count == p + 1)
                dist.broadcast(ref, root)
                want = make_input(root, count, "max", dtype, seed=count)
                if not (torch.equal(x, want) and torch.equal(x, ref)):
                    fails.append(f"broadcast {algorithm} {dtype} count={count} root={root}")
    return fails


def reduce_matrix(ctx, algorithm, dtypes=None):
    """Every dtype x op x count x root: the root holds the exact reduction (equal to torch.distributed.reduce's,
    where gloo has the op), every other rank its input unchanged."""
    p, r = ctx.world_size, ctx.rank
    fails = []
    for dtype in dtypes or DTYPES:
        for op in OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue
            for count in counts_for(p):
                for root in sorted({0, p - 1}):
                    mine = make_input(r, count, op, dtype, seed=count)
                    x = mine.clone()
                    hc.reduce(x, root, op, algorithm=algorithm, check=count == p + 1)
                    want = expected(p, count, op, dtype, seed=count) if r == root else mine
                    ok = torch.equal(x, want)
                    if op != "avg":   # torch.distributed is the oracle (gloo has no avg)
                        ref = mine.clone()
                        dist.reduce(ref, root, to_torch_op(op))
                        ok = ok and (r != root or torch.equal(x, ref))
                    if not ok:
                        fails.append(f"reduce {algorithm} {dtype} {op} count={count} root={root}")
    return fails


def strided_and_async(ctx, algorithm):
    """A strided view (written back, its surroundings untouched) and async calls issued back to back with
    torch's own all_reduce between them, waited in reverse order: all exact."""
    p, r = ctx.world_size, ctx.rank
    fails = []
    base = torch.full((9, 14), -77.0)
    view = base[1:8, 2:13:2].t()
    view.copy_(make_input(r, view.numel(), "sum", torch.float32, seed=1).view(view.shape))
    guard = base.clone()
    hc.broadcast(view, p - 1, algorithm=algorithm)
    mask = torch.ones_like(base, dtype=torch.bool)
    mask[1:8, 2:13:2] = False
    if not torch.equal(view, make_input(p - 1, view.numel(), "sum", torch.float32, seed=1).view(view.shape)) or \
            not torch.equal(base[mask], guard[mask]):
        fails.append("strided broadcast")
    view.copy_(make_input(r, view.numel(), "sum", torch.float32, seed=2).view(view.shape))
    hc.reduce(view, 0, "sum", algorithm=algorithm)
    want = expected(p, view.numel(), "sum", torch.float32, seed=2) if r == 0 else \
        make_input(r, view.numel(), "sum", torch.float32, seed=2)
    if not torch.equal(view.reshape(-1), want.view(view.shape).reshape(-1)):
        fails.append("strided reduce")
    xs = [make_input(r, 100 + i, "sum", torch.float32, seed=i) for i in range(4)]
    works, side = [], torch.full((5,), float(r))
    for i, x in enumerate(xs):
        if i % 2:
            works.append(hc.reduce(x, i % p, "sum", None, True, algorithm=algorithm))
        else:
            works.append(hc.broadcast(x, i % p, None, True, algorithm=algorithm))
        dist.all_reduce(side)
    works.append(hc.barrier(None, True, algorithm="native" if algorithm == "native" else "auto"))
    for w in reversed(works):
        assert w.wait() is True
    for i, x in enumerate(xs):
        root = i % p
        if i % 2:
            want = expected(p, 100 + i, "sum", torch.float32, seed=i) if r == root else \
                make_input(r, 100 + i, "sum", torch.float32, seed=i)
        else:
            want = make_input(root, 100 + i, "sum", torch.float32, seed=i)
        if not torch.equal(x, want):
            fails.append(f"async call {i}")
    if not torch.equal(side, torch.full((5,), float(sum(range(p))) * p ** 3)):
        fails.append(f"torch all_reduce between async calls: {side.tolist()}")
    return fails


def subgroup(ctx, algorithm):
    """A group of ranks 1..p-1: ``src``/``dst`` are global ranks as in c10d, ``group_src``/``group_dst`` ranks of
    the group; a global rank outside the group is a ValueError before any communication."""
    p, r = ctx.world_size, ctx.rank
    ranks = list(range(1, p))
    g = dist.new_group(ranks)
    if r not in ranks:
        return []
    fails = []
    x = torch.full((7,), float(r))
    hc.broadcast(x, p - 1, g, algorithm=algorithm)              # global rank p-1
    if not torch.equal(x, torch.full((7,), float(p - 1))):
        fails.append(f"broadcast src=global {p - 1}: {x.tolist()}")
    x = torch.full((7,), float(r))
    hc.broadcast(x, group=g, group_src=0, algorithm=algorithm)  # group rank 0 = global rank 1
    if not torch.equal(x, torch.full((7,), 1.0)):
        fails.append(f"broadcast group_src=0: {x.tolist()}")
    y = torch.full((3,), float(r))
    hc.reduce(y, 1, "sum", g, algorithm=algorithm)
    want = float(sum(ranks)) if r == 1 else float(r)
    if not torch.equal(y, torch.full((3,), want)):
        fails.append(f"reduce dst=global 1: {y.tolist()}")
    name, msg = _catch(lambda: hc.broadcast(torch.ones(2), 0, g, algorithm=algorithm))
    if name != "ValueError" or "src=0 is not a rank of the group" not in msg:
        fails.append(f"src outside the group: {name} {msg}")
    hc.barrier(g)
    hc.forget_group(g)
    return fails


def misuse(ctx):
    """Arguments refused before communicating (each error names the argument), and a root that differs
    across ranks caught by the argument check."""
    p, r = ctx.world_size, ctx.rank
    t = torch.ones(4)
    out = {
        "no_root": _catch(lambda: hc.broadcast(t)),
        "both_roots": _catch(lambda: hc.broadcast(t, 0, group_src=0)),
        "root_range": _catch(lambda: hc.reduce(t, p)),
        "root_type": _catch(lambda: hc.broadcast(t, 0.0)),
        "algorithm": _catch(lambda: hc.broadcast(t, 0, algorithm="ring")),
        "barrier_algorithm": _catch(lambda: hc.barrier(algorithm="binomial")),
        "avg_int": _catch(lambda: hc.reduce(torch.ones(3, dtype=torch.int32), 0, "avg")),
        "old_order": _catch(lambda: hc.reduce(t, 0, "sum", None, "binomial")),
        "device_ids": _catch(lambda: hc.barrier(device_ids="0")),
        "timeout": _catch(lambda: hc.barrier(timeout=0)),
    }
    out["mismatch"] = _catch(lambda: hc.broadcast(torch.ones(4), r % 2, check=True, timeout=30))
    out["world"] = p
    hc.barrier()
    return out


def everything(ctx, algorithms, barriers, folder):
    """One pool call per world size (a pool start costs more than the calls): every body above, for each
    algorithm; returns the failures."""
    fails = []
    for algorithm, dtypes in algorithms:   # dtypes None = all of them
        dtypes = dtypes and [getattr(torch, d) for d in dtypes]
        fails += broadcast_matrix(ctx, algorithm, dtypes) + reduce_matrix(ctx, algorithm, dtypes) + \
            strided_and_async(ctx, algorithm)
    for i, (algorithm, use_async) in enumerate(barriers):
        sub = os.path.join(folder, str(i))
        if ctx.rank == 0:
            os.makedirs(sub)
        dist.barrier()
        seen = barrier_waits(ctx, algorithm, use_async, sub)
        if seen != list(range(ctx.world_size)):
            fails.append(f"barrier {algorithm} async={use_async}: rank {ctx.rank} saw only {seen}")
    return fails


def barrier_waits(ctx, algorithm, use_async, folder):
    """Every rank leaves the file it makes before entering the barrier; rank 0 enters last (after a delay).
    After the barrier, every rank must see all the files: no rank passed before all had entered."""
    p, r = ctx.world_size, ctx.rank
    if r == 0:
        time.sleep(0.5)
    open(os.path.join(folder, f"{r}"), "w").close()
    w = hc.barrier(None, use_async, algorithm=algorithm)
    if use_async:
        w.wait()
    else:
        assert w is None
    seen = sorted(int(n) for n in os.listdir(folder) if n.isdigit())
    hc.barrier(algorithm=algorithm)   # nobody removes or rewrites while a peer still looks
    return seen


def outside_and_numpy_roots(ctx):
    """As c10d: a rank outside ``group`` gets None from broadcast/reduce/barrier (a warning, no error), and a
    numpy integer root is a rank like an int."""
    import warnings

    import numpy as np

    p, r = ctx.world_size, ctx.rank
    out = {}
    x = torch.full((3,), float(r))
    out["numpy_src"] = _catch(lambda: hc.broadcast(x, np.int64(p - 1)))
    out["numpy_value"] = x.tolist()
    g = dist.new_group([0, 1])
    y = torch.full((2,), float(r))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["broadcast"] = _catch(lambda: hc.broadcast(y, 0, g))
        out["reduce"] = _catch(lambda: hc.reduce(y, group=g, group_dst=0))
        out["barrier"] = _catch(lambda: hc.barrier(g))
    out["y"] = y.tolist()
    hc.barrier()
    return out
