"""Process-group bootstrap: from torchrun / mpirun environment variables, or by spawning local ranks.

Every entry point returns a :class:`Context`: rank, world size, device, topology and two groups, the
``group`` that carries data (gloo for CPU, NCCL for CUDA) and a gloo ``cpu_group`` for host-side work
(argument checks, CPU staging). ``spawn`` is what the CLI's embedded default and the tests use.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hpdl.runtime import env
from hpdl.runtime.errors import CollectiveTimeoutError, WorkerFailedError
from hpdl.runtime.topology import Topology, discover

log = logging.getLogger("hpdl.runtime")

# (rank, size, local rank) variables set by the launchers we know, in order of preference.
_LAUNCHER_VARS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


@dataclass
class Context:
    """What a rank knows about its job.

    Attributes:
        rank, world_size, local_rank: as torch.distributed defines them.
        device: ``cpu`` or ``cuda:<local_rank>``.
        backend: backend of ``group`` ("gloo", "nccl" or "mpi").
        topology: node and rail placement of every rank.
        group: the data process group (``None`` means the default world group).
        cpu_group: a gloo group over the same ranks, for host-side exchanges.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    topology: Topology
    group: Any = None
    cpu_group: Any = None


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_launcher() -> tuple[str, int, int, int] | None:
    """``(launcher, rank, world_size, local_rank)`` when started by torchrun, mpirun, srun; else None."""
    for name, rk, sz, lr in _LAUNCHER_VARS:
        if rk in os.environ and sz in os.environ:
            rank, size = int(os.environ[rk]), int(os.environ[sz])
            local = int(os.environ.get(lr, rank))
            return name, rank, size, local
    return None


def _timeout(timeout: float | None) -> float:
    return float(env.get("HPDL_TIMEOUT") if timeout is None else timeout)


def _make_context(rank, world, local_rank, device, backend, ranks_per_node) -> Context:
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else None
    topo = discover(cpu_group, ranks_per_node)
    return Context(rank, world, local_rank, device, backend, topo, group=None, cpu_group=cpu_group)


def _resolve_device(device: str, local_rank: int) -> tuple[torch.device, str]:
    if device == "cpu":
        return torch.device("cpu"), "gloo"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was asked for but torch.cuda.is_available() is False")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


def init_from_env(device: str = "cpu", ranks_per_node: int | Sequence[int] | None = None,
                  timeout: float | None = None) -> Context:
    """Join the job that torchrun, mpirun or srun started.

    MASTER_ADDR/MASTER_PORT come from the environment; under mpirun without them, rank 0's host and a free
    port are broadcast through mpi4py (``pip install hpdl[mpi]``).

    Raises:
        RuntimeError: no launcher variables are set, or mpi4py is needed and missing.
    """
    found = detect_launcher()
    if found is None:
        raise RuntimeError("no launcher found: set RANK/WORLD_SIZE (torchrun) or run under mpirun/srun")
    launcher, rank, world, local_rank = found
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        if launcher == "torchrun":
            raise RuntimeError("RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not")
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise RuntimeError(f"started by {launcher} without MASTER_ADDR/MASTER_PORT; install mpi4py "
                               "(pip install 'hpdl[mpi]') or export both variables") from exc
        addr = MPI.COMM_WORLD.bcast((socket.gethostname(), free_port()) if rank == 0 else None, root=0)
        os.environ.setdefault("MASTER_ADDR", addr[0])
        os.environ.setdefault("MASTER_PORT", str(addr[1]))
    dev, backend = _resolve_device(device, local_rank)
    kwargs = {"device_id": dev} if backend == "nccl" else {}
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=_timeout(timeout)), **kwargs)
        atexit.register(_destroy_at_exit)
    return _make_context(rank, world, local_rank, dev, backend, ranks_per_node)


def _destroy_at_exit() -> None:
    """Tear down the group this module created if the script did not: left to interpreter exit, gloo's threads
    can abort a rank ("terminate called without an active exception") and fail a torchrun job that succeeded."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _worker(rank, nprocs, port, fn, args, device, ranks_per_node, timeout, results) -> None:
    try:
        os.environ["HPDL_TIMEOUT"] = str(timeout)  # hpdl.comm's collectives default to the job's timeout
        threads = max(1, (os.cpu_count() or 1) // nprocs)
        torch.set_num_threads(threads)
        dev, backend = _resolve_device(device, rank)
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nprocs,
                                timeout=timedelta(seconds=timeout), **kwargs)
        ctx = _make_context(rank, nprocs, rank, dev, backend, ranks_per_node)
        out = fn(ctx, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report every failure to the parent with its traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort while tearing down after an error
                pass


def spawn(fn: Callable[..., Any], nprocs: int, *, args: tuple = (), device: str = "cpu",
          ranks_per_node: int | Sequence[int] | None = None, timeout: float | None = None,
          job_timeout: float | None = None, grace: float = 5.0) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``nprocs`` freshly spawned local ranks and return their results by rank.

    Args:
        fn: a picklable (module-level) function; ``ctx`` is the rank's :class:`Context`.
        nprocs: number of ranks (>= 1).
        device: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank).
        ranks_per_node: emulate nodes on this host (see :class:`Topology`).
        timeout: seconds any one collective may wait (default ``HPDL_TIMEOUT``); a hung peer fails the job then.
        job_timeout: seconds for the whole job (default: no limit beyond the per-collective timeouts).
        grace: seconds the other ranks get to finish after one rank fails, before they are killed.

    Raises:
        WorkerFailedError: a rank raised (its traceback is in the message) or died without a result.
        CollectiveTimeoutError: the job ran past ``job_timeout``; the message names the ranks still running.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    limit = _timeout(timeout)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, nprocs, port, fn, args, device, ranks_per_node, limit, results),
                         daemon=True, name=f"hpdl-rank{r}") for r in range(nprocs)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + job_timeout if job_timeout is not None else float("inf")
    first_error_at: float | None = None
    try:
        while len(outputs) + len(errors) < nprocs:
            now = time.monotonic()
            if first_error_at is not None and now > first_error_at + grace:
                break
            if now > deadline:
                missing = [r for r in range(nprocs) if r not in outputs and r not in errors]
                raise CollectiveTimeoutError(f"spawned job timed out after {job_timeout:.0f}s; ranks still running: "
                                             f"{missing}", missing_ranks=missing)
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if not p.is_alive() and r not in outputs and r not in errors:
                        # the queue feeder may still be flushing; give it a moment before calling it dead
                        try:
                            rank, status, payload = results.get(timeout=1.0)
                        except queue_mod.Empty:
                            errors[r] = f"rank {r} exited with code {p.exitcode} without a result"
                            first_error_at = first_error_at or time.monotonic()
                        else:
                            (outputs if status == "ok" else errors)[rank] = payload
                        break
                continue
            if status == "ok":
                outputs[rank] = payload
            else:
                errors[rank] = payload
                first_error_at = first_error_at or time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors else 5.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        first = next(iter(errors))  # the first failure reported is the cause; the others usually follow from it
        raise WorkerFailedError(f"rank {first} failed (failed ranks: {sorted(errors)}):\n{errors[first]}")
    return [outputs[r] for r in range(nprocs)]
