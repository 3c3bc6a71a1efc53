"""The algorithm contract and the name -> class registry (lazy imports, like vLLM's Executor.get_class).

An algorithm works on flat, contiguous buffers and a :class:`~hpdl.comm.transport.base.Transport`:
``all_reduce(buf, op, comm)`` in place; ``reduce_scatter(blocks, out, op, comm)`` where ``blocks[q]`` is the
part of this rank's input that rank ``q`` reduces; ``all_gather(blocks, comm)`` where ``blocks[rank]`` holds
this rank's part and every other block is filled from its owner. Block sizes may differ by rank.
"""

from __future__ import annotations

import importlib
from typing import Sequence

import torch

from hpdl.comm.transport.base import Transport

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
    """Base class: subclasses implement ``all_reduce`` and, where they can, the two phases."""

    name = "base"
    supports_phases = False  # True when reduce_scatter / all_gather are implemented

    def __init__(self, window: int | None = None):
        self.window = window
        self.workspace = Workspace()

    @classmethod
    def create(cls, resources, window: int | None, timeout: float) -> "Algorithm":
        """The one constructor path: an instance for the group whose
        :class:`~hpdl.comm.transport.resources.GroupResources` is ``resources``. Subclasses that need more
        than the throttle (the host transport, the topology) take it from ``resources`` here."""
        return cls(window)

    def all_reduce(self, buf: torch.Tensor, op: str, comm: Transport) -> None:
        raise NotImplementedError(f"algorithm {self.name!r} has no all_reduce")

    def reduce_scatter(self, blocks: Sequence[torch.Tensor], out: torch.Tensor, op: str, comm: Transport) -> None:
        raise ValueError(f"algorithm {self.name!r} does not implement reduce_scatter; use one of "
                         f"{phase_algorithms()}")

    def all_gather(self, blocks: Sequence[torch.Tensor], comm: Transport) -> None:
        raise ValueError(f"algorithm {self.name!r} does not implement all_gather; use one of "
                         f"{phase_algorithms()}")


def canonical(name: str) -> str:
    """Canonical algorithm name; raises ValueError listing the valid names for an unknown one."""
    key = ALIASES.get(name, name)
    if key not in REGISTRY and key != "auto":
        raise ValueError(f"algorithm must be 'auto' or one of {sorted(REGISTRY)} (aliases {sorted(ALIASES)}), "
                         f"got {name!r}")
    return key


def get_class(name: str) -> type[Algorithm]:
    module, _, cls = REGISTRY[canonical(name)].partition(":")
    return getattr(importlib.import_module(module), cls)


def phase_algorithms() -> list[str]:
    return [n for n in REGISTRY if get_class(n).supports_phases]
