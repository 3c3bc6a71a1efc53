"""Transport over torch.distributed point-to-point (gloo on CPU, NCCL on GPU, MPI where built).

CUDA tensors on a gloo group (ranks sharing a GPU, ``HPDL_RANKS_PER_GPU`` > 1, where NCCL cannot run) are staged
through host memory: a send copies the tensor to the host when it is posted (after the current stream's
work), a receive lands in a host tensor and is copied into the CUDA tensor when its request is waited for.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from hpdl.comm.transport.base import Request, Transport, check_post, check_timeout
from hpdl.runtime.errors import CollectiveTimeoutError


class _TorchRequest(Request):
    """A c10d ``Work`` of one send or receive (also :class:`~hpdl.comm.transport.gloo.GlooTransport`'s)."""

    def __init__(self, work, transport: "TorchTransport", peer: int, kind: str, landing=None):
        self._work, self._t, self._peer, self._kind = work, transport, peer, kind
        self._landing = landing   # (CUDA destination, host staging tensor) of a staged receive

    def wait(self) -> None:
        self._wait()
        if self._landing is not None:
            dst, host = self._landing
            self._landing = None
            dst.copy_(host)

    def _wait(self) -> None:
        try:
            if self._t.backend == "nccl":
                self._work.wait()  # orders the current stream after the op; NCCL's watchdog owns its timeout
            else:
                self._work.wait(timedelta(seconds=self._t.timeout))
        except RuntimeError as exc:
            msg = str(exc)
            if "imeout" in msg or "timed out" in msg.lower():
                raise CollectiveTimeoutError(
                    f"rank {self._t.rank} waited {self._t.timeout:.0f}s for the {self._kind} "
                    f"{'from' if self._kind == 'recv' else 'to'} {self._t.describe(self._peer)}, which did not answer",
                    missing_ranks=[self._peer]) from None
            raise

    def is_completed(self) -> bool:
        return self._work.is_completed()


class TorchTransport(Transport):
    """Sends and receives through ``torch.distributed`` on ``group`` (None = world).

    Args:
        group: process group whose ranks the algorithm addresses as 0..world_size-1.
        timeout: seconds each wait may block (gloo); NCCL waits are bounded by the group's own timeout.

    Raises:
        TypeError, ValueError: ``timeout`` not a finite number > 0; a bad tensor, peer or tag in a call
            (:func:`~hpdl.comm.transport.base.check_post`: CUDA tensors on NCCL, CPU or CUDA on gloo).
    """

    def __init__(self, group=None, timeout: float = 300.0, device: torch.device | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.timeout = check_timeout(timeout)
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                                 else torch.device("cpu"))
        self._global = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.world_size)]

    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
             tag: int = 0) -> tuple[list[Request], list[Request]]:
        devices = ("cuda",) if self.backend == "nccl" else ("cpu", "cuda")
        sends, recvs, tag = check_post(self, sends, recvs, tag, devices=devices)  # before anything is posted
        if self.backend == "nccl":
            ops = [dist.P2POp(dist.isend, t, self._global[p], self.group) for t, p in sends]
            ops += [dist.P2POp(dist.irecv, t, self._global[p], self.group) for t, p in recvs]
            if not ops:
                return [], []
            works = dist.batch_isend_irecv(ops)
            if len(works) != len(ops):  # NCCL coalesces the batch into one Work shared by every op
                works = [works[0]] * len(ops)
            n = len(sends)
            return ([_TorchRequest(w, self, p, "send") for w, (_, p) in zip(works[:n], sends)],
                    [_TorchRequest(w, self, p, "recv") for w, (_, p) in zip(works[n:], recvs)])
        rreqs = []
        for t, p in recvs:
            landing = (t, torch.empty(t.shape, dtype=t.dtype)) if t.is_cuda else None   # staged: see module doc
            rreqs.append(_TorchRequest(dist.irecv(landing[1] if landing else t, self._global[p], group=self.group,
                                                  tag=tag), self, p, "recv", landing))
        sreqs = [_TorchRequest(dist.isend(t.cpu() if t.is_cuda else t, self._global[p], group=self.group, tag=tag),
                               self, p, "send")
                 for t, p in sends]
        return sreqs, rreqs
