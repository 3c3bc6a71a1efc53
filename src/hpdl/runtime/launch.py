"""Process-group bootstrap: from torchrun / mpirun environment variables, or by spawning local ranks.

Every entry point returns a :class:`Context`: rank, world size, device, topology and two groups, the
``group`` that carries data (gloo for CPU, NCCL for CUDA) and a gloo ``cpu_group`` for host-side work
(argument checks, CPU staging). ``spawn`` is what the CLI's embedded default and the tests use.

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
                  timeout: float | None = None, ranks_per_gpu: int | None = None) -> Context:
    """Join the job that torchrun, mpirun or srun started.

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
    dev, backend = _resolve_device(device, local_rank, rpg)
    # hpdl.comm reads the variable: it must say this job's value, also 1 over an exported other one
    os.environ["HPDL_RANKS_PER_GPU"] = str(rpg)
    kwargs = {"device_id": dev} if backend == "nccl" else {}
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
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


def _worker(rank, nprocs, port, fn, args, device, ranks_per_node, timeout, results, ranks_per_gpu=1,
            environ=None) -> None:
    try:
        os.environ.update(environ or {"HPDL_TIMEOUT": str(timeout)})
        threads = max(1, (os.cpu_count() or 1) // nprocs)
        torch.set_num_threads(threads)
        dev, backend = _resolve_device(device, rank, ranks_per_gpu)
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nprocs,
                                timeout=timedelta(seconds=timeout), **kwargs)
        ctx = _make_context(rank, nprocs, rank, dev, backend, ranks_per_node, ranks_per_gpu)
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
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    rpg = job_ranks_per_gpu(device, ranks_per_gpu)
    check_gpus_for(device, nprocs, rpg)
    use_mps = use_mps_for(mps, rpg)
    limit = _timeout(timeout)
    with _maybe_mps(use_mps) as mps_env:
        return _spawn(fn, nprocs, args, device, ranks_per_node, limit, job_timeout, grace, rpg,
                      rank_environment(device, rpg, limit, mps_env))


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


def _spawn(fn, nprocs, args, device, ranks_per_node, limit, job_timeout, grace, rpg, environ) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, nprocs, port, fn, args, device, ranks_per_node, limit, results,
                                               rpg, environ),
                         daemon=True, name=f"hpdl-rank{r}") for r in range(nprocs)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + job_timeout if job_timeout is not None else float("inf")
    first_error_at: float | None = None
    aborted = False
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
    except BaseException:
        aborted = True   # Ctrl-C, the job timeout: the ranks get no more time
        raise
    finally:
        # one deadline for all ranks (joined one by one, a per-rank wait made Ctrl-C take 5 s per stuck rank)
        end = time.monotonic() + (0.5 if errors or aborted else 5.0)
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        first = next(iter(errors))  # the first failure reported is the cause; the others usually follow from it
        raise WorkerFailedError(f"rank {first} failed (failed ranks: {sorted(errors)}):\n{errors[first]}")
    return [outputs[r] for r in range(nprocs)]
