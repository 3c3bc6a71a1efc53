"""Defects found by a hostile review of the comm redesign (ed2e5fc), each a test that failed before its fix."""

import pytest

from hpdl.testing import get_pool

import _review_cases as R


@pytest.mark.timeout(120)
def test_is_completed_turns_true_and_finishes_the_result_without_wait():
    p = 3
    for r, out in enumerate(get_pool(p).run(R.is_completed_polls)):
        assert out["avg"] == (True, [2.0] * 10)
        assert out["all_gather"] == (True, [float(q) for q in range(p) for _ in range(2)])
        assert out["reduce_scatter"] == (True, [float(p * (2 * r + j) + sum(range(p))) for j in range(2)])
        assert out["non_contiguous"] == (True, [3.0] * 12)
