"""``native``: torch.distributed itself, the correctness oracle and the baseline of every benchmark."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from hpdl.comm.algorithms.base import Algorithm
from hpdl.comm.ops import to_torch_op
from hpdl.comm.transport.base import Transport
from hpdl.runtime.errors import CollectiveTimeoutError


def _wait(work, comm: Transport, what: str) -> None:
    """Wait for a torch.distributed Work within the call's timeout (gloo honours it; NCCL has its watchdog)."""
    if getattr(comm, "backend", "") == "nccl":
        work.wait()
        return
    try:
        work.wait(timedelta(seconds=comm.timeout))
    except RuntimeError as exc:
        if "imeout" in str(exc) or "timed out" in str(exc).lower():
            raise CollectiveTimeoutError(f"native {what} did not complete within {comm.timeout:.0f}s on rank "
                                         f"{comm.rank}: a peer did not answer (torch.distributed does not say "
                                         f"which; algorithm='direct' or HPDL_CHECK names it)") from None
        raise


class Native(Algorithm):
    """Delegates to ``torch.distributed`` on the transport's group (avg = sum then divide off NCCL)."""

    name = "native"
    supports_phases = True

    def all_reduce(self, buf: torch.Tensor, op: str, comm: Transport) -> None:
        group = getattr(comm, "group", None)
        if op == "avg" and getattr(comm, "backend", "") == "nccl":
            dist.all_reduce(buf, op=dist.ReduceOp.AVG, group=group)
            return
        _wait(dist.all_reduce(buf, op=to_torch_op(op), group=group, async_op=True), comm, "all_reduce")
        if op == "avg":
            if buf.dtype in (torch.float16, torch.bfloat16):
                buf.copy_(buf.float().div_(comm.world_size))
            else:
                buf.div_(comm.world_size)

    def reduce_scatter(self, blocks, out, op, comm):
        group = getattr(comm, "group", None)
        sizes = {b.numel() for b in blocks}
        if len(sizes) == 1 and getattr(comm, "backend", "") == "nccl":
            inp = torch.cat(list(blocks)) if len(blocks) > 1 else blocks[0]
            tmp = torch.empty_like(out)
            dist.reduce_scatter_tensor(tmp, inp, op=to_torch_op(op), group=group)
        else:  # gloo has no reduce_scatter: all_reduce a copy and keep this rank's block
            inp = torch.cat(list(blocks))
            dist.all_reduce(inp, op=to_torch_op(op), group=group)
            start = sum(b.numel() for b in blocks[:comm.rank])
            tmp = inp[start:start + out.numel()]
        if op == "avg":
            tmp = tmp.float().div_(comm.world_size) if tmp.dtype in (torch.float16, torch.bfloat16) \
                else tmp.div_(comm.world_size)
        out.copy_(tmp)

    def all_gather(self, blocks, comm):
        group = getattr(comm, "group", None)
        me = comm.rank
        if len({b.numel() for b in blocks}) == 1:
            out = [torch.empty_like(blocks[me]) for _ in blocks]
            dist.all_gather(out, blocks[me].contiguous(), group=group)
        else:
            raise ValueError("native all_gather needs equal block sizes")
        for q, b in enumerate(blocks):
            if q != me:
                b.copy_(out[q])
