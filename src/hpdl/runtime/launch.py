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
import functools
import itertools
import logging
import math
import multiprocessing as mp
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hpdl.runtime import channel as ch
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


GROUP_TIMEOUT_MAX_S = 1e8   # a process group's timeout becomes a timedelta (about 3 years here; inf overflows it)


def _check_seconds(name: str, value, *, none: bool = True, positive: bool = False,
                   limit: float = float("inf")) -> None:
    """Refuse a bad duration argument before anything is sent or started.

    Raises:
        ValueError: ``value`` is not a real number of seconds (a bool, a string, NaN), is negative (or 0 with
            ``positive``), above ``limit``, or is None where ``none`` is False; the message names ``name``.
    """
    if value is None and none:
        return
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value)
          and (value > 0 if positive else value >= 0) and value <= limit)
    if not ok:
        want = ("> 0" if positive else ">= 0") + (f" and <= {limit:g}" if limit != float("inf") else "")
        raise ValueError(f"{name} must be a number of seconds {want}{' or None' if none else ''}, got {value!r}")


def _locked(method):
    """Run ``method`` holding its group's lock: one call (send and replies) at a time per group."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        group = self.group if isinstance(self, Service) else self
        with group._lock:
            return method(self, *args, **kwargs)
    return call


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
    reach hpdl.comm in the ranks), and an MPS daemon's pipe/log folders. Every rank also clears the
    launcher's identity variables it inherited (:func:`launcher_identity`: torchrun's RANK/WORLD_SIZE/MASTER_*,
    TORCHELASTIC_*, PMI_*/PMIX_*, OMPI_COMM_WORLD_*, SLURM_PROCID/...): it is not the launcher's process."""
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
    _init_local_group(rank, world, port, dev, backend, timeout)
    return dev, backend


def _init_local_group(rank: int, world: int, port: int, dev: torch.device, backend: str,
                      timeout: float | None) -> None:
    kwargs = {"device_id": dev} if backend == "nccl" else {}   # an eager NCCL communicator
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=_timeout(timeout)), **kwargs)


def _destroy_bounded(timeout: float) -> bool:
    """``destroy_process_group`` (after hpdl.comm's cached groups and peer buffers), given up after ``timeout``
    seconds: NCCL's teardown waits for every rank, and a process that gives up exits with the communicator
    still open, which its peers tolerate. True when it finished (or there was no group)."""
    comm = sys.modules.get("hpdl.comm")
    if comm is not None:
        comm.reset()
    if not dist.is_initialized():
        return True
    t = threading.Thread(target=_destroy_at_exit, name="hpdl-destroy-group", daemon=True)
    t.start()
    t.join(timeout=timeout)
    return not t.is_alive()


def _sigint_to_parent(signum, frame) -> None:
    """A rank's SIGINT handler: nothing. The parent owns Ctrl-C (a terminal sends it to every process of the job)
    and tears its ranks down; a Python handler, unlike SIG_IGN, is not inherited by the programs a rank starts."""


# Variables by which a launcher tells a process who it is. A spawned rank inherits them from its parent but is not
# that process: they are cleared in it (under `mpiexec -n 1`, a rank importing mpi4py would join the launcher's PMI
# wire-up as the parent's rank and abort; torchrun's RANK would be misread by init_from_env).
_IDENTITY_VARS = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_STEP_NUM_TASKS",
    "SLURM_STEPID", "SLURM_STEP_ID", "SLURM_TASK_PID", "SLURM_GTIDS"})
_IDENTITY_PREFIXES = ("TORCHELASTIC_", "PMI_", "PMIX_", "OMPI_COMM_WORLD_", "OMPI_MCA_ess_", "OMPI_MCA_orte_",
                      "OMPI_MCA_pmix", "MV2_COMM_WORLD_", "HYDRA_", "HYDI_")


def launcher_identity(environ) -> list[str]:
    """The names in ``environ`` by which a launcher (torchrun, mpirun/mpiexec, srun) identified the process that
    has them: a rank spawned by :class:`WorkerGroup` clears them (see :func:`rank_environment`)."""
    return sorted(k for k in environ if k in _IDENTITY_VARS or k.startswith(_IDENTITY_PREFIXES))


def _die_with_parent() -> None:
    """Make this spawned rank end when its parent process does (SIGKILLed, a crash): nobody would stop it, and a
    rank busy in a task would run on, orphaned. A daemon thread waits on a pidfd of the parent (Linux >= 5.3) or,
    where there is none, looks at ``os.getppid()`` every half second, then SIGKILLs this process. Not
    ``PR_SET_PDEATHSIG``: it fires when the parent's *thread* that started the rank ends (a group started on a
    worker thread would lose its ranks with that thread)."""
    parent = mp.parent_process()
    if parent is None or parent.pid is None:
        return
    ppid = parent.pid
    pidfd = None
    with contextlib.suppress(AttributeError, OSError):
        pidfd = os.pidfd_open(ppid)
    if os.getppid() != ppid:   # the parent died before we looked (or before the pidfd): its pid may be reused
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        if pidfd is not None:
            p = select.poll()
            p.register(pidfd, select.POLLIN)
            while not p.poll(None):
                pass
        else:
            while os.getppid() == ppid:
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="hpdl-parent-watch", daemon=True).start()


_START = -1   # the id under which ranks report their start-up (Ready, or the Failure that ended it)


def _rank_main(rank, world, port, device, ranks_per_node, timeout, ranks_per_gpu, environ, threads, conn) -> None:
    """A :class:`WorkerGroup` rank: bootstrap, send :class:`~hpdl.runtime.channel.Ready`, then answer the
    parent's messages (:func:`_serve`) until it sends Stop or goes away."""
    from hpdl import __version__

    _die_with_parent()
    signal.signal(signal.SIGINT, _sigint_to_parent)
    for name in launcher_identity(os.environ):   # this rank is not the launcher's process (mpi4py would think so)
        del os.environ[name]
    os.environ.update(environ)
    ep = ch.Endpoint(conn, "the parent")
    try:
        torch.set_num_threads(threads)
        dev, backend = join_local(rank, world, port, device, ranks_per_gpu, timeout)
        ctx = _make_context(rank, world, rank, dev, backend, ranks_per_node, ranks_per_gpu)
        ep.send(ch.Ready(rank, os.getpid(), __version__))
    except BaseException:  # noqa: BLE001 - report a start-up failure to the parent with its traceback
        _send_quietly(ep, ch.Failure(_START, rank, traceback.format_exc(), True))
        _destroy_bounded(5.0)
        return
    try:
        _serve(ep, ctx, rank)
    except (EOFError, OSError):   # the parent went away (killed): nobody to answer
        pass
    finally:
        _destroy_bounded(10.0)


def _send_quietly(ep: "ch.Endpoint", msg) -> None:
    try:
        ep.send(msg)
    except (OSError, EOFError):   # the parent is gone
        pass


def _answer(ep: "ch.Endpoint", msg_id: int, rank: int, value, what) -> None:
    """Send ``Result(value)``, or a Failure that says why ``value`` cannot travel (pickled here, synchronously:
    the error reaches the parent instead of a wait)."""
    try:
        frame = ch.encode(ch.Result(msg_id, rank, value))
    except Exception as exc:  # noqa: BLE001 - any pickling error
        frame = ch.encode(ch.Failure(msg_id, rank, f"the result of {getattr(what, '__name__', what)} cannot be "
                                     f"sent to the parent ({type(exc).__name__}: {exc}); return picklable values",
                                     False))
    ep.send_frame(frame)


def _serve(ep: "ch.Endpoint", ctx: Context, rank: int) -> None:
    """The rank's message loop. A task that raises is reported and the rank lives on (every rank answered, so
    no peer waits for it); a service that raises (start, call or close) ends the rank after reporting it: it is
    stateful and its peers may wait for it inside a collective, which fails at once when it exits (gloo) rather
    than after ``HPDL_TIMEOUT``."""
    service = None
    try:
        while True:
            try:
                msg = ep.recv()
            except ch.BodyError as exc:
                if _undecodable(ep, exc, rank):
                    return
                continue
            except ch.ProtocolError as exc:
                ep.send(ch.Failure(_START, rank, f"rank {rank} cannot read the parent's message: {exc}", True))
                return
            kind = type(msg)
            if kind is ch.Call:
                if service is None:
                    ep.send(ch.Failure(msg.id, rank, "Call without a service: start_service() first", False))
                    continue
                try:
                    value = service(msg.payload)
                except BaseException:  # noqa: BLE001 - reported, then the rank ends (see above)
                    ep.send(ch.Failure(msg.id, rank, traceback.format_exc(), True))
                    return
                if msg.reply:
                    _answer(ep, msg.id, rank, value, type(service).__name__)
            elif kind is ch.Task:
                try:
                    value = msg.fn(ctx, *msg.args)
                except BaseException:  # noqa: BLE001 - every failure goes back to the parent with its traceback
                    ep.send(ch.Failure(msg.id, rank, traceback.format_exc(), False))
                    continue
                _answer(ep, msg.id, rank, value, msg.fn)
            elif kind is ch.StartService:
                try:
                    service = msg.factory(ctx, *msg.args)
                except BaseException:  # noqa: BLE001 - as a failed call
                    ep.send(ch.Failure(msg.id, rank, traceback.format_exc(), True))
                    return
                ep.send(ch.Result(msg.id, rank, None))
            elif kind is ch.StopService:
                closing, service = service, None
                try:
                    getattr(closing, "close", lambda: None)()
                except BaseException:  # noqa: BLE001 - as a failed call
                    ep.send(ch.Failure(msg.id, rank, traceback.format_exc(), True))
                    return
                ep.send(ch.Result(msg.id, rank, None))
            elif kind is ch.Stop:
                break
            else:
                ep.send(ch.Failure(_START, rank, f"rank {rank} got a {kind.__name__} message, which only a rank "
                                   "sends", True))
                return
    finally:
        if service is not None:   # Stop (or a failure) with a service running: it releases what it holds first
            try:
                getattr(service, "close", lambda: None)()
            except Exception:  # noqa: BLE001 - the rank is ending anyway
                log.exception("rank %d: closing its service failed", rank)


def _undecodable(ep: "ch.Endpoint", exc: "ch.BodyError", rank: int) -> bool:
    """Answer a message whose arguments or payload this rank cannot unpickle (``exc``) with a Failure naming it
    and the error. A task's or a request's failure is not fatal (the rank never started it, and lives on); a
    post's (no reply is awaited: only a fatal failure is reported, by the next call) and a service start's are,
    as when the service itself raises. Returns True when the rank must exit."""
    kind, msg_id = exc.cls.__name__, exc.head.get("id", _START)
    if exc.cls not in (ch.Task, ch.StartService, ch.Call):
        ep.send(ch.Failure(_START, rank, f"rank {rank} got a {kind} message, which only a rank sends", True))
        return True
    fatal = exc.cls is ch.StartService or (exc.cls is ch.Call and not exc.head.get("reply", False))
    what = {"Task": "arguments", "StartService": "factory or arguments", "Call": "payload"}[kind]
    ep.send(ch.Failure(msg_id, rank, f"rank {rank} cannot unpickle the {what} of the parent's {kind} message "
                       f"{msg_id} ({type(exc.cause).__name__}: {exc.cause}); send values a rank can import and "
                       f"rebuild:\n{''.join(traceback.format_exception(exc.cause))}", fatal))
    return fatal


class Service:
    """A long-running object on every spawned rank of a :class:`WorkerGroup`, made by
    :meth:`WorkerGroup.start_service`: messages reach it without a new process or task per message.

    On each rank ``service = factory(ctx, *args)``; each :meth:`post` or :meth:`request` calls
    ``service(payload)`` there; :meth:`stop` (or closing the group) calls ``service.close()`` when it has one. A
    service that raises (in ``factory``, a call or ``close``) reports its traceback and its rank exits (see
    :func:`_serve`); the next :meth:`post`, :meth:`request` or :meth:`failure` names that rank.
    """

    def __init__(self, group: "WorkerGroup", start_id: int, name: str):
        self.group, self.name, self._start_id = group, name, start_id
        self.started = self.stopped = False

    @_locked
    def wait_started(self, timeout: float | None = None) -> None:
        """Wait until ``factory`` returned on every rank (call it after this process's own part of the start, when
        the ranks' start needs collectives with it).

        Raises:
            WorkerFailedError: a rank's ``factory`` raised (its traceback) or the rank died; the group is torn down.
            CollectiveTimeoutError: ranks did not answer within ``timeout`` (default: the group's); they are named.
        """
        _check_seconds("timeout", timeout)
        if not self.started:
            g = self.group
            with g._torn_down_unless_answered():
                g._collect(self._start_id, g.timeout if timeout is None else timeout, 0.0, f"start of {self.name}")
            self.started = True

    @_locked
    def post(self, payload: Any) -> None:
        """Call ``service(payload)`` on every rank and return at once (one-way: no reply; a failure is reported by
        the next call). The frame is pickled once and written to each rank's pipe by this thread.

        Raises:
            WorkerFailedError: a rank failed or died since the last message (named, with its traceback); the group
                is torn down.
            CollectiveTimeoutError: a rank's pipe stayed full (the rank stopped reading, busy in a call) for the
                group's ``timeout``; the rank is named and the group torn down.
            RuntimeError: the service was stopped or the group closed.
        """
        g = self.group
        self._check()
        frame = ch.encode(ch.Call(next(g._ids), payload, False))
        with g._torn_down_unless_answered():
            g._send_all(frame, g.timeout, f"{self.name} post")

    @_locked
    def request(self, payload: Any, timeout: float | None = None, grace: float = 3.0) -> list[Any]:
        """``[service(payload) on rank r for r in group.ranks]``: a round trip.

        Raises:
            WorkerFailedError, CollectiveTimeoutError, ValueError: as :meth:`WorkerGroup.run`.
        """
        g = self.group
        _check_seconds("timeout", timeout)
        _check_seconds("grace", grace, none=False)
        self._check(look=False)   # a rank gone before is found while waiting for the replies
        msg_id = next(g._ids)
        frame = ch.encode(ch.Call(msg_id, payload, True))
        what = f"{self.name} request"
        with g._torn_down_unless_answered():
            g._replies[msg_id] = {}
            return g._send_and_collect(frame, msg_id, timeout, grace, what)

    @_locked
    def failure(self, wait: float = 0.0) -> WorkerFailedError | None:
        """The failure of a rank that failed or died, waiting up to ``wait`` seconds for one; None if none did.
        For a caller whose own part of a step raised (was a rank the cause?). Tears nothing down."""
        _check_seconds("wait", wait, none=False)
        g = self.group
        end = time.monotonic() + wait
        while True:
            g._receive(max(0.0, end - time.monotonic()))
            if g._gone:
                rank, why = next(iter(g._gone.items()))
                return WorkerFailedError(f"rank {rank} failed (failed ranks: {sorted(g._gone)}):\n{why}")
            if time.monotonic() >= end:
                return None

    @_locked
    def stop(self, timeout: float | None = None) -> None:
        """Call ``service.close()`` on every rank and wait for them; the ranks live on for other work.

        Raises:
            WorkerFailedError, CollectiveTimeoutError: as :meth:`WorkerGroup.run`.
        """
        _check_seconds("timeout", timeout)
        g = self.group
        if self.stopped:
            return
        self._check()
        self.stopped = True
        g._service = None
        msg_id = next(g._ids)
        g._replies[msg_id] = {}
        with g._torn_down_unless_answered():
            g._send_and_collect(ch.encode(ch.StopService(msg_id)), msg_id, g.timeout if timeout is None else timeout,
                                0.0, f"stop of {self.name}")

    def _check(self, look: bool = True) -> None:
        if self.stopped:
            raise RuntimeError(f"the service {self.name} was stopped; start a new one")
        self.group._check_healthy(look)


def _check_ranks_per_node(ranks_per_node, world_size: int) -> None:
    """Refuse a ``ranks_per_node`` that :meth:`Topology.emulate` would refuse in every rank, before any starts.

    Raises:
        ValueError: not None, an int >= 1, or a sequence of ints >= 1 summing to ``world_size`` (named).
    """
    if ranks_per_node is None:
        return
    if isinstance(ranks_per_node, int) and not isinstance(ranks_per_node, bool):
        if ranks_per_node >= 1:
            return
    elif isinstance(ranks_per_node, Sequence) and not isinstance(ranks_per_node, (str, bytes)):
        sizes = list(ranks_per_node)
        if (all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)
                and sum(sizes) == world_size):
            return
    raise ValueError(f"ranks_per_node must be None, an int >= 1 or a list of ints >= 1 summing to world_size="
                     f"{world_size}, got {ranks_per_node!r}")


class WorkerGroup:
    """``world_size`` local ranks, spawned once, each in one process group, running functions on request.

    The one place hpdl starts local ranks: :func:`spawn` (one function, then teardown), the test suite's rank
    pool (many functions on live ranks, :mod:`hpdl.testing.pool`) and serve's tensor-parallel executor (a
    :class:`Service` per rank, this process as rank 0) are all this class. Each rank bootstraps as :func:`spawn`
    documents (device, backend, ``HPDL_*`` environment, an optional private MPS daemon owned by the group), then
    answers messages on a typed, versioned channel (:mod:`hpdl.runtime.channel`): :meth:`run` sends
    ``fn(ctx, *args)`` to every rank and collects the results by rank, naming the ranks that failed, died or did
    not answer; :meth:`start_service` starts a long-running per-rank object that :meth:`Service.post` and
    :meth:`Service.request` reach without a new task per message. A rank's death is seen at once (its process
    sentinel), not by polling.

    Args:
        world_size: ranks in the job (>= 1), this process included with ``driver``.
        device, ranks_per_gpu, ranks_per_node, mps: as :func:`spawn`.
        timeout: seconds any one collective may wait inside the ranks (default ``HPDL_TIMEOUT``).
        start_timeout: seconds the ranks may take to start and meet (default ``timeout``).
        threads: torch intra-op threads per rank (default: this host's cores shared evenly).
        driver: this process is rank 0 (vLLM's driver worker): the group spawns ranks 1..world_size-1, this
            process joins the process group with them (its :class:`Context` is :attr:`context`, the group is
            destroyed by :meth:`close`), and :meth:`run` and services run on the spawned ranks only; this
            process does its own part itself. Needs no process group in this process yet.

    Attributes:
        ranks: the spawned ranks (``range(world_size)``, or from 1 with ``driver``).
        context: this process's :class:`Context` with ``driver``, else None.
        broken: True once torn down (after a failure, a timeout or :meth:`close`).

    Use as a context manager, or call :meth:`close`; Ctrl-C during start-up or a call leaves no rank (and no MPS
    daemon) behind. The ranks ignore SIGINT: the parent tears them down, and end themselves when the parent dies
    (SIGKILLed, crashed). Thread-safe: calls from several threads (of the group and its service) run one at a
    time under a lock; every send has a deadline (the call's ``timeout``, else the group's), so a rank that
    stops reading raises :class:`CollectiveTimeoutError` naming it instead of blocking the caller.

    Raises:
        ValueError, RuntimeError: as :func:`spawn`, before any rank starts; RuntimeError: ``driver`` with a
            process group already initialised here.
        WorkerFailedError: a rank failed to start (its traceback in the message).
        CollectiveTimeoutError: ranks did not start within ``start_timeout``; they are named.
    """

    def __init__(self, world_size: int, *, device: str = "cpu", ranks_per_gpu: int | None = None,
                 ranks_per_node: int | Sequence[int] | None = None, timeout: float | None = None,
                 mps: bool | None = None, threads: int | None = None, start_timeout: float | None = None,
                 driver: bool = False):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        _check_seconds("timeout", timeout, positive=True, limit=GROUP_TIMEOUT_MAX_S)
        _check_seconds("start_timeout", start_timeout, positive=True, limit=GROUP_TIMEOUT_MAX_S)
        _check_ranks_per_node(ranks_per_node, world_size)
        if driver and dist.is_initialized():
            raise RuntimeError("driver=True makes this process rank 0 of a new process group, but one is already "
                               "initialised here; destroy it first")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be an int >= 1 or None (this host's cores shared evenly), got {threads!r}")
        if not isinstance(driver, bool):
            raise ValueError(f"driver must be True or False, got {driver!r}")
        self.world_size, self.device, self.ranks_per_node = world_size, device, ranks_per_node
        self.ranks_per_gpu = job_ranks_per_gpu(device, ranks_per_gpu)
        check_gpus_for(device, world_size, self.ranks_per_gpu)
        use_mps = use_mps_for(mps, self.ranks_per_gpu)
        self.timeout = _timeout(timeout)
        self.driver = driver
        self.ranks = list(range(1 if driver else 0, world_size))
        self.context: Context | None = None
        threads = max(1, (os.cpu_count() or 1) // world_size) if threads is None else threads
        self.broken = True   # until every rank is up (close() is safe on a half-built group)
        self._lock = threading.RLock()   # one call at a time (see _locked)
        self._join_lock, self._closing = threading.Lock(), False
        self._procs: list = []
        self._eps: list[ch.Endpoint] = []
        self._ids = itertools.count()
        self._replies: dict[int, dict[int, tuple[bool, Any]]] = {_START: {}}  # id -> rank -> (ok, value/error)
        self._gone: dict[int, str] = {}   # rank -> why it is gone (its fatal failure, or its exit), in order
        self._service: Service | None = None
        self._poll, self._fds = None, {}
        self._owns_group = False
        self._mps = _maybe_mps(use_mps)
        environ = rank_environment(device, self.ranks_per_gpu, self.timeout, self._mps.__enter__())
        try:
            ctx = mp.get_context("spawn")
            port = free_port()
            pipes = [ctx.Pipe(duplex=True) for _ in self.ranks]
            self._eps = [ch.Endpoint(mine, f"rank {r}") for r, (mine, _) in zip(self.ranks, pipes)]
            self._procs = [ctx.Process(target=_rank_main, name=f"hpdl-rank{r}", daemon=True,
                                       args=(r, world_size, port, device, ranks_per_node, self.timeout,
                                             self.ranks_per_gpu, environ, threads, theirs))
                           for r, (_, theirs) in zip(self.ranks, pipes)]
            for p in self._procs:
                p.start()
            for _, theirs in pipes:   # the ranks hold these ends: a rank's exit then reads as end-of-file here
                theirs.close()
            self.broken = False
            self._start_timeout = self.timeout if start_timeout is None else start_timeout
            deadline = time.monotonic() + self._start_timeout
            if driver:
                self._join_as_driver(port, deadline)
            self._collect(_START, max(0.0, deadline - time.monotonic()), 0.0, "start", self._start_timeout)
        except BaseException:
            self.close(abort=True)
            raise

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abort=exc_type is not None)

    def _join_as_driver(self, port: int, deadline: float) -> None:
        """Join the process group as rank 0 while watching the ranks: one that fails or dies before it joins is
        reported at once (the join itself would wait ``timeout`` for it). The join runs on a helper thread (the
        device is selected on this one); the failed join's thread is left to time out."""
        dev, backend = _resolve_device(self.device, 0, self.ranks_per_gpu)
        os.environ["HPDL_RANKS_PER_GPU"] = str(self.ranks_per_gpu)   # as init_from_env: hpdl.comm reads it
        box: dict[str, BaseException] = {}

        def join() -> None:
            try:
                _init_local_group(0, self.world_size, port, dev, backend, self.timeout)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                box["error"] = exc
                return
            with self._join_lock:   # owned from now: close() destroys it on every failure path
                closed = self._closing
                self._owns_group = not closed
            if closed:   # the start failed (Ctrl-C, a rank died) while this thread joined: nobody else will
                _destroy_bounded(10.0)

        t = threading.Thread(target=join, name="hpdl-driver-join", daemon=True)
        t.start()
        while t.is_alive():
            self._receive(0.1)
            if self._gone:
                self._raise_gone("during start-up")
            if time.monotonic() > deadline:
                self._timed_out("start", self.ranks, self._start_timeout)
            t.join(0.0)
        if "error" in box:
            raise box["error"]
        self.context = _make_context(0, self.world_size, 0, dev, backend, self.ranks_per_node, self.ranks_per_gpu)

    @_locked
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, grace: float = 3.0
            ) -> list[Any]:
        """``[fn(ctx, *args) on rank r for r in ranks]``; ``fn`` must be a module-level function.

        Args:
            timeout: seconds the whole call may take (default: no limit beyond the ranks' collective timeouts).
            grace: seconds the other ranks get to answer once one has failed.

        Raises:
            WorkerFailedError: a rank raised or died; the message holds the first failure's traceback. The group
                stays usable when every rank answered; otherwise it is torn down (:attr:`broken`).
            CollectiveTimeoutError: ranks did not answer within ``timeout``; they are named; the group is torn
                down (a rank stuck in a collective cannot be trusted again).
            RuntimeError: the group was torn down or closed before.
            ValueError: ``timeout`` or ``grace`` is not a number of seconds >= 0 (nothing was sent; the group
                stays usable).
            what pickling ``fn`` or ``args`` raises (nothing was sent; the group stays usable).
        """
        _check_seconds("timeout", timeout)
        _check_seconds("grace", grace, none=False)
        self._check_healthy(look=False)   # a rank gone before is found while waiting for the results
        task_id = next(self._ids)
        frame = ch.encode(ch.Task(task_id, fn, args))
        self._replies[task_id] = {}
        try:
            with self._torn_down_unless_answered():
                return self._send_and_collect(frame, task_id, timeout, grace, "run")
        finally:
            self._replies.pop(task_id, None)

    @_locked
    def start_service(self, factory: Callable[..., Any], *args: Any, name: str | None = None) -> Service:
        """Start ``factory(ctx, *args)`` on every spawned rank and return its :class:`Service` at once (the ranks
        build it meanwhile; :meth:`Service.wait_started` waits for them). One service at a time.

        Raises:
            RuntimeError: a service is running, or the group was torn down.
            what pickling ``factory`` or ``args`` raises.
        """
        self._check_healthy()
        if self._service is not None:
            raise RuntimeError(f"the service {self._service.name} is running; stop() it first")
        msg_id = next(self._ids)
        frame = ch.encode(ch.StartService(msg_id, factory, args))
        self._replies[msg_id] = {}
        self._service = Service(self, msg_id, name or getattr(factory, "__name__", repr(factory)))
        with self._torn_down_unless_answered():
            self._send_all(frame, self.timeout, f"start of {self._service.name}")
        return self._service

    # -- the parent's side of the channel ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _torn_down_unless_answered(self):
        """Around a send and its wait: Ctrl-C, a timeout or any error other than the ranks' own answer
        (WorkerFailedError, which tears down itself when a rank is gone) tears the group down: the ranks get no
        more time, and no later call can trust where they stopped."""
        try:
            yield
        except BaseException as exc:
            if not isinstance(exc, WorkerFailedError):
                self.close(abort=True)
            raise

    def _check_healthy(self, look: bool = True) -> None:
        """Raise if the group is unusable: closed, or a rank failed fatally or died (with ``look``, also what the
        pipes and sentinels say now, without waiting: a one-way message has no reply that would tell)."""
        if self.broken:
            raise RuntimeError("this WorkerGroup was torn down after a failure or closed; start a new one")
        if look:
            self._receive(0.0)
        if self._gone:
            self._raise_gone("since the last message")

    def _send_all(self, frame: bytes, timeout: float, what: str) -> None:
        """Write ``frame`` to every rank's pipe within ``timeout`` seconds for all (a rank that stopped reading,
        busy in a long call, fills its pipe: the write then waits for it, never longer).

        Raises:
            CollectiveTimeoutError: a rank's pipe stayed full past the deadline (the rank is named); torn down.
            WorkerFailedError: a rank is gone; torn down.
        """
        deadline = time.monotonic() + timeout if math.isfinite(timeout) else None
        for r, ep in zip(self.ranks, self._eps):
            try:
                sent = ep.send_frame(frame, deadline)
            except (BrokenPipeError, ConnectionError, OSError) as exc:
                i = self.ranks.index(r)
                self._drain(i)   # its last words, if it left any
                p = self._procs[i]
                p.join(1.0)
                self._mark_gone(r, f"rank {r} died: exited with code {p.exitcode}" if p.exitcode is not None else
                                f"rank {r} is gone (its pipe: {exc!r})")
                self._raise_gone("before this message")
            if not sent:   # (out of the try: CollectiveTimeoutError is a TimeoutError, an OSError)
                self._timed_out(f"{what}: sending to rank {r} (it stopped reading its messages)", [r], timeout)

    def _send_and_collect(self, frame: bytes, msg_id: int, timeout: float | None, grace: float, what: str
                          ) -> list[Any]:
        """Send ``frame`` to every rank and collect the replies to ``msg_id``: ``timeout`` seconds for both
        together (None: the send gets the group's timeout, the wait no limit)."""
        start = time.monotonic()
        self._send_all(frame, self.timeout if timeout is None else timeout, what)
        left = float("inf") if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        return self._collect(msg_id, left, grace, what, timeout)

    def _raise_gone(self, what: str) -> None:
        gone = dict(self._gone)
        self.close(abort=True)
        rank, why = next(iter(gone.items()))
        raise WorkerFailedError(f"rank {rank} failed (failed ranks: {sorted(gone)}) {what}; the worker group was "
                                f"torn down:\n{why}")

    def _timed_out(self, what: str, missing: list[int], timeout: float) -> None:
        self.close(abort=True)
        raise CollectiveTimeoutError(f"{what} timed out after {timeout:.3g}s (world_size={self.world_size}); ranks "
                                     f"still running: {missing}; the worker group was torn down",
                                     missing_ranks=missing)

    def _mark_gone(self, r: int, why: str) -> None:
        """Rank ``r`` is gone (a fatal failure or its exit): every awaited reply of it fails with ``why``."""
        if r not in self._gone:
            self._gone[r] = why
            self._poll = None   # its pipe reads as end-of-file for ever: not watched again
            for got in self._replies.values():
                got.setdefault(r, (False, why))

    def _poller(self):
        """A ``select.poll`` over the pipes and process sentinels of the ranks not gone (kept between calls: one
        system call per look, where ``multiprocessing.connection.wait`` builds a selector each time)."""
        if self._poll is None:
            self._poll, self._fds = select.poll(), {}
            for i, r in enumerate(self.ranks if self._eps else ()):   # nothing to watch once closed
                if r not in self._gone:
                    for fd, exit_fd in ((self._eps[i].fileno(), False), (self._procs[i].sentinel, True)):
                        self._poll.register(fd, select.POLLIN)
                        self._fds[fd] = (i, exit_fd)
        return self._poll

    def _receive(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` seconds (None: no limit) for frames or rank exits, and file what came: replies
        under their id (only ids still awaited), fatal failures and exits in ``_gone``."""
        poller = self._poller()
        if not self._fds:
            if timeout:
                time.sleep(min(timeout, 1.0))   # nothing to watch: the caller loops to its deadline
            return
        events = poller.poll(None if timeout is None else (0 if timeout <= 0 else ch.poll_ms(timeout)))
        ready = [self._fds[fd] for fd, _ in events if fd in self._fds]
        exited = {i for i, exit_fd in ready if exit_fd}   # (its pipe may have no event: checked before reading)
        for i in sorted({i for i, _ in ready}):
            if self._drain(i, ready=i not in exited) or i in exited:   # end of file, or its sentinel: it exited
                p, r = self._procs[i], self.ranks[i]
                p.join(5.0)
                self._mark_gone(r, f"rank {r} died: exited with code {p.exitcode} without a result")

    def _drain(self, i: int, ready: bool = False) -> bool:
        """Read every frame rank ``self.ranks[i]`` has written (a dying rank's last words come before its exit);
        ``ready``: poll said its pipe is readable. True when its pipe reached end of file (it exited)."""
        ep, r = self._eps[i], self.ranks[i]
        while ready or ep.poll(0):   # (not select(): it fails on fds >= 1024)
            ready = False
            try:
                msg = ep.recv()
            except (EOFError, OSError):
                return True
            except ch.BodyError as exc:   # a result this process cannot unpickle: that call fails, naming the rank
                msg_id = exc.head.get("id")
                if exc.cls is ch.Result and msg_id in self._replies:
                    self._replies[msg_id][r] = (False, f"rank {r}'s result cannot be unpickled in this process "
                                                f"({type(exc.cause).__name__}: {exc.cause}); return values this "
                                                f"process can import and rebuild:\n"
                                                f"{''.join(traceback.format_exception(exc.cause))}")
                elif exc.cls is not ch.Result:
                    self.close(abort=True)
                    raise ch.ProtocolError(f"rank {r} sent a {exc.cls.__name__} message, which only the parent "
                                           "sends") from exc
                continue
            except ch.ProtocolError:
                self.close(abort=True)
                raise
            kind = type(msg)
            if kind is ch.Result:
                if msg.id in self._replies:   # else a straggler of a call that failed earlier
                    self._replies[msg.id][r] = (True, msg.value)
            elif kind is ch.Failure:
                if msg.id in self._replies:
                    self._replies[msg.id][r] = (False, msg.error)
                if msg.fatal:
                    self._mark_gone(r, msg.error)
            elif kind is ch.Ready:
                self._replies[_START][r] = (True, msg.pid)
            else:
                self.close(abort=True)
                raise ch.ProtocolError(f"rank {r} sent a {kind.__name__} message, which only the parent sends")
        return False

    def _collect(self, msg_id: int, timeout: float, grace: float, what: str, shown: float | None = None
                 ) -> list[Any]:
        """The replies to message ``msg_id`` by rank, waiting ``timeout`` seconds (``shown``: the timeout the
        error names), and ``grace`` seconds for the others once one rank failed."""
        got = self._replies.setdefault(msg_id, {})
        deadline = time.monotonic() + timeout
        first_error_at: float | None = None
        try:
            while True:
                for r in self.ranks:   # gone before this call was sent, or while it ran
                    if r in self._gone and r not in got:
                        got[r] = (False, self._gone[r])
                pending = [r for r in self.ranks if r not in got]
                if first_error_at is None and any(not ok for ok, _ in got.values()):
                    first_error_at = time.monotonic()
                if not pending:
                    break
                now = time.monotonic()
                if first_error_at is not None and now >= first_error_at + grace:
                    break
                if now >= deadline:
                    self._timed_out(what, pending, timeout if shown is None else shown)
                until = min(deadline, float("inf") if first_error_at is None else first_error_at + grace)
                self._receive(None if until == float("inf") else until - now)
        finally:
            self._replies.pop(msg_id, None)
        errors = {r: v for r, (ok, v) in got.items() if not ok}
        if errors:
            if len(got) < len(self.ranks) or self._gone or any(not p.is_alive() for p in self._procs):
                self.close(abort=True)   # a rank died or is left inside a collective: no later call can trust it
            first = next(iter(errors))  # the first failure reported is the cause; the others usually follow
            raise WorkerFailedError(f"rank {first} failed (failed ranks: {sorted(errors)}):\n{errors[first]}")
        return [got[r][1] for r in self.ranks]

    def close(self, abort: bool = False, timeout: float | None = None) -> None:
        """Stop every rank (its service closed, its process group destroyed), with ``driver`` this process's
        process group, and the MPS daemon; idempotent. Ranks get ``timeout`` seconds to finish (default 5 s;
        0.5 s with ``abort``), one deadline for all, then they are killed. Called while another thread is inside
        a call of this group (a watchdog ending a hung step), it kills the ranks at once: that call then fails
        (WorkerFailedError) and this one finishes the teardown.

        Raises:
            ValueError: ``timeout`` is not a number of seconds >= 0 or None.
        """
        _check_seconds("timeout", timeout)
        if not self._lock.acquire(blocking=False):
            self.broken = True
            for p in self._procs:   # the call in progress sees their exits at once and gives the lock back
                if p.pid is not None and p.is_alive():
                    p.kill()
            self._lock.acquire()
        try:
            self._close(abort, timeout)
        finally:
            self._lock.release()

    def _close(self, abort: bool, timeout: float | None) -> None:
        self.broken = True
        stop = ch.encode(ch.Stop())
        for ep in self._eps:
            try:   # a rank that stopped reading must not block the teardown: no wait (it is killed later)
                ep.send_frame(stop, deadline=0.0)
            except (OSError, ValueError):
                pass
        with self._join_lock:   # (a driver's join still running on its thread sees this and undoes itself)
            owns, self._owns_group, self._closing = self._owns_group, False, True
        if owns:   # with the ranks: NCCL's teardown waits for every rank
            _destroy_bounded(2.0 if abort else 10.0)
        end = time.monotonic() + (0.5 if abort else 5.0 if timeout is None else timeout)
        for p in self._procs:
            if p.pid is not None:   # never started (start-up was interrupted): join() would raise
                p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self._procs:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join()
        for ep in self._eps:
            ep.close()
        self._eps, self._poll, self._fds = [], None, {}
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
        ValueError: bad ``nprocs``, ``device``, ``ranks_per_gpu`` (also > 1 with ``device="cpu"``),
            ``timeout``, ``job_timeout``, ``grace`` or ``ranks_per_node``, or ``mps`` without shared GPUs.
        RuntimeError: the visible GPUs cannot hold ``nprocs`` ranks at ``ranks_per_gpu`` each (before any starts).
        WorkerFailedError: a rank raised (its traceback is in the message) or died without a result.
        CollectiveTimeoutError: the job ran past ``job_timeout``; the message names the ranks still running.
        hpdl.runtime.mps.MpsError: ``mps`` was asked for and the daemon could not start.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
    _check_seconds("job_timeout", job_timeout, positive=True)   # (named here: the group calls it start_timeout)
    _check_seconds("grace", grace, none=False)
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
