"""Where trial processes come from: a launcher owns the worker handles and hides the process topology from
the driver (as vLLM's executors do). Two launchers share one interface:

- :class:`LocalLauncher`: ``multiprocessing`` worker processes on this host, one pipe each, with a **warm
  pool** per GPU: before the clock starts, ``warm_workers`` processes per GPU are started and waited for
  until each has imported torch, loaded the study and created its CUDA context with cuBLAS and cuDNN
  handles (``auto``: as many as the policy ever runs on one GPU, at most 8, so every policy gets the same
  machinery; none on fake CPU devices). The pool is kept at that size (a worker exits after a failed trial
  and is replaced in the background); extra workers start on demand and stop after 10 s idle.
- :class:`hpdl.hpo.ray_backend.RayBackend`: one Ray task per trial on a Ray cluster.

The driver owns trial states; a launcher only starts, feeds and stops processes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from typing import Any

from hpdl.hpo.errors import HpoError
from hpdl.hpo.messages import Message, Ready, RunTask, Stop, Task, check

START_METHOD_ENV = "HPDL_HPO_START_METHOD"  # declared in hpdl.runtime.env
IDLE_WORKER_S = 10.0   # a worker beyond the warm pool stops after this long idle
WARM_MAX = 32          # trials per GPU the driver samples ahead for (packing looks ahead) are capped here
# The auto warm pool per GPU is capped here: workers starting at once slow each other's CUDA start-up
# (H200s, MPS, medians per run: 8 per GPU 1.3-1.5 s on one GPU and 2.0-3.0 s on two, 15 per GPU 3.9-5.9 s);
# pack runs 5.5-11.5 trials per GPU on average and starts workers beyond the pool on demand, while trials run.
WARM_AUTO_MAX = 8
WARM_TIMEOUT_S = 180.0  # the warm pool must be ready within this


def worker_context():
    """The ``multiprocessing`` context that starts local trial workers (``HPDL_HPO_START_METHOD``).

    ``forkserver`` (the default where available): one server process imports :mod:`hpdl.hpo._preload`
    (torch, ``torch._dynamo``, optuna) once and forks every worker from it, so a warm pool of N workers pays
    those imports once instead of N times at once. The server never initialises CUDA; each worker does,
    after the fork. Python keeps one forkserver per process, started by its first use and living until
    every process it forked and the process itself are gone; it keeps torch in memory meanwhile. Caveats:
    settings torch reads when it is imported (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``TORCH_*``,
    ``TORCHDYNAMO_*``, ``TORCHINDUCTOR_*``) come from the environment at the server's start, while
    everything read later sees the driver's current environment (:func:`hpdl.hpo.worker.worker_main`);
    a forkserver started earlier by other code has no preload (workers then import for themselves); a
    process forked (``fork``) from one that already used the forkserver cannot start workers through it.
    Use ``spawn`` in those cases: every worker a fresh interpreter.

    Raises:
        HpoError: ``HPDL_HPO_START_METHOD`` is neither ``forkserver`` nor ``spawn``.
    """
    from hpdl.runtime import env

    try:
        method = env.get(START_METHOD_ENV)
    except ValueError as exc:
        raise HpoError(str(exc)) from None
    if method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        from hpdl.hpo._prestart import start_forkserver

        start_forkserver()  # at once, not at the first worker's start: it imports while the driver opens the study
        return mp.get_context("forkserver")
    return mp.get_context("spawn")


@dataclass
class WorkerHandle:
    """One trial process as the driver sees it: ``proc`` (is_alive/join/kill/pid/exitcode), ``conn`` (the
    message channel; None until a remote task connected), the device, and the trial it runs (or None)."""

    proc: Any
    conn: Any
    device_id: str
    sm_percent: int = 100
    trial: Any = None
    stopping: bool = False
    ready: bool = False
    startup: dict = field(default_factory=dict)  # seconds per start-up phase, from the ready message
    token: int = 0        # Ray: the token its connection announces
    closed: bool = False  # its connection reached end of file
    idle_since: float = field(default_factory=time.monotonic)
    queued: Task | None = None  # a task for ``trial``, sent when the worker says ``ready`` (see LocalLauncher.start)


def send(w: WorkerHandle, msg: Message) -> bool:
    """Send ``msg`` to ``w``; False when it cannot be delivered (not connected yet, or died)."""
    if w.conn is None:
        return False
    try:
        w.conn.send(msg)
        return True
    except (OSError, ValueError):  # the worker died; the driver's reaping handles it
        return False


class Launcher(ABC):
    """Common worker bookkeeping. Subclasses implement ``start`` and may override the pool hooks."""

    def __init__(self):
        self.workers: list[WorkerHandle] = []
        self.stop_requested = lambda: False  # set by the driver: True once it was told to stop (a signal)

    def warm_target(self, device) -> int:
        """Workers kept alive on ``device`` while idle (0: none)."""
        return 0

    def start_blocks(self) -> bool:
        """True when starting a process blocks the caller until a server has imported its preload
        (``forkserver``): the driver then starts the warm pool from a thread while it works."""
        return False

    def warm_up(self, devices, limit_s: float, idle=None) -> float:
        """Prepare workers before the clock starts; return the seconds it took. ``idle()`` is called while
        waiting (the driver samples and estimates its first trials meanwhile) until it returns False
        (nothing more to do)."""
        return 0.0

    def replenish(self, devices) -> None:
        """Called every tick: keep the warm pools at their size."""

    def on_ready(self, w: WorkerHandle) -> None:
        """``w`` said ``ready``: mark it and send it the task queued for it, if any."""
        w.ready = True
        if w.queued is not None:
            task, w.queued = w.queued, None
            send(w, RunTask(task=task))  # if this fails the worker is dead: the driver's reaping retries the trial

    def connect(self) -> None:
        """Called every tick: attach channels of workers that connected since."""

    def idle_ready(self, like: WorkerHandle) -> WorkerHandle | None:
        """A ready idle worker that could take the task queued on ``like`` now (see
        :meth:`LocalLauncher.idle_ready`); None by default (a Ray task is not reused this way)."""
        return None

    @abstractmethod
    def start(self, device, task: Task, sm_percent: int, fraction: float) -> WorkerHandle:
        """Run ``task`` on ``device``; ``sm_percent`` is the MPS cap, ``fraction`` the policy's GPU share."""

    def stop_idle(self, devices_by_id: dict) -> None:
        """Stop workers beyond their device's warm pool that have been idle for 10 s."""
        for w in self.workers:
            if w.trial is not None or w.stopping or time.monotonic() - w.idle_since <= IDLE_WORKER_S:
                continue
            dev = devices_by_id.get(w.device_id)
            have = sum(x.device_id == w.device_id and not x.stopping for x in self.workers)
            if have > (self.warm_target(dev) if dev is not None else 0):
                w.stopping = True
                send(w, Stop())

    def shutdown(self, limit_s: float = 3.0) -> None:
        """Stop every worker: a stop message to all, then one shared deadline of ``limit_s`` seconds for all
        of them (not one per worker: 4 busy workers took 21.7 s one after another), then kill the rest;
        idempotent."""
        for w in self.workers:
            send(w, Stop())
        deadline = time.monotonic() + limit_s
        for w in self.workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.proc.is_alive():
                w.proc.kill()
        for w in self.workers:
            w.proc.join(2)
        self.workers.clear()


class LocalLauncher(Launcher):
    """Worker processes on this host (:func:`worker_context`), reused across trials, with a warm pool per GPU.

    Args:
        spec: the study as a plain dict (with absolute ``storage`` and ``run_dir``), sent to workers.
        warm_workers: ``"auto"`` or an int per device (see module docstring).
        concurrency: the policy's most trials per device (``max_concurrency()``), for ``auto``.
    """

    def __init__(self, spec: dict, warm_workers: int | str, concurrency: int):
        super().__init__()
        self.spec, self.warm_workers, self.concurrency = spec, warm_workers, concurrency
        self.ctx = worker_context()

    def warm_target(self, device) -> int:
        if self.warm_workers == "auto":
            return min(WARM_AUTO_MAX, self.concurrency) if device.torch_device.startswith("cuda") else 0
        return int(self.warm_workers)

    def start_blocks(self) -> bool:
        return self.ctx.get_start_method() == "forkserver"

    def _spawn(self, device, sm_percent: int = 100) -> WorkerHandle:
        from hpdl.hpo.worker import worker_main

        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=worker_main, daemon=True, name=f"hpdl-hpo-worker-{device.id}",
                                args=(child, device.__dict__, self.spec, sm_percent, time.time(), dict(os.environ)))
        if self.ctx.get_start_method() == "spawn":  # a fresh interpreter: Ctrl-C must not kill its start-up
            from hpdl.hpo._prestart import children_ignore_sigint

            with children_ignore_sigint():
                proc.start()
        else:  # forked from the forkserver, which ignores SIGINT (hpdl.hpo._preload)
            proc.start()
        child.close()
        w = WorkerHandle(proc, parent, device.id, sm_percent)
        self.workers.append(w)
        return w

    def replenish(self, devices) -> None:
        for d in devices:
            have = sum(w.device_id == d.id and not w.stopping for w in self.workers)
            for _ in range(self.warm_target(d) - have):
                self._spawn(d)

    def warm_up(self, devices, limit_s: float, idle=None) -> float:
        """Start the warm pool on every device and wait until each worker said ``ready``, calling ``idle()``
        between waits (see :meth:`Launcher.warm_up`).

        Raises:
            HpoError: a worker died during start-up, or the pool was not ready within ``limit_s``.
        """
        t0 = time.monotonic()
        self.replenish(devices)
        busy = idle is not None
        while not all(w.ready for w in self.workers) and not self.stop_requested():
            timeout = 0.0 if busy else 0.2
            for conn in mp_wait([w.conn for w in self.workers if not w.ready], timeout=timeout):
                w = next(x for x in self.workers if x.conn is conn)
                try:
                    msg = check(w.conn.recv())
                    if isinstance(msg, Ready):
                        w.startup = dict(msg.startup)
                        self.on_ready(w)
                except (EOFError, OSError):
                    raise HpoError(f"warm worker on {w.device_id} died during start-up "
                                   f"(exit code {w.proc.exitcode})") from None
            if time.monotonic() - t0 > limit_s:
                raise HpoError(f"warm worker pool not ready after {limit_s:.0f} s "
                               f"({sum(w.ready for w in self.workers)}/{len(self.workers)} ready)")
            if busy and not all(w.ready for w in self.workers):
                busy = bool(idle())
        return time.monotonic() - t0

    def start(self, device, task: Task, sm_percent: int = 100, fraction: float = 1.0) -> WorkerHandle:
        """Run ``task`` on an idle ready worker of ``device``; else queue it on one still starting, or on a
        new one. A queued task is sent when its worker says ``ready``; until then the driver may move it
        to a worker that became idle sooner (:meth:`idle_ready`): a cold start takes seconds (2.5-3.5 s
        with eight others starting under MPS on an H200) while warm workers finish trials."""
        idle = [w for w in self.workers if w.trial is None and not w.stopping and w.device_id == device.id
                and w.sm_percent == sm_percent and w.proc.is_alive()]
        w = max(idle, key=lambda x: x.ready, default=None) or self._spawn(device, sm_percent)
        if w.ready:
            send(w, RunTask(task=task))  # if this fails the worker is dead: the driver's reaping retries the trial
        else:
            w.queued = task
        return w

    def idle_ready(self, like: WorkerHandle) -> WorkerHandle | None:
        """A ready, idle, live worker on the device (and with the MPS cap) of ``like``, or None."""
        return next((w for w in self.workers if w.ready and w.trial is None and not w.stopping
                     and w.queued is None and w.device_id == like.device_id and w.sm_percent == like.sm_percent
                     and w.proc.is_alive()), None)
