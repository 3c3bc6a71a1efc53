"""Fault handling, the driver's second job: worker messages and their outcomes, dead workers, failures and
retries through the ledger, and stopping (SIGINT/SIGTERM, errors): every worker told at once, running
trials re-queued without spending an attempt. Mixed into :class:`hpdl.hpo.driver.Driver`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from multiprocessing.connection import wait as mp_wait

from hpdl.hpo import protocol
from hpdl.hpo.errors import HpoError, HpoInterrupted
from hpdl.hpo.launch import WorkerHandle, send
from hpdl.hpo.profiler import TrialProfile
from hpdl.hpo.scheduler import SMALL_BYTES

from hpdl.hpo.placement import _Group, _Trial, members

_OUTCOMES = (protocol.Done, protocol.Pruned, protocol.Halted, protocol.Failed)

_PREEMPT_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 3.0  # SIGINT/SIGTERM: workers get this long to checkpoint; the driver exits within 5 s
_START_FAILURES_MAX = 3  # workers of one device (and MPS cap) in a row dying before ready: the device is left out


class FaultsMixin:
    """Messages, reaping, failures and stopping of :class:`hpdl.hpo.driver.Driver`."""

    def _on_message(self, w: WorkerHandle, msg: protocol.Message) -> None:
        """Handle one record from ``w`` (see :mod:`hpdl.hpo.protocol`); a record about a trial other than the
        one ``w`` runs now (a late one) is ignored."""
        protocol.check(msg)
        t = w.trial
        if isinstance(msg, protocol.Ready):
            self._start_failures.pop((w.device_id, w.sm_percent), None)
            self.launcher.on_ready(w)
            return
        if isinstance(t, _Group) and isinstance(msg, _OUTCOMES):
            self._on_member(w, t, msg)
            return
        if t is None or not isinstance(msg, protocol.TrialMessage) or msg.trial_id != t.trial_id:
            return
        if isinstance(msg, protocol.PeakMemory):  # the whole run's peak (evaluations included): plan with it
            prof = self.profiles.get(t.skey, msg.kind)
            if prof is not None and prof.measured and msg.bytes > prof.memory_bytes:
                prof.memory_bytes = int(msg.bytes)
                self.profiles.put(t.skey, prof)
            return
        if isinstance(msg, protocol.ProfileReport):
            prof = TrialProfile(**msg.profile)
            old = self.profiles.get(t.skey, prof.kind)
            if old is not None and old.measured and old.memory_bytes > prof.memory_bytes:
                prof.memory_bytes = old.memory_bytes  # a sibling's whole-run peak or an OOM's 1.5x stays
            self.profiles.put(t.skey, prof)
            st = self.profiles.get(t.skey, "static")
            ratio = prof.memory_bytes / st.memory_bytes if st is not None and st.memory_bytes > SMALL_BYTES else 0.0
            self.policy.observe(prof.compute, prof.flops, ratio, prof.step_time_s)
            t.demand = self._demand(t, {prof.kind})
            return
        self.running.pop(t.number, None)
        w.trial, w.idle_since = None, time.monotonic()
        self._outcome(w, t, msg)

    def _on_member(self, w: WorkerHandle, g: _Group, msg: protocol.TrialMessage) -> None:
        """The outcome of one trial of fused group ``g``: it leaves the group (the others train on); the worker
        is free once the last one left. A failure of the whole group arrives as one per trial; the worker
        then exits, so it gets no further trial."""
        m = next((x for x in g.members if x.trial_id == msg.trial_id), None)
        if m is None:
            return  # a late record
        g.members.remove(m)
        if not g.members:
            self.running.pop(g.number, None)
            w.trial, w.idle_since = None, time.monotonic()
            w.stopping = w.stopping or isinstance(msg, protocol.Failed)
        if isinstance(msg, protocol.Failed) and msg.kind == "oom" and not g.oom_seen:
            g.oom_seen = True  # once per group, not once per trial
            self._grow_after_oom(g)
        self._outcome(w, m, msg, in_group=True)

    def _grow_after_oom(self, t: _Trial) -> None:
        """The profile under-estimated: never place this configuration (or group size) so tightly again."""
        for k, p in self.profiles.items():
            if k.endswith("|" + t.skey):
                p.memory_bytes = int(p.memory_bytes * 1.5)
                self.profiles.put(t.skey, p)

    def _outcome(self, w: WorkerHandle, t: _Trial, msg: protocol.TrialMessage, in_group: bool = False) -> None:
        """Tell the store trial ``t``'s outcome ``msg`` (retry, re-queue or stop as its kind says)."""
        from optuna.trial import TrialState

        if isinstance(msg, protocol.Done) and math.isnan(msg.value):  # diverged: Optuna cannot complete a NaN
            self.ledger.fail(t.number, t.params, {"hpdl_lineage": t.lineage}, "nan", "objective returned NaN",
                             retry=False)
        elif isinstance(msg, (protocol.Done, protocol.Pruned)):
            done = isinstance(msg, protocol.Done)
            self.ledger.tell(t.number, msg.value if done else None, TrialState.COMPLETE if done else TrialState.PRUNED)
            self.ledger.closed(t.lineage)
            if done:
                self._improve(msg.value)
        elif isinstance(msg, protocol.Halted) and self._stopping:  # checkpointed because this driver stops
            self._release(t, "interrupted", "the driver stopped; checkpointed and re-queued")
        elif isinstance(msg, protocol.Halted):
            self.preempted += 1
            self._requeue(t)
        elif isinstance(msg, protocol.Failed):
            if not in_group:  # a group's worker is marked once its last trial left (_on_member)
                w.stopping = True  # a worker exits after a failure: never give it another trial
                if msg.kind == "oom":
                    self._grow_after_oom(t)
            if msg.kind == "checkpoint_write":
                # the run folder cannot take checkpoints (removed, read-only, full): every trial would fail
                # alike and spend its configuration's attempts; re-queue this one as it was and stop the study
                self._release(t, "checkpoint_write", msg.message)
                if self._fatal is None:
                    self._fatal = HpoError(
                        f"study {self.spec.study!r} stopped: {msg.message.strip().splitlines()[-1]}; its running "
                        "trials were re-queued without spending an attempt; make the checkpoint folder "
                        f"{str(self.checkpoint_dir)!r} writable again, then `hpdl hpo resume`")
                return
            if msg.kind == "checkpoint":  # someone else's checkpoint on its path: loud, and never retried
                logging.getLogger("hpdl.hpo").error("trial %d: %s", t.number, msg.message)
            self.ledger.fail(t.number, t.params, {"hpdl_lineage": t.lineage, "hpdl_attempt": t.attempt},
                             msg.kind, msg.message, retry=msg.kind != "checkpoint")

    def _reap(self) -> None:
        """Dead workers: a trial they ran failed (``died``) and is retried, or, if it was being preempted,
        goes back to the queue; a trial queued on a worker that died before ``ready`` goes back to the
        queue too (it never started). After ``_START_FAILURES_MAX`` such deaths in a row on one device (and
        MPS cap) the device is left out, its trials move elsewhere as for a removed device, and
        :class:`HpoError` is raised when no device is left; idle workers beyond the warm pool are stopped."""
        self.launcher.stop_idle(self._by_id)
        for w in list(self.workers):
            t = w.trial
            if t is not None and t.preempt_at and time.monotonic() - t.preempt_at > _PREEMPT_TIMEOUT_S:
                w.proc.kill()  # did not stop after a preempt request: it continues elsewhere from its checkpoint
                w.proc.join(5)
            if w.proc.is_alive():
                continue
            self._drain(w)  # it may have sent its outcome ("done", ...) after this tick read its channel
            t = w.trial
            self.workers.remove(w)
            if not w.ready and not w.stopping and (t is None or w.queued is not None):
                # a local worker that died during its start-up: its task, if any, was never sent
                if t is not None:  # the trial waits for another worker
                    self._requeue(t)
                key = (w.device_id, w.sm_percent)
                self._start_failures[key] = n = self._start_failures.get(key, 0) + 1
                if n >= _START_FAILURES_MAX and w.device_id not in self._broken:
                    self._broken.add(w.device_id)  # its trials move elsewhere, as for a removed device
                    logging.getLogger("hpdl.hpo").error(
                        "%d workers on %s in a row died during start-up (last exit code %s): device left out",
                        n, w.device_id, w.proc.exitcode)
                    if not {d.id for d in self.pool.devices()} - self._broken:
                        raise HpoError(f"every device's workers die during start-up (last: {n} in a row on "
                                       f"{w.device_id}, exit code {w.proc.exitcode})")
                continue
            if t is not None:
                self.running.pop(t.number, None)
                if t.preempt_at:  # killed on purpose after a preempt timeout: run it elsewhere
                    self._requeue(t)
                else:
                    for m in members(t):  # every trial of a fused group died with it
                        self.ledger.fail(m.number, m.params, {"hpdl_lineage": m.lineage, "hpdl_attempt": m.attempt},
                                         "died", f"worker exited with code {w.proc.exitcode}")

    def _drain(self, w: WorkerHandle) -> None:
        """Handle what a worker whose process ended left in its channel, up to end of file. A Ray task's
        channel may not be attached yet (its hello arrived after this tick's ``connect``): attach it first."""
        if w.conn is None:
            self.launcher.connect()
        if w.conn is None or w.closed:
            return
        try:
            while w.conn.poll(0.5):  # the peer is gone: EOF follows its last message at once
                self._on_message(w, w.conn.recv())
        except (EOFError, OSError):
            pass
        w.closed = True

    def _catch_signals(self) -> dict:
        """SIGINT and SIGTERM set a flag the loop checks every tick (a handler that raised could cut a
        storage write in two); only from the main thread, where Python delivers signals."""
        self._signal, self._t_signal = None, 0.0
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum, _frame):
            if self._signal is None:
                self._signal, self._t_signal = signum, time.monotonic()
                if self.exit_deadline_s is not None:
                    self._watchdog = threading.Timer(self.exit_deadline_s, self._force_exit)
                    self._watchdog.daemon = True
                    self._watchdog.start()

        return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _restore_signals(self, previous: dict) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for sig, h in previous.items():
            signal.signal(sig, h)

    def _force_exit(self) -> None:
        """The stop did not finish by ``exit_deadline_s`` (the main thread is inside a blocking call): kill
        the workers, release the lock and end the process with the signal's status."""
        import sys

        for w in list(self.workers):
            with contextlib.suppress(Exception):
                w.proc.kill()
        self.lock.release()
        print(f"hpdl hpo: interrupted by {signal.Signals(self._signal).name}: study {self.spec.study!r}: the "
              f"driver did not stop within {self.exit_deadline_s:.1f} s; its workers were killed and "
              f"{len(self.running) + len(self.pending)} trials left for a resume to re-queue (no attempt spent); "
              "`hpdl hpo resume` continues", file=sys.stderr, flush=True)
        os._exit(128 + self._signal)

    def _interrupted(self, stopped: int, took_s: float) -> HpoInterrupted:
        name = signal.Signals(self._signal).name
        finished, _ = self.ledger.lineages(0.0)
        best = self.result().best_value
        return HpoInterrupted(
            f"interrupted by {name}: study {self.spec.study!r}: stopped {stopped} running trials in {took_s:.1f} s "
            f"(checkpointed and back to WAITING, no attempt spent), {len(finished)}/{self.spec.n_trials} "
            f"configurations finished, best {best}; `hpdl hpo resume` continues", self._signal)

    def _stop_workers(self, limit_s: float = _STOP_TIMEOUT_S) -> int:
        """Tell every worker at once to checkpoint and stop, handle what they answer for ``limit_s`` seconds,
        kill those still alive, and re-queue every trial that was running (``interrupted``: no attempt spent;
        each continues from its configuration's last checkpoint). Returns the number of trials stopped."""
        n = len(self.running)
        self._stopping = True
        workers = list(self.workers)
        for w in workers:
            w.stopping = True
            send(w, protocol.Stop())
        deadline = time.monotonic() + limit_s
        while self.running and time.monotonic() < deadline:
            conns = [w.conn for w in workers if w.conn is not None and not w.closed]
            for conn in mp_wait(conns, timeout=0.05) if conns else ():
                w = next(x for x in workers if x.conn is conn)
                try:
                    while w.conn.poll():
                        self._on_message(w, w.conn.recv())
                except (EOFError, OSError):
                    w.closed = True
            if not conns:
                time.sleep(0.05)
        for w in workers:
            if w.proc.is_alive():
                w.proc.kill()  # past the deadline: its last periodic checkpoint is what it continues from
        for t in list(self.running.values()):
            if t.worker is not None and t.worker.queued is not None:
                continue  # never started: _release_pending re-queues it as not_started
            self.running.pop(t.number, None)
            self._release(t, "interrupted", "the driver stopped while it ran; continues from its last checkpoint")
        return n

    def _release(self, t: _Trial, kind: str, why: str) -> None:
        """Fail ``t`` as ``kind`` (one of :data:`hpdl.hpo.ledger.REQUEUE_KINDS`) and re-queue its
        configuration with the same attempt number (each trial of a fused group)."""
        for m in members(t):
            self.ledger.fail(m.number, m.params, {"hpdl_lineage": m.lineage, "hpdl_attempt": m.attempt}, kind, why)

    def _release_pending(self) -> None:
        """After an error (e.g. the pool did not start, a timeout): trials that wait to start or to continue
        (pending, or queued on a worker that was still starting) are failed ``not_started`` and re-queued
        as they were (not an attempt), instead of staying RUNNING in the storage until a resume. Stops at
        the first storage error (a locked store would make every write wait out its timeout)."""
        waiting = list(self.pending) + [t for t in self.running.values()
                                        if t.worker is not None and t.worker.queued is not None]
        for i, t in enumerate(waiting):
            try:
                self.running.pop(t.number, None)
                self._release(t, "not_started", "the driver stopped before it started (its checkpoint, if any, "
                                                "is kept)")
            except Exception as exc:  # noqa: BLE001 - the error that stopped the study matters more
                logging.getLogger("hpdl.hpo").warning("%d trials left RUNNING (a resume re-queues them): %r",
                                                      len(waiting) - i, exc)
                break
        self.pending.clear()

