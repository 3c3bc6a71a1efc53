"""All-to-all over peer GPU memory on one node: PUSH and PULL through a persistent shared buffer, one kernel.

The intra-node half of the two-level Alltoall of seed 2 (multi-rail Allreduce/Alltoall with an IPC shared
buffer in PUSH and PULL variants), for CUDA tensors whose ranks share a host (docs/comm.md, "All-to-all"):

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

from hpdl.comm.algorithms.layout import Layout
from hpdl.comm.transport.resources import GroupResources, lookup, resources_of

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


def pair_lane(rank: int, peer: int, block: int, grid: int) -> int:
    """Position of ``block`` in pair (rank, peer)'s sequence of chunks: chunk c runs on block
    ``(c + rank + peer) % grid`` (the same on both ends; spreads small messages of different pairs)."""
    return (block - (rank + peer) % grid) % grid


def pair_active(lay: Layout, rank: int, peer: int, block: int, round_: int, grid: int, chunk: int) -> int | None:
    """Byte position of (rank, peer)'s chunk in ``block``'s round ``round_``, or None when it has none."""
    pos = (round_ * grid + pair_lane(rank, peer, block, grid)) * chunk
    return pos if pos < max(lay.send_len[peer], lay.recv_len[peer]) else None


def block_rounds(lay: Layout, rank: int, block: int, grid: int, chunks: Sequence[int]) -> int:
    """Rounds block ``block`` runs on ``rank``: the most any of its pairs needs (the kernel's loop bound)."""
    best = 0
    for p in range(len(chunks)):   # p == rank: the local copy of its own block takes rounds too
        units = -(-max(lay.send_len[p], lay.recv_len[p]) // chunks[p])
        lane = pair_lane(rank, p, block, grid)
        if units > lane:
            best = max(best, -(-(units - lane) // grid))
    return best


MAX_PLANS = 1024   # registered layouts per communicator before they are all forgotten (uneven splits vary)


def timeout_ns(seconds: float) -> int:
    """``seconds`` as the kernel's wait limit in nanoseconds, saturated (``inf`` waits practically forever)."""
    return int(min(float(seconds) * 1e9, 2.0 ** 63 - 1))


KIND = "peer_all_to_all"   # registration kind in the group's GroupResources


class _A2AComm:
    """Registered buffer + extension handle of one (group, device), and the registered launch plans: a
    registration owned by the group's :class:`~hpdl.comm.transport.resources.GroupResources`
    (:func:`communicator`).

    ``generation`` changes whenever registered plans are forgotten (more than :data:`MAX_PLANS` layouts, or
    :func:`release`); launchers made before check it and step aside, so a stale plan id is never launched.
    """

    def __init__(self, group, device: torch.device):
        from hpdl.comm.transport.kernels import load_peer_allreduce
        from hpdl.comm.transport.symm import PeerBuffer, device_census
        from hpdl.runtime import env

        self.ext = load_peer_allreduce()
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.world > MAX_RANKS:
            raise ValueError(f"peer all_to_all supports groups of at most {MAX_RANKS} ranks, got {self.world}")
        self.slot = slot_bytes(self.world)
        # probe the SM count on every rank so that all of them launch the same grid (pair rounds must agree);
        # ranks sharing a GPU share its SMs (blocks wait for peers' blocks: all must be resident)
        sms, sharing = device_census(group, device)
        self.grid = max(1, min(sms // sharing, MAX_BLOCKS))
        nbytes = HEADER_BYTES + self.grid * 2 * self.world * self.slot
        self.buffer = PeerBuffer(group, device, nbytes, header_bytes=HEADER_BYTES)
        self.handle = self.ext.a2a_create(self.buffer.ptrs, self.rank, self.world, device.index, HEADER_BYTES,
                                          self.slot, self.grid, timeout_ns(env.get("HPDL_TIMEOUT")))
        self.plans: dict[tuple, tuple[int, int]] = {}
        self.generation = 0

    def plan_id(self, lay: Layout, window: int | None) -> tuple[int, int]:
        """(plan id in the extension, widest unit the layout allows), registered once per layout."""
        key = (lay, window)
        got = self.plans.get(key)
        if got is None:
            if len(self.plans) >= MAX_PLANS:
                self.ext.a2a_clear_plans(self.handle)
                self.plans.clear()
                self.generation += 1
            layout, chunks = plan(lay, self.rank, self.grid, self.slot)
            got = self.plans[key] = (self.ext.a2a_plan(self.handle, layout, chunks, window or 0),
                                     unit_bytes(*layout))
        return got

    def launcher(self, lay: Layout, algorithm: str, window: int | None = None, timeout: float | None = None):
        """``launch(src_ptr, dst_ptr) -> bool``: one kernel launch of a registered layout on the current stream
        (the API's hot path: no tensor is touched); False, launching nothing, once the plan was forgotten
        (:data:`MAX_PLANS`, :func:`release`). ``timeout``: seconds a block may wait for a peer (None = the
        communicator's ``HPDL_TIMEOUT``)."""
        pid, unit = self.plan_id(lay, window)
        ext, handle, code, gen = self.ext, self.handle, ALGORITHMS[algorithm], self.generation
        limit = 0 if timeout is None else timeout_ns(timeout)

        def launch(sp: int, dp: int) -> bool:
            if self.generation != gen:
                return False
            ext.all_to_all(handle, pid, sp, dp, code, math.gcd(unit, sp, dp), limit)
            return True

        return launch

    def launch(self, dst: torch.Tensor, src: torch.Tensor, lay: Layout, algorithm: str, window: int | None = None,
               timeout: float | None = None) -> None:
        """:func:`peer_all_to_all` on this registration (arguments as there)."""
        _check(dst, src, algorithm)
        self.launcher(lay, algorithm, window, timeout)(src.data_ptr(), dst.data_ptr())

    def close(self, collective: bool = True) -> None:
        """Forget the plans and free the buffer; ``collective=False`` only forgets (the group is gone)."""
        self.generation = -1
        self.ext.a2a_release(self.handle)
        if collective:
            self.buffer.close()

    def forget(self) -> None:
        """:meth:`close` without communication."""
        self.close(collective=False)


def communicator(resources: GroupResources, device: torch.device) -> _A2AComm:
    """The group's registered all-to-all buffer on ``device`` (registered at first use: collective)."""
    return resources.registration(KIND, device, lambda: _A2AComm(resources.group, device))


def release(group=None) -> None:
    """Free the all-to-all buffers registered for ``group`` (collective over the group; call before
    destroying it). Cached API calls on it step aside and register afresh if the group is used again."""
    res = lookup(group)
    if res is not None:
        res.release(KIND)


def available(tensor: torch.Tensor, world_size: int) -> bool:
    """True when :func:`peer_all_to_all` can take ``tensor``: CUDA, a CUDA build, 2..8 ranks and a visible GPU
    for each (one GPU per process, as with per-rank ``CUDA_VISIBLE_DEVICES``, cannot map peers' memory; ranks
    sharing a GPU, ``HPDL_RANKS_PER_GPU``, count as that many); that the ranks share a host is checked,
    collectively, at the first call."""
    from hpdl.runtime.launch import gpu_slots

    return (tensor.is_cuda and torch.version.cuda is not None and 2 <= world_size <= MAX_RANKS
            and world_size <= gpu_slots())


def peer_all_to_all(dst: torch.Tensor, src: torch.Tensor, lay: Layout, group, algorithm: str,
                    window: int | None = None, timeout: float | None = None) -> None:
    """All-to-all of byte tensors over peer memory with one kernel on the current stream.

    Args:
        dst, src: flat uint8 CUDA tensors on this rank's device (output and input of all_to_all_single viewed
            as bytes), not overlapping.
        lay: byte offsets and lengths per peer (:func:`hpdl.comm.algorithms.layout.make_layout`); rank i's
            ``recv_len[j]`` must equal rank j's ``send_len[i]`` (a mismatch makes the pair's rounds differ and
            the kernel times out after ``HPDL_TIMEOUT``, printing the rank it waited for).
        group: process group of ranks on one host (None = default group), 2..8 ranks.
        algorithm: "push" or "pull".
        window: a block synchronises its threads after every ``window`` peers it stored to (a light
            throttle: it bounds how far a block's threads run ahead, not the stores in flight); None = never.
        timeout: seconds a block waits for a peer before it prints the peer's rank and traps (None =
            ``HPDL_TIMEOUT`` when the buffer was registered).

    The first call per (group, device) registers the buffer (collective, not inside CUDA-graph capture);
    later calls are one launch and replay safely in graphs. Calls on one group must be ordered on each rank
    (one stream, or streams joined by events): they share the buffer's slots and epochs. Copies use the
    widest unit (16 to 1 bytes) that divides both pointers and every offset and length.

    Raises:
        ValueError: unknown algorithm, non-uint8 or CPU tensors, more than 8 ranks.
        RuntimeError: the kernel launch failed, or the ranks are not on one host.
    """
    _check(dst, src, algorithm)
    communicator(resources_of(group), dst.device).launch(dst, src, lay, algorithm, window, timeout)


def _check(dst: torch.Tensor, src: torch.Tensor, algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}")
    if not (dst.is_cuda and src.is_cuda and dst.dtype == torch.uint8 and src.dtype == torch.uint8):
        raise ValueError(f"dst and src must be uint8 CUDA tensors, got {dst.dtype}/{dst.device} and "
                         f"{src.dtype}/{src.device}")


def launcher(lay: Layout, group, device: torch.device, algorithm: str, window: int | None = None,
             timeout: float | None = None):
    """:meth:`_A2AComm.launcher` of ``group``'s registration on ``device`` (the first call per (group, device)
    registers the buffer: collective)."""
    return communicator(resources_of(group), device).launcher(lay, algorithm, window, timeout)


# ----------------------------------------------------------------------------------------------------------
# CPU reference of the kernel's schedule
# ----------------------------------------------------------------------------------------------------------

def reference_all_to_all(srcs: Sequence[torch.Tensor], lays: Sequence[Layout], algorithm: str, *, grid: int = 4,
                         slot: int = 1024, calls: int = 1, seed: int = 0) -> list[torch.Tensor]:
    """Run the kernel's schedule on CPU byte tensors: ``srcs[r]``/``lays[r]`` are rank r's input and layout,
    ``calls`` back-to-back calls; returns each rank's output of the last call. See :func:`simulate`."""
    return simulate([(srcs, lays, algorithm)] * calls, grid=grid, slot=slot, seed=seed)[-1]


def simulate(calls: Sequence[tuple[Sequence[torch.Tensor], Sequence[Layout], str]], *, grid: int = 4,
             slot: int = 1024, seed: int = 0, halves: int = 2) -> list[list[torch.Tensor]]:
    """The kernel's schedule on CPU, with ranks and blocks interleaved at random, for a sequence of calls.

    Each call is ``(srcs, lays, algorithm)`` (rank r's input bytes and layout, "push" or "pull"). Every
    (rank, block) is a coroutine that runs its calls in order, exactly as the kernel's block does: per round,
    pair epochs, the half by epoch parity, outgoing stores into the slots (``grid x halves x world`` slots of
    ``slot`` bytes per rank, shared by PUSH and PULL), its own block's chunk, the flag stores and the pair
    barrier (it blocks until the peer's flag reaches the epoch), then the incoming copies. A seeded scheduler
    advances one coroutine a step at a time, so ranks run ahead of each other as far as the barriers allow.
    Each slot records who wrote it for which call and epoch; every read checks it. ``halves=1`` disables the
    double buffering (tests show the check then fails).

    Returns:
        ``outs[c][r]``: rank r's output bytes of call c.

    Raises:
        ValueError: bad algorithm, rank count, slot size or layouts.
        RuntimeError: a read saw a slot written for another round, call or rank, or the schedule deadlocked.
    """
    import random

    world = len(calls[0][0]) if calls else 0
    for srcs, lays, algorithm in calls:
        if algorithm not in ALGORITHMS or not 1 <= len(srcs) <= MAX_RANKS or len(lays) != len(srcs) \
                or len(srcs) != world or slot % 16:
            raise ValueError(f"algorithm in {list(ALGORITHMS)}, 1..{MAX_RANKS} ranks with one layout each and slot "
                             f"a multiple of 16 expected; got {algorithm!r}, {len(srcs)} ranks, {len(lays)} layouts, "
                             f"{slot}")
    rng = random.Random(seed)
    slots = [torch.zeros(grid, halves, world, slot, dtype=torch.uint8) for _ in range(world)]
    tags: dict[tuple, tuple] = {}
    flag: dict[tuple, int] = {}    # (algo, owner, block, src) -> epoch
    epoch: dict[tuple, int] = {}   # (algo, rank, block, peer) -> epoch
    outs = [[torch.zeros(sum(lay.recv_len), dtype=torch.uint8) for lay in lays] for _, lays, _ in calls]

    def run(r: int, b: int):
        for c, (srcs, lays, algorithm) in enumerate(calls):
            lay, src, out = lays[r], srcs[r], outs[c][r]
            ch = plan(lay, r, grid, slot)[1]
            push = algorithm == "push"
            for i in range(block_rounds(lay, r, b, grid, ch)):
                pos = {p: pair_active(lay, r, p, b, i, grid, ch[p]) for p in range(world)}
                act = [p for p in range(world) if p != r and pos[p] is not None]
                for p in act:
                    epoch[algorithm, r, b, p] = epoch.get((algorithm, r, b, p), 0) + 1
                for p in [(r + j) % world for j in range(1, world)]:   # outgoing
                    if p not in act:
                        continue
                    e = epoch[algorithm, r, b, p]
                    n = max(0, min(ch[p], lay.send_len[p] - pos[p]))
                    q, idx = (p, r) if push else (r, p)
                    slots[q][b, e % halves, idx, :n] = src[lay.send_off[p] + pos[p]:lay.send_off[p] + pos[p] + n]
                    tags[q, b, e % halves, idx] = (r, p, c, e)
                    yield
                if pos[r] is not None:   # own block
                    n = max(0, min(ch[r], lay.send_len[r] - pos[r]))
                    out[lay.recv_off[r] + pos[r]:lay.recv_off[r] + pos[r] + n] = \
                        src[lay.send_off[r] + pos[r]:lay.send_off[r] + pos[r] + n]
                for p in act:
                    flag[algorithm, p, b, r] = epoch[algorithm, r, b, p]
                yield
                for p in act:            # pair barrier
                    while flag.get((algorithm, r, b, p), 0) < epoch[algorithm, r, b, p]:
                        yield "wait"
                for p in [(r - j) % world for j in range(1, world)]:   # incoming
                    if p not in act:
                        continue
                    e = epoch[algorithm, r, b, p]
                    q, idx = (r, p) if push else (p, r)
                    if tags.get((q, b, e % halves, idx)) != (p, r, c, e):
                        raise RuntimeError(f"rank {r} block {b} call {c} round {i}: slot from rank {p} holds "
                                           f"{tags.get((q, b, e % halves, idx))}, expected (writer, reader, call, "
                                           f"epoch) {(p, r, c, e)}")
                    n = max(0, min(ch[p], lay.recv_len[p] - pos[p]))
                    out[lay.recv_off[p] + pos[p]:lay.recv_off[p] + pos[p] + n] = slots[q][b, e % halves, idx, :n]
                    yield

    live = {(r, b): run(r, b) for r in range(world) for b in range(grid)}
    stalled = 0
    while live:
        key = rng.choice(list(live))
        try:
            stalled = stalled + 1 if next(live[key]) == "wait" else 0
        except StopIteration:
            del live[key]
            stalled = 0
        if stalled > 200 * (len(live) + 1):
            raise RuntimeError(f"schedule deadlocked: (rank, block) {sorted(live)} wait at pair barriers forever")
    return outs
