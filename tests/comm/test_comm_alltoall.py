"""all_to_all_single on 8 ranks (2 x 4 and 4 x 2 emulated nodes): pairwise, throttled direct, two-level push
and pull against exact expectations and native, equal / uneven / zero-length splits, every dtype and bool,
non-contiguous and async calls, a 4 MiB message, and errors raised before any communication.
(6- and 5-rank topologies run in test_comm_two_level.py, grouped with the all-reduce tests of those sizes.)"""

import pytest

from hpdl.testing import get_pool

import _two_level_cases as T


@pytest.mark.parametrize("rpn", [4, 2], ids=["2x4", "4x2"])
@pytest.mark.timeout(240)
def test_alltoall_exact_every_split_and_dtype(rpn):
    pool = get_pool(8)
    for algo in ("push", "pull") + (("pairwise", "direct", "native") if rpn == 4 else ()):
        results = pool.run(T.alltoall_matrix, rpn, algo)
        assert [f for fails, _ in results for f in fails] == [], algo


@pytest.mark.parametrize("algo", ["push", "pull", "direct"])
@pytest.mark.timeout(240)
def test_alltoall_views_async_and_large(algo):
    assert get_pool(8).run(T.alltoall_views, 4, algo) == [0] * 8


@pytest.mark.timeout(120)
def test_alltoall_errors():
    results = get_pool(8).run(T.alltoall_errors)
    for r, out in enumerate(results):
        assert out["indivisible"][0] == "ValueError" and "divisible by world_size=8" in out["indivisible"][1]
        assert out["split_len"][0] == "ValueError" and "output_split_sizes" in out["split_len"][1]
        assert out["split_sum"][0] == "ValueError" and "sum to input.size(0)" in out["split_sum"][1]
        assert out["dtype"][0] == "ValueError" and "dtype" in out["dtype"][1]
        assert out["scalar"][0] == "ValueError" and "dimension" in out["scalar"][1]
        assert out["algo"][0] == "ValueError" and "pairwise" in out["algo"][1]
        assert out["ar_pairwise"][0] == "ValueError" and "all_to_all" in out["ar_pairwise"][1]
        assert out["topology"][0] == "ValueError"
        assert out["mismatch"][0] == "CollectiveMismatchError", (r, out["mismatch"])
        assert "rank 0 expects output_split_sizes[1]=3" in out["mismatch"][1]
