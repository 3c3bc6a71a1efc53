"""Every multi-rank CUDA path of hpdl.comm at 2, 4 and 8 ranks sharing the GPUs of this host
(``ranks_per_gpu``): peer kernels over CUDA IPC between processes of one device, host algorithms staged through
gloo, exact against closed forms and gloo (the oracle). Runs wherever one CUDA GPU is visible; a device run is
``NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 -m pytest -m gpu tests/comm/test_comm_shared_gpu.py -n 0``
(``HPDL_TEST_MPS=1``: the ranks are clients of a private MPS daemon). Timings here are never performance."""

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WORLDS = [2, 4, 8]


def _pool(world: int, timeout: float = 300.0):
    from hpdl.testing.pool import RankPool

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    gpus = torch.cuda.device_count()
    per_gpu = -(-world // gpus)
    if world % per_gpu:
        pytest.skip(f"{world} ranks do not spread evenly over {gpus} GPUs")
    return RankPool(world, timeout=timeout, device="cuda", ranks_per_gpu=per_gpu,
                    mps=os.environ.get("HPDL_TEST_MPS") == "1" and per_gpu > 1)


@pytest.fixture(scope="module", params=WORLDS, ids=[f"np{w}" for w in WORLDS])
def pool(request):
    p = _pool(request.param)
    yield p
    p.close()


def _clean(results):
    """Rank 0's dict (every rank holds the same sums); fail listing every case with wrong elements or errors."""
    res = results[0]
    bad = {k: v for k, v in res.items() if v != 0}
    assert bad == {}, f"cases with wrong elements (summed over ranks) or errors: {bad}"


@pytest.mark.timeout(900)
def test_launch_mode_environment(pool):
    import _shared_gpu_cases as C

    envs = pool.run(C.environment)
    assert {e["backend"] for e in envs} == {"gloo"} and not any(e["nccl"] for e in envs)
    assert all(e["shares_gpus"] and e["ranks_per_gpu"] == pool.ranks_per_gpu for e in envs)
    assert [e["device"] for e in envs] == [f"cuda:{r // pool.ranks_per_gpu}" for r in range(pool.world_size)]


@pytest.mark.timeout(900)
def test_all_reduce_every_algorithm_exact(pool):
    import _shared_gpu_cases as C

    _clean(pool.run(C.all_reduce_matrix, timeout=800))


@pytest.mark.timeout(900)
def test_reduce_scatter_all_gather_exact(pool):
    import _shared_gpu_cases as C

    _clean(pool.run(C.phases_matrix, timeout=800))


@pytest.mark.timeout(900)
def test_all_to_all_uneven_exact(pool):
    import _shared_gpu_cases as C

    _clean(pool.run(C.all_to_all_matrix, timeout=800))


@pytest.mark.timeout(900)
def test_two_level_emulated_nodes_exact(pool):
    import _shared_gpu_cases as C

    for rpn in sorted({1, 2, 4} & set(range(1, pool.world_size))):
        if pool.world_size % rpn == 0:
            _clean(pool.run(C.two_level_matrix, rpn, timeout=800))


@pytest.mark.timeout(900)
def test_sub_groups_exact(pool):
    import _shared_gpu_cases as C

    _clean(pool.run(C.subgroup_matrix, timeout=800))


@pytest.mark.timeout(900)
def test_ddp_hook_and_buckets_match_gloo_ddp_at_4_ranks():
    import _shared_gpu_cases as C

    p = _pool(4)
    try:
        runs = {hook: p.run(C.ddp_hook_losses, 8, hook, timeout=800)[0] for hook in ("gloo", "hpdl", "bucket")}
    finally:
        p.close()
    ref, _ = runs["gloo"]
    if os.environ.get("HPDL_TEST_RESULTS"):   # the device script keeps the curves for the results page
        import json

        with open(os.path.join(os.environ["HPDL_TEST_RESULTS"], "ddp_losses.json"), "w") as fh:
            json.dump({h: {"losses": v[0], "ranks_identical": v[1],
                           "bit_identical_to_gloo": v[0] == ref} for h, v in runs.items()}, fh, indent=1)
    for hook in ("hpdl", "bucket"):
        losses, identical = runs[hook]
        assert identical, f"{hook}: parameters differ between ranks"
        # gloo sums in its ring's order, hpdl's kernels in rank order: equal up to float32 rounding
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) < 1e-4, (hook, losses, ref)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["stuck", "killed"])
def test_missing_or_dead_rank_is_named(mode, tmp_path):
    """4 ranks on the GPU, the last one never calls (sleeps) or dies; the others call with the argument check
    on (the peer kernel's own wait would trap the CUDA context instead) and must name rank 3, within time."""
    import json

    import _shared_gpu_cases as C
    from hpdl.runtime import WorkerFailedError, spawn

    try:
        spawn(C.missing_and_dead, 4, args=(mode, str(tmp_path)), device="cuda", ranks_per_gpu=4, timeout=60,
              job_timeout=150, grace=60)
    except WorkerFailedError as exc:
        assert mode == "killed" and "rank 3" in str(exc), str(exc)
    for r in range(3):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        for algo, v in got.items():
            assert v["type"] in ("CollectiveTimeoutError", "PeerFailedError") and v["names"] == [3], (r, algo, v)
            assert v["seconds"] < 60, (r, algo, v)
        if mode == "killed":
            assert got["two_shot"]["type"] == "PeerFailedError", got
