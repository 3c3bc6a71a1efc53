"""The transport interface every algorithm is written against: post sends and receives, wait with a timeout.

An algorithm sees ranks 0..world_size-1 of its group; the transport maps them to the engine's ranks. The
same algorithm code therefore runs over gloo on CPU, NCCL on GPU or MPI, whichever transport it is given.
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
