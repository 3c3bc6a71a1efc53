"""Trial worker processes: one per running trial, pinned to one device, reused for later trials there.

A worker imports torch, loads the study and (on a GPU) creates its CUDA context with cuBLAS and cuDNN
handles before it says ``ready``, so the driver can start a pool of warm workers per GPU ahead of the
study and no trial pays that start-up (:func:`warm_cuda`).

Protocol: the typed records of :mod:`hpdl.hpo.messages` (``RunTask`` / ``Preempt`` / ``Stop`` in,
``Ready``, ``ProfileReport``, ``PeakMemory`` and one outcome per trial out: ``Done``, ``Pruned``, ``Halted``,
``Failed``). The worker records ``hpdl_host``, ``hpdl_pid``, ``hpdl_started_at`` and ``hpdl_device`` on the
trial before it trains, off the driver's critical path. After a failure the worker exits (its CUDA state
may be unusable); after ``Stop`` it checkpoints a running trial, reports ``Halted`` and exits.

The driver owns every state transition of the Optuna trial (``tell``); the worker writes only
intermediate values (``trial.report``) and reads the pruner's decision (``trial.should_prune``).
A worker dies with its driver (``PR_SET_PDEATHSIG`` on Linux, plus a parent check every step), so a
killed scheduler never leaves trials running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from hpdl.hpo import messages
from hpdl.hpo.checkpoint import CheckpointMismatch, CheckpointWriteError
from hpdl.hpo.errors import Preempted
from hpdl.hpo.trial import TrialContext, cap_memory


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _exit_with_driver() -> None:
    """Exit (code 3) as soon as the process that started this one is gone, whatever the trial is doing.

    Watches ``multiprocessing.parent_process().sentinel`` (a pipe the starting process holds open) from a
    daemon thread. Needed under ``forkserver``: the worker's OS parent is the server, which itself stays
    alive while any worker does, so ``PR_SET_PDEATHSIG`` and parent-pid checks would never fire."""
    import multiprocessing
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(3)

    threading.Thread(target=watch, name="hpdl-driver-watch", daemon=True).start()


def warm_cuda(device) -> None:
    """Create the CUDA context and the cuBLAS and cuDNN handles on ``device`` (a conv, a matmul and their
    backward on tiny tensors), then return the cached blocks: what the first trial of a cold process would
    otherwise pay (about 1-2 s with the torch import)."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(2, 3, 8, 8, device=device, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, device=device, requires_grad=True)
    y = F.conv2d(x, w, padding=1).flatten(1)
    (y @ torch.randn(y.shape[1], 4, device=device)).sum().backward()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def warm_imports() -> None:
    """Build and step one optimizer on a one-element CPU tensor: the first ``torch.optim.Optimizer`` a process
    constructs imports ``torch._dynamo`` (``Optimizer.__init__`` is wrapped by ``torch._disable_dynamo``),
    which took 3.1 s of a warm CPU worker's 3.5 s first trial (cProfile). On an H200 host it takes 3.6-6.2 s
    per worker. Paid here, it leaves the trials (``pack`` with MPS on 2 x H200, same scheduler: 14.5 s to
    9.4-12.3 s from a ready pool) but not the study: the pool's start-up grew by as much
    (docs/benchmarks/hpo.md). Touches no device, runs no workload code and leaves the global random state
    alone."""
    import torch

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(1)
    opt.step()


class _Env:
    """What a worker process loads once and reuses for every trial: device, workload, study, run folder.

    ``startup`` holds the seconds each start-up phase took: ``import`` (what of torch and optuna the spawned
    process had not imported yet, and the workload's module: under ``spawn`` torch comes with the ``hpdl``
    package, in phase ``spawn``),
    ``cuda`` (:func:`warm_cuda`), ``optimizer`` (:func:`warm_imports`), ``study`` (the study's load from its
    storage, in a thread beside ``cuda`` and ``optimizer``: it overlaps them) and ``ready`` (from the start
    of this call until all of them are done; ``spawn`` comes before it)."""

    def __init__(self, device: dict, spec: dict, torch_device: str):
        t = t_start = time.monotonic()
        import optuna
        import torch

        from hpdl.hpo.spec import make_pruner, make_storage
        from hpdl.hpo.workloads import get_workload

        # One intra-op thread: co-located trials each need a core for Python and kernel launches.
        from hpdl.runtime import env as hpdl_env

        torch.set_num_threads(hpdl_env.get("HPDL_HPO_CPU_THREADS"))
        if torch_device != "cpu":
            # no cudnn.benchmark: its autotuning allocates transient workspaces a profile cannot bound
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.device, self.spec = device, spec
        self.dev = torch.device(torch_device)
        self.startup: dict[str, float] = {}

        def lap(phase: str) -> None:
            nonlocal t
            now = time.monotonic()
            self.startup[phase], t = now - t, now

        self.workload = get_workload(spec["workload"])  # may import the user's module: phase "import"
        self.run_dir = Path(spec["run_dir"])
        lap("import")
        loaded: dict[str, Any] = {}
        import optuna.storages  # noqa: F401 - imported here, not in two threads at once
        import sqlalchemy.orm  # noqa: F401

        if getattr(self.workload, "define_by_run", False):  # an objective(trial) draws its parameters here
            from hpdl.hpo.spec import make_sampler

            sampler = make_sampler(spec["sampler"], spec.get("space") or {})
            sampler.reseed_rng()  # each worker process its own stream, as Optuna's n_jobs threads do
        else:  # parameters come with the task; nothing is sampled here
            sampler = optuna.samplers.RandomSampler()

        def load() -> None:  # storage I/O and SQLAlchemy set-up: overlaps the CUDA start-up below
            t_load = time.monotonic()
            try:
                loaded["study"] = optuna.load_study(
                    study_name=spec["study"], storage=make_storage(spec["storage"], attach=True),
                    sampler=sampler, pruner=make_pruner(spec["pruner"]))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
                loaded["error"] = exc
            loaded["seconds"] = time.monotonic() - t_load

        loader = threading.Thread(target=load, name="hpdl-study-load", daemon=True)
        loader.start()
        if self.dev.type == "cuda":
            warm_cuda(self.dev)
            lap("cuda")
        warm_imports()
        lap("optimizer")
        loader.join()
        if "error" in loaded:
            raise loaded["error"]
        self.study = loaded["study"]
        self.startup["study"] = loaded["seconds"]  # after the others, whichever ended first: a fixed order
        self.startup["ready"] = time.monotonic() - t_start


def run_task(env: _Env, conn, task: messages.Task, parent_pid: int | None) -> bool:
    """Train one trial and send its outcome on ``conn``; return False when the process should exit (after a
    failure its CUDA state may be unusable)."""
    import optuna
    import torch

    from hpdl.hpo.profiler import StepProfiler, TrialProfile

    if task.fused:  # K trials as one fused model (hpdl.hpo.fusion)
        from hpdl.hpo.fusion import run_group
        return run_group(env, conn, task, parent_pid)
    tid, dev = task.trial_id, env.dev
    try:
        trial = optuna.trial.Trial(env.study, tid)
        for key, val in (("hpdl_host", task.host), ("hpdl_pid", os.getpid()),
                         ("hpdl_started_at", time.time()), ("hpdl_device", task.device_id)):
            trial.set_user_attr(key, val)
        params = env.workload.resolve({**env.spec.get("fixed", {}), **task.params})
        prof = None
        if task.profile:
            prof = StepProfiler(dev, env.device["kind"], TrialProfile(**task.static),
                                peak_flops=env.device.get("peak_flops") or 5e10,
                                context_bytes=int(task.context_bytes))
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            cap_memory(dev, task.memory_cap, int(task.context_bytes))
        ctx = TrialContext(trial, params, dev, conn, task, env.run_dir,
                           int(env.spec.get("checkpoint_every", 1)), prof, parent_pid)
        value = env.workload.train(ctx)
        _send_peak(env, conn, task)
        conn.send(messages.Done(trial_id=tid, value=float(value)))
    except optuna.TrialPruned:
        _send_peak(env, conn, task)
        conn.send(messages.Pruned(trial_id=tid))
    except Preempted as exc:
        conn.send(messages.Halted(trial_id=tid))
        return not exc.stop  # the driver stops: exit now, do not wait for a second stop message
    except CheckpointMismatch as exc:  # someone else's training: never continue from it, never retry
        conn.send(messages.Failed(trial_id=tid, kind="checkpoint", message=str(exc)))
        return False
    except CheckpointWriteError as exc:  # the run folder's fault: the driver re-queues it and stops the study
        conn.send(messages.Failed(trial_id=tid, kind="checkpoint_write", message=str(exc)))
        return False
    except torch.cuda.OutOfMemoryError as exc:
        conn.send(messages.Failed(trial_id=tid, kind="oom", message=str(exc).splitlines()[0][:300]))
        return False
    except Exception as exc:  # noqa: BLE001 - any error of user code fails this trial, with its traceback
        # cuDNN/cuBLAS workspace failures are out-of-memory errors that are not OutOfMemoryError
        oom = any(m in str(exc) for m in ("out of memory", "ALLOC_FAILED"))
        conn.send(messages.Failed(trial_id=tid, kind="oom" if oom else "error", message=traceback.format_exc()[-2000:]))
        return False
    finally:
        if dev.type == "cuda":
            with contextlib.suppress(Exception):  # a broken CUDA state must not hide the report above
                torch.cuda.empty_cache()
    return True


def _send_peak(env: _Env, conn, task: messages.Task) -> None:
    """Tell the driver the trial's peak reserved bytes plus its context since the task started (CUDA only)."""
    if env.dev.type == "cuda":
        import torch

        peak = int(torch.cuda.max_memory_reserved(env.dev)) + int(task.context_bytes)
        conn.send(messages.PeakMemory(trial_id=task.trial_id, kind=env.device["kind"], bytes=peak))


def worker_main(conn, device: dict, spec: dict, sm_percent: int = 100, spawned_at: float | None = None,
                environ: dict[str, str] | None = None) -> None:
    """Entry point of a local worker process (``multiprocessing`` spawn target). Runs tasks until told to
    stop or the driver disappears; exits after a failed trial. ``spawned_at`` (Unix time the driver started
    the process) adds phase ``spawn`` to the ready message's start-up times: the interpreter's start, the
    unpickling of this call and the imports it triggers (``hpdl``, which imports torch; nothing new in a
    worker forked from the preloaded forkserver). ``environ``: the driver's environment, applied before
    anything reads it (a forkserver's children inherit the server's, from its start).

    The worker exits when the driver goes away, within a second whatever the trial is doing
    (:func:`_exit_with_driver`; plus ``PR_SET_PDEATHSIG`` and a parent check between steps)."""
    boot = time.time() - spawned_at if spawned_at else None
    # Ctrl-C reaches the whole foreground process group: the driver alone decides (it tells every worker
    # to checkpoint and stop), a worker must not die mid-step with a KeyboardInterrupt of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    _exit_with_driver()
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    parent_pid = os.getppid()  # the driver, or the forkserver that forked this worker; see the docstring
    torch_device = device["torch_device"]
    os.environ.update(spec.get("mps_env") or {})  # mps: start -> this study's MPS daemon (before any CUDA call)
    if torch_device.startswith("cuda"):
        os.environ["CUDA_VISIBLE_DEVICES"] = torch_device.partition(":")[2] or "0"
        if sm_percent < 100:
            os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(sm_percent)
        torch_device = "cuda:0"
    env = _Env(device, spec, torch_device)
    try:
        conn.send(messages.Ready(pid=os.getpid(), startup={**({"spawn": boot} if boot is not None else {}),
                                                           **env.startup}))
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent_pid:
                    return
                continue
            msg = messages.check(conn.recv())
            if isinstance(msg, messages.Stop):
                return
            if not isinstance(msg, messages.RunTask):
                continue  # a late preempt for a trial that already ended
            if not run_task(env, conn, msg.task, parent_pid):
                return
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the driver is gone (killed): nothing to report to, and no traceback to print


_RAY_ENVS: dict[tuple, _Env] = {}  # per Ray worker process: reused by later trials of the same study


def ray_trial(address: tuple[str, int], authkey: bytes, token: int, device: dict, spec: dict,
              task: messages.Task) -> str:
    """Body of one trial as a Ray task (see :mod:`hpdl.hpo.ray_backend`): connect back to the driver
    (``multiprocessing.connection`` over TCP, the same message protocol as a local worker), say
    :class:`~hpdl.hpo.messages.Hello`, train the trial on the GPU Ray assigned to this task (or the CPU for a
    logical GPU without a CUDA device), and return. Ray keeps its worker processes, so the imports, the
    CUDA context and the loaded study are reused by later trials that land in the same process.

    Returns:
        ``"ok"``, or ``"exit"`` after a failure (the driver has already been told).
    """
    from multiprocessing.connection import Client

    import torch

    torch_device = "cuda:0" if torch.cuda.is_available() and device["torch_device"] != "cpu" else "cpu"
    key = (spec["study"], spec["storage"], device["id"], torch_device)
    if key not in _RAY_ENVS:
        _RAY_ENVS[key] = _Env(device, spec, torch_device)
    conn = Client(address, authkey=authkey)
    try:
        conn.send(messages.Hello(token=token, pid=os.getpid()))
        return "ok" if run_task(_RAY_ENVS[key], _EofSafe(conn), task, None) else "exit"
    finally:
        conn.close()


class _EofSafe:
    """A connection whose ``poll`` turns a vanished driver into a stop request, so a Ray trial ends
    (with its last checkpoint) instead of raising inside the training loop."""

    def __init__(self, conn):
        self._conn = conn
        self._gone = False

    def send(self, msg) -> None:
        if not self._gone:
            with contextlib.suppress(OSError, EOFError):
                self._conn.send(msg)

    def poll(self, timeout: float = 0.0) -> bool:
        try:
            return self._gone or self._conn.poll(timeout)
        except (OSError, EOFError):
            self._gone = True
            return True

    def recv(self):
        if self._gone:
            return messages.Stop()
        try:
            return self._conn.recv()
        except (OSError, EOFError):
            self._gone = True
            return messages.Stop()
