"""CPU staging for small GPU messages (seed 1): device -> pinned host, reduce on the host, host -> device.

For tiny CUDA tensors the host path can beat a GPU collective whose floor is a kernel launch plus NCCL's
own latency; the GPU benchmark decides where (kept in the tuning table only where it wins). On CPU tensors
the staging copies vanish and this is the host path itself: recursive doubling below
``RD_MAX_BYTES``, throttled Direct Sendrecv above.
"""

from __future__ import annotations

import torch

from hpdl.comm.algorithms.base import AllReduce
from hpdl.comm.algorithms.direct import Direct
from hpdl.comm.algorithms.recursive_doubling import recursive_doubling_all_reduce
from hpdl.comm.transport.base import Transport

RD_MAX_BYTES = 64 << 10


class Staged(AllReduce):
    """Host-side all-reduce over the group's host transport (gloo), staging CUDA tensors through pinned memory.

    ``host_comm`` (keyword-only) replaces the resources' host transport, for use without a GroupResources."""

    name = "staged"

    def __init__(self, resources=None, window: int | None = None, timeout: float | None = None, *,
                 host_comm: Transport | None = None):
        super().__init__(resources, window, timeout)
        self.host_comm = host_comm if host_comm is not None or resources is None else resources.host(self.timeout)
        self._pinned: torch.Tensor | None = None

    def _host_all_reduce(self, buf: torch.Tensor, op: str, comm: Transport) -> None:
        if buf.numel() * buf.element_size() <= RD_MAX_BYTES:
            recursive_doubling_all_reduce(buf, op, comm)
        else:
            Direct(None, self.window).all_reduce(buf, op, comm)

    def all_reduce(self, buf: torch.Tensor, op: str, comm: Transport) -> None:
        if buf.device.type == "cpu":
            self._host_all_reduce(buf, op, comm)
            return
        host = self.host_comm
        if host is None:
            raise ValueError("algorithm='staged' on CUDA tensors needs a gloo cpu_group beside the NCCL group "
                             "(hpdl.runtime contexts create one)")
        nbytes = buf.numel() * buf.element_size()
        if self._pinned is None or self._pinned.numel() < nbytes:
            self._pinned = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=True)
        staging = self._pinned[:nbytes].view(buf.dtype)
        staging.copy_(buf, non_blocking=True)
        torch.cuda.current_stream(buf.device).synchronize()
        self._host_all_reduce(staging, op, host)
        buf.copy_(staging, non_blocking=True)
