"""Exact verification of every algorithm over world sizes, dtypes, ops and counts (nccl-tests style)."""

import pytest

from hpdl.testing import get_pool

import _cases as C

WORLDS = [1, 2, 3, 4, 5, 7, 8]
ALGORITHMS = ["direct", "ring", "recursive_doubling", "staged", "native", "auto"]
# hpdl's own schedules get every world size; the delegating ones (staged and auto pick among them on CPU,
# native is torch.distributed) a spread of sizes, to keep CI inside its budget.
MATRIX = [(w, a) for a in ("direct", "ring", "recursive_doubling") for w in WORLDS] + \
         [(w, a) for a in ("staged", "native", "auto") for w in (1, 3, 8)]


@pytest.mark.parametrize("world_size,algorithm", sorted(MATRIX))
@pytest.mark.timeout(240)
def test_all_reduce_exact_and_bit_identical(world_size, algorithm):
    results = get_pool(world_size).run(C.all_reduce_matrix, algorithm)
    failures = [f for fails, _ in results for f in fails]
    assert failures == []
    digests = [d for _, d in results]
    assert all(d == digests[0] for d in digests), "ranks disagree bitwise"


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("algorithm", ["direct", "ring", "recursive_doubling", "native"])
@pytest.mark.timeout(240)
def test_all_reduce_few_mib(world_size, algorithm):
    pool = get_pool(world_size)
    for count, dtype, op in [(786_433, "float32", "sum"), (1_048_577, "bfloat16", "avg")]:
        import torch

        res = pool.run(C.all_reduce_large, algorithm, count, getattr(torch, dtype), op)
        assert [w for w, _ in res] == [0] * world_size
        assert len({d for _, d in res}) == 1


@pytest.mark.parametrize("world_size", [2, 5])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.timeout(240)
def test_non_contiguous_back_to_back_async(world_size, algorithm):
    pool = get_pool(world_size)
    for wrong, guard in pool.run(C.non_contiguous, algorithm):
        assert wrong == 0 and guard == 0
    assert pool.run(C.back_to_back, algorithm) == [0] * world_size
    for wrong, _ in pool.run(C.async_ops, algorithm):
        assert wrong == 0


@pytest.mark.parametrize("world_size,algorithm", [(w, a) for a in ("direct", "ring") for w in (1, 2, 3, 4, 7)] +
                         [(w, a) for a in ("native", "auto") for w in (2, 5)])
@pytest.mark.timeout(240)
def test_reduce_scatter_and_all_gather(world_size, algorithm):
    results = get_pool(world_size).run(C.reduce_scatter_all_gather, algorithm)
    assert [f for r in results for f in r] == []
