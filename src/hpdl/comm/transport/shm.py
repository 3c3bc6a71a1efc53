"""POSIX shared memory between the processes of one (emulated) node: the CPU form of seed 2's shared buffer.

One :class:`NodeSharedBuffer` per (group, node) holds two segments made with ``multiprocessing.shared_memory``:

* a small **control** segment (int64 words): one arrival counter and one pid per local rank (node barrier
  and liveness), then a metadata area of ``meta_words`` words per local rank (e.g. Alltoall split sizes);
* a **data** segment, created on first use and grown on demand (capacity doubles; every local rank must
  ask for the same size in the same call, which the collectives guarantee).

Crash safety: a segment's name exists only between its creation and the moment every local rank has mapped
it; the creator (local rank 0) then unlinks it, so the memory is freed by the kernel when the last process
that maps it exits, however it exits. Names carry the creator's pid; creating a buffer first removes
``hpdl_<pid>_*`` segments whose creator is dead (left by a crash inside that short window), and the creator
stays registered with multiprocessing's resource tracker until it unlinks.

Ordering: data are written with plain stores (torch copies) before the arrival counter; x86-64 keeps stores
in program order (TSO), so a peer that sees the counter also sees the data. Waits poll with
``os.sched_yield`` then short sleeps, check that the awaited peers are alive, and raise
:class:`~hpdl.runtime.CollectiveTimeoutError` naming them after ``timeout`` seconds (or at once when a peer
process has died).
"""

from __future__ import annotations

import os
import secrets
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Sequence

import numpy as np
import torch

from hpdl.runtime.errors import CollectiveTimeoutError
from hpdl.runtime.procs import pid_alive

PREFIX = "hpdl"
_SHM_DIR = "/dev/shm"
MIN_DATA_BYTES = 1 << 20


def new_token() -> str:
    """A short random id for one group's buffers (rank 0 draws it and sends it to the others)."""
    return secrets.token_hex(4)


def _alive(pid: int) -> bool:
    return pid <= 0 or pid_alive(pid)  # pid 0: not registered yet, cannot tell


def sweep_stale() -> list[str]:
    """Unlink ``hpdl_<pid>_*`` segments in /dev/shm whose creator process is dead; return their names."""
    removed = []
    if not os.path.isdir(_SHM_DIR):
        return removed
    for name in os.listdir(_SHM_DIR):
        parts = name.split("_")
        if len(parts) < 3 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        if not _alive(int(parts[1])):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Attach without registering with the resource tracker: only the creator tracks a name (Python < 3.13
    registers every attach, and a tracker would then unlink a segment its owner still uses; bpo-39959)."""
    register = resource_tracker.register
    resource_tracker.register = lambda *a, **k: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


class _Segment:
    """One mapped shared-memory segment with a uint8 tensor view (``tensor``)."""

    def __init__(self, name: str, nbytes: int, create: bool, deadline: float):
        self.name = name
        self.creator = create
        if create:
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        else:
            while True:  # the creator may not have made (or sized) it yet
                try:
                    self._shm = _attach_untracked(name)
                    if self._shm.size >= nbytes:
                        break
                    self._shm.close()
                except (FileNotFoundError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(f"shared memory segment {name!r} ({nbytes} B) did not appear: its "
                                                 "creator (local rank 0 of this node) did not create it in time")
                time.sleep(0.001)
        self.linked = True
        self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)

    def unlink(self) -> None:
        if self.creator and self.linked:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
        self.linked = False

    def close(self) -> None:
        self.tensor = None  # the memoryview cannot be released while a tensor exports it
        try:
            self._shm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process


class NodeSharedBuffer:
    """Shared memory of the local ranks of one node, for one group.

    Args:
        token: id common to the group (see :func:`new_token`), so that groups and jobs never collide.
        node: node index (names the segments).
        local_rank: this process's index among the node's ranks.
        local_ranks: group ranks of the node, ordered by local rank (used in error messages).
        creator_pid: pid of local rank 0 (embedded in names for the stale sweep).
        meta_words: int64 words of metadata per local rank in the control segment.
        timeout: seconds any wait may block.

    Creation is collective over the node's ranks (all must construct it). Not thread-safe.

    Raises:
        CollectiveTimeoutError: a local rank did not attach within ``timeout``.
    """

    def __init__(self, token: str, node: int, local_rank: int, local_ranks: Sequence[int], creator_pid: int,
                 meta_words: int, timeout: float):
        self.g = len(local_ranks)
        if not 0 <= local_rank < self.g:
            raise ValueError(f"local_rank must be in [0, {self.g}), got {local_rank}")
        self.local_rank, self.local_ranks, self.timeout = local_rank, list(local_ranks), float(timeout)
        self.meta_words = int(meta_words)
        self._base = f"{PREFIX}_{creator_pid}_{token}_n{node}"
        self._seq = 0
        self.broken = False
        if local_rank == 0:
            sweep_stale()
        words = 2 * self.g + self.g * self.meta_words
        self._ctl = _Segment(self._base + "_c", 8 * words, local_rank == 0, time.monotonic() + self.timeout)
        self.ctl = self._ctl.tensor.view(torch.int64)
        self._arrive = self._ctl.tensor.numpy().view(np.int64)[: self.g]
        self._pids = self._ctl.tensor.numpy().view(np.int64)[self.g: 2 * self.g]
        self._pids[local_rank] = os.getpid()
        self.meta = self.ctl[2 * self.g:].view(self.g, self.meta_words)
        self.barrier("attaching the control segment")
        self._ctl.unlink()
        self._data: _Segment | None = None
        self._gen = 0
        self.capacity = 0

    # ------------------------------------------------------------------ synchronisation
    def barrier(self, what: str = "node barrier") -> None:
        """Wait until every local rank has reached its matching barrier (counts are per call site order)."""
        if self.broken:
            raise RuntimeError("this node's shared buffer is unusable after a failed call: call hpdl.comm.reset()")
        self._seq += 1
        seq = self._seq
        self._arrive[self.local_rank] = seq
        deadline = time.monotonic() + self.timeout
        spins, next_check = 0, time.monotonic() + 0.02
        while True:
            behind = [i for i in range(self.g) if self._arrive[i] < seq]
            if not behind:
                return
            spins += 1
            if spins < 64:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, 1e-5 * (spins - 63)))
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.02
                dead = [i for i in behind if not _alive(int(self._pids[i]))]
                if dead or now > deadline:
                    self.broken = True
                    ranks = [self.local_ranks[i] for i in (dead or behind)]
                    why = (f"died (pid {[int(self._pids[i]) for i in dead]})" if dead
                           else f"did not arrive within {self.timeout:.0f}s")
                    raise CollectiveTimeoutError(f"{what}: rank(s) {ranks} of this node {why}; rank "
                                                 f"{self.local_ranks[self.local_rank]} stops waiting",
                                                 missing_ranks=ranks)

    # ------------------------------------------------------------------ data segment
    def ensure(self, nbytes: int) -> torch.Tensor:
        """The data segment as a uint8 tensor of at least ``nbytes`` bytes, grown collectively if needed.

        Every local rank must call it with the same ``nbytes`` in the same call; growing costs two barriers.
        Data written before a growth are not carried over.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if self._data is not None and nbytes <= self.capacity:
            return self._data.tensor
        cap = -(-max(nbytes, 2 * self.capacity, MIN_DATA_BYTES) // 4096) * 4096  # whole pages
        self._gen += 1
        old = self._data
        self._data = _Segment(f"{self._base}_d{self._gen}", cap, self.local_rank == 0,
                              time.monotonic() + self.timeout)
        self.capacity = cap
        self.barrier("attaching the grown data segment")
        self._data.unlink()
        if old is not None:
            old.close()  # peers keep their own mappings; the memory goes when the last one unmaps
        return self._data.tensor

    def close(self) -> None:
        """Unmap both segments (local; names were unlinked at creation)."""
        self.meta = self.ctl = None  # type: ignore[assignment]
        self._arrive = self._pids = None  # type: ignore[assignment]
        for seg in (self._data, self._ctl):
            if seg is not None:
                seg.unlink()
                seg.close()
        self._data = None
        self.broken = True


def open_node_buffer(comm, topology, meta_words: int = 0) -> NodeSharedBuffer:
    """Collective over ``comm``'s group: agree on a token and each node's creator pid, then open this rank's
    :class:`NodeSharedBuffer` for the node ``topology`` places it on.

    Args:
        comm: the group's :class:`~hpdl.comm.transport.base.Transport` (one exchange of two int64 per pair).
        topology: :class:`hpdl.runtime.Topology` of the group (``topology.world_size == comm.world_size``).
        meta_words: int64 metadata words per local rank.
    """
    p, me = comm.world_size, comm.rank
    if topology.world_size != p:
        raise ValueError(f"topology has world_size={topology.world_size} but the group has {p} ranks")
    mine = torch.tensor([int(new_token(), 16), os.getpid()], dtype=torch.int64)
    if comm.device.type != "cpu":
        mine = mine.to(comm.device)
    theirs = comm.exchange_all(mine, tag=97)
    node = topology.node_of[me]
    local = topology.node_ranks(node)
    token = f"{int(theirs[0][0]):08x}"
    creator = int(theirs[local[0]][1])
    return NodeSharedBuffer(token, node, local.index(me), local, creator, meta_words, comm.timeout)
