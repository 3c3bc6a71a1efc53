"""Binomial-tree broadcast and reduce, and the dissemination barrier, over the transport interface.

Broadcast and reduce follow MPICH's binomial trees (Thakur, Rabenseifner & Gropp, IJHPCA 2005): with ranks
renumbered relative to the root (``v = (rank - root) mod p``), rank ``v`` receives from ``v - 2^k`` where
``2^k`` is its lowest set bit and sends to ``v + 2^j`` for every ``2^j`` below that bit, so the data crosses
``ceil(log2 p)`` rounds; reduce runs the same tree upwards. Partial sums travel in the accumulation dtype
(float32 for 16-bit inputs) and are rounded once at the root, as in the all-reduce schedules.

The barrier is Hensgen, Finkel & Manber's dissemination barrier (IJPP 1988): in round ``k`` every rank signals
``rank + 2^k`` and waits for ``rank - 2^k`` (mod p); after ``ceil(log2 p)`` rounds each rank has heard,
directly or through others, from every rank, so none leaves before all have entered.
"""

from __future__ import annotations

import torch

from hpdl.comm.algorithms.base import Barrier, Broadcast, Reduce
from hpdl.comm.ops import acc_dtype, combine_, finalize_
from hpdl.comm.transport.base import Transport

_TAG = 11   # messages of these schedules between one pair match in posting order; a tag of their own


def binomial_broadcast(buf: torch.Tensor, root: int, comm: Transport, tag: int = _TAG) -> None:
    """Copy ``root``'s ``buf`` (flat, contiguous) into every rank's ``buf``."""
    me, p = comm.rank, comm.world_size
    v = (me - root) % p
    mask = 1
    while mask < p:   # receive from the parent: v with its lowest set bit cleared
        if v & mask:
            comm.exchange(None, 0, buf, ((v - mask) + root) % p, tag)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:   # then send to the children below that bit
        if v + mask < p:
            comm.exchange(buf, ((v + mask) + root) % p, None, 0, tag)
        mask >>= 1


def binomial_reduce(buf: torch.Tensor, root: int, op: str, comm: Transport, tag: int = _TAG) -> None:
    """``root``'s ``buf`` = reduction over ranks of ``buf`` (flat, contiguous); other ranks' ``buf`` unchanged."""
    me, p = comm.rank, comm.world_size
    v = (me - root) % p
    acc = buf.to(acc_dtype(buf.dtype), copy=True)
    tmp = torch.empty_like(acc)
    mask = 1
    while mask < p:
        if v & mask:   # hand the subtree's partial result to the parent and stop
            comm.exchange(acc, ((v - mask) + root) % p, None, 0, tag)
            return
        if v + mask < p:
            comm.exchange(None, 0, tmp, ((v + mask) + root) % p, tag)
            combine_(acc, tmp, op)
        mask <<= 1
    finalize_(acc, buf, op, p)   # only the root gets here


class BinomialTree(Broadcast, Reduce):
    """Broadcast and reduce along a binomial tree rooted at the caller's ``root``: ``ceil(log2 p)`` rounds of
    whole-buffer messages (latency-optimal; for large buffers native's pipelined trees move fewer bytes)."""

    name = "binomial"

    def broadcast(self, buf: torch.Tensor, root: int, comm: Transport) -> None:
        binomial_broadcast(buf, root, comm)

    def reduce(self, buf: torch.Tensor, root: int, op: str, comm: Transport) -> None:
        binomial_reduce(buf, root, op, comm)


class Dissemination(Barrier):
    """Dissemination barrier: ``ceil(log2 p)`` rounds of one-byte messages, no root."""

    name = "dissemination"

    def barrier(self, comm: Transport) -> None:
        me, p = comm.rank, comm.world_size
        token, got = torch.zeros(1, dtype=torch.uint8, device=comm.device), \
            torch.empty(1, dtype=torch.uint8, device=comm.device)
        dist = 1
        while dist < p:
            comm.exchange(token, (me + dist) % p, got, (me - dist) % p, _TAG + 1)
            dist <<= 1
