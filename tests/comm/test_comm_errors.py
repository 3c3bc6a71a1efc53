"""Bad input: a clear exception naming the argument or the missing rank, never a hang, input untouched."""

import pytest

from hpdl.testing import get_pool

import _errors as E


@pytest.mark.parametrize("algorithm", ["direct", "ring", "native"])
@pytest.mark.timeout(120)
def test_mismatches_raise_everywhere(algorithm):
    pool = get_pool(3)
    for (name, msg), untouched in pool.run(E.mismatched_count, algorithm):
        assert name == "CollectiveMismatchError" and "'count'" in msg and "rank 1: 11" in msg
        assert untouched
    for name, msg in pool.run(E.mismatched_dtype, algorithm):
        assert name == "CollectiveMismatchError" and "'dtype'" in msg and "torch.float64" in msg
    for name, msg in pool.run(E.mismatched_op, algorithm):
        assert name == "CollectiveMismatchError" and "'op'" in msg
    for name, msg in pool.run(E.mismatched_algorithm):
        assert name == "CollectiveMismatchError" and "'algorithm'" in msg and "rank 0: direct" in msg


@pytest.mark.timeout(120)
def test_local_errors_name_the_argument():
    out = get_pool(3).run(E.local_errors)[0]
    assert out["bool"][0] == "ValueError" and "dtype" in out["bool"][1]
    assert out["avg_int"][0] == "ValueError" and "avg" in out["avg_int"][1]
    assert out["bad_op"][0] == "ValueError" and "'xor'" in out["bad_op"][1]
    assert out["bad_algo"][0] == "ValueError" and "butterfly" in out["bad_algo"][1] and "direct" in out["bad_algo"][1]
    assert out["not_tensor"][0] == "TypeError"
    assert out["bad_window"][0] == "ValueError" and "window" in out["bad_window"][1]
    assert out["rs_size"][0] == "ValueError" and "input.numel()" in out["rs_size"][1]
    assert out["ag_dtype"][0] == "ValueError" and "dtype" in out["ag_dtype"][1]
    assert out["one_shot_cpu"][0] == "ValueError" and "CUDA" in out["one_shot_cpu"][1]
    assert out["push_ar"][0] == "ValueError" and "all_to_all algorithm" in out["push_ar"][1]
    assert out["window0"][0] == "ValueError" and "window" in out["window0"][1]
    assert out["rs_rd"][0] == "ValueError" and "reduce_scatter" in out["rs_rd"][1] and "direct" in out["rs_rd"][1]
    assert out["after"] == [3.0] * 4


@pytest.mark.timeout(120)
def test_missing_rank_is_named_within_timeout():
    pool = get_pool(3)
    results = pool.run(E.missing_rank, 2, 3.0, timeout=60)
    for rank, (err, elapsed) in enumerate(results[:2]):
        assert err[0] == "CollectiveTimeoutError", err
        assert "rank 2" in err[1]
        assert elapsed < 30
    pool.close()  # ranks 0 and 1 have posted receives that will never match: do not reuse this group
