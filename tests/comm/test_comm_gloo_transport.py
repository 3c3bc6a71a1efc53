"""GlooTransport (hpdl.comm.transport.gloo): the private Gloo group hpdl.offload moves messages with, as a
Transport. Two ranks run as two threads of this process on one HashStore (Gloo connects them over loopback)."""

import threading

import pytest
import torch
import torch.distributed as dist

from hpdl.comm.algorithms.base import get_class
from hpdl.comm.transport.base import Transport
from hpdl.comm.transport.gloo import TRANSFER_WAIT_S, GlooTransport
from hpdl.runtime.errors import CollectiveTimeoutError


def pair(**kwargs) -> list[GlooTransport]:
    """Two connected transports (creation is collective: both ranks at once)."""
    store, out, errs = dist.HashStore(), [None, None], []

    def make(r):
        try:
            out[r] = GlooTransport.create(store, r, 2, 30.0, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errs.append(exc)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errs:
        raise errs[0]
    return out


def on_both(ts, fn):
    """``fn(transport)`` on each rank's thread; returns the two results (an exception is re-raised)."""
    res, errs = [None, None], []

    def run(r):
        try:
            res[r] = fn(ts[r])
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errs.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank's thread did not finish"
    if errs:
        raise errs[0]
    return res


def test_per_message_tags_posting_order_and_defaults():
    ts = pair()
    assert isinstance(ts[0], Transport) and ts[0].timeout == TRANSFER_WAIT_S
    assert [(t.rank, t.world_size, t.device.type) for t in ts] == [(0, 2, "cpu"), (1, 2, "cpu")]

    def body(t):
        if t.rank == 0:
            reqs = [t.isend(torch.full((4,), v), 1, tag) for v, tag in ((1.0, 7), (2.0, 8), (3.0, 9), (4.0, 9))]
            for r in reqs:
                r.wait()
            t.send(torch.arange(3), 1, 10)
            return None
        a, b, c, d = (torch.empty(4) for _ in range(4))
        rb, ra = t.irecv(b, 0, 8), t.irecv(a, 0, 7)   # tags match, whatever the posting order
        rc, rd = t.irecv(c, 0, 9), t.irecv(d, 0, 9)   # one tag: posting order
        for r in (rd, rc, ra, rb):
            r.wait()
            assert r.is_completed()
        e = torch.empty(3, dtype=torch.int64)
        t.recv(e, 0, 10)
        return [a[0].item(), b[0].item(), c[0].item(), d[0].item()], e.tolist()

    assert on_both(ts, body)[1] == ([1.0, 2.0, 3.0, 4.0], [0, 1, 2])
    rows = on_both(ts, lambda t: t.exchange_all(torch.tensor([10 * t.rank + 1, 10 * t.rank + 2]), tag=13))
    assert [[r.tolist() for r in rs] for rs in rows] == [[[1, 2], [11, 12]]] * 2


def test_hpdl_algorithms_run_over_it_exactly():
    ts = pair(prefix="algos")
    xs = [torch.randint(-1000, 1000, (1001,), generator=torch.Generator().manual_seed(r)).float() for r in range(2)]
    want = xs[0] + xs[1]   # integers: exact in float32 whatever the order of the sum

    def body(t):
        outs = []
        for name in ("ring", "direct", "recursive_doubling"):
            buf = xs[t.rank].clone()
            get_class(name)(None).all_reduce(buf, "sum", t)
            outs.append(buf)
        return outs

    for outs in on_both(ts, body):
        assert all(torch.equal(o, want) for o in outs)


def test_a_wait_past_its_deadline_names_the_peer_as_described():
    ts = pair(prefix="late", transfer_timeout=1.0, describe=lambda e: f"agent {e} (pid 42) on node-b")
    req = ts[0].irecv(torch.empty(2), 1, 77)   # rank 1 never sends
    with pytest.raises(CollectiveTimeoutError, match=r"rank 0 waited 1s for the recv from agent 1 \(pid 42\) on "
                                                     r"node-b, which did not answer") as info:
        req.wait()
    assert info.value.missing_ranks == [1]


def test_describe_and_explain_hooks_and_their_defaults():
    plain = pair(prefix="plain")[0]
    assert plain.describe(1) == "rank 1" and plain.explain(1) is None

    def gone(e):
        raise RuntimeError("the store went with the agent")

    said = pair(prefix="said", explain=lambda e: f"rank {e} (pid 7) died")[0]
    assert said.explain(1) == "rank 1 (pid 7) died"
    assert pair(prefix="gone", explain=gone)[0].explain(1) is None   # no explanation, not an error


def test_bad_arguments_are_named():
    t = pair(prefix="bad")[0]
    with pytest.raises(ValueError, match=r"send peer must be another rank in \[0, 2\), got 2"):
        t.isend(torch.zeros(2), 2, 0)
    with pytest.raises(ValueError, match="recv peer must be another rank"):
        t.irecv(torch.zeros(2), 0, 0)   # itself
    with pytest.raises(ValueError, match="must be a contiguous CPU tensor .* got a meta tensor"):
        t.post([(torch.empty(2, device="meta"), 1)], [])
    with pytest.raises(ValueError, match="non-contiguous"):
        t.post([], [(torch.zeros(3, 3).t(), 1)])
    with pytest.raises(ValueError, match=r"tag must be in \[0, 2\*\*31\), got -1"):
        t.isend(torch.zeros(2), 1, -1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, size=2\), got 2"):
        GlooTransport.create(dist.HashStore(), 2, 2, 1.0)
