"""broadcast, reduce and barrier with c10d's signatures (issue 37 item 7): exact against torch.distributed over
dtypes, ops, counts 0/odd and both end roots, on 2-4 gloo ranks, synchronous and async, in subgroups; the
barrier lets no rank through before all entered. One pool call per world size keeps the file inside a minute."""

import pytest

from hpdl.testing import get_pool

import _rooted_cases as R

# hpdl's own tree over every dtype; native (torch.distributed itself) and auto (native until a measured table
# says otherwise) over a float, a 16-bit float and the integers, to keep the file inside its minute
ALGORITHMS = [("binomial", None), ("native", ["float32", "bfloat16", "int32", "uint8"]),
              ("auto", ["float64", "int64"])]
BARRIERS = [("dissemination", False), ("dissemination", True), ("native", False), ("auto", True)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_broadcast_reduce_barrier_exact(world_size, tmp_path):
    fails = get_pool(world_size).run(R.everything, ALGORITHMS, BARRIERS, str(tmp_path))
    assert [f for rank in fails for f in rank] == []


@pytest.mark.timeout(240)
def test_subgroup_roots_follow_c10d():
    pool = get_pool(4)
    for algorithm in ("binomial", "native"):
        assert [f for fails in pool.run(R.subgroup, algorithm) for f in fails] == []


@pytest.mark.timeout(240)
def test_misuse_is_refused_before_communicating():
    results = get_pool(4).run(R.misuse)
    for out in results:
        p = out["world"]
        assert out["no_root"][0] == "ValueError" and "src" in out["no_root"][1]
        assert out["both_roots"][0] == "ValueError" and "group_src" in out["both_roots"][1]
        assert out["root_range"][0] == "ValueError" and f"dst must be a rank in [0, {p - 1}]" in out["root_range"][1]
        assert out["root_type"][0] == "TypeError" and "src" in out["root_type"][1]
        assert out["algorithm"][0] == "ValueError" and "'binomial'" in out["algorithm"][1]
        assert out["barrier_algorithm"][0] == "ValueError" and "dissemination" in out["barrier_algorithm"][1]
        assert out["avg_int"][0] == "ValueError" and "avg" in out["avg_int"][1]
        assert out["old_order"][0] == "TypeError" and "async_op" in out["old_order"][1]
        assert out["device_ids"][0] == "TypeError" and "device_ids" in out["device_ids"][1]
        assert out["timeout"][0] == "ValueError" and "timeout" in out["timeout"][1]
        assert out["mismatch"][0] == "CollectiveMismatchError" and "'root'" in out["mismatch"][1]


def test_exported_like_torch_distributed():
    import inspect

    import torch.distributed as dist

    import hpdl.comm as hc

    for name in ("broadcast", "reduce", "barrier"):
        assert name in hc.__all__
        ours = list(inspect.signature(getattr(hc, name)).parameters)
        theirs = [p for p in inspect.signature(getattr(dist, name)).parameters if p != "timeout"]
        assert ours[:len(theirs)] == theirs, (name, ours, theirs)


@pytest.mark.timeout(240)
def test_ranks_outside_the_group_and_numpy_roots_as_c10d():
    results = get_pool(3).run(R.outside_and_numpy_roots)
    for r, out in enumerate(results):
        assert out["numpy_src"] == (None, ""), out["numpy_src"]     # was TypeError: src must be an int rank
        assert out["numpy_value"] == [2.0] * 3
        for what in ("broadcast", "reduce", "barrier"):               # was ValueError on rank 2
            assert out[what] == (None, ""), (r, what, out[what])
        assert out["y"] == ([0.0, 0.0] if r < 2 else [2.0, 2.0])   # broadcast 0 in {0, 1}, summed at 0; 2 untouched
