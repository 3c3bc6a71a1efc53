"""hpdl.comm.hooks.BucketAllReduce: gradient buckets all-reduced while backward runs, exact against DDP."""

import pytest

from hpdl.testing import get_pool

import _bucket_cases as C


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["auto", "direct", "ring", "recursive_doubling", "native"])
def test_trains_bit_identical_to_ddp_on_two_ranks(algorithm):
    # 2 ranks: a + b == b + a and halving is exact, so any correct schedule must give DDP's bits exactly
    for cap, first in ((25.0, 1.0), (0.002, 0.001)):
        res = get_pool(2).run(C.train_vs_ddp, algorithm, cap, first)
        assert all(r[0] == 0.0 and r[1] == 0.0 for r in res), res
        assert res[0][2] == (1 if cap == 25.0 else 4)  # one bucket, or several launched out of backward order


@pytest.mark.timeout(240)
def test_unused_parameter_mismatch_and_double_backward():
    pool = get_pool(2)
    assert pool.run(C.unused_parameter) == [True] * 2
    msgs = pool.run(C.mismatched_layout)
    assert all(m and "differ from another rank" in m for m in msgs), msgs
    msgs = pool.run(C.ready_twice)
    assert all(m and "became ready twice" in m and "no_sync" in m for m in msgs), msgs


@pytest.mark.timeout(240)
def test_integer_gradients_exact_on_four_ranks_with_accumulation():
    pool = get_pool(4)
    for algorithm, cap, acc in (("auto", 25.0, False), ("direct", 0.0001, True), ("ring", 0.0002, False)):
        wrong = pool.run(C.integer_grads_vs_ddp, algorithm, cap, acc)
        assert wrong == [0] * 4, (algorithm, cap, wrong)


@pytest.mark.timeout(240)
def test_collectives_between_backward_and_wait_do_not_mix_with_buckets():
    # hpdl.comm runs async work on its own thread: on the caller's group the two all-reduces could pair up
    # with each other's peers (a crash in gloo, swapped data when the sizes match)
    assert get_pool(2).run(C.collective_between_backward_and_wait) == [0, 0]


@pytest.mark.timeout(240)
def test_frozen_unused_unfrozen_and_sparse_parameters():
    for frozen_ok, unused_ok, unfrozen, sparse in get_pool(2).run(C.frozen_unused_unfrozen_sparse):
        assert frozen_ok and unused_ok
        assert unfrozen and "requires_grad=False when BucketAllReduce was built" in unfrozen
        assert sparse and "dense gradients only" in sparse


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["direct", "ring", "native"])
def test_buckets_reduce_while_backward_runs(algorithm):
    import uuid

    assert get_pool(3).run(C.backward_overlaps_buckets, f"bucket-{uuid.uuid4().hex}", algorithm) == [0] * 3


@pytest.mark.timeout(120)
def test_ddp_hook_checks_arguments_once_per_bucket_layout():
    for per_step in get_pool(2).run(C.ddp_hook_checks_once, "direct"):
        assert per_step[0] > 0 and per_step[2:] == [0, 0]
