"""Conformance cases of hpdl.comm's Transport interface, written once for every backend (mpi4py's mixin
pattern): each ``case(t)`` runs on both ranks of a 2-rank transport ``t`` and raises AssertionError when a
check fails. Run by test_comm_gloo_transport.py (GlooTransport, two threads) and, under ``mpiexec -n 2``, by
_mpi_transport_cases.py (MpiTransport). Every check is exact: integer-valued data, compared byte for byte.
"""

import torch

from hpdl.comm.algorithms.base import get_class
from hpdl.comm.transport.base import Transport

CASES = {}


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
def every_dtype_and_shape_arrives_bit_identical(t: Transport):
    peer = 1 - t.rank
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8,
                  torch.bool, torch.complex64):
        for shape in ((37,), (3, 5), (), (0,), (300_000,)):   # 300k elements: past MPICH's eager limit
            x, y = value(t.rank, shape, dtype), torch.empty(shape, dtype=dtype)
            t.exchange(x, peer, y, peer, tag=5)
            assert same_bytes(y, value(peer, shape, dtype)), (dtype, shape)


@case
def per_message_isend_irecv_match_by_tag_then_posting_order(t: Transport):
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
def exchange_all_gives_every_rank_every_row(t: Transport):
    rows = t.exchange_all(torch.tensor([10 * t.rank + 1, 10 * t.rank + 2]), tag=13)
    assert [r.tolist() for r in rows] == [[1, 2], [11, 12]]


@case
def hpdl_algorithms_run_over_it_exactly(t: Transport):
    """hpdl.comm's algorithm classes on a bare transport (``resources=None``): all-reduce, all-to-all, the
    rooted trees and the barrier, against sums computed here (both ranks' inputs come from known seeds)."""
    from hpdl.comm.algorithms.layout import make_layout

    for n in (1, 7, 1000, 65_537):
        xs = [torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(100 + r)).float()
              for r in range(2)]
        for name, op, want in (("ring", "sum", xs[0] + xs[1]), ("direct", "sum", xs[0] + xs[1]),
                               ("recursive_doubling", "sum", xs[0] + xs[1]),
                               ("ring", "max", torch.maximum(xs[0], xs[1]))):
            buf = xs[t.rank].clone()
            get_class(name)(None).all_reduce(buf, op, t)
            assert same_bytes(buf, want), (name, op, n)
    # all-to-all: rank r sends block q = [100 r + q, ...] to rank q
    src = torch.cat([torch.full((3,), 100.0 * t.rank + q) for q in range(2)])
    dst = torch.empty_like(src)
    lay, _, _ = make_layout(dst, src, None, None, 2, t.rank)
    for name in ("pairwise", "direct"):
        dst.zero_()
        get_class(name)(None).all_to_all(dst.view(torch.uint8), src.view(torch.uint8), lay, t)
        assert same_bytes(dst, torch.cat([torch.full((3,), 100.0 * q + t.rank) for q in range(2)])), name
    tree = get_class("binomial")(None)
    for root in (0, 1):
        want = torch.arange(5, dtype=torch.float64) * (root + 2)
        b = want.clone() if t.rank == root else torch.zeros(5, dtype=torch.float64)
        tree.broadcast(b, root, t)
        assert same_bytes(b, want)
        r = torch.full((4,), float(t.rank + 1))
        tree.reduce(r, root, "sum", t)
        if t.rank == root:
            assert r.tolist() == [3.0] * 4
    get_class("dissemination")(None).barrier(t)
