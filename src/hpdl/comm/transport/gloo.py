"""Transport over a private Gloo group built directly on a store (no ``init_process_group``, no ``new_group``).

hpdl.offload's progress agents and its in-process progress thread move messages between endpoints with it: the
group's members are only the processes that share the store (the agents of a job, or the ranks of one
application group), so no other rank of the job takes part in creating it, and its tags never meet the
application's own torch.distributed calls. Each message is posted on its own (``isend``/``irecv`` with a tag per
message); its ``wait()`` blocks (Gloo's point-to-point work cannot be polled: ``is_completed()`` stays False
until ``wait()``), so offload waits on I/O threads.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from hpdl.comm.transport.base import Request, Transport, check_post, check_timeout
from hpdl.comm.transport.torch_p2p import _TorchRequest

# How long a posted transfer may wait for its peer by default. Not HPDL_TIMEOUT: one of hpdl.offload's persistent
# requests may be started by its peer much later (load imbalance), and a Gloo wait that times out closes the pair
# for good, breaking every later plan between the two endpoints. Failures are found otherwise: a dead peer closes
# its connections (Gloo fails the transfer at once), and wait()/test() time out on the application's side, naming
# the ranks.
TRANSFER_WAIT_S = 30 * 24 * 3600.0


class GlooTransport(Transport):
    """Point-to-point over a ``torch.distributed.ProcessGroupGloo`` whose ranks are the peers.

    Args:
        pg: the Gloo group (see :meth:`create`).
        describe: ``describe(peer) -> str`` for error messages (default "rank N").
        explain: ``explain(peer) -> str | None``: why the peer went away, if it said so (default: unknown); an
            exception it raises (the store may have gone with the peer) counts as unknown.
        timeout: seconds a request's ``wait()`` may block before it raises
            :class:`hpdl.runtime.CollectiveTimeoutError` naming the peer (default :data:`TRANSFER_WAIT_S`; a
            Gloo wait that times out leaves the pair of ranks unusable).

    Tensors are contiguous CPU tensors (Gloo's send/recv take no CUDA tensors: stage them through the host).
    Tags are non-negative 31-bit ints. A receive's tensor must have its message's size: Gloo fills a larger one's
    first bytes and reports success, and aborts the process on a smaller one (see :meth:`Transport.post`).

    Raises:
        TypeError, ValueError: ``timeout`` not a finite number > 0; a bad tensor, peer or tag in a call
            (:func:`~hpdl.comm.transport.base.check_post`).
    """

    backend = "gloo"

    def __init__(self, pg, describe: Callable[[int], str] | None = None,
                 explain: Callable[[int], str | None] | None = None, timeout: float = TRANSFER_WAIT_S):
        self.pg = pg
        self.rank, self.world_size = pg.rank(), pg.size()
        self.device = torch.device("cpu")
        self.timeout = check_timeout(timeout)
        self._describe, self._explain = describe, explain

    @classmethod
    def create(cls, store, rank: int, size: int, timeout: float, prefix: str = "hpdl-gloo",
               describe: Callable[[int], str] | None = None, explain: Callable[[int], str | None] | None = None,
               transfer_timeout: float = TRANSFER_WAIT_S) -> "GlooTransport":
        """Collective over the ``size`` processes that share ``store`` (a c10d Store: TCPStore, HashStore...).

        Args:
            timeout: seconds the group's connection set-up may take (every member must call within it).
            prefix: namespace of the group's keys in ``store`` (members pass the same one; other users of the
                store pick others).
            transfer_timeout: the transport's :attr:`timeout` (seconds a transfer's wait may block).

        Raises:
            ValueError: ``rank`` not in ``[0, size)``.
            RuntimeError: Gloo's, when the other members do not connect within ``timeout``.
        """
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, size={size}), got {rank}")
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timedelta(seconds=timeout))
        return cls(pg, describe, explain, transfer_timeout)

    def _check(self, sends, recvs, tag: int):
        return check_post(self, sends, recvs, tag, devices=("cpu",), to_self=False)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Request:
        return self.post([(tensor, dst)], [], tag)[0][0]

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Request:
        return self.post([], [(tensor, src)], tag)[1][0]

    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
             tag: int = 0) -> tuple[list[Request], list[Request]]:
        sends, recvs, tag = self._check(sends, recvs, tag)   # every check before anything is posted
        rreqs = [_TorchRequest(self.pg.recv([t], p, tag), self, p, "recv") for t, p in recvs]
        return [_TorchRequest(self.pg.send([t], p, tag), self, p, "send") for t, p in sends], rreqs

    def describe(self, peer: int) -> str:
        return self._describe(peer) if self._describe else f"rank {peer}"

    def explain(self, peer: int) -> str | None:
        if self._explain is None:
            return None
        try:
            return self._explain(peer)
        except Exception:  # noqa: BLE001 - the store may have gone with the peer: no explanation
            return None
