"""broadcast, reduce and barrier with c10d's signatures (issue 37 item 7): exact against torch.distributed over
dtypes, ops, counts 0/odd and every root, on 2-4 gloo ranks, synchronous and async, in subgroups."""

import pytest

from hpdl.testing import get_pool

import _rooted_cases as R

ALGORITHMS = ["binomial", "native", "auto"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_broadcast_and_reduce_exact(world_size, algorithm):
    pool = get_pool(world_size)
    assert [f for fails in pool.run(R.broadcast_matrix, algorithm) for f in fails] == []
    assert [f for fails in pool.run(R.reduce_matrix, algorithm) for f in fails] == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_strided_and_async_beside_torch(world_size, algorithm):
    assert [f for fails in get_pool(world_size).run(R.strided_and_async, algorithm) for f in fails] == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["binomial", "native"])
def test_subgroup_roots_follow_c10d(algorithm):
    assert [f for fails in get_pool(4).run(R.subgroup, algorithm) for f in fails] == []


@pytest.mark.timeout(240)
def test_misuse_is_refused_before_communicating():
    results = get_pool(2).run(R.misuse)
    for r, out in enumerate(results):
        assert out["no_root"][0] == "ValueError" and "src" in out["no_root"][1]
        assert out["both_roots"][0] == "ValueError" and "group_src" in out["both_roots"][1]
        assert out["root_range"][0] == "ValueError" and "dst must be a rank in [0, 1]" in out["root_range"][1]
        assert out["root_type"][0] == "TypeError" and "src" in out["root_type"][1]
        assert out["algorithm"][0] == "ValueError" and "'binomial'" in out["algorithm"][1]
        assert out["barrier_algorithm"][0] == "ValueError" and "dissemination" in out["barrier_algorithm"][1]
        assert out["avg_int"][0] == "ValueError" and "avg" in out["avg_int"][1]
        assert out["old_order"][0] == "TypeError" and "async_op" in out["old_order"][1]
        assert out["device_ids"][0] == "TypeError" and "device_ids" in out["device_ids"][1]
        assert out["timeout"][0] == "ValueError" and "timeout" in out["timeout"][1]
        assert out["mismatch"][0] == "CollectiveMismatchError" and "'root'" in out["mismatch"][1]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("algorithm, use_async", [("dissemination", False), ("dissemination", True),
                                                  ("native", False), ("auto", True)])
def test_barrier_lets_no_rank_through_early(world_size, algorithm, use_async, tmp_path):
    seen = get_pool(world_size).run(R.barrier_waits, algorithm, use_async, str(tmp_path))
    assert seen == [list(range(world_size))] * world_size


def test_exported_like_torch_distributed():
    import inspect

    import torch.distributed as dist

    import hpdl.comm as hc

    for name in ("broadcast", "reduce", "barrier"):
        assert name in hc.__all__
        ours = list(inspect.signature(getattr(hc, name)).parameters)
        theirs = [p for p in inspect.signature(getattr(dist, name)).parameters if p != "timeout"]
        assert ours[:len(theirs)] == theirs, (name, ours, theirs)
