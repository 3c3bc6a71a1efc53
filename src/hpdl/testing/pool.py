"""A pool of live ranks that runs one function on every rank per call, like PyTorch's MultiProcessTestCase
but without paying process start-up and rendezvous for every test: a :class:`hpdl.runtime.launch.WorkerGroup`
kept alive between tests.

Each call has a watchdog: ranks that do not answer within ``timeout`` are named in the error and the pool is
torn down (a rank stuck in a collective cannot be trusted again); the next :func:`get_pool` starts a new one.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from hpdl.runtime.launch import WorkerGroup


class RankPool(WorkerGroup):
    """``world_size`` spawned ranks in one process group, waiting for work (one torch thread each).

    Args:
        world_size: ranks to start.
        ranks_per_node: emulated topology (see :class:`hpdl.runtime.Topology`).
        timeout: default seconds a :meth:`run` may take; also the process group's timeout.
        device: "cpu" (gloo) or "cuda" (a GPU per rank with NCCL, or shared GPUs with gloo: ``ranks_per_gpu``).
        ranks_per_gpu: ranks sharing one CUDA device (rank r on ``cuda:(r // ranks_per_gpu)``), as
            :func:`hpdl.runtime.spawn`.
        mps: run the ranks as clients of a private MPS daemon (shared GPUs only), stopped by :meth:`close`.
    """

    def __init__(self, world_size: int, ranks_per_node: int | Sequence[int] | None = None, timeout: float = 120.0,
                 device: str = "cpu", ranks_per_gpu: int = 1, mps: bool = False):
        super().__init__(world_size, device=device, ranks_per_gpu=ranks_per_gpu, ranks_per_node=ranks_per_node,
                         timeout=timeout, mps=False if mps is None else mps, threads=1)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """As :meth:`WorkerGroup.run`, bounded by the pool's ``timeout`` unless another is given."""
        return super().run(fn, *args, timeout=self.timeout if timeout is None else timeout)


_POOLS: dict[tuple, RankPool] = {}
_MAX_LIVE = int(os.environ.get("HPDL_TEST_MAX_POOLS", "1"))


def get_pool(world_size: int, ranks_per_node: int | Sequence[int] | None = None, timeout: float = 120.0,
             device: str = "cpu", ranks_per_gpu: int = 1, mps: bool = False) -> RankPool:
    """A live pool for this shape, reusing the last one when it is healthy; at most ``_MAX_LIVE`` stay alive."""
    key = (world_size, tuple(ranks_per_node) if isinstance(ranks_per_node, (list, tuple)) else ranks_per_node,
           device, ranks_per_gpu, mps)
    pool = _POOLS.get(key)
    if pool is not None and not pool.broken:
        return pool
    _POOLS.pop(key, None)
    while len(_POOLS) >= _MAX_LIVE:
        _POOLS.pop(next(iter(_POOLS))).close()
    pool = _POOLS[key] = RankPool(world_size, ranks_per_node, timeout, device, ranks_per_gpu, mps)
    return pool


def shutdown_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()
