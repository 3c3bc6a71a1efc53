"""Rank functions of the misuse and failure tests (a hostile user's habits; run on a hpdl.testing pool)."""

import os
import signal
import time

import torch
import torch.distributed as dist

import hpdl.offload as ho

import _offload_cases as C


def _err(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test checks type and text
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None, None, time.monotonic() - t0


def one_rank_is_wrong(ctx):
    """A bad argument on one rank only: every rank raises at once (none is left in compile's collective)."""
    P, r = ctx.world_size, ctx.rank
    n = 4 * P + (1 if r == 2 else 0)
    out = {"alltoall": _err(lambda: ho.alltoall_init(torch.zeros(n), torch.zeros(n), progress="thread")),
           "allreduce": _err(lambda: ho.allreduce_init(torch.zeros(8), "avg" if r == 3 else "sum",
                                                       progress="thread")),
           "progress": _err(lambda: ho.alltoall_init(torch.zeros(P), torch.zeros(P),
                                                     progress="bogus" if r == 1 else "thread"))}
    dist.barrier()
    return out


def parameter_buffer(ctx):
    """An nn.Parameter bound to a plan (allreduce of weights) works in thread mode as in agent mode."""
    p = torch.nn.Parameter(torch.arange(10, dtype=torch.float32) * (ctx.rank + 1))
    with ho.allreduce_init(p, progress="thread", timeout=30) as req:
        req.start()
        req.wait()
    want = torch.arange(10, dtype=torch.float32) * sum(range(1, ctx.world_size + 1))
    return bool(torch.equal(p.detach(), want)) and p.requires_grad


def many_messages(ctx, n):
    """``n`` one-element messages each way between rank pairs (0,1) and (2,3), all independent: more
    transfers in flight than the executor has I/O threads."""
    peer = ctx.rank ^ 1
    p = ho.Plan("many", rank=ctx.rank, world_size=ctx.world_size)
    x, y = p.buffer("x", (n,), torch.float32), p.buffer("y", (n,), torch.float32)
    for i in range(n):
        p.send(x[i:i + 1], peer)
    for i in range(n):
        p.recv(y[i:i + 1], peer)
    g = dist.new_group(list(range(ctx.world_size)))  # a transport of its own, made with a short set-up timeout
    req = ho.compile(p, {"x": torch.arange(n, dtype=torch.float32) + 1000 * ctx.rank}, group=g,
                     progress="thread", timeout=8)
    req.start()
    got = _err(lambda: req.wait(timeout=20))
    wrong = int((req.buffers["y"] != torch.arange(n) + 1000 * peer).sum())
    if got[0] is None:
        req.free()
    return got[:2], wrong


def late_peer(ctx):
    """A peer that starts later than the timeout the first compile gave: the request still completes (a
    Gloo wait that timed out used to close the pair for good)."""
    g = dist.new_group(list(range(ctx.world_size)))
    P = ctx.world_size
    inp, out = torch.full((P, 3), float(ctx.rank)), torch.zeros(P, 3)
    req = ho.alltoall_init(inp, out, group=g, progress="thread", timeout=0.5)
    if ctx.rank == 1:
        time.sleep(2.0)
    req.start()
    res = _err(lambda: req.wait(timeout=30))
    ok = bool((out == torch.arange(P, dtype=torch.float32)[:, None]).all())
    req.free()
    return res[:2], ok


def test_loop_times_out(ctx, mode):
    """``while not req.test(): compute()`` with a peer that never starts: test() raises the request's timeout
    naming the rank; when the peer comes, the request completes and is reusable."""
    alloc = C._setup(ctx, mode)
    P = ctx.world_size
    inp, out = alloc((P, 8), torch.float32), alloc((P, 8), torch.float32)
    inp.fill_(ctx.rank)
    req = ho.alltoall_init(inp, out, progress=mode, timeout=1.0)
    res = None
    if ctx.rank != 3:
        req.start()
        t0 = time.monotonic()
        try:
            while not req.test():
                if time.monotonic() - t0 > 20:
                    res = ("looped 20 s", "", 20)
                    break
                time.sleep(0.001)
        except ho.OffloadTimeoutError as exc:
            res = (type(exc).__name__, str(exc), time.monotonic() - t0, exc.missing_ranks)
    dist.barrier()
    if ctx.rank == 3:
        req.start()
    req.wait(timeout=60)
    ok = bool((out == torch.arange(P, dtype=torch.float32)[:, None]).all())
    req.free()
    return res, ok


def with_block_error(ctx):
    """An error leaving ``with req:`` is not followed by a second full wait in __exit__."""
    P = ctx.world_size
    inp, out = torch.full((P, 2), float(ctx.rank)), torch.zeros(P, 2)
    req = ho.alltoall_init(inp, out, progress="thread", timeout=1.0)
    t0 = time.monotonic()
    res = None
    if ctx.rank != 3:
        try:
            with req:
                req.start()
                req.wait()
        except ho.OffloadTimeoutError:
            res = time.monotonic() - t0
    dist.barrier()
    if ctx.rank == 3:
        req.start()
    req.wait(timeout=60)
    req.free()
    return res


def test_loop_dead_agent(ctx):
    """Node 0's agent is killed while its ranks poll with test(): they get AgentError, not an endless loop."""
    a = C.ensure_agent(ctx)
    P = ctx.world_size
    inp, out = ho.empty((P, 8), torch.float32), ho.empty((P, 8), torch.float32)
    req = ho.alltoall_init(inp, out, progress="agent", timeout=30)
    dist.barrier()
    if ctx.rank == 0:
        os.kill(a.pid, signal.SIGKILL)
        a.proc.wait()
    dist.barrier()
    res = None
    if ctx.rank in (0, 1):
        req.start()
        t0 = time.monotonic()
        try:
            while not req.test():
                if time.monotonic() - t0 > 20:
                    res = ("looped 20 s", "", 20)
                    break
        except ho.AgentError as exc:
            res = (type(exc).__name__, str(exc), time.monotonic() - t0)
    dist.barrier()
    C._STATE.pop("agent", None)
    a.stop(clean=False)
    dist.barrier()
    return res


def peer_frees_while_waited(ctx):
    """Ranks 0 and 1 share agent 0; rank 1 frees its request without starting it while rank 0 waits for its
    message: rank 0 fails at once, naming rank 1, instead of waiting out its timeout."""
    C.ensure_agent(ctx)
    P = ctx.world_size
    inp, out = ho.empty((P, 8), torch.float32), ho.empty((P, 8), torch.float32)
    req = ho.alltoall_init(inp, out, progress="agent", timeout=30)
    res = None
    if ctx.rank == 0:
        req.start()
        time.sleep(0.2)
    dist.barrier()
    if ctx.rank == 1:
        req.free()
    if ctx.rank == 0:
        res = _err(lambda: req.wait())
    dist.barrier()
    if ctx.rank != 1:  # ranks 2 and 3 never started; rank 0's request failed: all can be freed
        req.free()
    return res


def agent_unmaps_freed_buffers(ctx):
    """The agent drops its mappings of buffers whose requests were freed (tmpfs pages go with them)."""
    a = C.ensure_agent(ctx)
    P = ctx.world_size
    for _ in range(2):
        inp, out = ho.empty((P, 1000), torch.float32), ho.empty((P, 1000), torch.float32)
        with ho.alltoall_init(inp, out, progress="agent") as req:
            C._a2a_check(req, inp, out)
        paths = {ho.shm.handle_of(inp).path, ho.shm.handle_of(out).path}
    dist.barrier()
    time.sleep(0.2)
    mapped = []
    if a.proc is not None:
        with open(f"/proc/{a.pid}/maps") as fh:
            mapped = [line.split()[-1] for line in fh if "hpdl-offload-buf" in line]
    dist.barrier()
    return mapped, sorted(paths)


def not_a_member(ctx):
    """compile() on a rank outside the group says so (the members' collective does not wait for it)."""
    g = dist.new_group([0, 1, 2])
    if ctx.rank != 3:
        return None
    return _err(lambda: ho.alltoall_init(torch.zeros(3), torch.zeros(3), group=g, progress="thread"))[:2]


def peer_freed_before_start(ctx):
    """Rank 1 (same agent as rank 0) frees its request; rank 0 starts afterwards: it fails at once, naming
    rank 1 (a killed rank's requests are freed the same way when its connection to the agent closes)."""
    C.ensure_agent(ctx)
    P = ctx.world_size
    inp, out = ho.empty((P, 8), torch.float32), ho.empty((P, 8), torch.float32)
    req = ho.alltoall_init(inp, out, progress="agent", timeout=30)
    if ctx.rank == 1:
        req.free()
    dist.barrier()
    res = None
    if ctx.rank == 0:
        req.start()
        res = _err(lambda: req.wait())
    dist.barrier()
    if ctx.rank != 1:
        req.free()
    return res


def free_after_timeout(ctx):
    """Rank 3 never starts: the others' wait() times out, and then free() cancels the request instead of
    raising 'free() of an active request' for ever (a timed-out request could never be released)."""
    g = dist.new_group(list(range(ctx.world_size)))  # its transport keeps the cancelled transfers' posts
    P = ctx.world_size
    inp, out = torch.full((P, 2), float(ctx.rank)), torch.zeros(P, 2)
    req = ho.alltoall_init(inp, out, group=g, progress="thread", timeout=0.3)
    res = None
    if ctx.rank != 3:
        req.start()
        timed = _err(req.wait)[0]
        res = (timed, _err(req.free)[:2], req.freed)
    dist.barrier()
    if ctx.rank == 3:
        req.free()
    return res


def rank_never_compiles(ctx):
    """Rank 3 never calls compile(): the others raise OffloadTimeoutError naming it after the request's
    timeout, instead of sitting in compile's gathers for the process group's timeout."""
    g = dist.new_group(list(range(ctx.world_size)), timeout=__import__("datetime").timedelta(seconds=60))
    P = ctx.world_size
    res = None
    if ctx.rank != 3:
        res = _err(lambda: ho.alltoall_init(torch.zeros(P, 2), torch.zeros(P, 2), group=g, progress="thread",
                                            timeout=1.0))
        res = (res[0], res[1], res[2] < 30)
    dist.barrier()
    return res


def remote_rank_dies(ctx, path):
    """Two emulated nodes of one rank each; rank 1 (its node's agent leader) dies while rank 0 waits for its
    message: rank 0 gets OffloadPeerError naming rank 1, not an AgentError blaming agent 1 (which only stopped
    because the rank that started it died). Rank 0 writes what it got to ``path``."""
    import json

    a = ho.Agent(ranks_per_node=1, timeout=60).start()
    P = ctx.world_size
    inp, out = ho.empty((P, 4), torch.float32), ho.empty((P, 4), torch.float32)
    req = ho.alltoall_init(inp, out, progress="agent", timeout=30)
    dist.barrier()
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    req.start()
    kind, msg, took = _err(lambda: req.wait(timeout=30))
    missing = None
    try:
        req.wait(timeout=0)
    except ho.OffloadError as exc:
        missing = getattr(exc, "missing_ranks", None)
    with open(path, "w") as fh:
        json.dump([kind, msg, took, missing], fh)
    a.stop(clean=False)
    return kind


def graph_needs_cuda(ctx):
    """progress='graph' on CPU buffers: a PlanError on every rank, at once."""
    P = ctx.world_size
    return _err(lambda: ho.alltoall_init(torch.zeros(P, 2), torch.zeros(P, 2), progress="graph"))[:2]


def plan_for_another_grid(ctx):
    """A plan built for another world size or rank (a grid whose product is not the group size, a rank
    mix-up): the error says so, not that some operation's peer is out of range."""
    from hpdl.offload import plans
    P, r = ctx.world_size, ctx.rank
    out = {"world": _err(lambda: ho.compile(plans.halo3d((2, 2, 2), (2 * P, 1, 1), r, torch.float32),
                                            progress="thread")),
           "rank": _err(lambda: ho.compile(plans.alltoall((r + 1) % P, P, 2, torch.float32), progress="thread"))}
    dist.barrier()
    return out


def zero_size_buffers(ctx):
    """Zero-element shared buffers bound in agent mode (a rank with nothing to exchange this run): the
    requests run; zero-size views had no shared-memory address (torch's data_ptr 0) and compile refused
    them as 'outside shared memory', advising the very hpdl.offload.empty call that made them."""
    C.ensure_agent(ctx)
    out = {}
    inp, o = ho.empty((ctx.world_size, 0), torch.float32), ho.empty((ctx.world_size, 0), torch.float32)
    out["alltoall"] = _err(lambda: _start_wait_free(ho.alltoall_init(inp, o, progress="agent", timeout=30)))
    full = ho.empty((8,), torch.float64)
    out["allreduce_view"] = _err(lambda: _start_wait_free(ho.allreduce_init(full[8:], progress="agent",
                                                                            timeout=30)))
    dist.barrier()
    return {k: v[:2] for k, v in out.items()}


def _start_wait_free(req):
    for _ in range(2):
        req.start()
        req.wait(timeout=30)
    req.free()


def native_on_some_ranks_only(ctx):
    """Pairs of ranks of one node (one agent), where only the receiving rank's plan has a reduction the native
    executor lacks (float16): every rank of the pair runs on one executor and the message arrives. Before,
    the sender went to the native executor, the receiver to the Python one, and both failed at once with
    'the request of a matching half is not registered (freed?)'."""
    C.ensure_agent(ctx)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    g = pairs[ctx.rank // 2]
    r = dist.get_rank(g)
    p = ho.Plan("mixed", rank=r, world_size=2)
    x, y = p.buffer("x", (4,), torch.float32), p.buffer("y", (4,), torch.float32)
    h = p.buffer("h", (4,), torch.float16)
    if r == 0:
        p.send(x[0:4], 1)
    else:
        p.recv(y[0:4], 0)
        p.reduce(h[0:2], h[2:4], op="sum")
    xs = ho.empty((4,), torch.float32)
    xs.fill_(7 + ctx.rank)
    req = ho.compile(p, {"x": xs}, group=g, progress="agent", timeout=30)
    got = _err(lambda: (req.start(), req.wait(timeout=30)))
    ys = req.buffers["y"].tolist()
    if got[0] is None:
        req.free()
    dist.barrier()
    return got[:2], req.executor, ys


def native_peer_freed_before_start(ctx):
    """On the native executor (pairs of ranks of one agent): the odd rank frees its request, then the even
    one starts; its error names the rank that freed and why, as the Python executor's does (it said
    'the request of a matching half is not registered (freed?)', naming nobody)."""
    C.ensure_agent(ctx)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    g = pairs[ctx.rank // 2]
    inp, out = ho.empty((2, 8), torch.float32), ho.empty((2, 8), torch.float32)
    req = ho.alltoall_init(inp, out, group=g, progress="agent", timeout=30)
    executor = req.executor
    res = None
    if ctx.rank % 2:
        req.free()
    dist.barrier()
    if ctx.rank % 2 == 0:
        res = _err(lambda: (req.start(), req.wait()))
        req.free()
    dist.barrier()
    return executor, res


def bad_arguments_everywhere(ctx):
    """Arguments compile accepted or crashed on, each wrong on one rank only: every rank raises a PlanError
    naming that rank and argument, at once. Before: a list raised AttributeError on its rank alone (the others
    waited in compile); a negative timeout was taken (every wait() timed out at once); a sparse tensor was
    called non-contiguous; meta tensors were sent by gloo from address 0 ('writev: Bad address') and broke
    the group's transport."""
    g = dist.new_group(list(range(ctx.world_size)))  # a transport of its own: a broken one stays here
    r, P = ctx.rank, ctx.world_size
    z = lambda: torch.zeros(P)  # noqa: E731
    out = {"list": _err(lambda: ho.alltoall_init([0.0] * P if r == 1 else z(), z(), group=g, progress="thread",
                                                 timeout=20)),
           "none": _err(lambda: ho.allreduce_init(None if r == 2 else z(), group=g, progress="thread", timeout=20)),
           "timeout": _err(lambda: ho.alltoall_init(z(), z(), group=g, progress="thread",
                                                    timeout=-1.0 if r == 3 else 20)),
           "sparse": _err(lambda: ho.alltoall_init(z().to_sparse() if r == 0 else z(), z(), group=g,
                                                   progress="thread", timeout=20)),
           "meta": _err(lambda: ho.alltoall_init(torch.zeros(P, device="meta" if r == 1 else "cpu"), z(), group=g,
                                                 progress="thread", timeout=20))}
    dist.barrier()
    return {k: (v[0], v[1], v[2] < 15) for k, v in out.items()}
