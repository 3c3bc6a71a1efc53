"""How trials end and how the driver stops. :class:`FaultHandler` tells the store each trial's outcome and
handles what goes wrong: failures retried through the ledger, dead workers (a trial's death, or a worker
that died starting, which after three in a row leaves its device out), preempted trials re-queued, and
the stop on a signal or an error (every worker told at once, running trials re-queued without spending an
attempt). :class:`StopSignals` turns SIGINT/SIGTERM into a flag the driver's loop reads.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait as mp_wait

from hpdl.hpo import messages
from hpdl.hpo.errors import HpoError
from hpdl.hpo.launch import WorkerHandle, send
from hpdl.hpo.runs import FusedGroup, TrialQueue, TrialRun, members

OUTCOMES = (messages.Done, messages.Pruned, messages.Halted, messages.Failed)

_PREEMPT_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 3.0  # SIGINT/SIGTERM: workers get this long to checkpoint; the driver exits within 5 s
_START_FAILURES_MAX = 3  # workers of one device (and MPS cap) in a row dying before ready: the device is left out

_log = logging.getLogger("hpdl.hpo")


class FaultHandler:
    """Ends trials and recovers from failures (see module docstring). Not thread-safe.

    Args:
        queue: the driver's trial queue (a trial leaves ``running`` here, or goes back to ``pending``).
        ledger: the study's :class:`hpdl.hpo.ledger.Ledger`: tells, failures, retries, re-queues.
        launcher: the worker processes (:mod:`hpdl.hpo.launch`).
        placement: its :meth:`~hpdl.hpo.placement.Placement.grow_after_oom` learns from an out-of-memory failure.
        on_message: the driver's handler of one worker message (what a dead or stopping worker left in its
            channel goes through it, like any other message).
        on_value: called with each completed trial's value (the driver's best-so-far history).
        pool_ids: the ids of the pool's devices now (the study fails once every one is left out).
        study_name, checkpoint_dir: for the message that stops a study whose checkpoints cannot be written.

    Attributes:
        broken: ids of devices left out after ``_START_FAILURES_MAX`` workers in a row died starting there.
        preempted: trials stopped with a checkpoint and re-queued to continue elsewhere.
        fatal: an error a message raised that must stop the study (the driver's loop raises it).
        stopping: set by :meth:`stop_workers`: a trial checkpointed from then on is re-queued, not preempted.
    """

    def __init__(self, queue: TrialQueue, ledger, launcher, placement, on_message: Callable,
                 on_value: Callable[[float], None], pool_ids: Callable[[], set[str]], study_name: str,
                 checkpoint_dir):
        self.queue, self.ledger, self.launcher, self.placement = queue, ledger, launcher, placement
        self.on_message, self.on_value, self.pool_ids = on_message, on_value, pool_ids
        self.study_name, self.checkpoint_dir = study_name, checkpoint_dir
        self.broken: set[str] = set()
        self.preempted = 0
        self.fatal: HpoError | None = None
        self.stopping = False
        self._start_failures: dict[tuple[str, int], int] = {}  # (device id, MPS cap) -> deaths before ready in a row

    # -- outcomes

    def worker_ready(self, w: WorkerHandle) -> None:
        """``w`` finished its start-up: deaths before ready on its device count from zero again."""
        self._start_failures.pop((w.device_id, w.sm_percent), None)

    def outcome(self, w: WorkerHandle, t: TrialRun, msg: messages.TrialMessage) -> None:
        """``t`` (run by ``w``) ended with ``msg``: it leaves the running set, ``w`` is free (or, after a
        failure, exits), and the store is told (retry, re-queue or stop as the kind says)."""
        self.queue.running.pop(t.number, None)
        w.trial, w.idle_since = None, time.monotonic()
        self._tell(w, t, msg)

    def member_outcome(self, w: WorkerHandle, g: FusedGroup, msg: messages.TrialMessage) -> None:
        """The outcome of one trial of fused group ``g``: it leaves the group (the others train on); the worker
        is free once the last one left. A failure of the whole group arrives as one per trial; the worker
        then exits, so it gets no further trial."""
        m = next((x for x in g.members if x.trial_id == msg.trial_id), None)
        if m is None:
            return  # a late record
        g.members.remove(m)
        if not g.members:
            self.queue.running.pop(g.number, None)
            w.trial, w.idle_since = None, time.monotonic()
            w.stopping = w.stopping or isinstance(msg, messages.Failed)
        if isinstance(msg, messages.Failed) and msg.kind == "oom" and not g.oom_seen:
            g.oom_seen = True  # once per group, not once per trial
            self.placement.grow_after_oom(g)
        self._tell(w, m, msg, in_group=True)

    def _tell(self, w: WorkerHandle, t: TrialRun, msg: messages.TrialMessage, in_group: bool = False) -> None:
        """Tell the store trial ``t``'s outcome ``msg`` (retry, re-queue or stop as its kind says)."""
        from optuna.trial import TrialState

        if isinstance(msg, messages.Done) and math.isnan(msg.value):  # diverged: Optuna cannot complete a NaN
            self.ledger.fail(t.number, t.params, {"hpdl_lineage": t.lineage}, "nan", "objective returned NaN",
                             retry=False)
        elif isinstance(msg, (messages.Done, messages.Pruned)):
            done = isinstance(msg, messages.Done)
            self.ledger.tell(t.number, msg.value if done else None, TrialState.COMPLETE if done else TrialState.PRUNED)
            self.ledger.closed(t.lineage)
            if done:
                self.on_value(msg.value)
        elif isinstance(msg, messages.Halted) and self.stopping:  # checkpointed because this driver stops
            self.release(t, "interrupted", "the driver stopped; checkpointed and re-queued")
        elif isinstance(msg, messages.Halted):
            self.preempted += 1
            self.queue.requeue(t)
        elif isinstance(msg, messages.Failed):
            if not in_group:  # a group's worker is marked once its last trial left (member_outcome)
                w.stopping = True  # a worker exits after a failure: never give it another trial
                if msg.kind == "oom":
                    self.placement.grow_after_oom(t)
            if msg.kind == "checkpoint_write":
                # the run folder cannot take checkpoints (removed, read-only, full): every trial would fail
                # alike and spend its configuration's attempts; re-queue this one as it was and stop the study
                self.release(t, "checkpoint_write", msg.message)
                if self.fatal is None:
                    self.fatal = HpoError(
                        f"study {self.study_name!r} stopped: {msg.message.strip().splitlines()[-1]}; its running "
                        "trials were re-queued without spending an attempt; make the checkpoint folder "
                        f"{str(self.checkpoint_dir)!r} writable again, then `hpdl hpo resume`")
                return
            if msg.kind == "checkpoint":  # someone else's checkpoint on its path: loud, and never retried
                _log.error("trial %d: %s", t.number, msg.message)
            self.ledger.fail(t.number, t.params, {"hpdl_lineage": t.lineage, "hpdl_attempt": t.attempt},
                             msg.kind, msg.message, retry=msg.kind != "checkpoint")

    # -- dead workers

    def reap(self, devices_by_id: dict) -> None:
        """Dead workers: a trial they ran failed (``died``) and is retried, or, if it was being preempted,
        goes back to the queue; a trial queued on a worker that died before ``ready`` goes back to the
        queue too (it never started). After ``_START_FAILURES_MAX`` such deaths in a row on one device (and
        MPS cap) the device is left out (:attr:`broken`), and :class:`HpoError` is raised when no device of
        the pool is left; idle workers beyond the warm pool of ``devices_by_id`` are stopped."""
        self.launcher.stop_idle(devices_by_id)
        workers = self.launcher.workers
        for w in list(workers):
            t = w.trial
            if t is not None and t.preempt_at and time.monotonic() - t.preempt_at > _PREEMPT_TIMEOUT_S:
                w.proc.kill()  # did not stop after a preempt request: it continues elsewhere from its checkpoint
                w.proc.join(5)
            if w.proc.is_alive():
                continue
            self.drain(w)  # it may have sent its outcome ("done", ...) after this tick read its channel
            t = w.trial
            workers.remove(w)
            if not w.ready and not w.stopping and (t is None or w.queued is not None):
                # a local worker that died during its start-up: its task, if any, was never sent
                if t is not None:  # the trial waits for another worker
                    self.queue.requeue(t)
                self._start_failed(w)
                continue
            if t is not None:
                self.queue.running.pop(t.number, None)
                if t.preempt_at:  # killed on purpose after a preempt timeout: run it elsewhere
                    self.queue.requeue(t)
                else:
                    for m in members(t):  # every trial of a fused group died with it
                        self.ledger.fail(m.number, m.params, {"hpdl_lineage": m.lineage, "hpdl_attempt": m.attempt},
                                         "died", f"worker exited with code {w.proc.exitcode}")

    def _start_failed(self, w: WorkerHandle) -> None:
        key = (w.device_id, w.sm_percent)
        self._start_failures[key] = n = self._start_failures.get(key, 0) + 1
        if n >= _START_FAILURES_MAX and w.device_id not in self.broken:
            self.broken.add(w.device_id)  # its trials move elsewhere, as for a removed device
            _log.error("%d workers on %s in a row died during start-up (last exit code %s): device left out",
                       n, w.device_id, w.proc.exitcode)
            if not self.pool_ids() - self.broken:
                raise HpoError(f"every device's workers die during start-up (last: {n} in a row on "
                               f"{w.device_id}, exit code {w.proc.exitcode})")

    def drain(self, w: WorkerHandle) -> None:
        """Handle what a worker whose process ended left in its channel, up to end of file. A Ray task's
        channel may not be attached yet (its hello arrived after this tick's ``connect``): attach it first."""
        if w.conn is None:
            self.launcher.connect()
        if w.conn is None or w.closed:
            return
        try:
            while w.conn.poll(0.5):  # the peer is gone: EOF follows its last message at once
                self.on_message(w, w.conn.recv())
        except (EOFError, OSError):
            pass
        w.closed = True

    # -- stopping

    def stop_workers(self, limit_s: float = _STOP_TIMEOUT_S) -> int:
        """Tell every worker at once to checkpoint and stop, handle what they answer for ``limit_s`` seconds,
        kill those still alive, and re-queue every trial that was running (``interrupted``: no attempt spent;
        each continues from its configuration's last checkpoint). Returns the number of trials stopped."""
        running = self.queue.running
        n = len(running)
        self.stopping = True
        workers = list(self.launcher.workers)
        for w in workers:
            w.stopping = True
            send(w, messages.Stop())
        deadline = time.monotonic() + limit_s
        while running and time.monotonic() < deadline:
            conns = [w.conn for w in workers if w.conn is not None and not w.closed]
            for conn in mp_wait(conns, timeout=0.05) if conns else ():
                w = next(x for x in workers if x.conn is conn)
                try:
                    while w.conn.poll():
                        self.on_message(w, w.conn.recv())
                except (EOFError, OSError):
                    w.closed = True
            if not conns:
                time.sleep(0.05)
        for w in workers:
            if w.proc.is_alive():
                w.proc.kill()  # past the deadline: its last periodic checkpoint is what it continues from
        for t in list(running.values()):
            if t.worker is not None and t.worker.queued is not None:
                continue  # never started: release_pending re-queues it as not_started
            running.pop(t.number, None)
            self.release(t, "interrupted", "the driver stopped while it ran; continues from its last checkpoint")
        return n

    def release(self, t: TrialRun, kind: str, why: str) -> None:
        """Fail ``t`` as ``kind`` (one of :data:`hpdl.hpo.ledger.REQUEUE_KINDS`) and re-queue its
        configuration with the same attempt number (each trial of a fused group)."""
        for m in members(t):
            self.ledger.fail(m.number, m.params, {"hpdl_lineage": m.lineage, "hpdl_attempt": m.attempt}, kind, why)

    def release_pending(self) -> None:
        """After an error (e.g. the pool did not start, a timeout): trials that wait to start or to continue
        (pending, or queued on a worker that was still starting) are failed ``not_started`` and re-queued
        as they were (not an attempt), instead of staying RUNNING in the storage until a resume. Stops at
        the first storage error (a locked store would make every write wait out its timeout)."""
        waiting = list(self.queue.pending) + [t for t in self.queue.running.values()
                                              if t.worker is not None and t.worker.queued is not None]
        for i, t in enumerate(waiting):
            try:
                self.queue.running.pop(t.number, None)
                self.release(t, "not_started", "the driver stopped before it started (its checkpoint, if any, "
                                               "is kept)")
            except Exception as exc:  # noqa: BLE001 - the error that stopped the study matters more
                _log.warning("%d trials left RUNNING (a resume re-queues them): %r", len(waiting) - i, exc)
                break
        self.queue.pending.clear()


class StopSignals:
    """SIGINT and SIGTERM set :attr:`signum` (and :attr:`since`, monotonic), which the driver's loop checks
    every tick: a handler that raised could cut a storage write in two. Handlers are installed only from the
    main thread, where Python delivers signals.

    Args:
        exit_deadline_s: if not None, ``force_exit(signum)`` runs in a timer thread this long after the first
            signal, in case the loop is stuck in a blocking call and never gets to stop.
    """

    def __init__(self, exit_deadline_s: float | None = None, force_exit: Callable[[int], None] | None = None):
        self.exit_deadline_s, self.force_exit = exit_deadline_s, force_exit
        self.signum: int | None = None
        self.since = 0.0
        self._watchdog: threading.Timer | None = None
        self._previous: dict = {}

    def catch(self) -> None:
        """Install the handlers (main thread only); :meth:`restore` puts the previous ones back."""
        self.signum, self.since = None, 0.0
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, _frame):
            if self.signum is None:
                self.signum, self.since = signum, time.monotonic()
                if self.exit_deadline_s is not None and self.force_exit is not None:
                    self._watchdog = threading.Timer(self.exit_deadline_s, self.force_exit, (signum,))
                    self._watchdog.daemon = True
                    self._watchdog.start()

        self._previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for sig, h in self._previous.items():
            signal.signal(sig, h)
        self._previous = {}
