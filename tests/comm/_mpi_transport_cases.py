"""Run under ``mpiexec -n 2`` by test_comm_mpi_transport.py: the Transport conformance cases
(_transport_cases.py) and MpiTransport's own on an MpiTransport; each rank writes ``OUT/rank<r>.json`` mapping a
case name to "ok" or the failure's traceback.

Every check is exact: integer-valued floats whose sums are exact, compared byte for byte.
"""

import json
import sys
import traceback

import torch
from mpi4py import MPI

from _transport_cases import CASES, case, same_bytes   # this script's folder is on sys.path
from hpdl.comm.transport.mpi import MpiTransport
from hpdl.runtime.errors import CollectiveMismatchError, CollectiveTimeoutError

WORLD = MPI.COMM_WORLD


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
    for timeout, exc_type, msg in ((0, ValueError, "timeout must be a finite number of seconds > 0, got 0.0"),
                                   (-1, ValueError, "got -1.0"), (float("inf"), ValueError, "got inf"),
                                   ("5", TypeError, "timeout must be a number of seconds > 0, got '5'")):
        try:
            MpiTransport(timeout=timeout)
        except exc_type as exc:
            assert msg in str(exc), str(exc)
        else:
            raise AssertionError(f"timeout={timeout!r} accepted")
    for device, msg in (("meta", "device must be a CPU or CUDA device, got meta"),
                        *((("cuda", "device=cuda: torch sees no CUDA GPU on this host"),)
                          if not torch.cuda.is_available() else ())):
        try:
            MpiTransport(device=device)
        except ValueError as exc:
            assert msg in str(exc), str(exc)
        else:
            raise AssertionError(f"device={device!r} accepted")
    # nothing was posted above: the next message on tag 14 is the first
    y = torch.empty(1)
    t.exchange(torch.tensor([float(t.rank + 40)]), 1 - t.rank, y, 1 - t.rank, tag=14)
    assert y.item() == float(1 - t.rank + 40)


@case
def a_receive_of_another_size_than_its_message_names_the_peer_and_both_sizes(t: MpiTransport):
    """A larger buffer (MPI completes it, counting fewer bytes) and a smaller one (MPI's "Message truncated")
    both raise CollectiveMismatchError on the receiver, naming the sender and the sizes; never garbage."""
    named = _Named(timeout=30.0)
    if t.rank == 1:
        for n, text in ((8, "rank 1 received 16 bytes from agent 0 on node-0 into a 32-byte buffer (tag 21)"),
                        (2, "rank 1's recv from agent 0 on node-0 got a message larger than its 8-byte buffer")):
            try:
                named.recv(torch.zeros(n), 0, 21)
            except CollectiveMismatchError as exc:
                assert text in str(exc), str(exc)
            else:
                raise AssertionError(f"a {n}-float buffer took a 4-float message")
    else:
        for _ in range(2):
            t.send(torch.full((4,), 1.0), 1, 21)
    WORLD.Barrier()
    y = torch.empty(1)   # the tag still carries messages
    t.exchange(torch.tensor([float(t.rank)]), 1 - t.rank, y, 1 - t.rank, tag=21)
    assert y.item() == float(1 - t.rank)


@case
def hpdl_algorithms_equal_mpi_allreduce_bit_for_bit(t: MpiTransport):
    """MPI's own Allreduce (the native oracle) and hpdl's schedules over MpiTransport give the same bytes."""
    from hpdl.comm.algorithms.base import get_class

    g = torch.Generator().manual_seed(7 + t.rank)
    for n in (1, 1000, 65_537):
        x = torch.randint(-1000, 1000, (n,), generator=g).to(torch.float32)   # sums of these are exact
        for op, mpi_op in (("sum", MPI.SUM), ("max", MPI.MAX)):
            oracle = x.clone()
            WORLD.Allreduce(MPI.IN_PLACE, oracle.numpy(), op=mpi_op)
            for name in ("ring", "direct", "recursive_doubling"):
                buf = x.clone()
                get_class(name)(None).all_reduce(buf, op, t)
                assert same_bytes(buf, oracle), (name, op, n)


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
