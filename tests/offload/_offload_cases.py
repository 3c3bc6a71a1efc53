"""Rank functions of the multi-process offload tests (run on every rank of a hpdl.testing pool)."""

import os
import signal
import time

import torch
import torch.distributed as dist

import hpdl.offload as ho
from hpdl.offload import plans

import _oracles as O

_STATE: dict = {}  # per rank process: the running Agent, kept across pool calls


def _healthy_everywhere(ok: bool) -> bool:
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    return all(flags)


def ensure_agent(ctx, ranks_per_node=2):
    a = _STATE.get("agent")
    ok = a is not None and a.client is not None and a.client.alive()
    if _healthy_everywhere(ok):
        return a
    if a is not None:
        a.stop(clean=False)
    dist.barrier()
    # two copy threads: messages of 64 KiB or more between ranks of a node take the copy-thread path
    _STATE["agent"] = a = ho.Agent(ranks_per_node=ranks_per_node, threads=2, timeout=60).start()
    return a


def stop_agent(ctx):
    a = _STATE.pop("agent", None)
    if a is not None:
        a.stop()
    return True


def _alloc(mode):
    return ho.empty if mode == "agent" else (lambda shape, dtype: torch.zeros(shape, dtype=dtype))


def _setup(ctx, mode):
    if mode == "agent":
        ensure_agent(ctx)
    return _alloc(mode)


def _a2a_check(req, inp, out, group=None, seed=0):
    r = dist.get_rank(group)
    inp.copy_(torch.arange(inp.numel(), dtype=torch.float32).view(inp.shape) % 977 + 1000 * r + seed)
    out.fill_(-1)
    req.start()
    req.wait(timeout=60)
    want = torch.empty(inp.numel())
    dist.all_to_all_single(want, inp.reshape(-1).clone(), group=group)
    return int((out.reshape(-1) != want).sum())


def _ar_check(req, data, group=None, op="sum", seed=0):
    r = dist.get_rank(group)
    x = (torch.arange(data.numel()) % 13 + r + seed).to(data.dtype)
    data.copy_(x)
    req.start()
    req.wait(timeout=60)
    want = x.clone()
    dist.all_reduce(want, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=group)
    return int((data != want).sum())


def ready_made(ctx, mode):
    """Every ready-made plan against plain torch.distributed results, exactly; returns #wrong per plan."""
    alloc = _setup(ctx, mode)
    P, r = ctx.world_size, ctx.rank
    wrong = {}
    inp, out = alloc((P, 37), torch.float32), alloc((P, 37), torch.float32)
    with ho.alltoall_init(inp, out, progress=mode) as req:
        wrong["alltoall"] = _a2a_check(req, inp, out)
    for algorithm in ("ring", "direct"):
        for op, dtype in (("sum", torch.float32), ("max", torch.int64)):
            data = alloc((1001,), dtype)
            with ho.allreduce_init(data, op, algorithm=algorithm, progress=mode) as req:
                wrong[f"allreduce_{algorithm}_{op}"] = _ar_check(req, data, op=op)
    # halo3d on a 2x2x1 grid: expected halos cut from the global array that all_gather assembles
    shape, grid, periodic = (2, 3, 2), (2, 2, 1), (True, True, False)
    u = alloc(tuple(n + 2 for n in shape), torch.float32)
    owned = (torch.arange(12, dtype=torch.float32).view(shape) + 100 * r)
    u.fill_(O.SENTINEL)
    u[1:-1, 1:-1, 1:-1] = owned
    blocks = [torch.empty(shape) for _ in range(P)]
    dist.all_gather(blocks, owned)
    G = torch.empty((4, 6, 2))
    for q in range(P):
        c = plans.grid_coords(q, grid)
        G[c[0] * 2:(c[0] + 1) * 2, c[1] * 3:(c[1] + 1) * 3, :] = blocks[q]
    with ho.compile(plans.halo3d(shape, grid, r, torch.float32, periodic=periodic, corners=True), {"u": u},
                    progress=mode) as req:
        req.start()
        req.wait(timeout=60)
    wrong["halo3d"] = int((u != O.halo_expected(G, shape, grid, r, 1, periodic, True)).sum())
    # pencil transposes on a 2x2 grid: forward then backward, pencils cut from the all_gathered array
    gshape, pgrid = (4, 4, 6), (2, 2)
    shapes = plans.pencil_shapes(gshape, pgrid)
    bufs = {k: alloc(v, torch.float32) for k, v in shapes.items()}
    Gp = O.pencil_global(gshape)
    bufs["x"].copy_(O.pencil(Gp, gshape, pgrid, r, "x"))
    xs = [torch.empty(shapes["x"]) for _ in range(P)]
    dist.all_gather(xs, bufs["x"].clone())
    Gd = torch.empty(gshape)
    for q in range(P):
        Gd[tuple(slice(a, b) for a, b in plans.pencil_box(gshape, pgrid, q, "x"))] = xs[q]
    reqs = {k: ho.compile(p, bufs, progress=mode) for k, p in plans.pencil_transposes(gshape, pgrid, r,
                                                                                     torch.float32).items()}
    for name, which in (("x_to_y", "y"), ("y_to_z", "z"), ("z_to_y", "y"), ("y_to_x", "x")):
        bufs[which].zero_()
        reqs[name].start()
        reqs[name].wait(timeout=60)
        wrong[f"pencil_{name}"] = int((bufs[which] != O.pencil(Gd, gshape, pgrid, r, which)).sum())
    for q in reqs.values():
        q.free()
    return wrong


def hundred_starts(ctx, mode):
    alloc = _setup(ctx, mode)
    P = ctx.world_size
    inp, out = alloc((P, 64), torch.float32), alloc((P, 64), torch.float32)
    data = alloc((257,), torch.float32)
    a2a = ho.alltoall_init(inp, out, progress=mode)
    ar = ho.allreduce_init(data, algorithm="direct", window=1, progress=mode)
    wrong = 0
    for i in range(100):
        wrong += _a2a_check(a2a, inp, out, seed=i) + _ar_check(ar, data, seed=i)
    a2a.free()
    ar.free()
    return wrong


def large_messages(ctx, mode):
    """Alltoall of 64 KiB and 256 KiB per peer and a 1 MiB ring Allreduce (the agent's copy threads), 5 starts
    each, against torch.distributed; returns #wrong."""
    alloc = _setup(ctx, mode)
    P = ctx.world_size
    wrong = 0
    for count in (16384, 65536):
        inp, out = alloc((P, count), torch.float32), alloc((P, count), torch.float32)
        a2a = ho.alltoall_init(inp, out, progress=mode)
        for i in range(5):
            wrong += _a2a_check(a2a, inp, out, seed=i)
        a2a.free()
    data = alloc((262144,), torch.float32)
    ar = ho.allreduce_init(data, algorithm="ring", progress=mode)
    for i in range(5):
        wrong += _ar_check(ar, data, seed=i)
    ar.free()
    return wrong


def subgroups(ctx, mode):
    """Plans on two overlapping sub-groups; rank 2 has one of each outstanding at once."""
    alloc = _setup(ctx, mode)
    g1, g2 = dist.new_group([0, 2, 3]), dist.new_group([1, 2])
    r = ctx.rank
    wrong, reqs = 0, []
    if r in (0, 2, 3):
        inp, out = alloc((3, 11), torch.float32), alloc((3, 11), torch.float32)
        reqs.append(("a2a", ho.alltoall_init(inp, out, group=g1, progress=mode), (inp, out), g1))
    if r in (1, 2):
        data = alloc((29,), torch.float32)
        reqs.append(("ar", ho.allreduce_init(data, group=g2, progress=mode), (data,), g2))
    for _ in range(3):
        x = {}
        for kind, req, bufs, g in reqs:
            gr = dist.get_rank(g)
            if kind == "a2a":
                bufs[0].copy_(torch.arange(33, dtype=torch.float32).view(3, 11) + 100 * gr)
            else:
                bufs[0].copy_(torch.arange(29, dtype=torch.float32) * (gr + 1))
            x[kind] = bufs[0].clone()
        for _, req, _, _ in reqs:
            req.start()
        for kind, req, bufs, g in reversed(reqs):
            req.wait(timeout=60)
            if kind == "a2a":
                want = torch.empty(33)
                dist.all_to_all_single(want, x[kind].view(-1), group=g)
                wrong += int((bufs[1].view(-1) != want).sum())
            else:
                dist.all_reduce(x[kind], group=g)
                wrong += int((bufs[0] != x[kind]).sum())
    for _, req, _, _ in reqs:
        req.free()
    dist.barrier()
    return wrong, [k for k, *_ in reqs]


def two_outstanding(ctx, mode):
    alloc = _setup(ctx, mode)
    P, r = ctx.world_size, ctx.rank
    inp, out = alloc((P, 300), torch.float32), alloc((P, 300), torch.float32)
    data = alloc((999,), torch.float32)
    a2a, ar = ho.alltoall_init(inp, out, progress=mode), ho.allreduce_init(data, algorithm="ring", progress=mode)
    wrong = 0
    for i in range(5):
        inp.copy_(torch.arange(P * 300, dtype=torch.float32).view(P, 300) + 10000 * r + i)
        x = torch.arange(999, dtype=torch.float32) * (r + 1) + i
        data.copy_(x)
        ho.startall([a2a, ar])
        both_active = a2a.active and ar.active
        ar.wait(timeout=60)   # reverse order of the starts
        a2a.wait(timeout=60)
        want = torch.empty(P * 300)
        dist.all_to_all_single(want, inp.view(-1).clone())
        dist.all_reduce(x)
        wrong += int((out.view(-1) != want).sum()) + int((data != x).sum())
        assert both_active
    assert ho.testall([a2a, ar])
    a2a.free()
    ar.free()
    return wrong


def busy(seconds):
    """Host compute for ``seconds`` (1-thread matmuls), never calling into hpdl."""
    a, b, c = torch.rand(64, 64), torch.rand(64, 64), torch.empty(64, 64)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            torch.mm(a, b, out=c)


def no_test_progress(ctx, mode):
    """The plan completes while the application computes and never calls test()."""
    alloc = _setup(ctx, mode)
    P = ctx.world_size
    inp, out = alloc((P, 16384), torch.float32), alloc((P, 16384), torch.float32)
    req = ho.alltoall_init(inp, out, progress=mode)
    inp.fill_(ctx.rank)
    dist.barrier()
    t0 = time.monotonic()
    req.start()
    busy(3.0)
    t_wait = time.monotonic()
    picked, done = req.picked_at, req.done_at  # mailbox reads, not test(): they never make progress
    req.wait(timeout=60)
    ok = bool((out == torch.arange(P, dtype=torch.float32)[:, None]).all())
    req.free()
    return ok, picked - t0, done - t0, t_wait - t0


def timeout_names_missing(ctx, mode):
    alloc = _setup(ctx, mode)
    P = ctx.world_size
    inp, out = alloc((P, 8), torch.float32), alloc((P, 8), torch.float32)
    req = ho.alltoall_init(inp, out, progress=mode)
    inp.fill_(ctx.rank)
    err = None
    if ctx.rank != 1:
        req.start()
        t0 = time.monotonic()
        try:
            req.wait(timeout=1.5)
        except ho.OffloadTimeoutError as exc:
            err = (str(exc), exc.missing_ranks, time.monotonic() - t0)
    dist.barrier()
    if ctx.rank == 1:  # the late rank arrives: everyone completes, the request is reusable
        req.start()
    req.wait(timeout=60)
    ok = bool((out == torch.arange(P, dtype=torch.float32)[:, None]).all())
    req.free()
    return err, ok


def agent_crash(ctx):
    """Kill node 0's agent: every waiting rank gets an AgentError naming agent 0 within the timeout."""
    a = ensure_agent(ctx)
    P = ctx.world_size
    inp, out = ho.empty((P, 1024), torch.float32), ho.empty((P, 1024), torch.float32)
    req = ho.alltoall_init(inp, out, progress="agent")
    req.start()
    req.wait(timeout=60)
    pids = [None] * P
    dist.all_gather_object(pids, a.pid)
    dist.barrier()
    if ctx.rank == 0:
        os.kill(a.pid, signal.SIGKILL)
        a.proc.wait()
    dist.barrier()
    t0 = time.monotonic()
    err = None
    try:
        req.start()
        req.wait(timeout=20)
    except ho.AgentError as exc:
        err = (type(exc).__name__, str(exc), exc.agent)
    except Exception as exc:  # noqa: BLE001 - the test reports the wrong type
        err = (type(exc).__name__, str(exc), "")
    elapsed = time.monotonic() - t0
    dist.barrier()
    _STATE.pop("agent", None)
    a.stop(clean=False)
    dist.barrier()
    return err, elapsed, pids[0]


def agent_start_timeout(ctx):
    t0 = time.monotonic()
    try:
        ho.Agent(ranks_per_node=2, start_timeout=0.3).start()
    except ho.AgentError as exc:
        return str(exc), exc.agent, time.monotonic() - t0
    return None, None, time.monotonic() - t0


def agent_stop_start(ctx):
    """Stop: the agent exits and leaves no files; compile then says there is no agent; a new one works."""
    a = ensure_agent(ctx)
    pid, address = a.pid, a.address
    stop_agent(ctx)
    from hpdl.runtime.procs import pid_alive

    gone = not pid_alive(pid) and not any(os.path.exists(address + s) for s in ("", ".status", ".bell", ".key"))
    try:
        ho.compile(plans.alltoall(ctx.rank, ctx.world_size, 4, torch.float32), progress="agent")
        err = None
    except ho.AgentError as exc:
        err = str(exc)
    a = ensure_agent(ctx)
    inp, out = ho.empty((ctx.world_size, 5), torch.float32), ho.empty((ctx.world_size, 5), torch.float32)
    with ho.alltoall_init(inp, out) as req:  # progress="auto" picks the running agent
        wrong = _a2a_check(req, inp, out)
        auto = req.progress
    return gone, err, wrong, auto


def external_agent(ctx, address):
    """Ranks connect to an agent started by `hpdl offload agent` (HPDL_OFFLOAD_AGENT's path)."""
    c = ho.connect(address, label=f"rank {ctx.rank}")
    P = ctx.world_size
    inp, out = ho.empty((P, 33), torch.float32), ho.empty((P, 33), torch.float32)
    with ho.alltoall_init(inp, out, progress="agent") as req:
        wrong = _a2a_check(req, inp, out)
    c.close()
    dist.barrier()
    return wrong, c.agents
