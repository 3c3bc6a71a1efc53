"""Two-level, multi-rail Allreduce with a persistent shared buffer and an early-triggered pipeline (seed 2).

Reading of the seed (docs/comm.md, "Two-level algorithms"; Chen-Chun Chen's SC25 abstract, no full text):
with ``g`` ranks on each of ``N`` nodes and local rank ``i`` driving rail ``i``,

1. every rank copies its tensor into its slot of the node's persistent shared buffer (POSIX shared memory on
   CPU, :mod:`hpdl.comm.transport.shm`; on GPU the same role is played by an IPC/symmetric-memory buffer);
2. **intra-node reduce-scatter**: the tensor is cut into ``R = max ranks per node`` shards; the local rank
   ``s mod g`` reduces shard ``s`` over the node's slots (on the host; float32 for 16-bit) into the buffer's
   result area;
3. **inter-node Allreduce on every rail at once**: shard ``s`` is all-reduced among the ranks that own it on
   each node, a rail-aligned group (local rank ``s mod g_n`` of every node), with a flat algorithm (ring by
   default); all rails run concurrently. **Early trigger**: the shard is cut into ``depth`` chunks and a
   background thread starts chunk ``j``'s inter-node Allreduce as soon as its intra-node reduction is done,
   while the reduction of chunk ``j+1`` proceeds;
4. **intra-node all-gather**: after a node barrier every rank copies the whole result out of the buffer.

Uneven nodes (e.g. 3 + 2 ranks) work: a node with fewer ranks gives several shards to one rank. The reduction
order is fixed (local ranks in order, then the inter-node algorithm's order), and every rank copies the same
bytes, so results are bitwise identical on all ranks.
"""

from __future__ import annotations

import math
import queue
import threading
from datetime import timedelta

import torch

from hpdl.comm.algorithms.base import AllReduce, get_class
from hpdl.comm.ops import acc_dtype, combine_, shard_bounds
from hpdl.comm.transport.base import Transport
from hpdl.comm.transport.shm import NodeSharedBuffer, open_node_buffer
from hpdl.comm.transport.sub import SubTransport
from hpdl.runtime import env
from hpdl.runtime.errors import CollectiveTimeoutError
from hpdl.runtime.topology import Topology

MIN_CHUNK_BYTES = 64 << 10   # below this a pipeline chunk costs more in latency than it hides
INTER_ALGORITHMS = ("ring", "direct", "recursive_doubling", "native")
_TAG_BASE = 1000
_ALIGN = 64


def shard_owners(topology: Topology, shard: int) -> list[int]:
    """Group ranks that own ``shard`` on each node, ordered by node: local rank ``shard mod g_n`` of node n."""
    owners = []
    for n in range(topology.num_nodes):
        local = topology.node_ranks(n)
        owners.append(local[shard % len(local)])
    return owners


def chunk_bounds(start: int, stop: int, depth: int, itemsize: int) -> list[tuple[int, int]]:
    """Split ``[start, stop)`` into at most ``depth`` chunks of at least ``MIN_CHUNK_BYTES`` (one if smaller)."""
    n = stop - start
    chunks = max(1, min(depth, n * itemsize // MIN_CHUNK_BYTES))
    return [(start + a, start + b) for a, b in shard_bounds(n, chunks)] if n else []


class _InterWorker:
    """One background thread that runs inter-node Allreduces in submission order (the early trigger)."""

    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="hpdl-two-level-inter", daemon=True)
        self._thread.start()
        self._error: BaseException | None = None
        self._outstanding = 0
        self._done = threading.Condition()

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                if self._error is None:
                    job()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller in drain()
                self._error = exc
            with self._done:
                self._outstanding -= 1
                self._done.notify_all()

    def submit(self, job) -> None:
        if self._error is not None:
            return
        with self._done:
            self._outstanding += 1
        self._q.put(job)

    def drain(self, timeout: float, peers: list[int]) -> None:
        """Wait for every submitted job; re-raise the first error. ``timeout`` bounds the wait; ``peers``
        (this rank's inter-node partners) are named when it runs out."""
        with self._done:
            if not self._done.wait_for(lambda: self._outstanding == 0, timeout=timeout):
                raise CollectiveTimeoutError(f"two_level: inter-node phase still running after {timeout:.0f}s, "
                                             f"waiting for rank(s) {peers}", missing_ranks=peers)
        err, self._error = self._error, None
        if err is not None:
            raise err

    def stop(self) -> None:
        self._q.put(None)


class TwoLevel(AllReduce):
    """Two-level multi-rail Allreduce over a node shared buffer (see the module docstring).

    Args:
        resources, window, timeout: as every algorithm (:class:`~hpdl.comm.algorithms.base.Algorithm`); the
            topology and, for an NCCL group, the gloo host transport come from ``resources``. ``window``:
            throttle of the inter-node ``direct`` algorithm (unused by ring).
        topology: overrides the group's :class:`~hpdl.runtime.Topology` (required without ``resources``;
            ``hpdl.comm.set_topology``).
        depth: pipeline depth, chunks per shard (default ``HPDL_PIPELINE_DEPTH``); 1 disables the early trigger.
        inter: algorithm among a shard's owners (one per node, a rail), one of :data:`INTER_ALGORITHMS` or
            "auto" (default ``HPDL_TWO_LEVEL_INTER``: native on the world group, ring otherwise). ring / direct /
            recursive_doubling run hpdl's algorithm over a view of the group's transport; ``native`` runs
            ``torch.distributed.all_reduce`` on one ``dist.new_group`` per rail (gloo, made at the first call by
            every rank, so the group must be the whole world).
        host_comm: gloo transport used to stage CUDA tensors through host memory (default: the resources').

    Raises:
        ValueError: missing topology, bad ``depth`` or ``inter``.
    """

    name = "two_level"
    needs_topology = True

    def __init__(self, resources=None, window: int | None = None, timeout: float | None = None, *,
                 topology: Topology | None = None, depth: int | None = None, inter: str | None = None,
                 host_comm: Transport | None = None):
        super().__init__(resources, window, timeout)
        if resources is not None:
            topology = topology if topology is not None else resources.get_topology(self.timeout)
            if host_comm is None and (resources.backend != "gloo" or resources.cuda_over_gloo):
                host_comm = resources.host(self.timeout)
        if topology is None:
            raise ValueError("algorithm 'two_level' needs the group's topology: call "
                             "hpdl.comm.set_topology(topology_or_ranks_per_node, group) first")
        self.topology = topology
        self.depth = int(env.get("HPDL_PIPELINE_DEPTH") if depth is None else depth)
        if self.depth < 1:
            raise ValueError(f"depth (pipeline chunks per shard) must be >= 1, got {self.depth}")
        self.inter = env.get("HPDL_TWO_LEVEL_INTER") if inter is None else inter
        if self.inter not in INTER_ALGORITHMS + ("auto",):
            raise ValueError(f"inter must be 'auto' or one of {INTER_ALGORITHMS}, got {self.inter!r}")
        self.host_comm = host_comm
        self._window = window
        self._inter_algo = get_class(self.inter)(None, window) if self.inter not in ("native", "auto") else None
        self._rail_groups: dict[int, object] = {}
        self._shm: NodeSharedBuffer | None = None
        self._worker: _InterWorker | None = None
        self._pinned: torch.Tensor | None = None
        self._last_result = 0   # bytes of the previous call's result (see _host_all_reduce)

    def _buffer(self, comm: Transport) -> NodeSharedBuffer:
        if self._shm is None or self._shm.broken:
            self._shm = open_node_buffer(comm, self.topology)
            self._last_result = 0
        self._shm.timeout = comm.timeout
        return self._shm

    def all_reduce(self, buf: torch.Tensor, op: str, comm: Transport) -> None:
        if buf.device.type == "cpu":
            self._host_all_reduce(buf, op, comm)
            return
        if self.host_comm is None:
            raise ValueError("two_level on CUDA tensors stages through host memory and needs a gloo group beside "
                             "the NCCL one (hpdl.runtime contexts create it)")
        nbytes = buf.numel() * buf.element_size()
        if self._pinned is None or self._pinned.numel() < nbytes:
            self._pinned = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=True)
        staging = self._pinned[:nbytes].view(buf.dtype)
        staging.copy_(buf)
        self._host_all_reduce(staging, op, self.host_comm)
        buf.copy_(staging)

    def _host_all_reduce(self, buf: torch.Tensor, op: str, comm: Transport) -> None:
        topo, me, p = self.topology, comm.rank, comm.world_size
        if topo.world_size != p:
            raise ValueError(f"topology world_size={topo.world_size} does not match the group's {p} ranks")
        shm = self._buffer(comm)
        local = topo.node_ranks(topo.node_of[me])
        g, lr = len(local), local.index(me)
        n, es = buf.numel(), buf.element_size()
        # Result at the front, input slots at the back: a fast rank writes the next call's input before the
        # first barrier, while slow ranks may still copy this call's result out, so the two must not overlap.
        nb = n * es
        stride = -(-nb // _ALIGN) * _ALIGN  # every slot starts 64-byte aligned (a dtype view needs alignment)
        data = shm.ensure(max(self._last_result, nb) + g * stride + _ALIGN)
        self._last_result = nb
        top = (data.numel() - g * stride) // _ALIGN * _ALIGN

        def slot(i: int) -> torch.Tensor:
            return data[top + i * stride:top + i * stride + nb].view(buf.dtype)

        result = data[:nb].view(buf.dtype)
        if self.inter == "auto":  # per-rail process groups when they can be made (world group), else ring
            import torch.distributed as dist

            parent = getattr(comm, "group", None)
            whole = parent is None or dist.get_world_size(parent) == dist.get_world_size()
            self.inter = "native" if whole and hasattr(comm, "group") else "ring"
            self._inter_algo = None if self.inter == "native" else get_class("ring")(None, self._window)
        if self.inter == "native" and topo.num_nodes > 1:
            self._make_rail_groups(comm)
        slot(lr).copy_(buf)
        shm.barrier("two_level: inputs in the shared buffer")
        multi = topo.num_nodes > 1
        if multi and self._worker is None:
            self._worker = _InterWorker()
        inter_op = "sum" if op == "avg" else op
        try:
            for s, (a, b) in enumerate(shard_bounds(n, topo.num_rails)):
                if s % g != lr:
                    continue
                sub = SubTransport(comm, shard_owners(topo, s), tag_offset=_TAG_BASE + 8 * s) if multi else None
                for c0, c1 in chunk_bounds(a, b, self.depth, es):
                    acc = slot(0)[c0:c1].to(acc_dtype(buf.dtype), copy=True)
                    for i in range(1, g):
                        combine_(acc, slot(i)[c0:c1], op)
                    out = result[c0:c1]
                    if not multi:
                        _finish(acc, out, op, p)
                    else:
                        out.copy_(acc)
                        if self.inter == "native":
                            self._worker.submit(self._native_job(comm, s, out, inter_op, op, p))
                        else:
                            self._worker.submit(_inter_job(self._inter_algo, out, inter_op, op, sub, p))
            if multi:  # each job's own waits end within the timeout; the margin lets their error (naming
                # the peer) arrive first
                self._worker.drain(comm.timeout + 5.0, self._rail_peers(comm))
        except BaseException:
            shm.broken = True  # peers may be inside a barrier we will not reach
            raise
        shm.barrier("two_level: reduced shards in the shared buffer")
        buf.copy_(result)

    def _make_rail_groups(self, comm: Transport) -> None:
        """One gloo group per shard (its owners: one rank per node, a rail), made once by every rank of the world
        in shard order (``dist.new_group`` is collective over the default group)."""
        import torch.distributed as dist

        if self._rail_groups:
            return
        parent = getattr(comm, "group", None)
        if parent is not None and dist.get_world_size(parent) != dist.get_world_size():
            raise ValueError("inter='native' needs the group to be the whole world (dist.new_group is collective "
                             "over it); use inter='ring' on subgroups")
        for s in range(self.topology.num_rails):
            members = [dist.get_global_rank(parent, m) if parent is not None else m
                       for m in shard_owners(self.topology, s)]
            self._rail_groups[s] = dist.new_group(members, backend="gloo")

    def _native_job(self, comm: Transport, shard: int, out: torch.Tensor, inter_op: str, op: str, world: int):
        """Inter-node phase of one chunk on the shard's rail process group (see :meth:`_make_rail_groups`)."""
        import torch.distributed as dist

        from hpdl.comm.ops import to_torch_op

        group = self._rail_groups[shard]
        peers = [r for r in shard_owners(self.topology, shard) if r != comm.rank]
        timeout = comm.timeout

        def job() -> None:
            work = dist.all_reduce(out, op=to_torch_op(inter_op), group=group, async_op=True)
            try:
                work.wait(timedelta(seconds=timeout))  # the rail group's own timeout is the job's, not ours
            except RuntimeError as exc:
                raise CollectiveTimeoutError(f"two_level: inter-node all_reduce of shard {shard} on rank "
                                             f"{comm.rank} failed waiting for rank(s) {peers}: {str(exc)[:200]}",
                                             missing_ranks=peers) from None
            if op == "avg":
                _finish(out.clone(), out, op, world)
        return job

    def _rail_peers(self, comm: Transport) -> list[int]:
        """Ranks on other nodes that share a shard with this rank (its inter-node partners)."""
        topo, me = self.topology, comm.rank
        local = topo.node_ranks(topo.node_of[me])
        out: set[int] = set()
        for s in range(topo.num_rails):
            owners = shard_owners(topo, s)
            if s % len(local) == local.index(me):
                out.update(r for r in owners if r != me)
        return sorted(out)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None


def _finish(acc: torch.Tensor, out: torch.Tensor, op: str, world: int) -> None:
    """Write a fully reduced ``acc`` (still a sum for avg) into ``out``, dividing once by ``world`` for avg."""
    if op == "avg":
        acc = acc.float() if acc.dtype in (torch.float16, torch.bfloat16) else acc
        acc.div_(world)
    out.copy_(acc)


def _inter_job(algo: AllReduce, out: torch.Tensor, inter_op: str, op: str, sub: SubTransport, world: int):
    def job() -> None:
        if sub.world_size > 1:
            algo.all_reduce(out, inter_op, sub)
        if op == "avg":
            _finish(out.clone(), out, op, world)
    return job


def pipeline_chunks(nbytes: int, world_rails: int, depth: int) -> int:
    """Chunks one shard is cut into for an ``nbytes`` tensor (the cost model uses the same rule)."""
    shard = math.ceil(nbytes / max(world_rails, 1))
    return max(1, min(depth, shard // MIN_CHUNK_BYTES))
