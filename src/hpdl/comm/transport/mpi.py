"""Transport over an MPI communicator (mpi4py): ``Isend``/``Irecv`` with tags, waits with a deadline.

Messages travel as bytes (any dtype, bfloat16 and bool included): a CPU tensor as a NumPy view of its storage (no
copy), a CUDA tensor through ``__cuda_array_interface__`` after its device's current stream is synchronised (MPI
knows nothing of CUDA streams), which needs a CUDA-aware MPI. A wait polls ``Test()`` (spinning briefly, then
sleeping with exponential backoff up to 1 ms), so that it can give up at a deadline and name the peer: MPI's own
``Wait`` cannot time out.

Launch with ``mpiexec -n N python script.py``; mpi4py initialises MPI on import (thread level MULTIPLE by default,
so requests may be waited for on any thread).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from hpdl.comm.transport.base import Request, Transport
from hpdl.runtime import env
from hpdl.runtime.errors import CollectiveTimeoutError

_SPIN_S = 50e-6       # poll without sleeping this long first: a reply within it costs no sleep's latency
_MAX_SLEEP_S = 1e-3   # then sleep between polls, doubling from 10 us up to this
_ABANDONED: list = []  # requests that timed out and MPI may still use: their buffers must stay alive


class _CudaBuffer:
    """Exposes only ``__cuda_array_interface__`` (mpi4py would otherwise take the DLPack path first)."""

    __slots__ = ("__cuda_array_interface__", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor  # keeps the memory alive as long as MPI holds this object
        self.__cuda_array_interface__ = tensor.__cuda_array_interface__


class _MpiRequest(Request):
    __slots__ = ("_req", "_t", "_peer", "_kind", "_done")

    def __init__(self, req, transport: "MpiTransport", peer: int, kind: str):
        self._req, self._t, self._peer, self._kind, self._done = req, transport, peer, kind, False

    def is_completed(self) -> bool:
        if not self._done:
            self._done = bool(self._req.Test())
        return self._done

    def wait(self) -> None:
        if self.is_completed():
            return
        start = time.monotonic()
        deadline = start + self._t.timeout
        delay = 1e-5
        while not self.is_completed():
            now = time.monotonic()
            if now >= deadline:
                self._abandon()
                t = self._t
                raise CollectiveTimeoutError(
                    f"rank {t.rank} waited {t.timeout:g}s for the {self._kind} "
                    f"{'from' if self._kind == 'recv' else 'to'} {t.describe(self._peer)}, which did not answer",
                    missing_ranks=[self._peer])
            if now - start > _SPIN_S:
                time.sleep(min(delay, deadline - now))
                delay = min(2 * delay, _MAX_SLEEP_S)

    def _abandon(self) -> None:
        """A receive is cancelled (its buffer is then free); a send cannot be withdrawn (MPI 4 deprecates
        cancelling sends), so it and its buffer are kept for MPI to finish or never touch again."""
        if self._kind == "recv":
            try:
                self._req.Cancel()
                if self._req.Test():
                    return
            except Exception:  # noqa: BLE001 - MPI refused the cancel: keep the buffer as for a send
                pass
        _ABANDONED.append(self._req)


class MpiTransport(Transport):
    """Point-to-point over an mpi4py communicator; its ranks are the group's.

    Args:
        comm: an ``mpi4py.MPI.Comm`` (default ``COMM_WORLD``).
        timeout: seconds a request's ``wait()`` may block before it raises
            :class:`hpdl.runtime.CollectiveTimeoutError` naming the peer (default ``HPDL_TIMEOUT``). After a
            timeout the pending receive is cancelled; treat the communicator as broken, as MPI's own error
            handling would.
        device: where the tensors an algorithm allocates for it live (default CPU); ``post`` itself takes CPU
            and CUDA tensors alike.

    Raises:
        ImportError: mpi4py (or the MPI library it loads) is missing.
        ValueError: ``timeout`` not positive.

    Example (under ``mpiexec -n 2``)::

        t = MpiTransport()
        x = torch.full((4,), float(t.rank))
        y = torch.empty(4)
        t.exchange(x, 1 - t.rank, y, 1 - t.rank)   # y holds the other rank's x
    """

    backend = "mpi"

    def __init__(self, comm=None, timeout: float | None = None, device: torch.device | str | None = None):
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise ImportError("MpiTransport needs mpi4py and an MPI library: pip install 'hpdl[mpi]' (mpi4py; "
                              "an MPI such as the mpich wheel or apt-get install mpich), then launch with "
                              f"mpiexec ({exc})") from exc
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout = float(env.get("HPDL_TIMEOUT") if timeout is None else timeout)
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.device = torch.device(device if device is not None else "cpu")
        self._tag_ub = int(self.comm.Get_attr(MPI.TAG_UB))

    def _message(self, t: torch.Tensor, peer: int, what: str):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} tensor must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous() or t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{what} tensor must be a contiguous CPU or CUDA tensor, got a {t.device} tensor "
                             f"(contiguous={t.is_contiguous()})")
        if not 0 <= peer < self.world_size:
            raise ValueError(f"{what} peer must be a rank in [0, {self.world_size}), got {peer}")
        flat = t.detach().reshape(-1).view(torch.uint8)  # bytes: every dtype, same storage
        return _CudaBuffer(flat) if t.is_cuda else flat.numpy()

    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
             tag: int = 0) -> tuple[list[Request], list[Request]]:
        if not 0 <= tag <= self._tag_ub:
            raise ValueError(f"tag must be in [0, {self._tag_ub}] (this MPI's TAG_UB), got {tag}")
        rmsgs = [(self._message(t, p, "recv"), p) for t, p in recvs]  # every check before anything is posted
        smsgs = [(self._message(t, p, "send"), p) for t, p in sends]
        # MPI ignores CUDA streams: the work queued on the buffers (writes to sends, reads of receives) first
        for d in {t.device for t, _ in list(sends) + list(recvs) if t.is_cuda}:
            torch.cuda.current_stream(d).synchronize()
        # receives first: a message then finds its buffer posted (no unexpected-message copy)
        rreqs = [_MpiRequest(self.comm.Irecv(m, source=p, tag=tag), self, p, "recv") for m, p in rmsgs]
        sreqs = [_MpiRequest(self.comm.Isend(m, dest=p, tag=tag), self, p, "send") for m, p in smsgs]
        return sreqs, rreqs
