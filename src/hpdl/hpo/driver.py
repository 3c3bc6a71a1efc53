"""The study driver: samples trials with Optuna, places them with a policy, runs them in worker processes,
and recovers from every failure it can see.

Loop (one thread; every wait has a timeout): read the pool (elasticity) -> drain worker messages ->
reap dead workers -> ``policy.place`` the sampled trials -> start assignments -> sample more while the
budget allows -> render progress. The Optuna storage is the source of truth: a driver that was killed is
restarted with ``resume=True`` and finishes the same budget (trials it left RUNNING are marked FAIL and
retried from their configuration's last checkpoint; their processes died with it).

Budget: ``n_trials`` configurations ("lineages"). A configuration is finished when one attempt completes
or is pruned, or after ``max_retries`` failed retries. Retries are ``study.enqueue_trial`` with the same
parameters and ``user_attrs`` ``hpdl_lineage`` / ``hpdl_attempt``, so the sampler never sees a duplicate. A
sampler that calls ``study.stop()`` ends it early: no new configuration is asked, and the study finishes
with what runs (``sampler: grid`` needs ``n_trials`` <= its points, so it never gets there).

Processes come from a launcher (:mod:`hpdl.hpo.launch`): local worker processes with a warm pool per GPU,
or Ray tasks (:mod:`hpdl.hpo.ray_backend`). Wall time counts from the moment the warm pool is ready.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import signal
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Any

from hpdl.hpo._prestart import start_forkserver
from hpdl.hpo.checkpoint import check_writable, checkpoint_dir
from hpdl.hpo.errors import HpoError, HpoInterrupted
from hpdl.hpo.launch import WARM_MAX, WARM_TIMEOUT_S, LocalLauncher, WorkerHandle, send
from hpdl.hpo.ledger import Ledger
from hpdl.hpo.lock import StudyLock
from hpdl.hpo.pool import PoolSource
from hpdl.hpo.profiler import CONTEXT_BYTES, ProfileCache, TrialProfile, static_profile
from hpdl.hpo.scheduler import SMALL_BYTES, DeviceState, TrialDemand, get_policy, mps_active
from hpdl.hpo.spec import StudySpec, make_pruner, make_sampler, make_storage, sqlite_path
from hpdl.hpo.workloads import get_workload

_PREEMPT_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 3.0  # SIGINT/SIGTERM: workers get this long to checkpoint; the driver exits within 5 s
_START_FAILURES_MAX = 3  # workers of one device (and MPS cap) in a row dying before ready: the device is left out
_ESTIMATE_BUDGET_S = 0.05  # static estimates per loop tick: dispatch what is known instead of waiting for all
_SAMPLE_BUDGET_S = 0.05  # asks per loop tick after the first (each is ~6 storage commits): start early
_BUDGET_READ_S = 0.05  # when the budget limits the asks, count from a storage read at most this old


@dataclass
class _Trial:
    number: int
    trial_id: int
    lineage: int
    params: dict
    skey: str
    since: float
    device_id: str = ""
    worker: Any = None
    demand: TrialDemand | None = None
    preempt_at: float = 0.0
    priority: float = 0.0
    attempt: int = 0  # failed attempts of its configuration before this one (user attribute hpdl_attempt)


@dataclass
class StudyResult:
    """Outcome of :func:`run_study`. ``history`` is ``[(elapsed_s, best_value)]`` at each improvement;
    ``failures`` counts the trials' own failed attempts by kind (``oom``, ``error``, ``died``, ``too_big``,
    ``checkpoint``: someone else's checkpoint on its path, not retried; ``nan``: the objective returned
    NaN, not retried); ``requeued`` counts trials a driver stopped and re-queued without spending an
    attempt (``driver_died``: found running by ``resume`` after a kill; ``interrupted``: SIGINT/SIGTERM or an
    error of the driver);
    ``preempted`` counts trials stopped with a checkpoint and continued elsewhere (device removed, or
    migrated by ``pack_hetero`` to a faster GPU). ``wall_s`` runs from the moment the warm worker pool was
    ready (``started_at``, Unix time) until the budget finished; ``warmup_s`` is the time the pool took before
    that and ``teardown_s`` the time to stop the workers (and an MPS daemon) after it. ``warmup_phases`` gives,
    per start-up phase of the warm workers (``spawn``, ``import``, ``cuda``, ``optimizer``, ``study``,
    ``ready``; see :class:`hpdl.hpo.worker._Env`), the median and the largest seconds over the warm pool's workers (empty
    without a warm pool, e.g. on fake CPU devices with ``warm_workers: auto`` or with the Ray backend).
    ``driver_s`` splits the driver's wall time by what its loop did: ``wait`` (for worker messages),
    ``messages`` (handling them, ``tell`` included), ``ledger`` (reaping dead workers, with their last
    messages and joins, and the budget), ``place`` (estimates, placement, starts), ``sample`` (``ask``)
    and ``other`` (pool changes, worker replenishment, ``pack_hetero`` migration); everything but
    ``wait`` delays the next start. ``prepare`` is the asks and estimates the driver made while the pool
    was starting (inside ``warmup_s``, not ``wall_s``)."""

    study: str
    policy: str
    n_trials: int
    requeued: dict[str, int]
    wall_s: float
    complete: int
    pruned: int
    failures: dict[str, int]
    best_value: float | None
    best_params: dict | None
    history: list[tuple[float, float]]
    preempted: int = 0
    warmup_s: float = 0.0
    teardown_s: float = 0.0
    started_at: float = 0.0
    warmup_phases: dict[str, dict[str, float]] = field(default_factory=dict)
    driver_s: dict[str, float] = field(default_factory=dict)


class Driver:
    """Runs one study (see module docstring). Not thread-safe; use from one thread.

    Args:
        spec: the study (:class:`StudySpec`).
        resume: load the existing study and recover it; without it an existing study is an error.
        progress: show a live table in the terminal (rich).
    Raises:
        HpoError: the study exists and ``resume`` is False, or does not exist and ``resume`` is True.
    """

    def __init__(self, spec: StudySpec, *, resume: bool = False, progress: bool = False,
                 exit_deadline_s: float | None = None):
        import optuna

        self.exit_deadline_s = exit_deadline_s
        if spec.backend.get("name", "local") == "local":  # its imports overlap this driver's set-up
            start_forkserver()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.spec = spec
        self.run_dir = Path(spec.run_dir)
        check_writable(self.run_dir, "run_dir")
        if (db := sqlite_path(spec.storage)) is not None:
            if resume and not db.exists():  # do not create an empty store for a study that is not there
                raise HpoError(f"study {spec.study!r} not found: no study store at {db} "
                               "(is run_dir/storage right? `hpdl hpo run` starts a study)")
            check_writable(db.parent, "the storage's folder")
        check_writable(self.run_dir / "checkpoints", "the checkpoint folder")
        self.lock = StudyLock(self.run_dir, spec.study, spec.storage)
        self.lock.acquire()  # before anything reads or changes the study's trials
        try:
            self._open(spec, resume, progress)
        except BaseException:
            self.lock.release()
            raise

    def _open(self, spec: StudySpec, resume: bool, progress: bool) -> None:
        import optuna

        self._spec_dict = {**spec.to_dict(), "storage": spec.storage, "run_dir": str(self.run_dir.resolve())}
        self.workload = get_workload(spec.workload)
        self.dists = spec.distributions()
        self.policy = get_policy(spec.policy.get("name", "pack"),
                                 **{k: v for k, v in spec.policy.items() if k != "name"})
        self.backend = None
        if spec.backend.get("name", "local") != "ray":
            self.pool = PoolSource(spec.pool)  # a bad pool fails before the study is created
        self.profiles = ProfileCache(self.run_dir / "profiles.json")
        self.storage = storage = make_storage(spec.storage)
        names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
        if resume and spec.study not in names:
            raise HpoError(f"study {spec.study!r} not found in {spec.storage}; use `hpdl hpo run` to start it")
        if not resume and spec.study in names:
            raise HpoError(f"study {spec.study!r} already exists in {spec.storage}; use `hpdl hpo resume`")
        sampler, pruner = make_sampler(spec.sampler, spec.space), make_pruner(spec.pruner)  # fail before Ray
        if spec.backend.get("name", "local") == "ray":  # joins or starts Ray: only once the study checks passed
            from hpdl.hpo.ray_backend import RayBackend
            self.backend = self.pool = RayBackend(spec.backend, spec.pool, self._spec_dict)
        try:
            self.study = optuna.create_study(study_name=spec.study, storage=storage, load_if_exists=resume,
                                             sampler=sampler, pruner=pruner, direction=spec.direction)
        except BaseException:
            if self.backend is not None:  # do not leave Ray holding the GPUs' placement group
                self.backend.shutdown()
            raise
        self.lock.check_heartbeat(self.study)  # a live driver of this host with another run_dir: refuse
        self.lock.beat(force=True)
        self.study.set_user_attr("hpdl_spec", spec.to_dict())
        # checkpoints belong to this study in this store: a study of the same name in another store, or a
        # study deleted and created again, gets another id and never reads them
        uid = self.study.user_attrs.get("hpdl_uid") or uuid.uuid4().hex
        self.study.set_user_attr("hpdl_uid", uid)
        self.checkpoint_dir = checkpoint_dir(self.run_dir, spec.study, uid)
        check_writable(self.checkpoint_dir, "the checkpoint folder")
        self._spec_dict.update(study_uid=uid, checkpoint_dir=str(self.checkpoint_dir.resolve()))
        self.progress = progress
        self.host = socket.gethostname()
        self.pending: list[_Trial] = []
        self.running: dict[int, _Trial] = {}
        self._short = False  # the last tick asked for trials: the next one places them without waiting
        self._start_failures: dict[tuple[str, int], int] = {}  # (device id, MPS cap) -> deaths before ready in a row
        self._broken: set[str] = set()  # devices left out after _START_FAILURES_MAX such deaths
        self._phase_s: dict[str, float] = {}
        self.preempted = 0
        self._stopping = False  # the driver stops: a worker's "preempted" re-queues its trial
        self._signal, self._t_signal = None, 0.0
        self._watchdog: threading.Timer | None = None
        self.migrated = 0
        self._last_migrate = 0.0
        self.history: list[tuple[float, float]] = []
        self._t0 = time.monotonic()
        self._t_done, self._teardown_s, self._started_at = 0.0, 0.0, time.time()
        self._cuda = any(d.torch_device.startswith("cuda") for d in self.pool.devices())
        n_gpus = sum(d.torch_device.startswith("cuda") for d in self.pool.devices())
        if n_gpus and self.backend is None:
            # each co-located trial needs a core to launch kernels; one core stays with the driver
            self.policy.limit_trials_per_device(((os.cpu_count() or 2) - 1) // n_gpus)
        self.warmup_s = 0.0
        self.warmup_phases: dict[str, dict[str, float]] = {}
        self._by_id: dict[str, Any] = {}
        if spec.mps in (True, "auto"):
            self.policy.set_mps(spec.mps is True or mps_active())
        self.mps_daemon = None  # mps: start -> hpdl.hpo.mps.MpsDaemon, started in run()
        self.launcher = self.backend or LocalLauncher(self._spec_dict, spec.warm_workers,
                                                      self.policy.max_concurrency())
        try:  # the first meta-device trace imports much of torch (seconds): pay it here, not in the first tick
            self.workload.estimate(dict(spec.fixed))
        except Exception:  # noqa: BLE001 - warm-up only; a workload that cannot build fails in its trials
            pass
        from optuna.trial import TrialState

        done = [t.value for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
        self._prior_best = ((max if spec.direction == "maximize" else min)(done)) if done else None
        self.ledger = Ledger(self.study, spec.max_retries, self.host, storage=self.storage)
        if resume:
            self.ledger.recover()  # safe: this driver holds the study's lock, no live driver runs its trials

    # ------------------------------------------------------------------ demands and placement
    def _demand(self, t: _Trial, kinds: set[str]) -> TrialDemand:
        measured = [p for k in kinds if (p := self.profiles.get(t.skey, k)) is not None and p.measured]
        steps = self.workload.schedule(self.workload.resolve({**self.spec.fixed, **t.params}))[0]
        if not self.policy.uses_profiles:  # the baselines place blind: no static trace on their critical path
            return TrialDemand(t.number, 0, 1.0, float(steps) * 0.01, t.priority,
                               waited_s=time.monotonic() - t.since, profiled=False)
        if measured:
            ref = max(measured, key=lambda q: q.step_time_s)
            mem = max(q.memory_bytes for q in measured)
            return TrialDemand(t.number, mem, ref.compute, steps * ref.step_time_s, t.priority,
                               waited_s=time.monotonic() - t.since, profiled=True, steps=steps)
        static = self._static(t, next(iter(kinds)) if kinds else "cpu")
        return TrialDemand(t.number, static.memory_bytes, 1.0, float(steps) * 0.01, t.priority,
                           waited_s=time.monotonic() - t.since, profiled=False, flops=static.flops, steps=steps)

    def _static(self, t: _Trial, kind: str) -> TrialProfile:
        st = self.profiles.get(t.skey, "static")
        if st is None:
            st = static_profile(self.workload, {**self.spec.fixed, **t.params}, "static",
                                CONTEXT_BYTES if self._cuda else 0)
            self.profiles.put(t.skey, st)
        return st

    def _device_states(self, devices) -> list[DeviceState]:
        states = {d.id: DeviceState(d) for d in devices}
        for t in self.running.values():
            if t.device_id in states and t.demand is not None:
                states[t.device_id].running.append(t.demand)
        for w in self.workers:  # an idle worker still holds its CUDA context
            if w.trial is None and w.device_id in states and states[w.device_id].device.torch_device != "cpu":
                states[w.device_id].running.append(TrialDemand(-1 - id(w) % 10**9, CONTEXT_BYTES, 0.0, 0.0,
                                                               profiled=True))
        return list(states.values())

    def _task(self, t: _Trial, device) -> dict:
        need_profile = self.policy.uses_profiles and (not (p := self.profiles.get(t.skey, device.kind))
                                                      or not p.measured)
        return {"trial_id": t.trial_id, "number": t.number, "lineage": t.lineage, "params": t.params,
                "device_id": device.id,
                "profile": need_profile, "static": self._static(t, device.kind).__dict__ if need_profile else None,
                "host": self.host, "study_uid": self._spec_dict["study_uid"],
                "checkpoint_dir": self._spec_dict["checkpoint_dir"], "context_bytes": CONTEXT_BYTES if device.torch_device.startswith("cuda") else 0,
                "memory_cap": self.policy.memory_cap(t.demand, device) if t.demand is not None else None}

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.launcher.workers

    def _start(self, t: _Trial, device, sm_percent: int) -> None:
        """Start ``t`` on ``device``: a warm local worker, or a Ray task with ``num_gpus`` from the policy."""
        frac = self.policy.gpu_fraction(t.demand, device)
        w = self.launcher.start(device, self._task(t, device), sm_percent, frac)
        w.trial, t.worker, t.device_id = t, w, device.id  # the worker records host, pid and start time
        self.running[t.number] = t
        if self.backend is not None:
            self.storage.set_trial_user_attr(t.trial_id, "hpdl_gpu_fraction", frac)

    def _sample(self, finished: set[int], active: set[int]) -> None:
        """Ask the sampler for trials until the lookahead is full: enough to fill every device up to the
        policy's concurrency (packing looks ahead). Stop after ``_SAMPLE_BUDGET_S`` (one ask at least) and
        go on in the next tick, so the first trials start without waiting for the whole lookahead (30
        asks took about 0.5 s before the first trial started on an H200 host, 2026-11-30)."""
        self._short = False
        want = self.spec.lookahead or max(2, min(WARM_MAX, self.policy.max_concurrency())) * max(
            1, len(self.pool.devices()))
        if len(self.pending) >= want:
            return
        budget = 0 if self.ledger.stop_requested else self.spec.n_trials - len(finished) - len(active)
        if budget > 0 and (self.ledger.shared or budget <= want - len(self.pending)):
            # others ask too (many nodes, resume), or the budget, not the lookahead, limits the asks: count
            # from the storage
            finished, active = self.ledger.lineages(_BUDGET_READ_S)
            budget = 0 if self.ledger.stop_requested else self.spec.n_trials - len(finished) - len(active)
        waiting = self.ledger.waiting
        deadline, asked = time.monotonic() + _SAMPLE_BUDGET_S, False
        while len(self.pending) < want and (budget > 0 or waiting > 0):
            if asked and time.monotonic() > deadline:  # one ask a tick at least
                self._short = True  # the next tick goes on sampling without waiting for a message
                return
            popped = waiting > 0  # Optuna's ask takes a waiting trial (a retry, or one a user enqueued) first
            trial = self.study.ask(self.dists)
            lin = int(trial.user_attrs.get("hpdl_lineage", trial.number))
            self.ledger.asked(lin)
            waiting -= popped
            if lin == trial.number:  # a new configuration: it uses the budget
                trial.set_user_attr("hpdl_lineage", lin)
                budget -= 1
            skey = self.workload.structural_key({**self.spec.fixed, **trial.params})
            self.pending.append(_Trial(trial.number, self.ledger.trial_id(trial.number), lin, dict(trial.params),
                                       skey, time.monotonic(), attempt=int(trial.user_attrs.get("hpdl_attempt", 0))))
            asked = True
        self._short = asked  # place what this tick sampled without waiting for a message

    # ------------------------------------------------------------------ messages and failures
    def _on_message(self, w: WorkerHandle, msg: tuple) -> None:
        from optuna.trial import TrialState

        kind, t = msg[0], w.trial
        if kind == "ready":
            self._start_failures.pop((w.device_id, w.sm_percent), None)
            self.launcher.on_ready(w)
            return
        if t is None or (len(msg) > 1 and msg[1] != t.trial_id):
            return
        if kind == "memory":  # the whole run's peak (evaluations included): plan the next ones with it
            prof = self.profiles.get(t.skey, msg[2])
            if prof is not None and prof.measured and msg[3] > prof.memory_bytes:
                prof.memory_bytes = int(msg[3])
                self.profiles.put(t.skey, prof)
            return
        if kind == "profile":
            prof = TrialProfile(**msg[2])
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
        if kind == "done" and math.isnan(msg[2]):  # a diverged configuration: Optuna cannot complete a NaN
            self.ledger.fail(t.number, t.params, {"hpdl_lineage": t.lineage}, "nan", "objective returned NaN",
                             retry=False)
        elif kind in ("done", "pruned"):
            self.ledger.tell(t.number, msg[2] if kind == "done" else None,
                             TrialState.COMPLETE if kind == "done" else TrialState.PRUNED)
            self.ledger.closed(t.lineage)
            if kind == "done":
                self._improve(msg[2])
        elif kind == "preempted" and self._stopping:  # checkpointed because this driver stops
            self._release(t, "interrupted", "the driver stopped; checkpointed and re-queued")
        elif kind == "preempted":
            self.preempted += 1
            self._requeue(t)
        elif kind == "failed":
            w.stopping = True  # a worker exits after a failure: never give it another trial
            if msg[2] == "oom":  # the profile under-estimated: never place this configuration so tightly again
                for k, p in self.profiles.items():
                    if k.endswith("|" + t.skey):
                        p.memory_bytes = int(p.memory_bytes * 1.5)
                        self.profiles.put(t.skey, p)
            if msg[2] == "checkpoint":  # someone else's checkpoint on its path: loud, and never retried
                logging.getLogger("hpdl.hpo").error("trial %d: %s", t.number, msg[3])
            self.ledger.fail(t.number, t.params, {"hpdl_lineage": t.lineage, "hpdl_attempt": t.attempt},
                             msg[2], msg[3], retry=msg[2] != "checkpoint")

    def _rebind(self) -> None:
        """Move each trial still queued on a starting worker to an idle ready worker of the same device (a
        warm worker that finished a trial while the new one starts): it starts now instead of after the
        cold start. The starting worker stays, idle, for later trials."""
        for w in [w for w in self.workers if w.queued is not None and w.trial is not None]:
            spare = self.launcher.idle_ready(w)
            if spare is None:
                continue
            if not send(spare, ("run", w.queued)):
                continue  # the spare just died (reaping removes it): the trial stays queued where it was
            t = w.trial
            w.trial, w.queued, w.idle_since = None, None, time.monotonic()
            spare.trial, t.worker = t, spare

    def _requeue(self, t: _Trial) -> None:
        """Put ``t`` (stopped, or never started) at the front of the pending queue, on no device."""
        self.running.pop(t.number, None)
        t.since, t.device_id, t.worker, t.preempt_at = time.monotonic(), "", None, 0.0
        self.pending.insert(0, t)

    def _preempt(self, t: _Trial) -> None:
        """Stop ``t`` with a checkpoint so it continues elsewhere; a trial still queued on a starting worker
        goes straight back to the pending queue."""
        w = t.worker
        if w is not None and w.queued is not None:
            w.trial, w.queued, w.idle_since = None, None, time.monotonic()
            self._requeue(t)
            return
        t.preempt_at = time.monotonic()
        send(w, ("preempt", t.trial_id))

    def best_so_far(self) -> float | None:
        """The study's best value: this driver's last improvement, or what the store held when it opened
        the study (a resumed study's earlier trials), whichever is better."""
        vals = [v for v in (self._prior_best, self.history[-1][1] if self.history else None) if v is not None]
        return (max if self.spec.direction == "maximize" else min)(vals) if vals else None

    def _improve(self, value: float) -> None:
        best = self.history[-1][1] if self.history else None
        better = best is None or (value > best if self.spec.direction == "maximize" else value < best)
        if better and not math.isnan(value):
            self.history.append((time.monotonic() - self._t0, float(value)))

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
                    self.ledger.fail(t.number, t.params, {"hpdl_lineage": t.lineage, "hpdl_attempt": t.attempt},
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

    def _migrate(self, devices) -> None:
        """pack_hetero: mark running trials better than the median at their last report as promising and
        move those the policy picks to faster GPUs (preempt with a checkpoint; they are re-placed first)."""
        if not self.policy.migrates or time.monotonic() - self._last_migrate < 2.0:
            return
        self._last_migrate = time.monotonic()
        by_step: dict[int, list[float]] = {}
        for fz in self.study.get_trials(deepcopy=False):
            for step, v in fz.intermediate_values.items():
                by_step.setdefault(step, []).append(v)
        sign = 1.0 if self.spec.direction == "maximize" else -1.0
        for t in self.running.values():
            iv = self.storage.get_trial(t.trial_id).intermediate_values
            if iv and t.demand is not None:
                step = max(iv)
                peers = sorted(by_step.get(step, []))
                t.priority = float(len(peers) >= 3 and sign * (iv[step] - peers[len(peers) // 2]) > 0)
                t.demand.priority = t.priority
        for key in self.policy.migrations(self._device_states(devices)):
            t = self.running[key]
            if not t.preempt_at:
                self.migrated += 1
                self._preempt(t)

    def _elastic(self, devices) -> None:
        ids = {d.id for d in devices}
        for w in self.workers:
            if w.device_id in ids:
                continue
            t = w.trial
            if t is None:
                if not w.stopping:
                    w.stopping = True
                    send(w, ("stop",))
            elif not t.preempt_at:
                self._preempt(t)

    # ------------------------------------------------------------------ main loop
    def run(self) -> StudyResult:
        """Run until the budget is finished (or ``spec.timeout_s`` passes); return the summary."""
        from hpdl.hpo.progress import Progress

        view = None
        previous = self._catch_signals()
        try:
            self._by_id = {d.id: d for d in self.pool.devices()}
            t = time.monotonic()
            self._start_mps()  # its start-up counts as the pool's
            self.launcher.stop_requested = lambda: self._signal is not None
            self.launcher.warm_up(self.pool.devices(), min(WARM_TIMEOUT_S, self.spec.timeout_s or WARM_TIMEOUT_S),
                                  idle=self._prepare)
            self.warmup_s = time.monotonic() - t
            self.warmup_phases = _phases([w.startup for w in self.launcher.workers])
            self._t0 = time.monotonic()  # wall time counts from a ready pool, for every policy alike
            self._started_at = time.time()
            view = Progress(self) if self.progress else None
            while self._signal is None:
                tick = time.monotonic()
                self.lock.beat()
                devices = [d for d in self.pool.devices() if d.id not in self._broken]
                self._by_id = {d.id: d for d in devices}
                self._elastic(devices)
                self.launcher.replenish(devices)
                self._migrate(devices)
                self.launcher.connect()
                conns = [w.conn for w in self.workers if w.conn is not None and not w.closed]
                tick = self._lap("other", tick)
                ready = mp_wait(conns, timeout=0.0 if self._short else 0.05) if conns else []
                tick = self._lap("wait", tick)
                for conn in ready:
                    w = next(x for x in self.workers if x.conn is conn)
                    try:
                        while w.conn.poll():
                            self._on_message(w, w.conn.recv())
                    except (EOFError, OSError):
                        w.closed = True
                        w.proc.join(1)
                self._rebind()
                tick = self._lap("messages", tick)
                self._reap()
                finished, active = self.ledger.lineages()
                tick = self._lap("ledger", tick)
                stopped = self.ledger.stop_requested and not active  # e.g. every grid point ran
                if (len(finished) >= self.spec.n_trials or stopped) and not self.running and not self.pending:
                    self._t_done = time.monotonic()
                    break
                if self.spec.timeout_s and time.monotonic() - self._t0 > self.spec.timeout_s:
                    raise HpoError(f"study {self.spec.study!r} ran past timeout_s={self.spec.timeout_s}")
                if self.pending and devices:  # before sampling: what is already sampled starts now
                    self._place(devices)
                tick = self._lap("place", tick)
                self._sample(finished, active)
                tick = self._lap("sample", tick)
                if not conns and not self._short:
                    time.sleep(0.02)
                    tick = self._lap("wait", tick)
                if view:
                    view.update()
                    self._lap("other", tick)
        finally:
            if view:
                view.update(force=True)  # the last frame shows the final counts and best value
                view.close()
            t = time.monotonic()
            stopped = self._stop_workers() if self.running else 0
            self._release_pending()
            self.shutdown()
            self._teardown_s = time.monotonic() - t
            self._restore_signals(previous)
        if self._signal is not None:
            raise self._interrupted(stopped, time.monotonic() - self._t_signal)
        return self.result()

    # ------------------------------------------------------------------ stopping
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
        print(f"hpdl hpo: study {self.spec.study!r} interrupted by {signal.Signals(self._signal).name}: the "
              f"driver did not stop within {self.exit_deadline_s:.1f} s; its workers were killed and "
              f"{len(self.running) + len(self.pending)} trials left for `hpdl hpo resume` to re-queue (no "
              "attempt spent)", file=sys.stderr, flush=True)
        os._exit(128 + self._signal)

    def _interrupted(self, stopped: int, took_s: float) -> HpoInterrupted:
        name = signal.Signals(self._signal).name
        finished, _ = self.ledger.lineages(0.0)
        best = self.result().best_value
        return HpoInterrupted(
            f"study {self.spec.study!r} interrupted by {name}: stopped {stopped} running trials in {took_s:.1f} s "
            f"(checkpointed and re-queued, no attempt spent), {len(finished)}/{self.spec.n_trials} configurations "
            f"finished, best {best}; `hpdl hpo resume` continues", self._signal)

    def _stop_workers(self, limit_s: float = _STOP_TIMEOUT_S) -> int:
        """Tell every worker at once to checkpoint and stop, handle what they answer for ``limit_s`` seconds,
        kill those still alive, and re-queue every trial that was running (``interrupted``: no attempt spent;
        each continues from its configuration's last checkpoint). Returns the number of trials stopped."""
        n = len(self.running)
        self._stopping = True
        workers = list(self.workers)
        for w in workers:
            w.stopping = True
            send(w, ("stop",))
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
        configuration with the same attempt number."""
        self.ledger.fail(t.number, t.params, {"hpdl_lineage": t.lineage, "hpdl_attempt": t.attempt}, kind, why)

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

    def _prepare(self) -> bool:
        """While the warm pool starts: ask for the first trials and estimate their demands (phase
        ``prepare`` of ``driver_s``), so the first placement finds them ready. True while there is more to
        do. Every policy asks here; only those that use profiles (``pack``, ``pack_hetero``) trace
        meta-device estimates, so from 2026-11-30 17:00 their ``wall_s`` no longer contains the first
        0.5-1.4 s of that work: compare policies with the pool's start-up included."""
        t = time.monotonic()
        self.lock.beat()
        if self._signal is not None:
            return False
        finished, active = self.ledger.lineages()
        self._sample(finished, active)
        estimated = self._demands(self.pool.devices()) if self.pending else {}
        self._lap("prepare", t)
        return self._short or len(estimated) < len(self.pending)

    def _place(self, devices) -> None:
        """Ask the policy to place the pending trials on ``devices`` and start its assignments; a trial
        measured larger than every device fails for good (``too_big``)."""
        states = self._device_states(devices)
        by_id = {d.id: d for d in devices}
        demands = self._demands(devices)
        biggest = max(d.memory_bytes for d in devices)
        for t in [t for t in self.pending if t.number in demands and demands[t.number].profiled
                  and demands[t.number].memory_bytes > biggest]:
            self.pending.remove(t)  # measured, and larger than any device: it can never run
            need = demands.pop(t.number).memory_bytes
            self.ledger.fail(t.number, t.params, {"hpdl_lineage": t.lineage}, "too_big",
                             f"needs {need} B, largest device has {biggest} B", retry=False)
        for a in self.policy.place(list(demands.values()), states):
            t = next(x for x in self.pending if x.number == a.key)
            self.pending.remove(t)
            t.demand = demands[a.key]
            self._start(t, by_id[a.device_id], a.sm_percent)

    def _lap(self, phase: str, since: float) -> float:
        """Add the seconds since ``since`` to the driver's time in ``phase``; return now."""
        now = time.monotonic()
        self._phase_s[phase] = self._phase_s.get(phase, 0.0) + now - since
        return now

    def _demands(self, devices) -> dict[int, TrialDemand]:
        """Demands of the pending trials, oldest first. A trial whose structure has neither a profile nor a
        static estimate yet needs a meta-device trace (about 0.1 s); after ``_ESTIMATE_BUDGET_S`` of those in
        one tick the rest wait for the next tick, so the first trials start without waiting for every
        estimate of a deep lookahead."""
        kinds = {d.kind for d in devices}
        deadline = time.monotonic() + _ESTIMATE_BUDGET_S
        out, traced = {}, 0
        for t in self.pending:
            known = (not self.policy.uses_profiles or self.profiles.get(t.skey, "static") is not None
                     or any((p := self.profiles.get(t.skey, k)) is not None and p.measured for k in kinds))
            if known or not traced or time.monotonic() < deadline:  # at least one new estimate a tick
                traced += not known
                out[t.number] = self._demand(t, kinds)
        return out

    def _start_mps(self) -> None:
        """``mps: start``: a private MPS daemon for this study's worker processes (local GPUs only)."""
        if self.spec.mps != "start" or self.backend is not None or self.mps_daemon:
            return
        if not self._cuda:
            logging.getLogger("hpdl.hpo").warning("mps: start ignored: the pool has no CUDA device")
            return
        from hpdl.hpo.mps import MpsDaemon

        self.mps_daemon = MpsDaemon(self.run_dir / "mps")  # set first: shutdown() stops a half-started one
        self.mps_daemon.start()
        self._spec_dict["mps_env"] = self.mps_daemon.env  # workers set it before creating a CUDA context
        self.policy.set_mps(True)

    def shutdown(self) -> None:
        """Stop every worker (stop messages to all, one shared deadline, then kill), the Ray backend and a
        daemon started by ``mps: start``, and release the study's lock; idempotent."""
        try:
            self.launcher.shutdown()
            if self.mps_daemon is not None:
                self.mps_daemon.stop()
        finally:
            self.lock.release()

    def result(self) -> StudyResult:
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        done = [t for t in trials if t.state == TrialState.COMPLETE]
        best = None
        if done:
            best = (max if self.spec.direction == "maximize" else min)(done, key=lambda t: t.value)
        return StudyResult(self.spec.study, self.policy.name, self.spec.n_trials,
                           dict(self.ledger.requeued),
                           (self._t_done or time.monotonic()) - self._t0,
                           len(done), sum(t.state == TrialState.PRUNED for t in trials), dict(self.ledger.failures),
                           best.value if best else None, dict(best.params) if best else None, list(self.history),
                           self.preempted, self.warmup_s, self._teardown_s, self._started_at,
                           self.warmup_phases, {k: round(v, 4) for k, v in self._phase_s.items()})


def _phases(startups: list[dict]) -> dict[str, dict[str, float]]:
    """Median and largest seconds per phase over the workers' start-up times."""
    names = dict.fromkeys(k for s in startups for k in s)
    return {k: {"median": statistics.median(v), "max": max(v)}
            for k in names if (v := [s[k] for s in startups if k in s])}


def run_study(spec: StudySpec, *, resume: bool = False, progress: bool = False,
              exit_deadline_s: float | None = None) -> StudyResult:
    """Run (or, with ``resume``, continue) the study described by ``spec`` to its budget.

    SIGINT/SIGTERM (main thread only) stop it: every worker is told at once to checkpoint and stop, the
    running trials are re-queued without spending an attempt, and :class:`HpoInterrupted` is raised with a
    one-line summary. ``exit_deadline_s`` (the CLI gives 4.5 s): if that has not finished so long after the
    signal (the driver was inside a blocking call, e.g. starting the first worker), kill the workers, print
    the summary line and end the process (``os._exit``); a later ``resume`` re-queues what was left RUNNING,
    without spending an attempt.

    Returns:
        StudyResult with wall time (s), counts, best value/params and best-so-far history.
    Raises:
        HpoError: study exists (without ``resume``) or is missing (with it), or ``timeout_s`` passed.
        HpoConfigError: invalid spec, pool or policy.
    """
    return Driver(spec, resume=resume, progress=progress, exit_deadline_s=exit_deadline_s).run()
