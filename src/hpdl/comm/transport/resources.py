"""What one process group owns inside hpdl.comm, and the one per-group cache: :class:`GroupResources`.

A group's resources are its transports (its own, and a gloo host transport beside an NCCL group), its
topology, its algorithm instances (built from these resources: ``cls(resources, window, timeout)``), its
registered peer-memory buffers (``registration``/``release``), its failure board (the post-mortem that names
a missing rank) and the side stream of its asynchronous peer-memory calls. :func:`resources_of` returns the
group's one instance; :func:`forget` and :func:`forget_all` drop them without communicating
(``hpdl.comm.forget_group`` / ``reset``). Everything here lives below the algorithms, so they never need the API.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpdl.comm.transport.failure import FailureBoard, is_peer_failure
from hpdl.comm.transport.torch_p2p import TorchTransport
from hpdl.runtime import env
from hpdl.runtime.launch import ranks_per_gpu_of


class GroupResources:
    """Transports, topology, algorithm instances, peer-memory registrations and failure board of one group.

    Args:
        group: the process group (None = world).

    Attributes:
        group, world_size, rank, backend: of the group.
        topology: a :class:`hpdl.runtime.Topology`, set by ``hpdl.comm.set_topology`` or discovered at first
            use by the two-level algorithms.
        board: the group's :class:`~hpdl.comm.transport.failure.FailureBoard`; ``calls`` counts the
            collectives issued on the group (the post-mortem's call number).
        worker: the thread that runs the group's ``async_op=True`` CPU schedules in call order (made at first
            use; :meth:`drain` waits for it).
        side_stream, side_pending: CUDA stream of async peer-memory calls, and the event of the last one that
            no later call on the group has waited for yet; ``side_waited``: ``(event, stream)`` when a
            ``CudaWork.wait`` on ``stream`` took it (a later call on another stream must still wait).
        ranks_per_gpu: ranks sharing one CUDA device in this job (``HPDL_RANKS_PER_GPU``, set in every rank by
            the launch mode). Above 1 a gloo group carries CUDA tensors: the peer-memory kernels run on them,
            every other algorithm stages them through host memory.
    """

    def __init__(self, group):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group))
        self.ranks_per_gpu = ranks_per_gpu_of(None)   # 0 or -1 would make "auto" see no GPUs at all
        self._comm: TorchTransport | None = None
        self._host: TorchTransport | None = None
        self._algos: dict = {}
        self.registered: dict[tuple[str, int], object] = {}   # (kind, device index) -> registration
        self.topology = None
        self.side_stream = None
        self.side_pending = None
        self.side_waited = None   # (event, stream) of the last side_pending that a CudaWork.wait cleared
        self.calls = 0
        self._worker = None
        ranks = self.global_ranks()
        name = "world" if group is None else str(getattr(group, "group_name", "") or "-".join(map(str, ranks)))
        self.board = FailureBoard(name, ranks, self.rank)
        self.name = name

    @property
    def worker(self):
        """The group's :class:`~hpdl.comm.transport.worker.GroupWorker` (async CPU schedules, in call order),
        made at first use."""
        if self._worker is None:
            from hpdl.comm.transport.worker import GroupWorker

            self._worker = GroupWorker(self.name)
        return self._worker

    def drain(self, timeout: float | None = None) -> None:
        """Wait for the group's queued async calls (before a call that must run after them)."""
        if self._worker is not None:
            self._worker.drain(timeout)

    def on_worker(self) -> bool:
        """True on the group's worker thread (its metadata exchanges use their own tags there)."""
        w = self._worker
        return w is not None and w.is_current()

    @property
    def cuda_over_gloo(self) -> bool:
        """True when this gloo group takes CUDA tensors (ranks share GPUs, so no NCCL group exists)."""
        return self.backend == "gloo" and self.ranks_per_gpu > 1

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

            rpn, rpg = env.get("HPDL_RANKS_PER_NODE"), self.ranks_per_gpu
            if rpn:
                parts = [int(x) for x in rpn.split(",")]
                self.topology = Topology.emulate(self.world_size, parts[0] if len(parts) == 1 else parts, rpg)
            else:
                self.topology = discover(self.host(timeout).group, ranks_per_gpu=rpg)
        return self.topology

    def algorithm(self, name: str, window: int | None, timeout: float):
        """The registry's class for ``name``, built once per (name, window) from these resources."""
        algo = self._algos.get((name, window))
        if algo is None:
            from hpdl.comm.algorithms.base import get_class  # the registry sits above the transports

            algo = self._algos[(name, window)] = get_class(name)(self, window, timeout)
        return algo

    def registration(self, kind: str, device: torch.device, make):
        """The group's registered peer-memory object of ``kind`` on ``device`` (``make()`` at first use, which
        is collective over the group). A registration has ``close()`` (collective: frees the buffer) and
        ``forget()`` (local: drops the handle, the mapping is freed at process exit)."""
        key = (kind, device.index)
        reg = self.registered.get(key)
        if reg is None:
            reg = self.registered[key] = make()
        return reg

    def release(self, kind: str | None = None) -> None:
        """Free the registered buffers (of ``kind``, or all): collective over the group, call it on every rank
        before destroying the group. Cached hot-path calls step aside and register afresh on the next use."""
        for key in [k for k in self.registered if kind is None or k[0] == kind]:
            self.registered.pop(key).close()

    def guard(self, what: str, call: int, timeout: float):
        """``run(fn)``: call ``fn``; a peer failure becomes the post-mortem's typed error naming the rank."""
        def run(fn):
            try:
                return fn()
            except BaseException as exc:
                if not is_peer_failure(exc):
                    raise
                err = self.board.diagnose(what, call, timeout, exc)
                if err is exc:
                    raise
                raise err from exc
        return run

    def drop_topology_algorithms(self) -> None:
        """Close and forget the algorithms built for the old topology (before a new one is set)."""
        for key in [k for k, a in self._algos.items() if getattr(a, "needs_topology", False)]:
            self._algos.pop(key).close()

    def close(self) -> None:
        """Free every algorithm's buffers (shared memory of the two-level algorithms) and forget the peer-memory
        registrations, stop the worker (queued calls that did not start fail); no communication."""
        worker = getattr(self, "_worker", None)   # absent on resources built without __init__ (tests' fakes)

        def free():   # what exists when no call runs any more (a running call may still build an algorithm)
            for algo in self._algos.values():
                algo.close()
            self._algos.clear()
            for reg in self.registered.values():
                reg.forget()
            self.registered.clear()

        if worker is None:
            free()
        else:
            # an async call still running on the worker uses these algorithms and buffers: they are freed when
            # it returns (on the worker), not under it (forget_group during a call freed them mid-schedule)
            self._worker = None
            worker.close(then=free)


_GROUPS: dict[object, GroupResources] = {}   # group as callers spell it (None, dist.group.WORLD, a group) -> its


def _canonical(group):
    """None for the default group however it is spelled, so that None and dist.group.WORLD share resources."""
    return None if group is None or (dist.is_initialized() and group is dist.group.WORLD) else group


def lookup(group) -> GroupResources | None:
    """The resources of ``group`` when they exist (one dict lookup for a known spelling); None otherwise."""
    res = _GROUPS.get(group)
    if res is None:
        res = _GROUPS.get(_canonical(group))
        if res is not None:
            _GROUPS[group] = res
    return res


def resources_of(group) -> GroupResources:
    """The one :class:`GroupResources` of ``group`` (None = world), made at first use (no communication).

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    res = _GROUPS.get(group)
    if res is not None:
        return res
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call hpdl.runtime.init_from_env() or "
                           "torch.distributed.init_process_group() first")
    res = lookup(group)
    if res is None:
        canon = _canonical(group)
        res = _GROUPS[canon] = GroupResources(canon)
        _GROUPS[group] = res
    return res


def all_resources() -> list[GroupResources]:
    """Every group's resources, once each."""
    return list({id(r): r for r in _GROUPS.values()}.values())


def forget(group) -> GroupResources | None:
    """Drop and close (locally) the resources of ``group``; returns them, or None when there were none."""
    res = lookup(group)
    if res is not None:
        for key in [k for k, v in _GROUPS.items() if v is res]:
            del _GROUPS[key]
        res.close()
    return res


def forget_all() -> None:
    """Drop and close (locally) every group's resources (after the process groups were destroyed)."""
    for res in all_resources():
        res.close()
    _GROUPS.clear()
