"""The transport interface every algorithm is written against: post sends and receives, wait with a timeout.

An algorithm sees ranks 0..world_size-1 of its group; the transport maps them to the engine's ranks. The
same algorithm code therefore runs over gloo on CPU, NCCL on GPU or MPI, whichever transport it is given:
:class:`~hpdl.comm.transport.torch_p2p.TorchTransport` (a torch.distributed group),
:class:`~hpdl.comm.transport.gloo.GlooTransport` (a private Gloo group built on a store: hpdl.offload's),
:class:`~hpdl.comm.transport.mpi.MpiTransport` (an mpi4py communicator), and
:class:`~hpdl.comm.transport.sub.SubTransport` (a subset of another transport's ranks).

Backends implement :meth:`Transport.post`; per-message ``isend``/``irecv`` (what hpdl.offload's executor
posts, one tag per message) and the ``describe``/``explain`` hooks its error messages use have defaults here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch


class Request(ABC):
    """One posted send or receive."""

    @abstractmethod
    def wait(self) -> None:
        """Block until done; raise :class:`hpdl.runtime.CollectiveTimeoutError` naming the peer on timeout."""

    @abstractmethod
    def is_completed(self) -> bool:
        """True once the operation has finished (never blocks)."""


class Transport(ABC):
    """Point-to-point messaging inside one group, with a deadline per wait.

    Attributes:
        rank: this process's rank in the group.
        world_size: ranks in the group.
        device: where tensors passed to ``post`` live.
        timeout: seconds a :meth:`Request.wait` may block.
    """

    rank: int
    world_size: int
    device: torch.device
    timeout: float

    @abstractmethod
    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
             tag: int = 0) -> tuple[list[Request], list[Request]]:
        """Start ``sends`` (tensor, dst) and ``recvs`` (tensor, src) together; return their requests.

        Tensors must be contiguous and stay untouched until their request completes. Messages between one
        pair of ranks with one tag match in the order they were posted.
        """

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Request:
        """Post one send of ``tensor`` to ``dst``; its request's ``wait()`` blocks until it is done."""
        return self.post([(tensor, dst)], [], tag)[0][0]

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Request:
        """Post one receive into ``tensor`` from ``src``; its request's ``wait()`` blocks until it landed."""
        return self.post([], [(tensor, src)], tag)[1][0]

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Blocking :meth:`isend`."""
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        """Blocking :meth:`irecv`."""
        self.irecv(tensor, src, tag).wait()

    def describe(self, peer: int) -> str:
        """Who ``peer`` is, for error messages ("rank 3"; hpdl.offload's agents name their process and host)."""
        return f"rank {peer}"

    def explain(self, peer: int) -> str | None:
        """Why ``peer`` went away, when it said so before going (e.g. "rank 3 (pid 42) on node-b died"), so that
        a failure is blamed on that rank rather than on the peer that relayed it; None when unknown."""
        return None

    def exchange(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
                 tag: int = 0) -> None:
        """Send to ``dst`` and receive from ``src`` at once, and wait for both (a sendrecv)."""
        sends = [(send, dst)] if send is not None else []
        recvs = [(recv, src)] if recv is not None else []
        s, r = self.post(sends, recvs, tag)
        for req in r + s:
            req.wait()

    def exchange_all(self, mine: torch.Tensor, tag: int = 0) -> list[torch.Tensor]:
        """Every rank's copy of a small tensor (same shape and dtype everywhere), sent directly peer to peer.

        Used for metadata (argument signatures, split sizes, segment names). A peer that does not answer
        raises :class:`hpdl.runtime.CollectiveTimeoutError` naming it.
        """
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        rows[self.rank] = mine
        peers = [q for q in range(self.world_size) if q != self.rank]
        sends, recvs = self.post([(mine, q) for q in peers], [(rows[q], q) for q in peers], tag)
        for req in recvs + sends:
            req.wait()
        return rows
