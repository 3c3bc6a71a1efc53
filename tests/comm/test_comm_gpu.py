"""GPU correctness of hpdl.comm through its public API (2+ CUDA GPUs of one node). Skipped without them; a
device run is ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=src python3 -m pytest -m gpu
tests/comm/test_comm_gpu.py -p no:cacheprovider -n 0``. Replaces benchmarks/cuda_api_check.py and
benchmarks/cuda_alltoall_check.py (their timings live in ``hpdl bench``)."""

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def pool():
    """One rank per GPU with NCCL as the oracle; on a one-GPU host two ranks share it (gloo as the oracle)."""
    from hpdl.testing.pool import RankPool

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    gpus = torch.cuda.device_count()
    p = RankPool(max(gpus, 2), timeout=300.0, device="cuda", ranks_per_gpu=2 if gpus < 2 else 1)
    yield p
    p.close()


@pytest.mark.timeout(600)
def test_all_reduce_cuda_paths_exact(pool):
    import _gpu_cases as G

    assert pool.run(G.all_reduce_cases, timeout=500) == [[]] * pool.world_size


@pytest.mark.timeout(600)
def test_all_to_all_cuda_paths_exact(pool):
    import _gpu_cases as G

    results = pool.run(G.alltoall_cases, timeout=500)
    assert {name: v for name, v in results[0].items() if v != 0} == {}
    assert [res for res in results[1:] if any(isinstance(v, str) for v in res.values())] == []
