"""Run under ``mpiexec -n 2`` by test_comm_mpi_transport.py: MpiTransport's cases; each rank writes
``OUT/rank<r>.json`` mapping a case name to "ok" or the failure's traceback.

Every check is exact: integer-valued floats whose sums are exact, compared byte for byte.
"""

import json
import sys
import traceback

import torch
from mpi4py import MPI

from hpdl.comm.transport.base import Transport
from hpdl.comm.transport.mpi import MpiTransport
from hpdl.runtime.errors import CollectiveTimeoutError

CASES = {}
WORLD = MPI.COMM_WORLD


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def value(rank: int, shape, dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    base = torch.arange(n, dtype=torch.int64) * (rank + 1) + 3 * rank + 1   # differs between the ranks
    if dtype == torch.bool:
        return (base % 3 == rank).reshape(shape)
    return base.to(dtype).reshape(shape)


@case
def every_dtype_and_shape_arrives_bit_identical(t: MpiTransport):
    peer = 1 - t.rank
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8,
                  torch.bool, torch.complex64):
        for shape in ((37,), (3, 5), (), (0,), (300_000,)):   # 300k floats: past MPICH's eager limit
            x, y = value(t.rank, shape, dtype), torch.empty(shape, dtype=dtype)
            t.exchange(x, peer, y, peer, tag=5)
            assert same_bytes(y, value(peer, shape, dtype)), (dtype, shape)


@case
def per_message_isend_irecv_match_by_tag_then_posting_order(t: MpiTransport):
    if t.rank == 0:
        reqs = [t.isend(torch.full((4,), v), 1, tag) for v, tag in ((1.0, 7), (2.0, 8), (3.0, 9), (4.0, 9))]
        for r in reqs:
            r.wait()
        t.send(torch.tensor([5.0]), 1, 10)
        got = torch.empty(2, dtype=torch.int64)
        t.recv(got, 1, 11)
        assert got.tolist() == [6, 7]
    else:
        a, b, c, d = (torch.empty(4) for _ in range(4))
        rb, ra = t.irecv(b, 0, 8), t.irecv(a, 0, 7)   # tags match, whatever the posting order
        rc, rd = t.irecv(c, 0, 9), t.irecv(d, 0, 9)   # one tag: posting order
        for r in (rd, rc, ra, rb):
            r.wait()
            assert r.is_completed()
        assert [a[0].item(), b[0].item(), c[0].item(), d[0].item()] == [1.0, 2.0, 3.0, 4.0]
        e = torch.empty(1)
        t.recv(e, 0, 10)
        assert e.item() == 5.0
        t.send(torch.tensor([6, 7]), 0, 11)


@case
def a_receive_is_not_completed_before_its_message_is_sent(t: MpiTransport):
    buf = torch.zeros(3)
    if t.rank == 1:
        req = t.irecv(buf, 0, 12)
        assert not req.is_completed()
        WORLD.Barrier()   # rank 0 sends only after this
        req.wait()
        assert req.is_completed() and buf.tolist() == [1.0, 2.0, 3.0]
    else:
        WORLD.Barrier()
        t.send(torch.tensor([1.0, 2.0, 3.0]), 1, 12)


@case
def exchange_all_gives_every_rank_every_row(t: MpiTransport):
    rows = t.exchange_all(torch.tensor([10 * t.rank + 1, 10 * t.rank + 2]), tag=13)
    assert [r.tolist() for r in rows] == [[1, 2], [11, 12]]


class _Named(MpiTransport):
    def describe(self, peer: int) -> str:
        return f"agent {peer} on node-{peer}"


@case
def a_wait_past_its_deadline_names_the_peer(t: MpiTransport):
    short = _Named(timeout=0.3)
    if t.rank == 0:   # rank 1 never sends on tag 77
        req = short.irecv(torch.empty(2), 1, 77)
        try:
            req.wait()
        except CollectiveTimeoutError as exc:
            assert exc.missing_ranks == [1], exc.missing_ranks
            assert "rank 0 waited 0.3s for the recv from agent 1 on node-1, which did not answer" in str(exc), str(exc)
        else:
            raise AssertionError("no CollectiveTimeoutError")
    WORLD.Barrier()
    x = torch.full((2,), float(t.rank))   # the communicator still carries other tags
    y = torch.empty(2)
    t.exchange(x, 1 - t.rank, y, 1 - t.rank, tag=78)
    assert y.tolist() == [float(1 - t.rank)] * 2


@case
def bad_arguments_are_named_before_anything_is_posted(t: MpiTransport):
    x = torch.zeros(4)
    for kwargs, msg in (({"tag": -1}, "tag must be in [0, "), ({"tag": t._tag_ub + 1}, "TAG_UB"),):
        try:
            t.post([(x, 1 - t.rank)], [], **kwargs)
        except ValueError as exc:
            assert msg in str(exc), str(exc)
        else:
            raise AssertionError(kwargs)
    for sends, recvs, msg in (([(x, 2)], [], "send peer must be a rank in [0, 2), got 2"),
                              ([], [(torch.zeros(4, 4).t(), 0)], "recv tensor must be a contiguous"),
                              ([(x, 1 - t.rank)], [(x, -1)], "recv peer must be a rank")):
        try:
            t.post(sends, recvs, 14)
        except ValueError as exc:
            assert msg in str(exc), str(exc)
        else:
            raise AssertionError(msg)
    try:
        MpiTransport(timeout=0)
    except ValueError as exc:
        assert "timeout must be > 0" in str(exc)
    else:
        raise AssertionError("timeout=0 accepted")
    # nothing was posted above: the next message on tag 14 is the first
    y = torch.empty(1)
    t.exchange(torch.tensor([float(t.rank + 40)]), 1 - t.rank, y, 1 - t.rank, tag=14)
    assert y.item() == float(1 - t.rank + 40)


@case
def hpdl_algorithms_run_over_mpi_and_equal_mpi_allreduce(t: MpiTransport):
    from hpdl.comm.algorithms.base import get_class
    from hpdl.comm.algorithms.layout import make_layout

    assert isinstance(t, Transport)
    g = torch.Generator().manual_seed(100 + t.rank)
    for n in (1, 7, 1000, 65_537):
        x = torch.randint(-1000, 1000, (n,), generator=g).to(torch.float32)   # sums of these are exact
        oracle = x.clone()
        WORLD.Allreduce(MPI.IN_PLACE, oracle.numpy(), op=MPI.SUM)   # MPI's own all-reduce: the native oracle
        for name in ("ring", "direct", "recursive_doubling"):
            buf = x.clone()
            get_class(name)(None).all_reduce(buf, "sum", t)
            assert same_bytes(buf, oracle), (name, n)
        buf = x.clone()
        get_class("ring")(None).all_reduce(buf, "max", t)
        mx = x.clone()
        WORLD.Allreduce(MPI.IN_PLACE, mx.numpy(), op=MPI.MAX)
        assert same_bytes(buf, mx), ("max", n)
    # all-to-all: rank r sends block q = [100 r + q, ...] to rank q
    src = torch.cat([torch.full((3,), 100.0 * t.rank + q) for q in range(2)])
    dst = torch.empty_like(src)
    lay, _, _ = make_layout(dst, src, None, None, 2, t.rank)
    for name in ("pairwise", "direct"):
        dst.zero_()
        get_class(name)(None).all_to_all(dst.view(torch.uint8), src.view(torch.uint8), lay, t)
        want = torch.cat([torch.full((3,), 100.0 * q + t.rank) for q in range(2)])
        assert same_bytes(dst, want), name
    # rooted: binomial broadcast and reduce, dissemination barrier
    tree = get_class("binomial")(None)
    for root in (0, 1):
        b = torch.arange(5, dtype=torch.float64) * (root + 2) if t.rank == root else torch.zeros(5,
                                                                                           dtype=torch.float64)
        tree.broadcast(b, root, t)
        assert same_bytes(b, torch.arange(5, dtype=torch.float64) * (root + 2))
        r = torch.full((4,), float(t.rank + 1))
        tree.reduce(r, root, "sum", t)
        if t.rank == root:
            assert r.tolist() == [3.0] * 4
    get_class("dissemination")(None).barrier(t)


@case
def apps_mpi_comm_exchanges_halos_over_mpi_transport(t: MpiTransport):
    from hpdl.apps.comm import MpiComm

    c = MpiComm("cpu")
    assert isinstance(c.transport, MpiTransport) and c.transport.comm is c.comm
    peer = 1 - c.rank
    send = [torch.full((6,), 10.0 * c.rank + k) for k in range(2)]
    recv = [torch.empty(6) for _ in range(2)]
    c.start_halo([(peer, send[0])], [(peer, recv[0])]).wait()
    assert recv[0].tolist() == [10.0 * peer] * 6
    c.start_halo([(peer, send[1])], [(peer, recv[1])]).wait()
    assert recv[1].tolist() == [10.0 * peer + 1] * 6
    t2 = torch.tensor([float(c.rank + 1)] * 3)
    c.allreduce(t2)   # MPI's own Allreduce, kept as the baseline
    assert t2.tolist() == [3.0] * 3


if __name__ == "__main__":
    out = sys.argv[1]
    only = sys.argv[2:]
    transport = MpiTransport(timeout=60.0)
    results = {}
    for name, fn in CASES.items():
        if only and name not in only:
            continue
        try:
            fn(transport)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported per case to the test
            results[name] = traceback.format_exc()
        WORLD.Barrier()   # a failed case leaves no rank behind in the next one
    with open(f"{out}/rank{transport.rank}.json", "w") as fh:
        json.dump(results, fh)
