"""CPU tests of the peer all-to-all schedule (hpdl.comm.algorithms.peer_alltoall): the reference that mirrors
the CUDA kernel is checked against all_to_all_single's definition for equal, uneven and zero-length splits,
several back-to-back calls and several rounds per pair; CI has no GPU."""

from __future__ import annotations

import random

import pytest
import torch

from hpdl.comm.algorithms import peer_alltoall as pa
from hpdl.comm.algorithms.alltoall import Layout, make_layout


def _world_layouts(splits: list[list[int]], row_bytes: int) -> tuple[list[torch.Tensor], list[Layout]]:
    """``splits[r][q]`` rows rank r sends to rank q; returns each rank's input bytes and layout."""
    world = len(splits)
    g = torch.Generator().manual_seed(sum(map(sum, splits)) + world)
    srcs, lays = [], []
    for r in range(world):
        isp = splits[r]
        osp = [splits[q][r] for q in range(world)]
        inp = torch.randint(0, 256, (sum(isp), row_bytes), generator=g, dtype=torch.uint8)
        out = torch.empty(sum(osp), row_bytes, dtype=torch.uint8)
        lay, _, _ = make_layout(out, inp, osp, isp, world)
        srcs.append(inp.view(-1))
        lays.append(lay)
    return srcs, lays


def _expected(srcs: list[torch.Tensor], lays: list[Layout]) -> list[torch.Tensor]:
    world = len(srcs)
    return [torch.cat([srcs[q][lays[q].send_off[r]:lays[q].send_off[r] + lays[q].send_len[r]] for q in range(world)])
            for r in range(world)]


@pytest.mark.parametrize("algorithm", list(pa.ALGORITHMS))
@pytest.mark.parametrize("world", [2, 3, 5, 8])
@pytest.mark.parametrize("kind", ["equal", "uneven", "zeros"])
def test_reference_matches_all_to_all_definition(algorithm, world, kind):
    rng = random.Random(world * 7 + len(kind))
    if kind == "equal":
        splits = [[37] * world for _ in range(world)]
    elif kind == "uneven":
        splits = [[rng.randint(1, 90) for _ in range(world)] for _ in range(world)]
    else:  # zero-length blocks, and one rank that exchanges nothing with anyone
        splits = [[0 if (r + q) % 3 == 0 or r == world - 1 or q == world - 1 else rng.randint(1, 60)
                   for q in range(world)] for r in range(world)]
    srcs, lays = _world_layouts(splits, row_bytes=12)
    # 4 blocks x 1 KiB slots: pairs of up to 1 KiB take several blocks, bigger ones several rounds
    got = pa.reference_all_to_all(srcs, lays, algorithm, grid=4, slot=1024, calls=3)
    for r, (g, w) in enumerate(zip(got, _expected(srcs, lays))):
        assert torch.equal(g, w), f"rank {r}: {int((g != w).sum())} wrong bytes"


@pytest.mark.parametrize("algorithm", list(pa.ALGORITHMS))
def test_reference_many_rounds_and_changing_sizes(algorithm):
    """Back-to-back calls of different sizes keep the pair epochs consistent (the device counters persist)."""
    srcs, lays = _world_layouts([[400, 20, 0], [3, 200, 900], [50, 0, 7]], row_bytes=16)
    got = pa.reference_all_to_all(srcs, lays, algorithm, grid=3, slot=256, calls=2)
    assert all(torch.equal(g, w) for g, w in zip(got, _expected(srcs, lays)))


def test_reference_detects_ends_that_disagree():
    """A receiver expecting more bytes than its peer sends runs different rounds: the slot check fires."""
    srcs, lays = _world_layouts([[10, 10], [10, 10]], row_bytes=16)
    bad = Layout(lays[0].send_off, lays[0].send_len, lays[0].recv_off, (lays[0].recv_len[0], 9000))
    with pytest.raises(RuntimeError, match="slot from rank 1"):
        pa.reference_all_to_all(srcs, [bad, lays[1]], "push", grid=2, slot=512)


@pytest.mark.parametrize("nbytes", [0, 1, 100, 8192, 8193, 1 << 20, 1 << 30])
@pytest.mark.parametrize("grid", [1, 132])
def test_pair_chunk_bounds(nbytes, grid):
    slot = pa.slot_bytes(2)
    c = pa.pair_chunk(nbytes, grid, slot)
    assert c % 16 == 0 and pa.MIN_CHUNK <= c <= slot
    if nbytes > grid * slot:
        assert c == slot   # big messages use full slots, in several rounds
    if nbytes <= grid * pa.MIN_CHUNK:
        assert c == pa.MIN_CHUNK


def test_plan_is_symmetric_between_ends():
    """Both ends of every pair compute the same chunk: no metadata exchange is needed."""
    rng = random.Random(3)
    world = 6
    splits = [[rng.choice([0, 1, 500, 70000]) for _ in range(world)] for _ in range(world)]
    _, lays = _world_layouts(splits, row_bytes=8)
    chunks = [pa.plan(lays[r], r, 132, pa.slot_bytes(world))[1] for r in range(world)]
    for r in range(world):
        for p in range(world):
            if p != r:
                assert chunks[r][p] == chunks[p][r]


def test_unit_bytes_and_slots():
    assert pa.unit_bytes(0, 4096, 32, 48) == 16
    assert pa.unit_bytes(4096, 6) == 2
    assert pa.unit_bytes(1024, 12, 8) == 4
    assert pa.unit_bytes(3) == 1
    assert pa.slot_bytes(2) == 128 * 1024 and pa.slot_bytes(8) == 32 * 1024


def test_bad_arguments_are_named():
    srcs, lays = _world_layouts([[1, 1], [1, 1]], row_bytes=16)
    with pytest.raises(ValueError, match="algorithm"):
        pa.reference_all_to_all(srcs, lays, "scatter")
    with pytest.raises(ValueError, match="slot"):
        pa.reference_all_to_all(srcs, lays, "push", slot=100)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        pa.peer_all_to_all(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8), lays[0], None,
                           "broadcast")
    with pytest.raises(ValueError, match="uint8 CUDA tensors"):
        pa.peer_all_to_all(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8), lays[0], None,
                           "push")


def test_auto_picks_the_peer_kernel_on_cuda_only():
    from hpdl.comm.algorithms.alltoall import select

    assert select(4 << 20, 2, "cuda") == "push"          # measured: push beat NCCL at every size on 2 x H200
    assert select(1 << 30, 8, "cuda") == "push"
    assert select(4 << 20, 16, "cuda") == "native"       # beyond one node's 8 GPUs
    assert select(4 << 20, 8, "cpu") == "native"
    assert select(4 << 20, 1, "cuda") == "native"
