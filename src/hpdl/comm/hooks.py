"""DDP communication hook: gradient buckets all-reduced (averaged) through hpdl.comm.

>>> # model = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
>>> # hpdl.comm.hooks.register(model, algorithm="auto")   # uses model.process_group

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
    """Arguments of every bucket's all-reduce: ``algorithm``, ``window`` and ``group``, which must be the DDP
    model's own process group (None means the default world group; :func:`register` fills it in)."""

    algorithm: str = "auto"
    group: object = None
    window: int | None = None


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` (1-D, the bucket's gradients) over the group; returns a torch Future of it.

    Raises: what :func:`hpdl.comm.all_reduce` raises, directly for CUDA buckets and through the future for CPU.
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


def register(model: torch.nn.parallel.DistributedDataParallel, algorithm: str = "auto",
             window: int | None = None) -> HookState:
    """Register :func:`allreduce_hook` on ``model`` over the model's own process group; returns the state."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"model must be a DistributedDataParallel module, got {type(model).__name__}")
    state = HookState(algorithm=algorithm, group=model.process_group, window=window)
    model.register_comm_hook(state, allreduce_hook)
    return state
