"""``native``: torch.distributed itself, the correctness oracle and the baseline of every benchmark."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from hpdl.comm.algorithms.base import AllGather, AllReduce, AllToAll, Barrier, Broadcast, Reduce, ReduceScatter
from hpdl.comm.ops import to_torch_op
from hpdl.comm.transport.base import Transport
from hpdl.runtime.errors import CollectiveTimeoutError


def wait_native(work, comm: Transport, what: str, timeout: float | None = None) -> None:
    """Wait for a torch.distributed Work within ``timeout`` (default the transport's; gloo honours it, NCCL
    has its watchdog). A timeout becomes :class:`CollectiveTimeoutError`; the API's post-mortem then names
    the rank (torch.distributed does not say which)."""
    if getattr(comm, "backend", "") == "nccl":
        work.wait()
        return
    limit = comm.timeout if timeout is None else timeout
    try:
        work.wait(timedelta(seconds=limit))
    except RuntimeError as exc:
        if "imeout" in str(exc) or "timed out" in str(exc).lower():
            raise CollectiveTimeoutError(f"native {what} did not complete within {limit:.0f}s on rank "
                                         f"{comm.rank}: a peer did not answer") from None
        raise


class Pending:
    """A torch.distributed collective in flight (issued, not waited) and what finishes it after the wait
    (the division of avg on gloo, copies back into the caller's tensor). :class:`hpdl.comm.Work` holds one."""

    def __init__(self, work, comm: Transport, what: str, finish=None):
        self.work, self.comm, self.what = work, comm, what
        self.finish = [finish] if finish is not None else []
        self._lock = threading.Lock()   # wait() and a future's callback may both finish: once, the other waits

    def then(self, fn) -> "Pending":
        self.finish.append(fn)
        return self

    def wait(self, timeout: float | None = None) -> None:
        wait_native(self.work, self.comm, self.what, timeout)
        self.run_finish()

    def run_finish(self) -> None:
        with self._lock:
            fns, self.finish = self.finish, []
            for fn in fns:
                fn()


def _avg(buf: torch.Tensor, world: int) -> None:
    if buf.dtype in (torch.float16, torch.bfloat16):
        buf.copy_(buf.float().div_(world))
    else:
        buf.div_(world)


class Native(AllReduce, ReduceScatter, AllGather, AllToAll, Broadcast, Reduce, Barrier):
    """Delegates to ``torch.distributed`` on the transport's group (avg = sum then divide off NCCL).

    Each method issues its torch collective on the calling thread and returns a :class:`Pending` without
    waiting, so that an ``async_op=True`` call is matched across ranks in call order, like torch's own.
    CUDA tensors on a gloo group (ranks sharing a GPU) go through host copies: gloo's own CUDA support does
    not cover every collective, and the copies make the oracle the same code as on CPU.
    """

    name = "native"

    @staticmethod
    def _host(comm: Transport, *tensors: torch.Tensor) -> bool:
        return getattr(comm, "backend", "") == "gloo" and any(t.is_cuda for t in tensors)

    def all_reduce(self, buf: torch.Tensor, op: str, comm: Transport) -> Pending:
        if self._host(comm, buf):
            host = buf.cpu()
            return self.all_reduce(host, op, comm).then(lambda: buf.copy_(host))
        group = getattr(comm, "group", None)
        if op == "avg" and getattr(comm, "backend", "") == "nccl":
            return Pending(dist.all_reduce(buf, op=dist.ReduceOp.AVG, group=group, async_op=True), comm,
                           "all_reduce")
        finish = (lambda: _avg(buf, comm.world_size)) if op == "avg" else None
        return Pending(dist.all_reduce(buf, op=to_torch_op(op), group=group, async_op=True), comm, "all_reduce",
                       finish)

    def reduce_scatter(self, blocks, out, op, comm) -> Pending:
        if self._host(comm, out, *blocks):
            host_out = torch.empty(out.shape, dtype=out.dtype)
            return self.reduce_scatter([b.cpu() for b in blocks], host_out, op, comm).then(
                lambda: out.copy_(host_out))
        group = getattr(comm, "group", None)
        sizes = {b.numel() for b in blocks}
        if len(sizes) == 1 and getattr(comm, "backend", "") == "nccl":
            inp = torch.cat(list(blocks)) if len(blocks) > 1 else blocks[0]
            tmp = torch.empty_like(out)
            work = dist.reduce_scatter_tensor(tmp, inp, op=to_torch_op(op), group=group, async_op=True)
        else:  # gloo has no reduce_scatter: all_reduce a copy and keep this rank's block
            inp = torch.cat(list(blocks))
            work = dist.all_reduce(inp, op=to_torch_op(op), group=group, async_op=True)
            start = sum(b.numel() for b in blocks[:comm.rank])
            tmp = inp[start:start + out.numel()]

        def finish() -> None:
            if op == "avg":
                _avg(tmp, comm.world_size)
            out.copy_(tmp)
        return Pending(work, comm, "reduce_scatter", finish)

    def all_gather(self, blocks, comm) -> Pending:
        if self._host(comm, *blocks):
            host = [b.cpu() for b in blocks]

            def back() -> None:
                for b, h in zip(blocks, host):
                    b.copy_(h)
            return self.all_gather(host, comm).then(back)
        group = getattr(comm, "group", None)
        me = comm.rank
        if len({b.numel() for b in blocks}) != 1:
            raise ValueError("native all_gather needs equal block sizes")
        out = [torch.empty_like(blocks[me]) for _ in blocks]
        work = dist.all_gather(out, blocks[me].contiguous(), group=group, async_op=True)

        def finish() -> None:
            for q, b in enumerate(blocks):
                if q != me:
                    b.copy_(out[q])
        return Pending(work, comm, "all_gather", finish)

    def all_to_all(self, dst: torch.Tensor, src: torch.Tensor, lay, comm: Transport) -> Pending:
        """``torch.distributed.all_to_all_single`` on byte views (the oracle and baseline); equal splits are
        passed as None, so NCCL takes the same path as a plain equal-split call."""
        if self._host(comm, dst, src):
            host = torch.empty(dst.shape, dtype=dst.dtype)
            return self.all_to_all(host, src.cpu(), lay, comm).then(lambda: dst.copy_(host))
        equal = len(set(lay.recv_len)) == 1 and len(set(lay.send_len)) == 1
        work = dist.all_to_all_single(dst, src, None if equal else list(lay.recv_len),
                                      None if equal else list(lay.send_len), group=getattr(comm, "group", None),
                                      async_op=True)
        return Pending(work, comm, "all_to_all_single")


    def broadcast(self, buf: torch.Tensor, root: int, comm: Transport) -> Pending:
        """``torch.distributed.broadcast`` with ``group_src=root`` (a rank of the group)."""
        work = dist.broadcast(buf, group=getattr(comm, "group", None), async_op=True, group_src=root)
        return Pending(work, comm, "broadcast")

    def reduce(self, buf: torch.Tensor, root: int, op: str, comm: Transport) -> Pending:
        """``torch.distributed.reduce`` with ``group_dst=root``; avg is a sum divided at the root. The other
        ranks reduce a copy, so their ``buf`` is left as it was (torch leaves that unspecified)."""
        group = getattr(comm, "group", None)
        mine = comm.rank == root
        tmp = buf if mine else buf.clone()
        if op == "avg" and getattr(comm, "backend", "") == "nccl":
            return Pending(dist.reduce(tmp, op=dist.ReduceOp.AVG, group=group, async_op=True, group_dst=root), comm,
                           "reduce")
        finish = (lambda: _avg(buf, comm.world_size)) if op == "avg" and mine else None
        return Pending(dist.reduce(tmp, op=to_torch_op(op), group=group, async_op=True, group_dst=root), comm,
                       "reduce", finish)

    def barrier(self, comm: Transport) -> Pending:
        return Pending(dist.barrier(group=getattr(comm, "group", None), async_op=True), comm, "barrier")


def run_sync(result, timeout: float | None = None) -> None:
    """Wait for what an algorithm method returned (a :class:`Pending`, or None when it ran to completion)."""
    if result is not None:
        result.wait(timeout)
