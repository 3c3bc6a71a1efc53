"""Issue 21's defects, each as a test that failed on the code before the fix: c10d positional calls, async
hpdl collectives beside torch's own (call order), DDP with find_unused_parameters, killed and stopped peers
named within the timeout, one-element strided all_to_all_single, reduce_scatter/all_gather dtypes."""

import json
import time

import pytest

from hpdl.comm.transport.failure import window
from hpdl.testing import get_pool

import _c10d_cases as K


@pytest.mark.timeout(120)
def test_c10d_positional_signatures():
    p = 3
    results = get_pool(p).run(K.positional)
    for r, out in enumerate(results):
        assert out["ar_work"] == "Work"
        assert out["ar"] == [6.0] * 5 and out["ar_max"] == [2.0] * 3
        want_rs = [float(sum(2 * r + j + q for q in range(p))) for j in range(2)]
        assert out["rs"] == want_rs and out["rs_list"] == want_rs
        assert out["ag"] == [float(q) for q in range(p) for _ in range(2)]
        assert out["ag_list"] == [[float(q)] * 2 for q in range(p)]
        assert out["a2a"] == [float(r + 10 * q) for q in range(p)]
        assert out["old_order"][0] == "TypeError" and "algorithm='direct'" in out["old_order"][1]
        assert out["exports"] == [True] * 4


@pytest.mark.timeout(180)
@pytest.mark.parametrize("algorithm", ["auto", "native", "direct"])
def test_async_beside_torch_collectives_in_call_order(algorithm):
    # 1 MiB of float32 on 4 ranks: auto resolves to native (the case that paired with the wrong collective)
    results = get_pool(4).run(K.interleaved_with_torch, 30 if algorithm != "direct" else 5, 1 << 18, algorithm)
    assert results == [[]] * 4


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["auto", "native", "direct", "ring"])
def test_ddp_hook_with_unused_parameters(algorithm):
    diffs = get_pool(3).run(K.ddp_unused, algorithm)
    assert max(diffs) < 1e-5


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_killed_peer_is_named(tmp_path, algorithm):
    from hpdl.runtime.errors import WorkerFailedError

    timeout, victim = 20.0, 2
    pool = get_pool(4)
    try:
        with pytest.raises(WorkerFailedError, match=f"rank {victim} died"):
            pool.run(K.killed_peer_to_file, victim, algorithm, timeout, str(tmp_path), timeout=90)
        deadline = time.monotonic() + 2 * timeout + 10
        while len(list(tmp_path.glob("*.json"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        pool.close()
    got = {int(f.stem): json.loads(f.read_text())["result"] for f in tmp_path.glob("*.json")}
    assert sorted(got) == [0, 1, 3]
    for rank, (name, msg, missing, elapsed) in got.items():
        assert name == "PeerFailedError", (rank, name, msg)
        assert missing == [victim] and f"[{victim}]" in msg, (rank, msg)
        # ranks that exchange with the victim see it die at once; a rank blocked on a live peer that already gave
        # up can only notice at its own timeout (a gloo receive cannot be polled or interrupted)
        # (margins wide enough for a loaded 2-core machine: 3 s over the timeout failed there once)
        assert elapsed < 1.5 * timeout, (rank, elapsed)
    assert min(e for *_, e in got.values()) < timeout   # seen by its death, before any timeout could fire


@pytest.mark.timeout(240)
def test_two_level_stopped_rank_on_other_node_named_within_timeout():
    timeout, stopped = 4.0, 3   # nodes {0, 1} and {2, 3}: rank 0's inter-node partner is rank 2, a live one
    pool = get_pool(4)
    try:
        results = pool.run(K.two_level_stopped, 2, stopped, timeout, timeout=120)
    finally:
        pool.close()  # ranks hold receives that will never match
    assert [good for good, _, _ in results] == [True] * 4
    for rank, (_, err, elapsed) in enumerate(results):
        if rank == stopped:
            continue
        name, msg, missing = err
        assert name == "CollectiveTimeoutError", (rank, err)
        assert missing == [stopped] and f"[{stopped}]" in msg, (rank, msg)
        assert elapsed < timeout + window(timeout) + 2.0, (rank, elapsed)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["auto", "pairwise", "direct", "native"])
def test_all_to_all_one_element_strided(algorithm):
    p = 3
    for r, (out, ref, guard) in enumerate(get_pool(p).run(K.one_element_strided, algorithm)):
        assert out == ref == [float((r - 1) % p + 1)]
        assert guard == -7.0   # the element beside the strided view is untouched


@pytest.mark.timeout(180)
@pytest.mark.parametrize("algorithm", ["auto", "direct", "ring", "native"])
def test_reduce_scatter_all_gather_small_and_complex_dtypes(algorithm):
    assert get_pool(3).run(K.phase_dtypes, algorithm) == [[]] * 3
