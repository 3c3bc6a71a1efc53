"""Recursive doubling all-reduce for small messages (Thakur, Rabenseifner & Gropp, IJHPCA 2005).

log2(p) exchange steps of the whole buffer; latency-optimal. Non-power-of-two world sizes use the standard
fix-up: with p' the largest power of two <= p and rem = p - p', ranks 0..2*rem-1 pair up first, the even
rank of each pair hands its data to the odd one and sits out, the p' remaining ranks run recursive doubling,
and the odd ranks hand the result back. Partial results travel in the accumulation dtype (float32 for
16-bit inputs), and both partners of a step compute x + y in the same order, so every rank ends bit-identical.
"""

from __future__ import annotations

import torch

from hpdl.comm.algorithms.base import AllReduce
from hpdl.comm.ops import acc_dtype, combine_, finalize_
from hpdl.comm.transport.base import Transport


def recursive_doubling_all_reduce(buf: torch.Tensor, op: str, comm: Transport, tag: int = 5) -> None:
    """Reduce ``buf`` (flat, contiguous) in place over all ranks of ``comm``."""
    me, p = comm.rank, comm.world_size
    acc = buf.to(acc_dtype(buf.dtype), copy=True)
    if p > 1:
        tmp = torch.empty_like(acc)
        pof2 = 1 << (p.bit_length() - 1)
        rem = p - pof2
        if me < 2 * rem and me % 2 == 0:  # fix-up: hand my data to my odd partner and sit out
            comm.exchange(acc, me + 1, None, 0, tag)
            comm.exchange(None, 0, acc, me + 1, tag)  # the finished result comes back
            finalize_(acc, buf, "sum", p)  # already divided for avg by the partner
            return
        if me < 2 * rem:
            comm.exchange(None, 0, tmp, me - 1, tag)
            combine_(acc, tmp, op)
            new_rank = me // 2
        else:
            new_rank = me - rem
        mask = 1
        while mask < pof2:
            partner_new = new_rank ^ mask
            partner = partner_new * 2 + 1 if partner_new < rem else partner_new + rem
            comm.exchange(acc, partner, tmp, partner, tag)
            combine_(acc, tmp, op)  # x + y == y + x bitwise, so both partners hold identical values
            mask <<= 1
        if op == "avg":
            acc.div_(p)
        if me < 2 * rem:
            comm.exchange(acc, me - 1, None, 0, tag)
        finalize_(acc, buf, "sum", p)
        return
    finalize_(acc, buf, op, p)


class RecursiveDoubling(AllReduce):
    """Whole-buffer exchanges with partners at distance 1, 2, 4, ...; best for small messages."""

    name = "recursive_doubling"

    def all_reduce(self, buf: torch.Tensor, op: str, comm: Transport) -> None:
        recursive_doubling_all_reduce(buf, op, comm)
