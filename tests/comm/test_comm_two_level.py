"""Two-level multi-rail all-reduce (and the two-level all-to-all on 6 and 5 ranks) over emulated nodes: exact
(#wrong == 0), bitwise identical on all ranks, pipelined, buffer reuse with changing sizes, and no shared
memory left behind, even after a rank dies mid-call (last: it breaks the pool)."""

import json
import os
import time

import pytest

from hpdl.testing import get_pool

import _two_level_cases as T


def _shm_names():
    """hpdl.comm's segments in /dev/shm: ``hpdl-comm-<creator pid>x<hex>-...``."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("hpdl-comm-")) if os.path.isdir("/dev/shm") else []


def _creator_pid(name):
    return name.split("-")[2].split("x")[0]


def _exact_and_identical(results):
    assert [f for fails, _ in results for f in fails] == []
    digests = [d for _, d in results if d]
    assert all(d == digests[0] for d in digests), "ranks disagree bitwise"


def _pipelined(world, rpn, depth):
    count = 1 << 20  # 4 MiB of float32: every shard is at least `depth` chunks of 64 KiB
    results = get_pool(8).run(T.all_reduce_pipelined, rpn, depth, count, world)[:world]
    assert [w for w, _, _, _ in results] == [0] * world
    assert {(d, c) for _, d, c, _ in results} == {(depth, depth)}
    assert len({h for *_, h in results}) == 1


# One 8-rank pool runs every case: 6- and 5-rank topologies run on a subgroup of its first ranks (which also
# tests hpdl.comm on a group other than the world).
CASES = [(8, 4), (8, 2), (6, 3), (6, 2), (5, [3, 2]), (5, 5)]
IDS = ["2x4", "4x2", "2x3", "3x2", "3+2", "1x5"]


@pytest.mark.parametrize("world,rpn", CASES, ids=IDS)
@pytest.mark.timeout(240)
def test_two_level_all_reduce_exact_and_bit_identical(world, rpn):
    _exact_and_identical(get_pool(8).run(T.all_reduce_matrix, rpn, world)[:world])


@pytest.mark.parametrize("world,rpn", CASES[2:5], ids=IDS[2:5])
@pytest.mark.timeout(240)
def test_alltoall_on_6_and_5_ranks(world, rpn):
    algos = ("push", "pull") + (("pairwise", "direct", "native") if rpn != 2 else ())
    for algo in algos:
        results = get_pool(8).run(T.alltoall_matrix, rpn, algo, world)[:world]
        assert [f for fails, _ in results for f in fails] == [], algo


@pytest.mark.timeout(240)
def test_pipeline_chunks_are_exact():
    _pipelined(8, 4, 4)
    _pipelined(8, 2, 1)  # depth 1: no early trigger, same result
    _pipelined(5, [3, 2], 3)


@pytest.mark.timeout(240)
def test_inter_node_phase_on_per_rail_process_groups():
    results = get_pool(8).run(T.inter_native, 4)
    assert [w for w, _ in results] == [0] * 8
    assert all("whole world" in e for _, e in results[:6]) and [e for _, e in results[6:]] == [None, None]


@pytest.mark.timeout(240)
def test_buffer_reused_and_grown_across_back_to_back_calls():
    results = get_pool(8).run(T.back_to_back, 4)
    assert [w for w, _ in results] == [0] * 8
    caps = results[0][1]
    assert caps[-1] > caps[0] > 0, caps  # grew on demand, never re-created smaller
    assert all(b >= a for a, b in zip(caps, caps[1:]))
    assert _shm_names() == []  # names are unlinked as soon as every local rank has mapped a segment


@pytest.mark.timeout(120)
def test_rank_dying_mid_call_errors_others_within_timeout_and_leaks_no_segment(tmp_path):
    from hpdl.runtime.errors import WorkerFailedError

    world, rpn, victim, timeout = 8, 4, 1, 6.0
    pool = get_pool(world)
    pids = {str(p.pid) for p in pool._procs}
    try:
        with pytest.raises(WorkerFailedError, match="rank 1 died"):
            pool.run(T.dies_mid_call_to_file, rpn, victim, timeout, str(tmp_path), timeout=60)
        deadline = time.monotonic() + 3 * timeout + 10
        while len(list(tmp_path.iterdir())) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        pool.close()  # its group is broken now
    got = {int(f.stem): json.loads(f.read_text())["result"] for f in tmp_path.iterdir()}
    assert sorted(got) == [0, 2, 3, 4, 5, 6, 7]
    for rank, (name, msg, elapsed, names) in got.items():
        assert name is not None, f"rank {rank} returned normally"  # never a silent wrong result
        assert elapsed < timeout + 5, (rank, elapsed)
        assert [n for n in names if _creator_pid(n) in pids] == []  # mid-run: no name of ours exists
    for rank in (0, 2, 3):  # the victim's node-mates see it die at once, by pid; the post-mortem confirms it
        assert got[rank][0] == "PeerFailedError" and "[1]" in got[rank][1] and "gone" in got[rank][1], got[rank]
        assert got[rank][2] < timeout
    assert [n for n in _shm_names() if _creator_pid(n) in pids] == []
