"""Process-group bootstrap: from torchrun / mpirun environment variables, or by spawning local ranks.

Every entry point returns a :class:`Context`: rank, world size, device, topology and two groups, the
``group`` that carries data (gloo for CPU, NCCL for CUDA) and a gloo ``cpu_group`` for host-side work
(argument checks, CPU staging). Local ranks are started in one place, :class:`WorkerGroup` (live ranks that
run functions on request); ``spawn`` (one function, then teardown) is what the CLI's embedded default uses, and
the test suite's rank pool is a ``WorkerGroup`` kept alive between tests.

Ranks sharing a GPU (``ranks_per_gpu`` > 1, or ``HPDL_RANKS_PER_GPU``): local rank r uses
``cuda:(r // ranks_per_gpu)`` and no NCCL group is made (NCCL refuses two ranks on one device): the data group
is gloo, and hpdl.comm moves CUDA tensors through its peer-memory kernels (CUDA IPC works between processes on
one device) or through host staging. It exists to run the multi-rank GPU code at 2-8 ranks on one GPU for
correctness; its timings are never multi-GPU performance (the topology says the GPUs are shared, and
``hpdl bench`` prints so). ``spawn(..., mps=True)`` runs the ranks as clients of a private MPS daemon.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from multiprocessing.reduction import ForkingPickler
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
        topology: node and rail placement of every rank (``topology.ranks_per_gpu`` > 1: GPUs are shared).
        group: the data process group (``None`` means the default world group).
        cpu_group: a gloo group over the same ranks, for host-side exchanges (None when ``group`` is gloo).
        ranks_per_gpu: ranks that share one CUDA device (1: a device per rank).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    topology: Topology
    group: Any = None
    cpu_group: Any = None
    ranks_per_gpu: int = 1


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


def _make_context(rank, world, local_rank, device, backend, ranks_per_node, ranks_per_gpu: int = 1) -> Context:
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else None
    rpg = ranks_per_gpu if device.type == "cuda" else 1
    topo = discover(cpu_group, ranks_per_node, ranks_per_gpu=rpg)
    return Context(rank, world, local_rank, device, backend, topo, group=None, cpu_group=cpu_group,
                   ranks_per_gpu=rpg)


def ranks_per_gpu_of(ranks_per_gpu: int | None) -> int:
    """``ranks_per_gpu`` checked, or ``HPDL_RANKS_PER_GPU`` when None.

    Raises:
        ValueError: not an int >= 1 (the message names the argument or the variable).
    """
    value = env.get("HPDL_RANKS_PER_GPU") if ranks_per_gpu is None else ranks_per_gpu
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        name = "HPDL_RANKS_PER_GPU" if ranks_per_gpu is None else "ranks_per_gpu"
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def job_ranks_per_gpu(device: str, ranks_per_gpu: int | None) -> int:
    """The job's ranks per GPU: ``ranks_per_gpu`` (checked), or ``HPDL_RANKS_PER_GPU`` when None, on CUDA; 1 on
    the CPU, where the variable (a GPU-only setting, perhaps left from another job) is not read.

    Raises:
        ValueError: a bad ``ranks_per_gpu`` (or variable, on CUDA), or ``ranks_per_gpu`` > 1 with a CPU device.
    """
    if device != "cuda":
        if ranks_per_gpu is not None and ranks_per_gpu_of(ranks_per_gpu) > 1:
            raise ValueError(f"ranks_per_gpu={ranks_per_gpu} needs device='cuda' (got device={device!r})")
        return 1
    return ranks_per_gpu_of(ranks_per_gpu)


def gpu_slots() -> int:
    """Ranks this host's visible GPUs hold: ``torch.cuda.device_count()`` times ``HPDL_RANKS_PER_GPU`` (what the
    peer-memory algorithms compare a group's size with; ranks sharing a GPU count as that many GPUs)."""
    return torch.cuda.device_count() * ranks_per_gpu_of(None)


def device_for(device: str, local_rank: int, ranks_per_gpu: int = 1,
               device_count: int | None = None) -> tuple[torch.device, str]:
    """``(device, data backend)`` of local rank ``local_rank``, without touching CUDA (``device_count`` given)
    or after checking it: CPU -> gloo; CUDA -> ``cuda:(local_rank // ranks_per_gpu)`` with NCCL when each rank
    has its own GPU, gloo when ranks share one (NCCL refuses two ranks on one device).

    Raises:
        ValueError: ``device`` is not "cpu" or "cuda", or ``ranks_per_gpu`` < 1.
        RuntimeError: the rank's GPU index is not visible (the message names ``ranks_per_gpu``).
    """
    if device == "cpu":
        return torch.device("cpu"), "gloo"
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    ranks_per_gpu_of(ranks_per_gpu)   # the argument check
    count = torch.cuda.device_count() if device_count is None else device_count
    index = local_rank // ranks_per_gpu
    if index >= count:
        raise RuntimeError(f"local rank {local_rank} has no GPU: only {count} visible and ranks_per_gpu="
                           f"{ranks_per_gpu} (rank r uses cuda:(r // ranks_per_gpu)); raise ranks_per_gpu to at "
                           f"least {-(-(local_rank + 1) // max(count, 1))} or start fewer ranks")
    return torch.device("cuda", index), ("nccl" if ranks_per_gpu == 1 else "gloo")


def _resolve_device(device: str, local_rank: int, ranks_per_gpu: int = 1) -> tuple[torch.device, str]:
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but torch.cuda.is_available() is False")
    dev, backend = device_for(device, local_rank, ranks_per_gpu)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev, backend


def init_from_env(device: str = "cpu", ranks_per_node: int | Sequence[int] | None = None,
                  timeout: float | None = None, ranks_per_gpu: int | None = None, standalone: bool = False
                  ) -> Context:
    """Join the job that torchrun, mpirun or srun started (with ``standalone``, and no launcher, a job of one
    rank on this process, as ``torchrun --standalone --nproc-per-node 1``).

    MASTER_ADDR/MASTER_PORT come from the environment; under mpirun without them, rank 0's host and a free
    port are broadcast through mpi4py (``pip install hpdl[mpi]``). ``ranks_per_gpu`` (default
    ``HPDL_RANKS_PER_GPU``, 1): ranks sharing one CUDA device, see the module docstring; with more than 1 the
    variable is set in this process too, so that hpdl.comm knows.

    Raises:
        RuntimeError: no launcher variables are set, mpi4py is needed and missing, or a rank has no GPU.
        ValueError: bad ``device`` or ``ranks_per_gpu`` (also > 1 with ``device="cpu"``).
    """
    rpg = job_ranks_per_gpu(device, ranks_per_gpu)
    found = detect_launcher()
    if found is None and not standalone:
        raise RuntimeError("no launcher found: set RANK/WORLD_SIZE (torchrun) or run under mpirun/srun")
    launcher, rank, world, local_rank = found or ("standalone", 0, 1, 0)
    init_method = None
    if launcher == "standalone":
        init_method = f"tcp://127.0.0.1:{free_port()}"
    elif "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
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
    dev, backend = _resolve_device(device, local_rank, rpg)
    # hpdl.comm reads the variable: it must say this job's value, also 1 over an exported other one
    os.environ["HPDL_RANKS_PER_GPU"] = str(rpg)
    kwargs = {"device_id": dev} if backend == "nccl" else {}
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=_timeout(timeout)), **kwargs)
        atexit.register(_destroy_at_exit)
    return _make_context(rank, world, local_rank, dev, backend, ranks_per_node, rpg)


def _destroy_at_exit() -> None:
    """Tear down the group this module created if the script did not: left to interpreter exit, gloo's threads
    can abort a rank ("terminate called without an active exception") and fail a torchrun job that succeeded."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def rank_environment(device: str, ranks_per_gpu: int, timeout: float, mps_env: dict[str, str] | None = None
                     ) -> dict[str, str]:
    """Environment variables a spawned rank sets before it touches CUDA: the job's timeout (hpdl.comm's
    default), ``HPDL_RANKS_PER_GPU`` (the job's value, 1 on the CPU: a value the parent inherited must not
    reach hpdl.comm in the ranks), and an MPS daemon's pipe/log folders."""
    out = {"HPDL_TIMEOUT": str(timeout), "HPDL_RANKS_PER_GPU": str(ranks_per_gpu if device == "cuda" else 1)}
    out.update(mps_env or {})
    return out


def join_local(rank: int, world: int, port: int, device: str, ranks_per_gpu: int = 1,
               timeout: float | None = None) -> tuple[torch.device, str]:
    """Join a local job of ``world`` ranks meeting at ``tcp://127.0.0.1:port`` as ``rank``: the rank's device
    selected (``cuda:(rank // ranks_per_gpu)``), its backend (NCCL with a GPU per rank, else gloo), the group's
    timeout (default ``HPDL_TIMEOUT``). Every locally spawned rank in hpdl joins through here.

    Returns ``(device, backend)``. Raises RuntimeError (no such GPU) and what ``init_process_group`` raises.
    """
    dev, backend = _resolve_device(device, rank, ranks_per_gpu)
    kwargs = {"device_id": dev} if backend == "nccl" else {}   # an eager NCCL communicator
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=_timeout(timeout)), **kwargs)
    return dev, backend


def _rank_main(rank, world, port, device, ranks_per_node, timeout, ranks_per_gpu, environ, threads, tasks,
               results) -> None:
    """A :class:`WorkerGroup` rank: bootstrap, say ready, then run ``(task_id, fn, args)`` items until ``None``."""
    os.environ.update(environ)
    torch.set_num_threads(threads)
    try:
        dev, backend = join_local(rank, world, port, device, ranks_per_gpu, timeout)
        ctx = _make_context(rank, world, rank, dev, backend, ranks_per_node, ranks_per_gpu)
        results.put((_READY, rank, "ok", None))
    except BaseException:  # noqa: BLE001 - report a start-up failure to the parent with its traceback
        results.put((_READY, rank, "error", traceback.format_exc()))
        _destroy_at_exit()
        return
    try:
        while True:
            item = tasks.get()
            if item is None:
                break
            task_id, fn, args = item
            try:
                value = fn(ctx, *args)
            except BaseException:  # noqa: BLE001 - every failure goes back to the parent with its traceback
                results.put((task_id, rank, "error", traceback.format_exc()))
                continue
            try:  # the queue pickles in a feeder thread, which prints a failure here and drops the message
                _check_picklable(value)
            except Exception as exc:  # noqa: BLE001 - the parent would wait for the result until its timeout
                results.put((task_id, rank, "error", f"the result of {getattr(fn, '__name__', fn)} cannot be sent "
                             f"to the parent ({type(exc).__name__}: {exc}); return picklable values"))
                continue
            results.put((task_id, rank, "ok", value))
    finally:
        comm = sys.modules.get("hpdl.comm")
        if comm is not None:   # hpdl.comm's cached groups and peer buffers go before the process group
            comm.reset()
        _destroy_at_exit()


_READY = -1


def _check_picklable(value) -> None:
    """Raise what pickling ``value`` for the result queue would raise. Plain pickle first: the queue's
    ForkingPickler shares tensors by file descriptors, and a trial dump would leave each one registered with
    multiprocessing's resource sharer; only what plain pickle refuses is tried with it."""
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - e.g. objects that only the ForkingPickler reduces
        ForkingPickler.dumps(value)


class WorkerGroup:
    """``world_size`` local ranks, spawned once, each in one process group, running functions on request.

    The one place hpdl starts local ranks: :func:`spawn` (one function, then teardown) and the test suite's rank
    pool (many functions on live ranks, :mod:`hpdl.testing.pool`) are both this class. Each rank bootstraps as
    :func:`spawn` documents (device, backend, ``HPDL_*`` environment, an optional private MPS daemon owned by the
    group), then waits for work; :meth:`run` sends ``fn(ctx, *args)`` to every rank and collects the results by
    rank, naming the ranks that failed, died or did not answer.

    Args:
        world_size: ranks to start (>= 1).
        device, ranks_per_gpu, ranks_per_node, mps: as :func:`spawn`.
        timeout: seconds any one collective may wait inside the ranks (default ``HPDL_TIMEOUT``).
        start_timeout: seconds the ranks may take to start and meet (default ``timeout``).
        threads: torch intra-op threads per rank (default: this host's cores shared evenly).

    Use as a context manager, or call :meth:`close`; Ctrl-C during start-up or a call leaves no rank (and no MPS
    daemon) behind.

    Raises:
        ValueError, RuntimeError: as :func:`spawn`, before any rank starts.
        WorkerFailedError: a rank failed to start (its traceback in the message).
        CollectiveTimeoutError: ranks did not start within ``start_timeout``; they are named.
    """

    def __init__(self, world_size: int, *, device: str = "cpu", ranks_per_gpu: int | None = None,
                 ranks_per_node: int | Sequence[int] | None = None, timeout: float | None = None,
                 mps: bool | None = None, threads: int | None = None, start_timeout: float | None = None):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.world_size, self.device, self.ranks_per_node = world_size, device, ranks_per_node
        self.ranks_per_gpu = job_ranks_per_gpu(device, ranks_per_gpu)
        check_gpus_for(device, world_size, self.ranks_per_gpu)
        use_mps = use_mps_for(mps, self.ranks_per_gpu)
        self.timeout = _timeout(timeout)
        threads = max(1, (os.cpu_count() or 1) // world_size) if threads is None else threads
        self.broken = True   # until every rank is up (close() is safe on a half-built group)
        self._procs: list = []
        self._tasks: list = []
        self._ids = itertools.count()
        self._mps = _maybe_mps(use_mps)
        environ = rank_environment(device, self.ranks_per_gpu, self.timeout, self._mps.__enter__())
        try:
            ctx = mp.get_context("spawn")
            self._tasks = [ctx.Queue() for _ in range(world_size)]
            self._results = ctx.Queue()
            port = free_port()
            self._procs = [ctx.Process(target=_rank_main, name=f"hpdl-rank{r}", daemon=True,
                                       args=(r, world_size, port, device, ranks_per_node, self.timeout,
                                             self.ranks_per_gpu, environ, threads, self._tasks[r], self._results))
                           for r in range(world_size)]
            for p in self._procs:
                p.start()
            self.broken = False
            self._collect(_READY, self.timeout if start_timeout is None else start_timeout, grace=0.0,
                          what="start")
        except BaseException:
            self.close(abort=True)
            raise

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abort=exc_type is not None)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, grace: float = 3.0
            ) -> list[Any]:
        """``[fn(ctx, *args) on rank r for r in range(world_size)]``; ``fn`` must be a module-level function.

        Args:
            timeout: seconds the whole call may take (default: no limit beyond the ranks' collective timeouts).
            grace: seconds the other ranks get to answer once one has failed.

        Raises:
            WorkerFailedError: a rank raised or died; the message holds the first failure's traceback. The group
                stays usable when every rank answered; otherwise it is torn down (:attr:`broken`).
            CollectiveTimeoutError: ranks did not answer within ``timeout``; they are named; the group is torn
                down (a rank stuck in a collective cannot be trusted again).
            RuntimeError: the group was torn down or closed before.
        """
        if self.broken:
            raise RuntimeError("this WorkerGroup was torn down after a failure or closed; start a new one")
        task_id = next(self._ids)
        try:
            for q in self._tasks:
                q.put((task_id, fn, args))
            return self._collect(task_id, float("inf") if timeout is None else timeout, grace, "run")
        except BaseException as exc:
            if not isinstance(exc, WorkerFailedError):   # Ctrl-C, a timeout: the ranks get no more time
                self.close(abort=True)
            raise

    def _collect(self, task_id: int, timeout: float, grace: float, what: str) -> list[Any]:
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        first_error_at: float | None = None
        while len(out) + len(errors) < self.world_size:
            now = time.monotonic()
            if first_error_at is not None and now > first_error_at + grace:
                break
            if now > deadline:
                missing = [r for r in range(self.world_size) if r not in out and r not in errors]
                self.close(abort=True)
                raise CollectiveTimeoutError(
                    f"{what} timed out after {timeout:.0f}s (world_size={self.world_size}); ranks still running: "
                    f"{missing}; the worker group was torn down", missing_ranks=missing)
            try:
                tid, rank, status, payload = self._results.get(timeout=min(0.2, max(deadline - now, 0.001)))
            except queue_mod.Empty:
                for r, p in enumerate(self._procs):
                    if not p.is_alive() and r not in out and r not in errors:
                        # its queue feeder may still be flushing a result: a moment before calling it dead
                        try:
                            tid, rank, status, payload = self._results.get(timeout=1.0)
                        except queue_mod.Empty:
                            errors[r] = f"rank {r} died: exited with code {p.exitcode} without a result"
                            first_error_at = first_error_at or time.monotonic()
                            continue
                        if tid == task_id:
                            (out if status == "ok" else errors)[rank] = payload
                            if status != "ok":
                                first_error_at = first_error_at or time.monotonic()
                        break
                continue
            if tid != task_id:
                continue   # a straggler from an earlier, failed call
            (out if status == "ok" else errors)[rank] = payload
            if status != "ok":
                first_error_at = first_error_at or time.monotonic()
        if errors:
            if len(out) + len(errors) < self.world_size or any(not p.is_alive() for p in self._procs):
                self.close(abort=True)   # a rank died or is left inside a collective: no later call can trust it
            first = next(iter(errors))  # the first failure reported is the cause; the others usually follow
            raise WorkerFailedError(f"rank {first} failed (failed ranks: {sorted(errors)}):\n{errors[first]}")
        return [out[r] for r in range(self.world_size)]

    def close(self, abort: bool = False) -> None:
        """Stop every rank (their process groups destroyed) and the MPS daemon; idempotent. Ranks get 5 s to
        finish (0.5 s with ``abort``), one deadline for all, then they are killed."""
        self.broken = True
        for q in self._tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        end = time.monotonic() + (0.5 if abort else 5.0)
        for p in self._procs:
            if p.pid is not None:   # never started (start-up was interrupted): join() would raise
                p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self._procs:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join()
        mps, self._mps = self._mps, None
        if mps is not None:
            mps.__exit__(None, None, None)


def spawn(fn: Callable[..., Any], nprocs: int, *, args: tuple = (), device: str = "cpu",
          ranks_per_node: int | Sequence[int] | None = None, timeout: float | None = None,
          job_timeout: float | None = None, grace: float = 5.0, ranks_per_gpu: int | None = None,
          mps: bool | None = None) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``nprocs`` freshly spawned local ranks and return their results by rank.

    Args:
        fn: a picklable (module-level) function; ``ctx`` is the rank's :class:`Context`.
        nprocs: number of ranks (>= 1).
        device: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank; gloo when ranks share a GPU).
        ranks_per_gpu: ranks sharing one CUDA device (default ``HPDL_RANKS_PER_GPU``, 1): rank r uses
            ``cuda:(r // ranks_per_gpu)``, e.g. ``spawn(fn, 8, device="cuda", ranks_per_gpu=8)`` puts 8 ranks on
            cuda:0. For correctness runs: the timings are not multi-GPU performance.
        mps: with ranks sharing a GPU, run them as clients of a private MPS daemon started here and stopped
            when the job ends (default ``HPDL_MPS``, off: the ranks' kernels time-slice).
        ranks_per_node: emulate nodes on this host (see :class:`Topology`).
        timeout: seconds any one collective may wait (default ``HPDL_TIMEOUT``); a hung peer fails the job then.
        job_timeout: seconds for the whole job (default: no limit beyond the per-collective timeouts).
        grace: seconds the other ranks get to finish after one rank fails, before they are killed.

    Raises:
        ValueError: bad ``nprocs``, ``device`` or ``ranks_per_gpu`` (also > 1 with ``device="cpu"``), or ``mps``
            without shared GPUs.
        RuntimeError: the visible GPUs cannot hold ``nprocs`` ranks at ``ranks_per_gpu`` each (before any starts).
        WorkerFailedError: a rank raised (its traceback is in the message) or died without a result.
        CollectiveTimeoutError: the job ran past ``job_timeout``; the message names the ranks still running.
        hpdl.runtime.mps.MpsError: ``mps`` was asked for and the daemon could not start.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
    started = time.monotonic()
    with WorkerGroup(nprocs, device=device, ranks_per_gpu=ranks_per_gpu, ranks_per_node=ranks_per_node,
                     timeout=timeout, mps=mps, start_timeout=job_timeout) as group:
        left = None if job_timeout is None else max(0.0, job_timeout - (time.monotonic() - started))
        return group.run(fn, *args, timeout=left, grace=grace)


def check_gpus_for(device: str, nprocs: int, ranks_per_gpu: int) -> None:
    """Refuse, before any rank (or MPS daemon) starts, ``nprocs`` local ranks that this host's visible GPUs
    cannot hold at ``ranks_per_gpu`` each (e.g. 3 ranks at 2 a GPU on one GPU: rank 2 would have none). Where
    CUDA is not available at all, each rank says so itself.

    Raises:
        RuntimeError: from :func:`device_for`, naming the rank, the GPU count and ``ranks_per_gpu``.
    """
    if device == "cuda" and torch.cuda.is_available():
        device_for("cuda", nprocs - 1, ranks_per_gpu)


def use_mps_for(mps: bool | None, ranks_per_gpu: int) -> bool:
    """Whether a job of ``ranks_per_gpu`` runs under a private MPS daemon: ``mps``, or ``HPDL_MPS`` when None
    (read only when ranks share a GPU: set for another job shape, or malformed, it does not fail this one).

    Raises:
        ValueError: ``mps`` is not True, False or None (a string such as "false" is not taken as true), or
            ``mps=True`` with a GPU per rank or the CPU.
    """
    if mps is not None and not isinstance(mps, bool):
        raise ValueError(f"mps must be True, False or None (HPDL_MPS), got {mps!r}")
    if ranks_per_gpu == 1:
        if mps:
            raise ValueError("mps=True needs ranks sharing a GPU (device='cuda' and ranks_per_gpu > 1)")
        return False
    return bool(env.get("HPDL_MPS") if mps is None else mps)


def _maybe_mps(use: bool):
    """A started private MPS daemon (context manager yielding the clients' environment), or nothing."""
    if not use:
        return contextlib.nullcontext({})
    import tempfile

    from hpdl.runtime.mps import MpsDaemon

    @contextlib.contextmanager
    def run():
        with tempfile.TemporaryDirectory(prefix="hpdl-mps-") as root:
            with MpsDaemon(root) as daemon:
                yield daemon.env
    return run()
