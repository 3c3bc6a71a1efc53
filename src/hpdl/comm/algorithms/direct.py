"""Direct Sendrecv all-reduce with throttling and overlap (seed 1; Chen et al., ICPP 2025).

Reduce-scatter: every rank exchanges shards directly with every peer (no ring dependency chain), at most
``k`` peers in flight at a time (the throttle), reducing each arriving shard while the next ones are still in
flight. All-gather: every rank sends its reduced shard directly to every peer, with the same window.
Rounds: 2 * ceil((p-1)/k); bytes sent per rank: 2 (p-1)/p n, as the ring. Peers are visited at distances
1, 2, ..., p-1 (send to rank+d, receive from rank-d), so each posted receive has its matching send in the
same window on the other side, and the reduction order is fixed: results are bit-identical on all ranks.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

from hpdl.comm.algorithms.alltoall import throttled_direct
from hpdl.comm.algorithms.base import AllGather, AllReduce, AllToAll, ReduceScatter, Workspace, scratch
from hpdl.comm.ops import acc_dtype, combine_, finalize_, shard_bounds
from hpdl.comm.transport.base import Transport

DEFAULT_WINDOW = 4  # peers in flight; tuned per device/world by hpdl.comm.tuning


def window_size(window: int | None, world_size: int) -> int:
    """Effective throttle: ``window`` clamped to [1, world_size-1]; None or 0 means the default."""
    k = DEFAULT_WINDOW if not window else int(window)
    if k < 0:
        raise ValueError(f"window must be >= 1 (0 or None for the default), got {window}")
    return max(1, min(k, world_size - 1))


def direct_reduce_scatter(blocks: Sequence[torch.Tensor], out: torch.Tensor, op: str, comm: Transport,
                          window: int | None = None, tag: int = 1, workspace: Workspace | None = None) -> None:
    """``out = reduce_q blocks_q[rank]`` over all ranks q; ``blocks[q]`` is sent to rank q.

    ``out`` may alias ``blocks[rank]``. Accumulates in float32 for 16-bit dtypes; one rounding at the end.
    Receive slots and the accumulator come from ``workspace`` when given (persistent across calls).
    """
    me, p = comm.rank, comm.world_size
    n = blocks[me].numel()
    acc = scratch(workspace, "acc", n, acc_dtype(out.dtype), out.device)
    acc.copy_(blocks[me])
    k = window_size(window, p)
    ring = scratch(workspace, "slots", n * min(k, p - 1), out.dtype, out.device)
    slots = [ring[i * n:(i + 1) * n] for i in range(min(k, p - 1))]
    pending: deque = deque()

    def post(d: int) -> None:
        dst, src = (me + d) % p, (me - d) % p
        slot = slots[(d - 1) % len(slots)]
        sends, recvs = comm.post([(blocks[dst], dst)], [(slot, src)], tag)
        pending.append((slot, sends[0], recvs[0]))

    next_d = 1
    while next_d <= min(k, p - 1):
        post(next_d)
        next_d += 1
    while pending:
        slot, sreq, rreq = pending.popleft()
        rreq.wait()
        combine_(acc, slot, op)  # later receives stay in flight meanwhile (overlap)
        sreq.wait()
        if next_d <= p - 1:
            post(next_d)
            next_d += 1
    finalize_(acc, out, op, p)


def direct_all_gather(blocks: Sequence[torch.Tensor], comm: Transport, window: int | None = None,
                      tag: int = 2) -> None:
    """Fill every ``blocks[q]`` (q != rank) from rank q, sending ``blocks[rank]`` to all, ``k`` peers at a time."""
    me, p = comm.rank, comm.world_size
    k = window_size(window, p)
    pending: deque = deque()
    for d in range(1, p):
        dst, src = (me + d) % p, (me - d) % p
        sends, recvs = comm.post([(blocks[me], dst)], [(blocks[src], src)], tag)
        pending.append(sends + recvs)
        if len(pending) >= k:
            for req in pending.popleft():
                req.wait()
    while pending:
        for req in pending.popleft():
            req.wait()


class Direct(AllReduce, ReduceScatter, AllGather, AllToAll):
    """Throttled Direct Sendrecv: direct reduce-scatter + direct all-gather, window ``k`` peers; for all_to_all
    the scattered exchange with ``window`` peers in flight (None = all)."""

    name = "direct"

    def all_reduce(self, buf: torch.Tensor, op: str, comm: Transport) -> None:
        blocks = [buf[a:b] for a, b in shard_bounds(buf.numel(), comm.world_size)]
        direct_reduce_scatter(blocks, blocks[comm.rank], op, comm, self.window, workspace=self.workspace)
        direct_all_gather(blocks, comm, self.window)

    def reduce_scatter(self, blocks, out, op, comm):
        direct_reduce_scatter(blocks, out, op, comm, self.window, workspace=self.workspace)

    def all_gather(self, blocks, comm):
        direct_all_gather(blocks, comm, self.window)

    def all_to_all(self, dst, src, lay, comm):
        throttled_direct(dst, src, lay, comm, self.window)
