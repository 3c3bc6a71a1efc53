"""All-to-all over peer GPU memory on one node: PUSH and PULL through a persistent shared buffer, one kernel.

The intra-node half of the two-level Alltoall of seed 2 (multi-rail Allreduce/Alltoall with an IPC shared
buffer in PUSH and PULL variants), for CUDA tensors whose ranks share a host (docs/comm_two_level.md):

* every rank registers one persistent buffer, mapped into every peer (``PeerBuffer``: torch symmetric memory,
  else CUDA IPC handles), holding ``grid x 2 halves x world`` slots of :func:`slot_bytes`;
* ``push``: rank r stores the bytes it sends to p into slot ``r`` of p's buffer (NVLink store), meets p at a
  pair barrier, then copies the slots its peers filled into its output (local HBM copy);
* ``pull``: rank r copies the bytes for p into slot ``p`` of its own buffer, meets p at a pair barrier, then
  loads slot ``r`` of every peer's buffer into its output (NVLink load);
* messages larger than ``grid x chunk`` go in rounds; halves alternate per pair so one barrier a round
  suffices, and a pair of ranks that exchanges nothing never synchronises.

The pair (r, p) moves ``max(send_len, recv_len)`` bytes in chunks of :func:`pair_chunk`, a function of that
length only, which both ends know: uneven splits need no metadata exchange. The kernel is
``transport/kernels/peer_alltoall.cuh``; :func:`reference_all_to_all` runs the same schedule (slots, halves,
pair epochs, rounds) on CPU tensors and checks that every slot read sees the pair's current round, which CI
tests against torch's all_to_all_single semantics.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from hpdl.comm.algorithms.alltoall import Layout

ALGORITHMS = {"push": 0, "pull": 1}
MAX_RANKS = 8
MAX_BLOCKS = 256
HEADER_BYTES = 64 * 1024     # pair flags and epochs (32 KiB used), zeroed at registration
MIN_CHUNK = 8 * 1024         # one 16-byte unit per thread of a 512-thread block


def slot_bytes(world: int) -> int:
    """Capacity of one slot: 256 KiB split over the ranks, at least 32 KiB (128 KiB at 2 ranks)."""
    return max(32 * 1024, (256 * 1024) // max(world, 1))


def pair_chunk(nbytes: int, grid: int, slot: int) -> int:
    """Bytes per block and round for a pair moving ``nbytes`` (the larger direction): spread over ``grid``
    blocks, at least :data:`MIN_CHUNK`, at most ``slot``, a multiple of 16."""
    c = -(-max(nbytes, 1) // grid)
    c = -(-c // 16) * 16
    return min(slot, max(MIN_CHUNK, c))


def unit_bytes(*values: int) -> int:
    """Widest copy unit (16, 8, 4, 2 or 1 bytes) that divides every pointer, offset and length given."""
    g = 16
    for v in values:
        g = math.gcd(g, int(v))
    return g


def plan(lay: Layout, rank: int, grid: int, slot: int) -> tuple[list[int], list[int]]:
    """``(layout, chunks)`` as the kernel takes them: send_off + send_len + recv_off + recv_len, and the
    per-pair chunk (for the rank itself: the chunk of its own block's local copy)."""
    chunks = [pair_chunk(max(lay.send_len[p], lay.recv_len[p]), grid, slot) for p in range(len(lay.send_len))]
    return [*lay.send_off, *lay.send_len, *lay.recv_off, *lay.recv_len], chunks


def block_rounds(lay: Layout, rank: int, block: int, grid: int, chunks: Sequence[int]) -> int:
    """Rounds block ``block`` runs on ``rank``: the most any of its pairs needs (the kernel's loop bound)."""
    best = 0
    for p in range(len(chunks)):   # p == rank: the local copy of its own block takes rounds too
        units = -(-max(lay.send_len[p], lay.recv_len[p]) // chunks[p])
        if units > block:
            best = max(best, -(-(units - block) // grid))
    return best


class _A2AComm:
    """Registered buffer + extension handle of one (group, device), and the registered launch plans."""

    def __init__(self, group, device: torch.device):
        from hpdl.comm.transport.kernels import load_peer_allreduce
        from hpdl.comm.transport.symm import PeerBuffer
        from hpdl.runtime import env

        self.ext = load_peer_allreduce()
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.world > MAX_RANKS:
            raise ValueError(f"peer all_to_all supports groups of at most {MAX_RANKS} ranks, got {self.world}")
        self.slot = slot_bytes(self.world)
        # probe the SM count on every rank so that all of them launch the same grid (pair rounds must agree)
        sms: list = [None] * self.world
        with torch.cuda.device(device):
            dist.all_gather_object(sms, torch.cuda.get_device_properties(device).multi_processor_count, group=group)
        self.grid = min(min(sms), MAX_BLOCKS)
        nbytes = HEADER_BYTES + self.grid * 2 * self.world * self.slot
        self.buffer = PeerBuffer(group, device, nbytes, header_bytes=HEADER_BYTES)
        timeout_ns = int(float(env.get("HPDL_TIMEOUT")) * 1e9)
        self.handle = self.ext.a2a_create(self.buffer.ptrs, self.rank, self.world, device.index, HEADER_BYTES,
                                          self.slot, self.grid, timeout_ns)
        self.plans: dict[tuple, tuple[int, int]] = {}

    def plan_id(self, lay: Layout, window: int | None) -> tuple[int, int]:
        """(plan id in the extension, widest unit the layout allows), registered once per layout."""
        key = (lay, window)
        got = self.plans.get(key)
        if got is None:
            layout, chunks = plan(lay, self.rank, self.grid, self.slot)
            got = self.plans[key] = (self.ext.a2a_plan(self.handle, layout, chunks, window or 0),
                                     unit_bytes(*layout))
        return got

    def close(self) -> None:
        self.ext.a2a_release(self.handle)
        self.buffer.close()


_COMMS: dict[tuple, _A2AComm] = {}


def _comm(group, device: torch.device) -> _A2AComm:
    key = (group, device.index)
    comm = _COMMS.get(key)
    if comm is None:
        comm = _COMMS[key] = _A2AComm(group, device)
    return comm


def release(group=None) -> None:
    """Free the all-to-all buffers registered for ``group`` (collective over the group)."""
    for key in [k for k in _COMMS if k[0] is group]:
        _COMMS.pop(key).close()


def available(tensor: torch.Tensor, world_size: int) -> bool:
    """True when :func:`peer_all_to_all` can take ``tensor`` (CUDA, a CUDA build, 2..8 ranks); that the ranks
    share a host is checked, collectively, at the first call."""
    return tensor.is_cuda and torch.version.cuda is not None and 2 <= world_size <= MAX_RANKS


def peer_all_to_all(dst: torch.Tensor, src: torch.Tensor, lay: Layout, group, algorithm: str,
                    window: int | None = None) -> None:
    """All-to-all of byte tensors over peer memory with one kernel on the current stream.

    Args:
        dst, src: flat uint8 CUDA tensors on this rank's device (output and input of all_to_all_single viewed
            as bytes), not overlapping.
        lay: byte offsets and lengths per peer (:func:`hpdl.comm.algorithms.alltoall.make_layout`); rank i's
            ``recv_len[j]`` must equal rank j's ``send_len[i]`` (a mismatch makes the pair's rounds differ and
            the kernel times out after ``HPDL_TIMEOUT``, printing the rank it waited for).
        group: process group of ranks on one host (None = default group), 2..8 ranks.
        algorithm: "push" or "pull".
        window: peers a block serves before synchronising its threads (the throttle); None = all.

    The first call per (group, device) registers the buffer (collective, not inside CUDA-graph capture);
    later calls are one launch and replay safely in graphs. Copies use the widest unit (16 to 1 bytes)
    that divides both pointers and every offset and length.

    Raises:
        ValueError: unknown algorithm, non-uint8 or CPU tensors, more than 8 ranks.
        RuntimeError: the kernel launch failed, or the ranks are not on one host.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}")
    if not (dst.is_cuda and src.is_cuda and dst.dtype == torch.uint8 and src.dtype == torch.uint8):
        raise ValueError(f"dst and src must be uint8 CUDA tensors, got {dst.dtype}/{dst.device} and "
                         f"{src.dtype}/{src.device}")
    launcher(lay, group, dst.device, algorithm, window)(src.data_ptr(), dst.data_ptr())


def launcher(lay: Layout, group, device: torch.device, algorithm: str, window: int | None = None):
    """``launch(src_ptr, dst_ptr)``: one kernel launch of a registered layout on the current stream (the API's
    hot path: no tensor is touched). The first call per (group, device) registers the buffer (collective)."""
    comm = _comm(group, device)
    pid, unit = comm.plan_id(lay, window)
    ext, handle, code = comm.ext, comm.handle, ALGORITHMS[algorithm]

    def launch(sp: int, dp: int) -> None:
        ext.all_to_all(handle, pid, sp, dp, code, math.gcd(unit, sp, dp))

    return launch


# ----------------------------------------------------------------------------------------------------------
# CPU reference of the kernel's schedule
# ----------------------------------------------------------------------------------------------------------

def reference_all_to_all(srcs: Sequence[torch.Tensor], lays: Sequence[Layout], algorithm: str, *, grid: int = 4,
                         slot: int = 1024, calls: int = 1) -> list[torch.Tensor]:
    """Run the kernel's schedule on CPU byte tensors: ``srcs[r]``/``lays[r]`` are rank r's input and layout.

    Simulates every block's rounds with per-rank slot buffers (``grid x 2 x world`` slots of ``slot`` bytes),
    per-pair epochs carried over ``calls`` back-to-back calls (as the device counters are), the halves chosen by
    epoch parity and the pair masks; each slot records who wrote it at which epoch, and every read checks that
    it sees the pair's current round (so ends that disagree on chunks or rounds fail loudly). Small defaults
    (4 blocks, 1 KiB slots) make rounds, partial chunks and idle blocks occur on small inputs.

    Returns:
        Each rank's output bytes (``sum(recv_len)`` long; with ``calls > 1`` the last call's).

    Raises:
        ValueError: unknown algorithm, fewer than 1 or more than 8 ranks, ``slot`` not a multiple of 16.
        RuntimeError: a read saw a slot written for another round or by another rank (a schedule bug).
    """
    world = len(srcs)
    if algorithm not in ALGORITHMS or not 1 <= world <= MAX_RANKS or slot % 16 or len(lays) != world:
        raise ValueError(f"algorithm in {list(ALGORITHMS)}, 1..{MAX_RANKS} ranks with one layout each and slot a "
                         f"multiple of 16 expected; got {algorithm!r}, {world} ranks, {len(lays)} layouts, {slot}")
    push = algorithm == "push"
    slots = [torch.zeros(grid, 2, world, slot, dtype=torch.uint8) for _ in range(world)]
    tags = [[[[None] * world for _ in range(2)] for _ in range(grid)] for _ in range(world)]
    epoch = [[[0] * world for _ in range(grid)] for _ in range(world)]   # [rank][block][peer]
    plans = [plan(lays[r], r, grid, slot)[1] for r in range(world)]
    outs: list[torch.Tensor] = []
    for _ in range(calls):
        outs = [torch.zeros(sum(lay.recv_len), dtype=torch.uint8) for lay in lays]
        for b in range(grid):
            rounds = max(block_rounds(lays[r], r, b, grid, plans[r]) for r in range(world))
            for i in range(rounds):
                active = []
                for r in range(world):
                    lay, ch = lays[r], plans[r]
                    mask = [p != r and (i * grid + b) * ch[p] < max(lay.send_len[p], lay.recv_len[p])
                            for p in range(world)]
                    for p in range(world):
                        epoch[r][b][p] += mask[p]
                    active.append(mask)
                for r in range(world):   # outgoing
                    lay, ch = lays[r], plans[r]
                    for p in [(r + j) % world for j in range(1, world)]:
                        if not active[r][p]:
                            continue
                        pos = (i * grid + b) * ch[p]
                        n = max(0, min(ch[p], lay.send_len[p] - pos))
                        half = epoch[r][b][p] & 1
                        q, idx = (p, r) if push else (r, p)
                        slots[q][b, half, idx, :n] = srcs[r][lay.send_off[p] + pos:lay.send_off[p] + pos + n]
                        tags[q][b][half][idx] = (r, p, epoch[r][b][p])
                    pos = (i * grid + b) * ch[r]   # own block: its chunk of this round, locally
                    n = max(0, min(ch[r], lay.send_len[r] - pos))
                    outs[r][lay.recv_off[r] + pos:lay.recv_off[r] + pos + n] = \
                        srcs[r][lay.send_off[r] + pos:lay.send_off[r] + pos + n]
                for r in range(world):   # pair barriers passed: incoming
                    lay, ch = lays[r], plans[r]
                    for p in [(r - j) % world for j in range(1, world)]:
                        if not active[r][p]:
                            continue
                        pos = (i * grid + b) * ch[p]
                        n = max(0, min(ch[p], lay.recv_len[p] - pos))
                        half = epoch[r][b][p] & 1
                        q, idx = (r, p) if push else (p, r)
                        if tags[q][b][half][idx] != (p, r, epoch[r][b][p]):
                            raise RuntimeError(f"rank {r} block {b} round {i}: slot from rank {p} holds "
                                               f"{tags[q][b][half][idx]}, expected {(p, r, epoch[r][b][p])}")
                        outs[r][lay.recv_off[p] + pos:lay.recv_off[p] + pos + n] = slots[q][b, half, idx, :n]
    return outs
