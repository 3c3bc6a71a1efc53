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

from hpdl.comm.transport.base import Request, Transport, check_post, check_timeout
from hpdl.runtime import env
from hpdl.runtime.errors import CollectiveMismatchError, CollectiveTimeoutError, HpdlError

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
    __slots__ = ("_req", "_t", "_peer", "_kind", "_done", "_nbytes", "_status")

    def __init__(self, req, transport: "MpiTransport", peer: int, kind: str, nbytes: int):
        self._req, self._t, self._peer, self._kind, self._done = req, transport, peer, kind, False
        self._nbytes = nbytes   # the buffer's size: a receive's message must fill it exactly
        self._status = transport._MPI.Status() if kind == "recv" else None

    def is_completed(self) -> bool:
        if not self._done:
            try:
                done = bool(self._req.Test(self._status))
            except self._t._MPI.Exception as exc:   # completed with an error (e.g. a truncated message)
                self._done = True
                self._raise(exc)
            self._done = done
            if done and self._status is not None:
                got = self._status.Get_count(self._t._MPI.BYTE)
                if got != self._nbytes:
                    t = self._t
                    raise CollectiveMismatchError(
                        f"rank {t.rank} received {got} bytes from {t.describe(self._peer)} into a {self._nbytes}-byte "
                        f"buffer (tag {self._status.Get_tag()}); a send and its receive must have the same size")
        return self._done

    def _raise(self, exc) -> None:
        t, peer = self._t, self._peer
        where = f"{'from' if self._kind == 'recv' else 'to'} {t.describe(peer)}"
        if exc.Get_error_class() == t._MPI.ERR_TRUNCATE:
            raise CollectiveMismatchError(
                f"rank {t.rank}'s recv {where} got a message larger than its {self._nbytes}-byte buffer (MPI: "
                f"{exc.Get_error_string().strip()}); a send and its receive must have the same size") from None
        raise HpdlError(f"rank {t.rank}'s {self._kind} {where} failed in MPI: {exc.Get_error_string().strip()}") \
            from exc

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
        ValueError: ``timeout`` not > 0 and finite, ``device`` neither CPU nor CUDA, or CUDA without a GPU here.
        TypeError: ``timeout`` not a number.

    A receive whose message has another size than its tensor raises
    :class:`hpdl.runtime.CollectiveMismatchError` from ``wait()``, naming the peer and both sizes.

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
        self._MPI = MPI
        self.timeout = check_timeout(env.get("HPDL_TIMEOUT") if timeout is None else timeout)
        self.device = torch.device(device if device is not None else "cpu")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be a CPU or CUDA device, got {self.device}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device}: torch sees no CUDA GPU on this host; pass device='cpu'")
        self._tag_ub = int(self.comm.Get_attr(MPI.TAG_UB))

    @staticmethod
    def _buffer(t: torch.Tensor):
        flat = t.detach().reshape(-1).view(torch.uint8)  # bytes: every dtype, same storage
        return _CudaBuffer(flat) if t.is_cuda else flat.numpy()

    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
             tag: int = 0) -> tuple[list[Request], list[Request]]:
        sends, recvs, tag = check_post(self, sends, recvs, tag, devices=("cpu", "cuda"), tag_max=self._tag_ub,
                                       tag_note=" (this MPI's TAG_UB)")  # every check before anything is posted
        # MPI ignores CUDA streams: the work queued on the buffers (writes to sends, reads of receives) first
        for d in {t.device for t, _ in list(sends) + list(recvs) if t.is_cuda}:
            torch.cuda.current_stream(d).synchronize()
        # receives first: a message then finds its buffer posted (no unexpected-message copy)
        rreqs = [_MpiRequest(self.comm.Irecv(self._buffer(t), source=p, tag=tag), self, p, "recv", t.nbytes)
                 for t, p in recvs]
        sreqs = [_MpiRequest(self.comm.Isend(self._buffer(t), dest=p, tag=tag), self, p, "send", t.nbytes)
                 for t, p in sends]
        return sreqs, rreqs
