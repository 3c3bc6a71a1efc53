"""Rank-side bodies for test_comm_async.py: ``async_op=True`` of hpdl's CPU schedules runs on the group's
worker while the caller computes (issue 41)."""

import torch
import torch.distributed as dist

import hpdl.comm as hc


def _store():
    return dist.distributed_c10d._get_default_store()


def returns_before_peer_calls(ctx, key, algorithm):
    """Rank 0 issues an async all-reduce, then tells the others (through the store) to issue theirs: a call that
    blocked until every rank joined would never return on rank 0 (the others wait for its signal)."""
    x = torch.full((1000,), float(ctx.rank + 1))
    if ctx.rank == 0:
        w = hc.all_reduce(x, async_op=True, algorithm=algorithm, timeout=30)
        _store().set(key, "issued")
    else:
        _store().wait([key])
        w = hc.all_reduce(x, async_op=True, algorithm=algorithm, timeout=30)
    w.wait()
    return x.tolist() == [float(sum(range(1, ctx.world_size + 1)))] * 1000


def overlap_exact(ctx, algorithms, sizes):
    """Async all-reduces of integer-valued floats issued before a compute loop (matmuls, which release the GIL)
    that polls ``is_completed``; results exact and bit-identical on every rank."""
    p, r = ctx.world_size, ctx.rank
    works, tensors = [], []
    for i, (algo, n) in enumerate((a, n) for a in algorithms for n in sizes):
        t = (torch.arange(n, dtype=torch.float32) % 97 + 1000 * r + i)
        tensors.append(t)
        works.append(hc.all_reduce(t, async_op=True, algorithm=algo))
    a = torch.randn(128, 128)
    steps = 0
    while not all(w.is_completed() for w in works) and steps < 100000:
        a = torch.tanh(a @ a)   # the caller's computation, meanwhile
        steps += 1
    for w in works:
        w.wait()
    wrong = 0
    for i, ((algo, n), t) in enumerate(zip(((a, n) for a in algorithms for n in sizes), tensors)):
        want = (torch.arange(n, dtype=torch.float32) % 97) * p + 1000 * sum(range(p)) + i * p
        wrong += int((t != want).sum())
    digest = torch.cat(tensors)
    everyone = [torch.empty_like(digest) for _ in range(p)]
    dist.all_gather(everyone, digest)
    identical = all(bool(torch.equal(e, digest)) for e in everyone)
    return wrong, identical


def many_outstanding(ctx, count):
    """``count`` async calls of several schedules, sizes, ops and collectives in flight at once, mixed with
    native async calls and synchronous calls; every result exact, in any wait order."""
    p, r = ctx.world_size, ctx.rank
    algos = ["direct", "ring", "recursive_doubling", "native", "auto"]
    pending = []
    for i in range(count):
        algo = algos[i % len(algos)]
        n = 1 + (i * 37) % 3000
        if i % 7 == 3:    # a synchronous call in the middle runs after the queued ones
            t = torch.full((n,), float(r + i))
            hc.all_reduce(t, algorithm=algo)
            pending.append((None, t, float(sum(q + i for q in range(p)))))
        elif i % 7 == 5:  # max, so the order of different ops matters too
            t = torch.full((n,), float(r * 3 + i))
            pending.append((hc.all_reduce(t, op="max", async_op=True, algorithm=algo), t, float(3 * (p - 1) + i)))
        elif i % 7 == 6:  # an all-gather on the same worker
            out = torch.empty(p * n)
            w = hc.all_gather_into_tensor(out, torch.full((n,), float(r + i)), async_op=True,
                                          algorithm="direct" if algo != "native" else "native")
            pending.append((w, out, torch.arange(p, dtype=torch.float32).repeat_interleave(n) + i))
        else:
            t = torch.full((n,), float(r + i))
            pending.append((hc.all_reduce(t, async_op=True, algorithm=algo), t, float(sum(q + i for q in range(p)))))
    wrong = 0
    for w, t, want in reversed(pending):   # waited in reverse: completion does not depend on wait order
        if w is not None:
            w.wait()
        wrong += int((t != want).sum())
    return wrong


def error_at_wait(ctx):
    """A mismatch (rank 1 passes another count) raises at ``wait()`` on every rank, not at the call; the group
    stays usable for the next call; a future carries the error too."""
    from hpdl.runtime.errors import CollectiveMismatchError

    r = ctx.rank
    n = 10 + (r == 1)
    w = hc.all_reduce(torch.ones(n), async_op=True, algorithm="direct", check=True)
    issued = True
    w2 = hc.all_reduce(torch.ones(n), async_op=True, algorithm="ring", check=True)
    fut = w2.get_future()
    raised = []
    for work in (w, w2):
        try:
            work.wait()
        except CollectiveMismatchError as exc:
            raised.append("count" in str(exc))
    try:
        fut.wait()
        fut_error = False
    except Exception as exc:  # noqa: BLE001 - the future carries the collective's error
        fut_error = "differs across ranks" in str(exc)
    again = torch.full((4,), float(r))
    hc.all_reduce(again, async_op=True, algorithm="direct").wait()
    return issued, raised, fut_error, again.tolist() == [float(sum(range(ctx.world_size)))] * 4


def cpu_call_path(ctx):
    """A CPU all-reduce never asks torch.cuda for the GPU count (uncached before CUDA is initialised, it loads
    and queries NVML on every call); identical calls that resolved to native take the hot path, which a new
    selection table or a check request leaves."""
    import hpdl.comm.api as api
    from hpdl.comm import tuning
    from hpdl.comm.transport.resources import resources_of

    p, r = ctx.world_size, ctx.rank
    asked = [0]
    real = torch.cuda.device_count

    def counting(*a, **k):
        asked[0] += 1
        return real(*a, **k)
    torch.cuda.device_count = counting
    out = {}
    try:
        x = torch.full((2,), float(r))
        for _ in range(5):
            hc.all_reduce(x, check=False)
            x.fill_(float(r))
        out["device_count_calls"] = asked[0]
    finally:
        torch.cuda.device_count = real
    api._CPU_NATIVE.clear()
    x = torch.full((3,), float(r + 1))
    hc.all_reduce(x, check=False)
    out["cached"] = len(api._CPU_NATIVE) == 1
    sums = []
    for i in range(10):
        x = torch.full((3,), float(r + i))
        w = hc.all_reduce(x, check=False, async_op=bool(i % 2))
        if w is not None:
            w.wait()
        sums.append(x.tolist() == [float(sum(q + i for q in range(p)))] * 3)
    out["hot_exact"] = all(sums)
    tuning.set_table(tuning.TuningTable([tuning.Rule("cpu", tuning.INF, "recursive_doubling")], "test"))
    try:
        x = torch.full((3,), float(r + 1))
        hc.all_reduce(x, check=False)
        out["new_table"] = (x.tolist() == [float(sum(range(1, p + 1)))] * 3 and
                            any(k[0] == "recursive_doubling" for k in resources_of(None)._algos))
    finally:
        tuning.set_table(None)
    return out


def timeout_at_wait(ctx, key):
    """Rank 1 never calls: ``wait()`` on rank 0's async call raises CollectiveTimeoutError
    naming rank 1 after the call's timeout (the post-mortem runs on the worker). On a group of its own, dropped
    afterwards; the world group is still usable."""
    from hpdl.runtime.errors import CollectiveTimeoutError

    g = dist.new_group(list(range(ctx.world_size)))
    out = None
    if ctx.rank == 0:
        w = hc.all_reduce(torch.ones(4), group=g, async_op=True, algorithm="direct", timeout=2)
        try:
            w.wait()
            out = "no error"
        except CollectiveTimeoutError as exc:
            out = list(exc.missing_ranks)
        _store().set(key, "done")
    else:
        _store().wait([key])
    hc.forget_group(g)
    x = torch.full((2,), 1.0)
    hc.all_reduce(x, algorithm="direct")
    return out, x.tolist() == [float(ctx.world_size)] * 2


def callback_issues_call(ctx):
    """A future's callback (run on the group's worker) issues a synchronous hpdl call on the same group, as
    DDP hooks that chain ``then`` do: it runs in order instead of waiting for the worker it runs on."""
    p, r = ctx.world_size, ctx.rank
    x = torch.full((5,), float(r))
    y = torch.full((3,), float(r + 1))

    def chained(fut):
        hc.all_reduce(y, algorithm="direct")
        return fut.value()
    fut = hc.all_reduce(x, async_op=True, algorithm="ring").get_future().then(chained)
    fut.wait()
    return x.tolist() == [float(sum(range(p)))] * 5 and y.tolist() == [float(sum(range(1, p + 1)))] * 3


def hot_path_timeout(ctx, key):
    """A CPU all-reduce on the hot path (an identical call resolved to native before) whose peer never calls
    raises CollectiveTimeoutError naming it, as the general path does."""
    import os

    import hpdl.comm.api as api
    from hpdl.runtime.errors import CollectiveTimeoutError

    g = dist.new_group(list(range(ctx.world_size)))
    old = os.environ.get("HPDL_TIMEOUT")
    os.environ["HPDL_TIMEOUT"] = "3"
    out = None
    try:
        x = torch.ones(2)
        hc.all_reduce(x, group=g, check=False)
        cached = any(k[0] is g for k in api._CPU_NATIVE)
        if ctx.rank == 0:
            try:
                hc.all_reduce(x, group=g, check=False)
                out = (cached, "no error")
            except CollectiveTimeoutError as exc:
                out = (cached, list(exc.missing_ranks))
            _store().set(key, "done")
        else:
            _store().wait([key])
            out = (cached, None)
    finally:
        if old is None:
            del os.environ["HPDL_TIMEOUT"]
        else:
            os.environ["HPDL_TIMEOUT"] = old
    hc.forget_group(g)
    return out


def torch_call_between(ctx):
    """torch.distributed's own all-reduce on the same (sub)group between an async hpdl call and its wait, with
    rank 0 computing a while first: the async call's first use of two_level discovers the topology (an
    all-gather over the group), which must be issued in program order on the caller's thread, not race the
    caller's torch call from the worker (ranks matched different collectives and hung)."""
    import time

    p, r = ctx.world_size, ctx.rank
    g = dist.new_group(list(range(p)))
    try:
        x = torch.full((1000,), float(r + 1))
        w = hc.all_reduce(x, group=g, async_op=True, algorithm="two_level", timeout=20)
        if r == 0:
            time.sleep(1.0)   # the caller's computation: rank 0's worker reaches its first exchange first
        y = torch.full((3,), float(10 * (r + 1)))
        dist.all_reduce(y, group=g)
        w.wait()
        w.wait()   # a second wait returns at once
        return x.tolist() == [float(sum(range(1, p + 1)))] * 1000 and y.tolist() == [10.0 * sum(range(1, p + 1))] * 3
    finally:
        hc.forget_group(g)
