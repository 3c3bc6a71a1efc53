"""Ring all-reduce: ring reduce-scatter then ring all-gather (Patarasuk & Yuan 2009; what NCCL's ring does).

The conventional baseline the Direct Sendrecv paper compares against: 2(p-1) dependent steps, each a
sendrecv with the neighbours. Partial sums travel in the tensor's dtype (as NCCL's do), added in float32
for 16-bit types at each hop.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hpdl.comm.algorithms.base import AllGather, AllReduce, ReduceScatter, Workspace, scratch
from hpdl.comm.ops import acc_dtype, combine_, finalize_, shard_bounds
from hpdl.comm.transport.base import Transport


def ring_reduce_scatter(blocks: Sequence[torch.Tensor], out: torch.Tensor, op: str, comm: Transport,
                        tag: int = 3, workspace: Workspace | None = None) -> None:
    """After p-1 steps rank r holds the reduction of block r; ``blocks`` are not modified."""
    me, p = comm.rank, comm.world_size
    right, left = (me + 1) % p, (me - 1) % p
    if p == 1:
        acc = blocks[0].to(acc_dtype(out.dtype), copy=True)
        finalize_(acc, out, op, 1)
        return
    width = max(b.numel() for b in blocks)
    send_buf = scratch(workspace, "send", width, out.dtype, out.device)
    recv_buf = scratch(workspace, "recv", width, out.dtype, out.device)
    acc_buf = scratch(workspace, "acc", width, acc_dtype(out.dtype), out.device)
    outgoing = blocks[(me - 1) % p]
    for step in range(p - 1):
        idx = (me - step - 2) % p
        n = blocks[idx].numel()
        recv = recv_buf[:n]
        comm.exchange(outgoing, right, recv, left, tag)
        acc = acc_buf[:n]
        acc.copy_(blocks[idx])
        combine_(acc, recv, op)
        if step == p - 2:
            finalize_(acc, out, op, p)
        else:
            send_buf, recv_buf = recv_buf, send_buf  # the old send buffer is free once the exchange waited
            outgoing = send_buf[:n]
            outgoing.copy_(acc)


def ring_all_gather(blocks: Sequence[torch.Tensor], comm: Transport, tag: int = 4) -> None:
    """Step s forwards block (rank - s) to the right and receives block (rank - s - 1) from the left."""
    me, p = comm.rank, comm.world_size
    right, left = (me + 1) % p, (me - 1) % p
    for step in range(p - 1):
        comm.exchange(blocks[(me - step) % p], right, blocks[(me - step - 1) % p], left, tag)


class Ring(AllReduce, ReduceScatter, AllGather):
    """Ring reduce-scatter + ring all-gather over shards of near-equal size."""

    name = "ring"

    def all_reduce(self, buf: torch.Tensor, op: str, comm: Transport) -> None:
        blocks = [buf[a:b] for a, b in shard_bounds(buf.numel(), comm.world_size)]
        ring_reduce_scatter(blocks, blocks[comm.rank], op, comm, workspace=self.workspace)
        ring_all_gather(blocks, comm)

    def reduce_scatter(self, blocks, out, op, comm):
        ring_reduce_scatter(blocks, out, op, comm, workspace=self.workspace)

    def all_gather(self, blocks, comm):
        ring_all_gather(blocks, comm)
