"""DDP communication hook: gradient buckets all-reduced (averaged) through hpdl.comm.

>>> # model = torch.nn.parallel.DistributedDataParallel(model)
>>> # model.register_comm_hook(HookState(algorithm="auto"), allreduce_hook)

The hook averages each bucket like DDP's default (sum, then divide by world size) with the algorithm of
``HookState``; CPU buckets run on hpdl's ordered async executor, CUDA buckets on the current stream (the
peer kernels are stream-ordered, so the returned future is complete when the work is queued, as NCCL's is).
"""

# no `from __future__ import annotations`: DDP inspects the hook's annotations at registration

from dataclasses import dataclass

import torch
import torch.distributed as dist

import hpdl.comm as hc


@dataclass
class HookState:
    """Arguments of every bucket's all-reduce: ``group`` (None = DDP's), ``algorithm`` and ``window``."""

    algorithm: str = "auto"
    group: object = None
    window: int | None = None


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` (1-D, the bucket's gradients) over the group; returns a torch Future of it.

    Raises (through the future): what :func:`hpdl.comm.all_reduce` raises.
    """
    buf = bucket.buffer()
    fut: torch.futures.Future = torch.futures.Future()
    if buf.is_cuda:
        hc.all_reduce(buf, op="avg", group=state.group, algorithm=state.algorithm, window=state.window)
        fut.set_result(buf)
        return fut
    work = hc.all_reduce(buf, op="avg", group=state.group, algorithm=state.algorithm, window=state.window,
                         async_op=True)

    def _done(f):
        try:
            f.result()
            fut.set_result(buf)
        except Exception as exc:  # noqa: BLE001 - handed to DDP through the future
            fut.set_exception(exc)

    work._future.add_done_callback(_done)
    return fut
