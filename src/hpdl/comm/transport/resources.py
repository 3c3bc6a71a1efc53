"""What one process group owns inside hpdl.comm: its transports, its topology and its algorithm instances.

:class:`GroupResources` is the one object every algorithm is built from (``Algorithm.create(resources,
window, timeout)``) and the one cache the API keeps per group; dropping it (``close``) frees the algorithms'
shared buffers. It lives below the algorithms, so they never need the API's state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpdl.comm.transport.torch_p2p import TorchTransport
from hpdl.runtime import env


class GroupResources:
    """Transports (the group's own, and a gloo host transport beside an NCCL group), topology and algorithm
    instances of one process group.

    Args:
        group: the process group (None = world).

    Attributes:
        group, world_size, rank, backend: of the group.
        topology: a :class:`hpdl.runtime.Topology`, set by ``hpdl.comm.set_topology`` or discovered at first
            use by the two-level algorithms.
    """

    def __init__(self, group):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group))
        self._comm: TorchTransport | None = None
        self._host: TorchTransport | None = None
        self._algos: dict = {}
        self.topology = None

    def global_ranks(self) -> list[int]:
        return (list(range(self.world_size)) if self.group is None
                else [dist.get_global_rank(self.group, r) for r in range(self.world_size)])

    def comm(self, timeout: float) -> TorchTransport:
        """The group's point-to-point transport, its waits bounded by ``timeout`` seconds."""
        if self._comm is None:
            self._comm = TorchTransport(self.group, timeout)
        self._comm.timeout = timeout
        return self._comm

    def host(self, timeout: float) -> TorchTransport:
        """A gloo transport over the same ranks (the group's own when it is gloo), for metadata and staging."""
        if self._host is None:
            if self.backend == "gloo":
                self._host = self.comm(timeout)
            else:
                # the world's copy is made by plain new_group (every rank calls hpdl on the world group in the
                # same order); use_local_synchronization can deadlock on torch 2.14, but a subgroup's
                # non-members never call hpdl on it, so there it is the only option
                ranks = self.global_ranks()
                hg = (dist.new_group(ranks, backend="gloo") if self.group is None else
                      dist.new_group(ranks, backend="gloo", use_local_synchronization=True))
                self._host = TorchTransport(hg, timeout, device=torch.device("cpu"))
        self._host.timeout = timeout
        return self._host

    def get_topology(self, timeout: float):
        """The topology set with ``hpdl.comm.set_topology``, else ``HPDL_RANKS_PER_NODE``, else hostnames
        (one all-gather over the host transport at first use)."""
        if self.topology is None:
            from hpdl.runtime.topology import Topology, discover

            rpn = env.get("HPDL_RANKS_PER_NODE")
            if rpn:
                parts = [int(x) for x in rpn.split(",")]
                self.topology = Topology.emulate(self.world_size, parts[0] if len(parts) == 1 else parts)
            else:
                self.topology = discover(self.host(timeout).group)
        return self.topology

    def cached(self, key, make):
        """The group's algorithm instance under ``key`` (made by ``make()`` at first use). The API keys by
        (name, window) and makes them with ``Algorithm.create(resources, window, timeout)``."""
        algo = self._algos.get(key)
        if algo is None:
            algo = self._algos[key] = make()
        return algo

    def drop_topology_algorithms(self) -> None:
        """Close and forget the algorithms built for the old topology (before a new one is set)."""
        for key in [k for k, a in self._algos.items() if getattr(a, "needs_topology", False)]:
            self._algos.pop(key).close()

    def close(self) -> None:
        """Free every algorithm's buffers (shared memory of the two-level algorithms); no communication."""
        for algo in self._algos.values():
            if hasattr(algo, "close"):
                algo.close()
        self._algos.clear()
