"""Where each rank lives: node id, local rank, ranks per node, and rails (local rank i drives rail i).

Nodes come from hostnames, or are emulated on one host with ``ranks_per_node`` (an int for equal nodes,
or a list such as ``[3, 2]`` for uneven ones), so that two-level algorithms can be tested on a laptop.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class Topology:
    """Placement of every rank of a group.

    Attributes:
        world_size: number of ranks.
        node_of: ``node_of[r]`` is the node index of rank ``r`` (nodes numbered by first appearance).
        emulated: True when nodes come from ``ranks_per_node`` instead of hostnames.
        ranks_per_gpu: ranks that share one GPU (1: a GPU per rank). Above 1 the "node" holds fewer GPUs than
            ranks: code paths are the multi-GPU ones, but nothing measured on it is multi-GPU performance
            (``hpdl bench`` says so, and refuses to write a tuning table from it).
    """

    world_size: int
    node_of: tuple[int, ...]
    emulated: bool = False
    _local: tuple[int, ...] = field(default=(), repr=False)
    ranks_per_gpu: int = 1

    def __post_init__(self) -> None:
        if self.ranks_per_gpu < 1:
            raise ValueError(f"ranks_per_gpu must be >= 1, got {self.ranks_per_gpu}")
        if len(self.node_of) != self.world_size:
            raise ValueError(f"node_of has {len(self.node_of)} entries, expected world_size={self.world_size}")
        seen: dict[int, int] = {}
        local = []
        for n in self.node_of:
            local.append(seen.get(n, 0))
            seen[n] = seen.get(n, 0) + 1
        object.__setattr__(self, "_local", tuple(local))

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of))

    def local_rank(self, rank: int) -> int:
        return self._local[rank]

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks on ``node``, ordered by local rank."""
        return [r for r in range(self.world_size) if self.node_of[r] == node]

    def ranks_per_node(self) -> list[int]:
        return [len(self.node_ranks(n)) for n in range(self.num_nodes)]

    def rail_ranks(self, rail: int) -> list[int]:
        """Ranks with local rank ``rail`` on every node that has one, ordered by node (one rail group)."""
        return [r for r in range(self.world_size) if self._local[r] == rail]

    @property
    def num_rails(self) -> int:
        return max(self.ranks_per_node())

    @property
    def single_node(self) -> bool:
        return self.num_nodes == 1

    @property
    def shares_gpus(self) -> bool:
        """True when ranks share GPUs (``ranks_per_gpu`` > 1): timings are not multi-GPU performance."""
        return self.ranks_per_gpu > 1

    @classmethod
    def emulate(cls, world_size: int, ranks_per_node: int | Sequence[int] | None,
                ranks_per_gpu: int = 1) -> "Topology":
        """Emulated nodes: consecutive blocks of ``ranks_per_node`` ranks.

        Raises:
            ValueError: ``ranks_per_node`` is not positive, or a list that does not sum to ``world_size``.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if ranks_per_node is None:
            return cls(world_size, (0,) * world_size, emulated=True, ranks_per_gpu=ranks_per_gpu)
        if isinstance(ranks_per_node, int):
            if ranks_per_node < 1:
                raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
            return cls(world_size, tuple(r // ranks_per_node for r in range(world_size)), emulated=True,
                       ranks_per_gpu=ranks_per_gpu)
        sizes = list(ranks_per_node)
        if any(s < 1 for s in sizes) or sum(sizes) != world_size:
            raise ValueError(f"ranks_per_node={sizes} must be positive and sum to world_size={world_size}")
        node_of = [n for n, s in enumerate(sizes) for _ in range(s)]
        return cls(world_size, tuple(node_of), emulated=True, ranks_per_gpu=ranks_per_gpu)

    @classmethod
    def from_hostnames(cls, hostnames: Sequence[str], ranks_per_gpu: int = 1) -> "Topology":
        order: dict[str, int] = {}
        node_of = tuple(order.setdefault(h, len(order)) for h in hostnames)
        return cls(len(hostnames), node_of, emulated=False, ranks_per_gpu=ranks_per_gpu)


def discover(group=None, ranks_per_node: int | Sequence[int] | None = None, ranks_per_gpu: int = 1) -> Topology:
    """Topology of ``group``: emulated from ``ranks_per_node`` when given, else from gathered hostnames;
    ``ranks_per_gpu`` is recorded as given (the launch mode knows it).

    Collective over ``group`` when hostnames are gathered: every rank must call it.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if ranks_per_node is not None:
        return Topology.emulate(world, ranks_per_node, ranks_per_gpu)
    names: list[str | None] = [None] * world
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return Topology.from_hostnames([str(n) for n in names], ranks_per_gpu)
