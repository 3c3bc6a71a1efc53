"""A pool of live ranks that runs one function on every rank per call, like PyTorch's MultiProcessTestCase
but without paying process start-up and rendezvous for every test.

Each call has a watchdog: ranks that do not answer within ``timeout`` are named in the error and the pool is
torn down (a rank stuck in a collective cannot be trusted again); the next :func:`get_pool` starts a new one.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

from hpdl.runtime.errors import CollectiveTimeoutError, WorkerFailedError


def _serve(rank, world, port, device, ranks_per_node, timeout, tasks, results, ranks_per_gpu=1,
           environ=None) -> None:
    os.environ.update(environ or {})
    import torch
    import torch.distributed as dist

    from hpdl.runtime.launch import _make_context, _resolve_device

    torch.set_num_threads(1)
    try:
        dev, backend = _resolve_device(device, rank, ranks_per_gpu)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        ctx = _make_context(rank, world, rank, dev, backend, ranks_per_node, ranks_per_gpu)
        results.put((-1, rank, "ok", None))
    except BaseException:  # noqa: BLE001 - report start-up failure to the parent
        results.put((-1, rank, "error", traceback.format_exc()))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, fn, args = item
        try:
            results.put((task_id, rank, "ok", fn(ctx, *args)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent with its traceback
            results.put((task_id, rank, "error", traceback.format_exc()))
    import hpdl.comm

    hpdl.comm.reset()
    dist.destroy_process_group()


class RankPool:
    """``world_size`` spawned ranks in one gloo process group, waiting for work.

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
        from hpdl.runtime.launch import (_maybe_mps, check_gpus_for, free_port, job_ranks_per_gpu, rank_environment,
                                         use_mps_for)

        self.world_size, self.ranks_per_node, self.timeout = world_size, ranks_per_node, timeout
        self.device, self.ranks_per_gpu = device, job_ranks_per_gpu(device, ranks_per_gpu)
        check_gpus_for(device, world_size, self.ranks_per_gpu)
        mps = use_mps_for(False if mps is None else mps, self.ranks_per_gpu)   # checked: "false" is not true
        self._procs = []
        self.broken = True   # until every rank is up (close() is safe on a half-built pool)
        mps_context = _maybe_mps(mps)
        environ = rank_environment(device, self.ranks_per_gpu, timeout, mps_context.__enter__())
        self._mps = mps_context   # set once started: close() stops it
        try:
            ctx = mp.get_context("spawn")
            self._tasks = [ctx.Queue() for _ in range(world_size)]
            self._results = ctx.Queue()
            port = free_port()
            self._procs = [ctx.Process(target=_serve, args=(r, world_size, port, device, ranks_per_node, timeout,
                                                            self._tasks[r], self._results, self.ranks_per_gpu,
                                                            environ),
                                       daemon=True)
                           for r in range(world_size)]
            for p in self._procs:
                p.start()
            self._ids = itertools.count()
            self.broken = False
            self._collect(-1, timeout)
        except BaseException:
            self.close()   # no half-started pool (or MPS daemon) is left behind, also after Ctrl-C
            raise

    def _collect(self, task_id: int, timeout: float) -> list[Any]:
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if errors:  # the others may be stuck waiting for the failed rank: give them a short grace
                remaining = min(remaining, 3.0)
            if remaining <= 0:
                missing = [r for r in range(self.world_size) if r not in out and r not in errors]
                self.close()
                if errors:
                    break
                raise CollectiveTimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s "
                                             f"(world_size={self.world_size}); pool torn down", missing_ranks=missing)
            try:
                tid, rank, status, payload = self._results.get(timeout=min(remaining, 0.5))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in out and r not in errors]
                for r in dead:
                    errors[r] = f"rank {r} died (exit code {self._procs[r].exitcode})"
                continue
            if tid != task_id:
                continue  # a straggler from an earlier, failed call
            (out if status == "ok" else errors)[rank] = payload
        if errors:
            # a rank that died (or any rank left inside a collective) makes the pool unusable for later calls
            self.broken = (self.broken or len(out) + len(errors) < self.world_size
                           or any(not p.is_alive() for p in self._procs))
            first = next(iter(errors))  # first reported = the cause
            raise WorkerFailedError(f"rank {first} failed (failed ranks {sorted(errors)}):\n{errors[first]}")
        return [out[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """``[fn(ctx, *args) on rank r for r in range(world_size)]``; ``fn`` must be a module-level function.

        Raises:
            WorkerFailedError: a rank raised; the message holds its traceback.
            CollectiveTimeoutError: ranks did not answer in time; they are named and the pool is torn down.
        """
        if self.broken:
            raise RuntimeError("this RankPool was torn down after a failure; get a new one with get_pool()")
        task_id = next(self._ids)
        for q in self._tasks:
            q.put((task_id, fn, args))
        return self._collect(task_id, self.timeout if timeout is None else timeout)

    def close(self) -> None:
        self.broken = True
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        end = time.monotonic() + 2.0   # one deadline for all ranks, not 2 s for each stuck one in turn
        for p in self._procs:
            if p.pid is None:   # never started (start-up was interrupted): join() would raise
                continue
            p.join(timeout=max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        mps, self._mps = getattr(self, "_mps", None), None
        if mps is not None:
            mps.__exit__(None, None, None)


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
