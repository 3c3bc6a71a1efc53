"""Rank-side bodies for test_comm_c10d.py: c10d call shapes, ordering beside torch's collectives, typed peer
failures, odd strides and dtypes (issue 21)."""

import json
import os
import signal
import time

import torch
import torch.distributed as dist

import hpdl.comm as hc


def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return type(exc).__name__, str(exc), list(getattr(exc, "missing_ranks", []) or [])
    return None, "", []


def positional(ctx):
    """torch.distributed's positional order: (tensor, op, group, async_op); algorithm keyword-only."""
    p, r = ctx.world_size, ctx.rank
    out = {}
    x = torch.full((5,), float(r + 1))
    w = hc.all_reduce(x, "sum", None, True)
    out["ar_work"] = type(w).__name__
    w.wait()
    out["ar"] = x.tolist()
    y = torch.full((3,), float(r))
    assert hc.all_reduce(y, dist.ReduceOp.MAX, None, False) is None
    out["ar_max"] = y.tolist()
    inp = torch.arange(2 * p, dtype=torch.float32) + r
    rs = torch.empty(2)
    hc.reduce_scatter_tensor(rs, inp, "sum", None, True).wait()
    out["rs"] = rs.tolist()
    rs2 = torch.empty(2)
    hc.reduce_scatter(rs2, list(inp.view(p, 2).unbind(0)), "sum", None, False)   # c10d's input_list form
    out["rs_list"] = rs2.tolist()
    ag = torch.empty(2 * p)
    hc.all_gather_into_tensor(ag, torch.full((2,), float(r)), None, True).wait()
    out["ag"] = ag.tolist()
    lst = [torch.empty(2) for _ in range(p)]
    hc.all_gather(lst, torch.full((2,), float(r)), None, False)                  # c10d's tensor_list form
    out["ag_list"] = [t.tolist() for t in lst]
    a2a_in = torch.arange(p, dtype=torch.float32) + 10 * r
    a2a_out = torch.empty(p)
    hc.all_to_all_single(a2a_out, a2a_in, None, None, None, True).wait()
    out["a2a"] = a2a_out.tolist()
    out["old_order"] = _catch(lambda: hc.all_reduce(torch.ones(2), "sum", None, "direct"))[:2]
    out["exports"] = [hasattr(hc, n) for n in ("Work", "CudaWork", "reduce_scatter_tensor",
                                                "all_gather_into_tensor")]
    return out


def interleaved_with_torch(ctx, iterations, count, algorithm):
    """``w = hc.all_reduce(a, async_op=True); dist.all_reduce(b); w.wait()``: both exact every iteration."""
    p, r = ctx.world_size, ctx.rank
    wrong = []
    for i in range(iterations):
        a = torch.full((count,), float(r + 1 + i))
        b = torch.full((count,), float(10 * (r + 1) + i))
        w = hc.all_reduce(a, async_op=True, algorithm=algorithm)
        dist.all_reduce(b)
        w.wait()
        want_a = sum(q + 1 + i for q in range(p))
        want_b = sum(10 * (q + 1) + i for q in range(p))
        if int((a != want_a).sum()) or int((b != want_b).sum()):
            wrong.append(i)
    return wrong


def ddp_unused(ctx, algorithm):
    """DDP with find_unused_parameters=True and a parameter no rank uses, default hook vs hpdl's; the bucket
    (1 MiB of float32) is above auto's native threshold on CPU."""
    from hpdl.comm.hooks import register

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(512, 512)
            self.unused = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(512, 1)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    results = []
    for use_hpdl in (False, True):
        torch.manual_seed(0)
        m = torch.nn.parallel.DistributedDataParallel(Net(), find_unused_parameters=True)
        if use_hpdl:
            register(m, algorithm=algorithm)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(100 + ctx.rank)
        for _ in range(3):
            x = torch.randn(4, 512, generator=g)
            loss = m(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            b = torch.ones(3)
            dist.all_reduce(b)   # a torch collective of the caller's between steps
        results.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    return float((results[0] - results[1]).abs().max())


def _to_file(path, rank, value):
    tmp = os.path.join(path, f".{rank}.tmp")
    with open(tmp, "w") as fh:
        json.dump({"result": value}, fh)
    os.replace(tmp, os.path.join(path, f"{rank}.json"))


def killed_peer_to_file(ctx, victim, algorithm, timeout, path):
    """After one good call, ``victim`` is killed (SIGKILL) instead of calling again; the others' error and
    time go to ``path``."""
    x = torch.ones(16)
    hc.all_reduce(x, algorithm=algorithm, timeout=timeout)
    if ctx.rank == victim:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    err = _catch(lambda: hc.all_reduce(torch.ones(4096), algorithm=algorithm, timeout=timeout, check=False))
    _to_file(path, ctx.rank, list(err) + [time.monotonic() - t0])
    return None


def two_level_stopped(ctx, ranks_per_node, stopped, timeout):
    """Two-level all-reduce on emulated nodes; rank ``stopped`` (another node than rank 0's) stops taking
    part after a first good call. Returns (first call exact, error, seconds) per rank."""
    p, r = ctx.world_size, ctx.rank
    hc.set_topology(ranks_per_node)
    x = torch.full((1 << 16,), float(r + 1))
    hc.all_reduce(x, algorithm="two_level", timeout=timeout, check=False)   # builds the rail groups and buffer
    good = bool((x == sum(range(1, p + 1))).all())
    if r == stopped:
        time.sleep(timeout * 3)
        return good, None, 0.0
    t0 = time.monotonic()
    err = _catch(lambda: hc.all_reduce(torch.ones(1 << 16), algorithm="two_level", timeout=timeout, check=False))
    return good, err, time.monotonic() - t0


def one_element_strided(ctx, algorithm):
    """Each rank sends its single element to rank+1: one-element tensors with stride 2 (torch accepts them)."""
    p, r = ctx.world_size, ctx.rank
    isp = [1 if q == (r + 1) % p else 0 for q in range(p)]
    osp = [1 if q == (r - 1) % p else 0 for q in range(p)]
    base_in = torch.tensor([float(r + 1), -1.0])
    base_out = torch.full((2,), -7.0)
    inp, out = base_in[::2], base_out[::2]
    assert inp.stride() == (2,) and inp.numel() == 1
    hc.all_to_all_single(out, inp, osp, isp, algorithm=algorithm)
    ref = torch.empty(1)
    dist.all_to_all_single(ref, torch.tensor([float(r + 1)]), osp, isp)
    return out.tolist(), ref.tolist(), base_out[1].item()


def _value(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype == torch.complex64:
        return torch.complex(torch.randint(-3, 4, (n,), generator=g).float(),
                             torch.randint(-3, 4, (n,), generator=g).float())
    if dtype == torch.int8:
        return torch.randint(-4, 5, (n,), generator=g).to(dtype)
    return torch.randint(0, 4, (n,), generator=g).to(dtype)


def _reduce(parts, op):
    acc = parts[0].clone()
    for x in parts[1:]:
        if op == "sum":
            acc = (acc | x) if acc.dtype == torch.bool else acc + x
        elif op == "product":
            acc = (acc & x) if acc.dtype == torch.bool else acc * x
        elif op == "max":
            acc = torch.maximum(acc, x)
    return acc


def phase_dtypes(ctx, algorithm):
    """reduce_scatter and all_gather in int8, uint8, bool and complex64, exact against a local reduction."""
    p, r = ctx.world_size, ctx.rank
    failures = []
    for dtype in (torch.int8, torch.uint8, torch.bool, torch.complex64):
        ops = ("sum",) if dtype == torch.complex64 else ("sum", "product", "max")
        for op in ops:
            m = 7
            inp = _value(r, m * p, dtype, seed=3)
            out = torch.empty(m, dtype=dtype)
            hc.reduce_scatter(out, inp, op=op, algorithm=algorithm)
            want = _reduce([_value(q, m * p, dtype, seed=3) for q in range(p)], op)[r * m:(r + 1) * m]
            if not torch.equal(out, want):
                failures.append(f"reduce_scatter {algorithm} {dtype} {op}")
        mine = _value(r, 5, dtype, seed=4)
        out = torch.empty(5 * p, dtype=dtype)
        hc.all_gather(out, mine, algorithm=algorithm)
        if not torch.equal(out, torch.cat([_value(q, 5, dtype, seed=4) for q in range(p)])):
            failures.append(f"all_gather {algorithm} {dtype}")
    return failures
