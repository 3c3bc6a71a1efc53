"""The algorithm contract: one abstract base class per collective, one constructor, and the name -> class
registry (lazy imports, like vLLM's Executor.get_class).

Every algorithm is built the same way, ``cls(resources, window, timeout)``, from the
:class:`~hpdl.comm.transport.resources.GroupResources` of its group (transports, topology, registered
peer-memory buffers); options of one algorithm (two_level's ``inter``, ``depth``) are keyword-only after those.
It implements the collectives whose base it subclasses, each on flat, contiguous buffers and a
:class:`~hpdl.comm.transport.base.Transport` that carries the call's timeout:

* :class:`AllReduce`: ``all_reduce(buf, op, comm)`` in place;
* :class:`ReduceScatter`: ``reduce_scatter(blocks, out, op, comm)``, ``blocks[q]`` the part of this rank's
  input that rank ``q`` reduces;
* :class:`AllGather`: ``all_gather(blocks, comm)``, ``blocks[rank]`` holds this rank's part and every other
  block is filled from its owner (block sizes may differ by rank);
* :class:`AllToAll`: ``all_to_all(dst, src, lay, comm)`` on byte tensors and a
  :class:`~hpdl.comm.algorithms.layout.Layout`;
* :class:`Broadcast`: ``broadcast(buf, root, comm)``; :class:`Reduce`: ``reduce(buf, root, op, comm)``;
  :class:`Barrier`: ``barrier(comm)`` (``root`` is a rank of the group, not a global rank).

Each method returns None when the collective is complete, or the native algorithm's
:class:`~hpdl.comm.algorithms.native.Pending` (a torch collective issued, not yet waited).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Callable, Sequence

import torch

from hpdl.comm.transport.base import Transport
from hpdl.runtime import env

# Public names of the algorithms; "auto" is resolved by hpdl.comm.tuning before lookup.
REGISTRY: dict[str, str] = {
    "direct": "hpdl.comm.algorithms.direct:Direct",
    "ring": "hpdl.comm.algorithms.ring:Ring",
    "recursive_doubling": "hpdl.comm.algorithms.recursive_doubling:RecursiveDoubling",
    "staged": "hpdl.comm.algorithms.staged:Staged",
    "native": "hpdl.comm.algorithms.native:Native",
    "one_shot": "hpdl.comm.algorithms.peer:OneShot",   # CUDA, one node: peer-memory kernels
    "two_shot": "hpdl.comm.algorithms.peer:TwoShot",
    "two_level": "hpdl.comm.algorithms.two_level:TwoLevel",
    # all_to_all only (hpdl.comm.all_to_all_single); "direct" and "native" serve both
    "pairwise": "hpdl.comm.algorithms.alltoall:Pairwise",
    "push": "hpdl.comm.algorithms.alltoall:TwoLevelPush",
    "pull": "hpdl.comm.algorithms.alltoall:TwoLevelPull",
    # broadcast / reduce / barrier ("native" serves them too)
    "binomial": "hpdl.comm.algorithms.tree:BinomialTree",
    "dissemination": "hpdl.comm.algorithms.tree:Dissemination",
}
PEER = ("one_shot", "two_shot")
ALIASES = {"rd": "recursive_doubling", "nccl": "native", "torch": "native", "two_level_push": "push",
           "two_level_pull": "pull"}


class Workspace:
    """Persistent scratch buffers, grown on demand and reused across calls (no allocation or page faults on
    the hot path). One per algorithm instance, i.e. per group: calls on a group run one at a time."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}

    def get(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        k = (key, dtype, device)
        buf = self._bufs.get(k)
        if buf is None or buf.numel() < numel:
            buf = self._bufs[k] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def clear(self) -> None:
        self._bufs.clear()


def scratch(ws: "Workspace | None", key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer from ``ws``, or a fresh one when no workspace is given."""
    return ws.get(key, numel, dtype, device) if ws is not None else torch.empty(numel, dtype=dtype, device=device)


class Algorithm:
    """Root of the per-collective bases: what every algorithm has, whatever it implements.

    Args:
        resources: the group's :class:`~hpdl.comm.transport.resources.GroupResources` (None for an instance
            used on a bare transport, e.g. by another algorithm or a test; algorithms that need the topology,
            the host transport or peer memory then raise when they need it).
        window: throttle (peers in flight) where the schedule has one; None = its default.
        timeout: seconds a wait may block at construction-time communication (topology discovery, host
            transport); the calls themselves use their transport's timeout. None = ``HPDL_TIMEOUT``.

    Instances are built once per (group, name, window) by ``GroupResources.algorithm`` and reused; calls on a
    group run one at a time, so an instance may keep persistent buffers (:attr:`workspace`).
    """

    name = "base"
    needs_topology = False   # built for one topology: dropped when hpdl.comm.set_topology changes it

    def __init__(self, resources=None, window: int | None = None, timeout: float | None = None):
        self.resources = resources
        self.window = window
        self.timeout = float(env.get("HPDL_TIMEOUT") if timeout is None else timeout)
        self.workspace = Workspace()

    @classmethod
    def fits(cls, device_type: str, world_size: int, *, dtype: torch.dtype | None = None, gpus: int | None = None,
             topology=None) -> bool:
        """Whether this algorithm can run such a call where the selection table assumes it does (the peer
        kernels: CUDA, a kernel dtype, one host with a GPU per rank). Only the facts given are checked.
        :func:`hpdl.comm.resolve` falls back to native when the table's pick does not fit."""
        return True

    @classmethod
    def runs_kernel(cls, resources, tensor: torch.Tensor, timeout: float) -> bool:
        """True when a call on ``tensor`` is kernel launches on the current stream (peer memory), so that the
        API runs its async form on the group's side stream and may cache a launcher for the hot path."""
        return False

    def close(self) -> None:
        """Free what the instance holds (shared buffers, threads); no communication."""
        self.workspace.clear()


class AllReduce(Algorithm, ABC):
    """An all-reduce schedule (:func:`hpdl.comm.all_reduce`)."""

    @abstractmethod
    def all_reduce(self, buf: torch.Tensor, op: str, comm: Transport):
        """Reduce the flat, contiguous ``buf`` in place over ``comm``'s ranks; None or a Pending."""

    def all_reduce_launcher(self, op: str, device: torch.device) -> Callable[[torch.Tensor], None] | None:
        """The hot path after a first checked call: ``fn(tensor)`` reducing with ``op`` in one launch (None:
        this algorithm has none)."""
        return None


class ReduceScatter(Algorithm, ABC):
    """A reduce-scatter schedule (:func:`hpdl.comm.reduce_scatter_tensor`)."""

    @abstractmethod
    def reduce_scatter(self, blocks: Sequence[torch.Tensor], out: torch.Tensor, op: str, comm: Transport):
        """``out = reduce over ranks q of q's blocks[rank]``; ``blocks`` are not modified. None or a Pending."""


class AllGather(Algorithm, ABC):
    """An all-gather schedule (:func:`hpdl.comm.all_gather_into_tensor`)."""

    @abstractmethod
    def all_gather(self, blocks: Sequence[torch.Tensor], comm: Transport):
        """Fill every ``blocks[q]`` (q != rank) from rank q. None or a Pending."""


class AllToAll(Algorithm, ABC):
    """An all-to-all schedule on bytes (:func:`hpdl.comm.all_to_all_single`)."""

    @abstractmethod
    def all_to_all(self, dst: torch.Tensor, src: torch.Tensor, lay, comm: Transport):
        """Send ``src[lay.send_off[q]:+send_len[q]]`` to rank q and receive rank q's block into ``dst`` at
        ``lay.recv_off[q]``; ``dst`` and ``src`` are flat uint8 and do not overlap. None or a Pending."""

    def all_to_all_launcher(self, lay, device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], bool] | None:
        """The hot path of a validated layout: ``fn(output, input) -> bool`` (False: nothing done, take the
        general path), or None when this algorithm has none."""
        return None


class Broadcast(Algorithm, ABC):
    """A broadcast schedule (:func:`hpdl.comm.broadcast`)."""

    @abstractmethod
    def broadcast(self, buf: torch.Tensor, root: int, comm: Transport):
        """Copy rank ``root``'s flat, contiguous ``buf`` into every other rank's ``buf``. None or a Pending."""


class Reduce(Algorithm, ABC):
    """A reduce-to-one-rank schedule (:func:`hpdl.comm.reduce`)."""

    @abstractmethod
    def reduce(self, buf: torch.Tensor, root: int, op: str, comm: Transport):
        """Rank ``root``'s ``buf`` becomes the reduction of every rank's ``buf``; the other ranks' ``buf`` are
        not modified. None or a Pending."""


class Barrier(Algorithm, ABC):
    """A barrier (:func:`hpdl.comm.barrier`)."""

    @abstractmethod
    def barrier(self, comm: Transport):
        """Return once every rank of ``comm`` has entered the barrier. None or a Pending."""


BASES: dict[str, type[Algorithm]] = {"all_reduce": AllReduce, "reduce_scatter": ReduceScatter,
                                     "all_gather": AllGather, "all_to_all": AllToAll, "broadcast": Broadcast,
                                     "reduce": Reduce, "barrier": Barrier}


def canonical(name: str) -> str:
    """Canonical algorithm name; raises ValueError listing the valid names for an unknown one."""
    key = ALIASES.get(name, name)
    if key not in REGISTRY and key != "auto":
        raise ValueError(f"algorithm must be 'auto' or one of {sorted(REGISTRY)} (aliases {sorted(ALIASES)}), "
                         f"got {name!r}")
    return key


def get_class(name: str) -> type[Algorithm]:
    """The class registered under ``name`` (or an alias), imported on first use.

    Raises:
        ValueError: unknown name (listing the valid ones), or "auto" (resolve it first).
    """
    key = name if name in REGISTRY else canonical(name)
    if key not in REGISTRY:
        raise ValueError("algorithm 'auto' has no class: resolve it first (hpdl.comm.resolve)")
    module, _, cls = REGISTRY[key].partition(":")
    return getattr(importlib.import_module(module), cls)


def implements(name: str, collective: str) -> bool:
    """Whether the algorithm ``name`` subclasses the base of ``collective`` (a key of :data:`BASES`)."""
    return issubclass(get_class(name), BASES[collective])


def algorithms_for(collective: str) -> list[str]:
    """Registry names that implement ``collective``, in registry order."""
    return [n for n in REGISTRY if implements(n, collective)]


def phase_algorithms() -> list[str]:
    """Names that implement both reduce_scatter and all_gather (the two phases of an all-reduce)."""
    return [n for n in REGISTRY if implements(n, "reduce_scatter") and implements(n, "all_gather")]
