"""Conformance cases of hpdl.comm's Transport interface, written once for every backend (mpi4py's mixin
pattern): each ``case(t)`` runs on both ranks of a 2-rank transport ``t`` and raises AssertionError when a
check fails. Run by test_comm_gloo_transport.py (GlooTransport, two threads) and, under ``mpiexec -n 2``, by
_mpi_transport_cases.py (MpiTransport). Every check is exact: integer-valued data, compared byte for byte.
"""

import torch

from hpdl.comm.algorithms.base import get_class
from hpdl.comm.transport.base import Transport
from hpdl.runtime.errors import CollectiveMismatchError

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


def raises(exc_type, text: str, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        assert text in str(exc), f"{text!r} not in {str(exc)!r}"
    else:
        raise AssertionError(f"no {exc_type.__name__} ({text!r})")


@case
def exchange_all_of_mismatched_tensors_raises_on_every_rank(t: Transport):
    """A rank passing another size (or, at one size, another dtype or shape) is an error on every rank, never
    garbage or a torn message (MPI: "Message truncated" on one rank; Gloo aborted the process)."""
    big = 4 if t.rank == 0 else 8
    raises(CollectiveMismatchError, "rank 0: 16 bytes, rank 1: 32 bytes", t.exchange_all, torch.full((big,), 1.0),
           tag=15)
    raises(CollectiveMismatchError, "differ in size, shape or dtype", t.exchange_all,
           torch.zeros(4, dtype=torch.float32 if t.rank == 0 else torch.int32), tag=15)
    raises(CollectiveMismatchError, "differ in size, shape or dtype", t.exchange_all,
           torch.zeros((2, 3) if t.rank == 0 else (3, 2)), tag=15)
    raises(CollectiveMismatchError, "rank 0: 8000 bytes, rank 1: 8008 bytes", t.exchange_all,
           torch.zeros(1000 + t.rank, dtype=torch.float64), tag=15)   # past the inline part: caught by the header
    rows = t.exchange_all(torch.tensor([t.rank + 20]), tag=15)   # the tag carries nothing left over
    assert [r.tolist() for r in rows] == [[20], [21]]


@case
def exchange_all_moves_every_dtype_and_size_inline_or_not(t: Transport):
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.bool, torch.int8, torch.complex128):
        for shape in ((), (0,), (3, 0), (5,), (2, 3), (63,), (126,), (127,), (1000,)):   # 126 x 8 B fill it exactly
            rows = t.exchange_all(value(t.rank, shape, dtype), tag=17)
            assert len(rows) == 2 and all(same_bytes(rows[q], value(q, shape, dtype)) for q in range(2)), \
                (dtype, shape)


@case
def exchange_all_takes_a_non_contiguous_tensor_on_some_ranks_only(t: Transport):
    # 300 x 400 float32 (over the inline limit): rank 1's is a transposed view; its send was refused on that rank
    # alone while rank 0 waited for the bytes until its timeout
    base = value(0, (300, 400), torch.float32)
    mine = base if t.rank == 0 else base.t().contiguous().t()
    rows = t.exchange_all(mine, tag=18)
    assert all(same_bytes(r, base) for r in rows)


@case
def bad_arguments_raise_the_shared_checks_before_anything_is_posted(t: Transport):
    x, peer = torch.zeros(4), 1 - t.rank
    raises(TypeError, "tag must be an int (in [0, ", t.post, [(x, peer)], [], tag=1.5)
    raises(ValueError, "tag must be in [0, ", t.post, [(x, peer)], [], tag=-1)
    raises(TypeError, "send peer must be an int", t.post, [(x, float(peer))], [], tag=16)
    raises(TypeError, "recv peer must be an int", t.post, [], [(x, True)], tag=16)
    raises(TypeError, "send tensor must be a torch.Tensor, got list", t.post, [([1.0, 2.0], peer)], [], tag=16)
    raises(TypeError, "recv tensor must be a torch.Tensor, got ndarray", t.post, [], [(x.numpy(), peer)], tag=16)
    raises(ValueError, "got a sparse_coo (not dense) cpu tensor", t.post, [(x.to_sparse(), peer)], [], tag=16)
    raises(ValueError, "lazy conjugate/negative view", t.post,
           [(torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj(), peer)], [], tag=16)
    raises(ValueError, "got a non-contiguous cpu tensor", t.post, [], [(torch.zeros(3, 3).t(), peer)], tag=16)
    raises(ValueError, "got a meta tensor", t.post, [(torch.empty(2, device="meta"), peer)], [], tag=16)
    raises(ValueError, "send peer must be", t.post, [(x, 2)], [], tag=16)
    # nothing was posted above: the next message on tag 16 is the first (a resolved conjugate view travels)
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj().resolve_conj()
    y = torch.empty(2, dtype=torch.complex64)
    t.exchange(z, peer, y, peer, tag=16)
    assert same_bytes(y, z)


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


def on_torch_transport(ctx) -> dict:
    """Rank body for hpdl.testing's pool: every case over a TorchTransport on the pool's gloo world; returns
    case name -> "ok" or the failure's traceback (a barrier after each: a failed case leaves no rank behind)."""
    import traceback

    import torch.distributed as dist

    from hpdl.comm.transport.torch_p2p import TorchTransport

    t, out = TorchTransport(None, 60.0), {}
    for name, fn in CASES.items():
        try:
            fn(t)
            out[name] = "ok"
        except Exception:  # noqa: BLE001 - reported per case to the test
            out[name] = traceback.format_exc()
        dist.barrier()
    return out
