"""Alltoall algorithms behind ``hpdl.comm.all_to_all_single``: flat pairwise and throttled direct, and the
two-level PUSH and PULL variants over a node shared buffer (seed 2).

Every algorithm moves bytes: ``src``/``dst`` are flat uint8 tensors and a :class:`Layout` gives, per peer, the
byte offset and length of the block sent to it and received from it (torch's ``all_to_all_single`` layout:
block ``q`` of the input goes to rank ``q``, block ``q`` of the output comes from rank ``q``). Zero-length
blocks are never sent. So every dtype works, with equal or uneven splits.

* ``pairwise`` (Thakur, Rabenseifner & Gropp, IJHPCA 2005; MPICH's long-message Alltoall): p-1 steps, step d
  sends to rank+d and receives from rank-d.
* ``direct``: every send and receive posted at once, at most ``window`` peers in flight (MPICH's scattered
  algorithm with ``MPIR_CVAR_ALLTOALL_THROTTLE``; window None = all peers).
* ``push``: each local rank writes its outgoing blocks into the node's shared buffer, ordered by destination;
  after a node barrier, blocks for the node's ranks are copied out by their destinations, and for every remote
  rank ``q`` (local index ``j``) the node's rail-``j`` rank (local rank ``j mod g``) sends the ``g`` blocks for
  ``q``, contiguous in the buffer, as one aggregated message straight to ``q`` (same rail on both ends).
* ``pull``: each local rank exposes its whole input in the shared buffer, unchanged; destinations on the node
  read their blocks from it, and the rail rank reads (gathers) the ``g`` blocks for each remote ``q`` and sends
  them as one message. Exposing costs one contiguous copy into the shared buffer (a local HBM copy in the GPU kernel of
  :mod:`hpdl.comm.algorithms.peer_alltoall`); a zero-copy variant would register the caller's input itself for IPC.

Inter-node messages are posted before the intra-node copies, so the two overlap. Receivers take the message
from node ``n`` straight into the output when node ``n``'s blocks are contiguous there (consecutive ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hpdl.comm.algorithms.base import AllToAll
from hpdl.comm.transport.base import Transport
from hpdl.comm.transport.shm import NodeSharedBuffer, open_node_buffer
from hpdl.runtime.errors import CollectiveMismatchError
from hpdl.runtime.topology import Topology

_TAG = 7


@dataclass(frozen=True)
class Layout:
    """Byte offsets and lengths of the blocks one rank sends to / receives from each peer."""

    send_off: tuple[int, ...]
    send_len: tuple[int, ...]
    recv_off: tuple[int, ...]
    recv_len: tuple[int, ...]


def _splits(name: str, t: torch.Tensor, splits, p: int) -> list[int]:
    rows = t.size(0)
    if splits is None:
        if rows % p:
            raise ValueError(f"{name}.size(0)={rows} must be divisible by world_size={p} when {name}_split_sizes "
                             "is None")
        return [rows // p] * p
    out = [int(s) for s in splits]
    if len(out) != p or any(s < 0 for s in out):
        raise ValueError(f"{name}_split_sizes must be {p} non-negative ints (one per rank), got {list(splits)}")
    if sum(out) != rows:
        raise ValueError(f"{name}_split_sizes must sum to {name}.size(0)={rows}, got sum {sum(out)}")
    return out


def make_layout(output: torch.Tensor, input: torch.Tensor, output_split_sizes, input_split_sizes,
                world_size: int, rank: int | None = None) -> tuple[Layout, list[int], list[int]]:
    """Validate torch's ``all_to_all_single`` arguments; return the byte layout and both split lists (rows).

    ``rank`` (this rank in the group), when given, also checks the one pair a rank can check alone: the rows
    it keeps, ``input_split_sizes[rank]``, must equal ``output_split_sizes[rank]``.

    Raises:
        ValueError: a 0-d tensor, different dtypes, devices or row shapes, splits of the wrong length, negative,
            or not summing to ``size(0)``, equal splits requested for a size not divisible by ``world_size``,
            or different own-block sizes.
    """
    for name, t in (("output", output), ("input", input)):
        if t.dim() == 0:
            raise ValueError(f"{name} must have at least one dimension (rows are split along dim 0)")
    if output.dtype != input.dtype:
        raise ValueError(f"output and input must have the same dtype, got {output.dtype} and {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"output and input must be on the same device, got {output.device} and {input.device}")
    if tuple(output.shape[1:]) != tuple(input.shape[1:]):
        raise ValueError(f"output and input must have the same shape after dim 0, got {tuple(output.shape)} and "
                         f"{tuple(input.shape)}")
    osp = _splits("output", output, output_split_sizes, world_size)
    isp = _splits("input", input, input_split_sizes, world_size)
    if rank is not None and osp[rank] != isp[rank]:
        raise ValueError(f"rank {rank} keeps input_split_sizes[{rank}]={isp[rank]} rows of its own input but "
                         f"expects output_split_sizes[{rank}]={osp[rank]}: they must be equal")
    row = math.prod(input.shape[1:]) * input.element_size()
    soff = np.concatenate([[0], np.cumsum(isp)[:-1]]) * row
    roff = np.concatenate([[0], np.cumsum(osp)[:-1]]) * row
    lay = Layout(tuple(int(x) for x in soff), tuple(s * row for s in isp), tuple(int(x) for x in roff),
                 tuple(s * row for s in osp))
    return lay, osp, isp


def verify_splits(comm: Transport, osp: Sequence[int], isp: Sequence[int], tag: int = 98) -> None:
    """Collective: every rank checks that rank i's output split j equals rank j's input split i, for all i, j.

    Raises:
        CollectiveMismatchError: on every rank, naming the first inconsistent pair.
    """
    p = comm.world_size
    mine = torch.tensor(list(isp) + list(osp), dtype=torch.int64)
    rows = comm.exchange_all(mine, tag=tag)
    m = torch.stack(rows)  # m[i, :p] = input splits of rank i, m[i, p:] = output splits of rank i
    bad = (m[:, p:] != m[:, :p].t()).nonzero()
    if len(bad):
        i, j = (int(x) for x in bad[0])
        raise CollectiveMismatchError(f"all_to_all_single: rank {i} expects output_split_sizes[{j}]={int(m[i, p + j])}"
                                      f" rows from rank {j}, but rank {j} sends input_split_sizes[{i}]="
                                      f"{int(m[j, i])}; every pair must agree")


def _blk(buf: torch.Tensor, off: int, n: int) -> torch.Tensor:
    return buf[off:off + n]


def pairwise(dst: torch.Tensor, src: torch.Tensor, lay: Layout, comm: Transport) -> None:
    """Pairwise exchange: p-1 sendrecv steps at distances 1..p-1, zero-length blocks skipped."""
    me, p = comm.rank, comm.world_size
    _blk(dst, lay.recv_off[me], lay.recv_len[me]).copy_(_blk(src, lay.send_off[me], lay.send_len[me]))
    for d in range(1, p):
        to, frm = (me + d) % p, (me - d) % p
        sends = [(_blk(src, lay.send_off[to], lay.send_len[to]), to)] if lay.send_len[to] else []
        recvs = [(_blk(dst, lay.recv_off[frm], lay.recv_len[frm]), frm)] if lay.recv_len[frm] else []
        s, r = comm.post(sends, recvs, _TAG)
        for req in r + s:
            req.wait()


def throttled_direct(dst: torch.Tensor, src: torch.Tensor, lay: Layout, comm: Transport,
                     window: int | None = None) -> None:
    """Scattered Alltoall: windows of ``window`` peers (distances d..d+k-1) posted together, then waited."""
    me, p = comm.rank, comm.world_size
    k = p - 1 if not window else max(1, min(int(window), p - 1))
    _blk(dst, lay.recv_off[me], lay.recv_len[me]).copy_(_blk(src, lay.send_off[me], lay.send_len[me]))
    for d0 in range(1, p, k):
        ds = range(d0, min(d0 + k, p))
        sends = [(_blk(src, lay.send_off[(me + d) % p], lay.send_len[(me + d) % p]), (me + d) % p) for d in ds
                 if lay.send_len[(me + d) % p]]
        recvs = [(_blk(dst, lay.recv_off[(me - d) % p], lay.recv_len[(me - d) % p]), (me - d) % p) for d in ds
                 if lay.recv_len[(me - d) % p]]
        s, r = comm.post(sends, recvs, _TAG + 1)
        for req in r + s:
            req.wait()


class _TwoLevelAlltoall(AllToAll):
    """Shared machinery of PUSH and PULL; subclasses fill the node buffer and feed the aggregated sends.

    CPU tensors go through the node's POSIX shared buffer. CUDA tensors of a group on one host run the
    one-kernel peer-memory all-to-all over the group's registered buffer
    (:mod:`hpdl.comm.algorithms.peer_alltoall`: the node buffer is then GPU memory mapped into every peer);
    CUDA tensors across nodes are staged through host memory over the host transport.

    ``topology`` (keyword-only) overrides the resources' (required without ``resources``).
    """

    needs_topology = True
    layout_by_destination = True

    def __init__(self, resources=None, window: int | None = None, timeout: float | None = None, *,
                 topology: Topology | None = None):
        super().__init__(resources, window, timeout)
        if topology is None and resources is not None:
            topology = resources.get_topology(self.timeout)
        if topology is None:
            raise ValueError(f"algorithm {self.name!r} needs the group's topology: call "
                             "hpdl.comm.set_topology(topology_or_ranks_per_node, group) first")
        self.topology = topology
        self._shm: NodeSharedBuffer | None = None

    @classmethod
    def fits(cls, device_type, world_size, *, dtype=None, gpus=None, topology=None) -> bool:
        """On CUDA: the peer kernel can take the call (2..8 ranks, a GPU per rank, one node); elsewhere True."""
        if device_type != "cuda":
            return True
        from hpdl.comm.algorithms.peer_alltoall import MAX_RANKS  # that module imports Layout from here

        return (torch.version.cuda is not None and 2 <= world_size <= MAX_RANKS
                and (gpus is None or world_size <= gpus)
                and (topology is None or getattr(topology, "single_node", True)))

    @classmethod
    def runs_kernel(cls, resources, tensor, timeout) -> bool:
        """True when ``tensor`` is CUDA and the group one host of peers: the peer-memory kernel runs."""
        if not tensor.is_cuda or resources.world_size == 1:
            return False
        from hpdl.comm.algorithms.peer_alltoall import available

        return available(tensor, resources.world_size) and resources.get_topology(timeout).single_node

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    def all_to_all(self, dst: torch.Tensor, src: torch.Tensor, lay: Layout, comm: Transport) -> None:
        if src.device.type == "cuda":
            if self.resources is None:
                raise ValueError(f"algorithm {self.name!r} on CUDA tensors needs its group's GroupResources (the "
                                 "peer-memory buffer, or the host transport to stage through)")
            if self.runs_kernel(self.resources, src, comm.timeout):
                from hpdl.comm.algorithms.peer_alltoall import communicator

                communicator(self.resources, src.device).launch(dst, src, lay, self.name, self.window, comm.timeout)
                return
            host_dst = torch.empty(dst.numel(), dtype=torch.uint8)   # across nodes: stage through host memory
            self._node_all_to_all(host_dst, src.cpu(), lay, self.resources.host(comm.timeout))
            dst.copy_(host_dst)
            return
        self._node_all_to_all(dst, src, lay, comm)

    def all_to_all_launcher(self, lay: Layout, device: torch.device):
        """The peer kernel's hot path for ``lay`` (see :meth:`~.peer_alltoall._A2AComm.launcher`), or None
        when this group does not run the kernel."""
        from hpdl.comm.algorithms.peer_alltoall import communicator

        launch = communicator(self.resources, device).launcher(lay, self.name, self.window)

        def fn(output: torch.Tensor, input: torch.Tensor) -> bool:
            if not (output.is_contiguous() and input.is_contiguous()):
                return False
            o, i = output.data_ptr(), input.data_ptr()
            no, ni = output.numel() * output.element_size(), input.numel() * input.element_size()
            if not no or not ni or (i < o + no and o < i + ni):
                return False
            return launch(i, o)

        return fn

    def _node_all_to_all(self, dst: torch.Tensor, src: torch.Tensor, lay: Layout, comm: Transport) -> None:
        topo, me, p = self.topology, comm.rank, comm.world_size
        if topo.world_size != p:
            raise ValueError(f"topology world_size={topo.world_size} does not match the group's {p} ranks")
        if self._shm is None or self._shm.broken or self._shm.meta_words != p:
            self._shm = open_node_buffer(comm, topo, meta_words=p)
        shm = self._shm
        shm.timeout = comm.timeout
        node = topo.node_of[me]
        local = topo.node_ranks(node)
        lr = local.index(me)
        shm.meta[lr].copy_(torch.tensor(lay.send_len, dtype=torch.int64))
        shm.barrier(f"{self.name}: split sizes")
        m = shm.meta.numpy().copy()  # m[l, q] = bytes local rank l sends to rank q
        try:
            self._exchange(dst, src, lay, comm, shm, m, local, lr)
        except BaseException:
            shm.broken = True
            raise

    def _exchange(self, dst, src, lay, comm, shm, m, local, lr) -> None:
        me, p = comm.rank, comm.world_size
        g = len(local)
        data = shm.ensure(int(m.sum()))
        if self.layout_by_destination:   # PUSH: [q][l] blocks, writers scatter
            col = m.sum(axis=0)
            base = np.concatenate([[0], np.cumsum(col)[:-1]])
            pos = base[None, :] + np.concatenate([np.zeros((1, p), dtype=np.int64), np.cumsum(m, axis=0)[:-1]])
            for q in range(p):
                if m[lr, q]:
                    _blk(data, int(pos[lr, q]), int(m[lr, q])).copy_(_blk(src, lay.send_off[q], lay.send_len[q]))
        else:                            # PULL: each rank's input as is, one region per local rank
            region = np.concatenate([[0], np.cumsum(m.sum(axis=1))[:-1]])
            pos = region[:, None] + np.concatenate([np.zeros((g, 1), dtype=np.int64), np.cumsum(m, axis=1)[:, :-1]],
                                                   axis=1)
            _blk(data, int(region[lr]), int(m[lr].sum())).copy_(src[: int(m[lr].sum())])
        shm.barrier(f"{self.name}: blocks in the shared buffer")
        sends, recvs, staged = self._post_inter(dst, lay, comm, data, m, pos, local, lr)
        for l in range(g):  # intra-node: read my blocks from the node buffer (overlaps the inter-node traffic)
            src_rank = local[l]
            if lay.recv_len[src_rank]:
                _blk(dst, lay.recv_off[src_rank], lay.recv_len[src_rank]).copy_(
                    _blk(data, int(pos[l, me]), int(m[l, me])))
        for req in recvs:
            req.wait()
        for tmp, ranks in staged:  # messages that could not land in place
            o = 0
            for r in ranks:
                _blk(dst, lay.recv_off[r], lay.recv_len[r]).copy_(tmp[o:o + lay.recv_len[r]])
                o += lay.recv_len[r]
        for req in sends:
            req.wait()

    def _post_inter(self, dst, lay, comm, data, m, pos, local, lr):
        topo, me = self.topology, comm.rank
        g, my_node = len(local), topo.node_of[me]
        sends, recv_list, staged = [], [], []
        for n in range(topo.num_nodes):
            if n == my_node:
                continue
            ranks = topo.node_ranks(n)
            for j, q in enumerate(ranks):   # I aggregate for remote q when q's rail maps to me
                size = int(m[:, q].sum())
                if j % g != lr or size == 0:
                    continue
                if self.layout_by_destination:
                    msg = _blk(data, int(pos[0, q]), size)
                else:   # PULL: gather the g blocks for q from the exposed inputs
                    msg = torch.empty(size, dtype=torch.uint8)
                    o = 0
                    for l in range(g):
                        msg[o:o + int(m[l, q])].copy_(_blk(data, int(pos[l, q]), int(m[l, q])))
                        o += int(m[l, q])
                sends.append((msg, q))
            # I receive from node n's rank on my rail: the blocks of all of n's ranks for me, in local order
            agg = ranks[local.index(me) % len(ranks)]
            size = sum(lay.recv_len[r] for r in ranks)
            if size == 0:
                continue
            contiguous = all(lay.recv_off[b] == lay.recv_off[a] + lay.recv_len[a] for a, b in zip(ranks, ranks[1:]))
            if contiguous:
                recv_list.append((_blk(dst, lay.recv_off[ranks[0]], size), agg))
            else:
                tmp = torch.empty(size, dtype=torch.uint8)
                staged.append((tmp, ranks))
                recv_list.append((tmp, agg))
        s, r = comm.post(sends, recv_list, _TAG + 2)
        return s, r, staged


class TwoLevelPush(_TwoLevelAlltoall):
    """Two-level Alltoall, PUSH: local ranks store their blocks into the node buffer ordered by destination."""

    name = "push"
    layout_by_destination = True


class TwoLevelPull(_TwoLevelAlltoall):
    """Two-level Alltoall, PULL: local ranks expose their inputs; destinations and rail ranks read from them."""

    name = "pull"
    layout_by_destination = False


class Pairwise(AllToAll):
    """Pairwise exchange (:func:`pairwise`), an all_to_all algorithm only."""

    name = "pairwise"

    def all_to_all(self, dst, src, lay, comm):
        pairwise(dst, src, lay, comm)


def _byte_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bytes as a flat uint8 view, or None when it has no such view (non-contiguous, empty, or one
    element with a stride other than 1, which counts as contiguous but cannot be viewed as bytes)."""
    if not t.is_contiguous() or t.numel() == 0:
        return None
    flat = t.view(-1)
    return flat.view(torch.uint8) if flat.stride(0) == 1 else None


def execute(algo: AllToAll, resources, output: torch.Tensor, input: torch.Tensor, lay: Layout, timeout: float):
    """Run one validated ``all_to_all_single`` with the algorithm instance ``algo`` of the group whose
    :class:`~hpdl.comm.transport.resources.GroupResources` is ``resources``: byte views of the tensors (copies
    where there are none, or where output overlaps input), the algorithm, the copy back.

    Returns the native algorithm's :class:`~hpdl.comm.algorithms.native.Pending` (issued, not waited), or None
    when the exchange is complete.
    """
    src = _byte_view(input)
    if src is None:
        src = torch.empty(input.numel() * input.element_size(), dtype=torch.uint8, device=input.device)
        if input.numel():
            src.view(input.dtype).copy_(input.reshape(-1))
    dst = _byte_view(output)
    direct_out = dst is not None
    if dst is None:
        dst = torch.empty(output.numel() * output.element_size(), dtype=torch.uint8, device=output.device)
    if dst.numel() and src.numel() and src.data_ptr() < dst.data_ptr() + dst.numel() \
            and dst.data_ptr() < src.data_ptr() + src.numel():
        src = src.clone()  # output overlaps input: read from a copy
    pending = None
    if resources.world_size == 1:
        dst.copy_(src)
    else:
        pending = algo.all_to_all(dst, src, lay, resources.comm(timeout))
    if not direct_out and output.numel():
        def back() -> None:
            output.copy_(dst.view(output.dtype).view(output.shape))
        if pending is None:
            back()
        else:
            pending.then(back)
    return pending
