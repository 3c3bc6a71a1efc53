"""The study driver: samples trials with Optuna, places them with a policy, runs them in worker processes,
and recovers from every failure it can see.

Loop (one thread; every wait has a timeout): read the pool (elasticity) -> drain worker messages ->
reap dead workers -> ``policy.place`` the sampled trials -> start assignments -> sample more while the
budget allows -> render progress. The Optuna storage is the source of truth: a driver that was killed is
restarted with ``resume=True`` and finishes the same budget (trials it left RUNNING go back to WAITING,
Optuna's state for a trial that waits to run, without spending an attempt, and continue from their
configuration's last checkpoint; their processes died with it).

Budget: ``n_trials`` configurations ("lineages"). A configuration is finished when one attempt completes
or is pruned, or after ``max_retries`` failed retries. Retries are ``study.enqueue_trial`` with the same
parameters and ``user_attrs`` ``hpdl_lineage`` / ``hpdl_attempt``, so the sampler never sees a duplicate;
only a trial's own failures count. A
sampler that calls ``study.stop()`` ends it early: no new configuration is asked, and the study finishes
with what runs (``sampler: grid`` needs ``n_trials`` <= its points, so it never gets there).

The driver owns the study's set-up, the loop and the summary, and wires objects that each do one job
behind a few methods, sharing only the trial queue (:class:`hpdl.hpo.runs.TrialQueue`), which each is
given: :class:`hpdl.hpo.asking.Asker` asks the sampler for trials; :class:`hpdl.hpo.placement.Placement`
decides what each pending trial needs and where it runs (through a policy of :mod:`hpdl.hpo.policies`)
and starts and moves trials; :class:`hpdl.hpo.faults.FaultHandler` ends trials, retries failures,
reaps dead workers and stops the workers on a signal (:class:`hpdl.hpo.faults.StopSignals`); a launcher
(:mod:`hpdl.hpo.launch`: local worker processes with a warm pool per GPU, or Ray tasks,
:mod:`hpdl.hpo.ray_backend`) owns the processes. The driver routes each worker message
(:mod:`hpdl.hpo.messages`) to the one that handles it. :mod:`hpdl.hpo.ledger` counts configurations and
retries in the store; :mod:`hpdl.hpo.lock` keeps one live driver per study; :mod:`hpdl.hpo.checkpoint`
ties checkpoints to their study. Wall time counts from the moment the warm pool is ready.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Any

from hpdl.hpo import messages
from hpdl.hpo._prestart import start_forkserver
from hpdl.hpo.asking import Asker
from hpdl.hpo.checkpoint import check_writable, checkpoint_dir
from hpdl.hpo.errors import HpoError, HpoInterrupted
from hpdl.hpo.faults import OUTCOMES, FaultHandler, StopSignals
from hpdl.hpo.grouping import FuseOptions
from hpdl.hpo.launch import WARM_TIMEOUT_S, LocalLauncher, WorkerHandle
from hpdl.hpo.ledger import Ledger
from hpdl.hpo.lock import StudyLock
from hpdl.hpo.placement import Placement
from hpdl.hpo.policies import DeviceState, get_policy, mps_active
from hpdl.hpo.pool import PoolSource
from hpdl.hpo.profiler import CONTEXT_BYTES, ProfileCache
from hpdl.hpo.runs import FusedGroup, TrialQueue
from hpdl.hpo.spec import StudySpec, make_pruner, make_sampler, make_storage, sqlite_path
from hpdl.hpo.workloads import get_workload


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
    was starting (inside ``warmup_s``, not ``wall_s``).

    Two clocks: **ready** (``wall_s``, above) and **counted in** (``counted_s``: from ``counted_from``, Unix
    time, until the teardown ended; ``hpdl hpo run`` counts from its process's start, so the interpreter, the
    imports and the study's set-up are in it; :func:`run_study` called from Python counts from the call).
    ``setup_s`` is the part before the ready clock started (``counted_from`` to a ready pool; ``warmup_s`` is
    in it), so ``counted_s`` is ``setup_s + wall_s + teardown_s`` up to the bookkeeping between them.
    ``setup_phases`` splits ``setup_s``: ``before_driver`` (the interpreter's start, imports and the study
    file, until the driver was constructed), ``driver`` (the study's store, the study, the pool, the MPS daemon's
    start, until :meth:`Driver.run`) and ``pool`` (``warmup_s``)."""

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
    counted_s: float = 0.0
    setup_s: float = 0.0
    counted_from: float = 0.0
    setup_phases: dict[str, float] = field(default_factory=dict)


class Driver:
    """Runs one study (see module docstring). Not thread-safe; use from one thread.

    Args:
        spec: the study (:class:`StudySpec`).
        resume: load the existing study and recover it; without it an existing study is an error.
        progress: show a live table in the terminal (rich).
        overwrite: (without ``resume``) delete a study of the same name in the storage, with its
            checkpoints, and start afresh (``hpdl hpo run --overwrite``), as ``optuna.delete_study`` then
            ``optuna.create_study``; done while holding the study's lock, so a live driver's study is never
            deleted.
        started: the Unix time the counted-in clock starts from (``StudyResult.counted_s``); default: now.
    Raises:
        HpoError: the study exists and neither ``resume`` nor ``overwrite`` is given, or does not exist and
            ``resume`` is True; ``resume`` and ``overwrite`` together.
    """

    def __init__(self, spec: StudySpec, *, resume: bool = False, progress: bool = False,
                 exit_deadline_s: float | None = None, overwrite: bool = False, started: float | None = None):
        self._t_init = time.time()
        self._counted_from = self._t_init if started is None else float(started)
        self._t_run = self._t_ready = self._t_end = 0.0
        self.mps_daemon = None  # mps: start -> hpdl.hpo.mps.MpsDaemon, started beside the study's set-up
        self._mps_start: threading.Thread | None = None
        self._mps_error: BaseException | None = None
        if resume and overwrite:
            raise HpoError("resume and overwrite exclude each other: resume continues the stored study, "
                           "overwrite deletes it")
        self.overwrite = overwrite
        self.host_name = socket.gethostname()
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
            try:
                self._join_mps()
                if self.mps_daemon is not None:
                    self.mps_daemon.stop()
            finally:
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
            self._begin_mps()  # the daemon comes up while the store and the study are opened
        self.profiles = ProfileCache(self.run_dir / "profiles.json")
        self.storage = storage = make_storage(spec.storage)
        names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
        if resume and spec.study not in names:
            raise HpoError(f"study {spec.study!r} not found in {spec.storage}; use `hpdl hpo run` to start it")
        if not resume and spec.study in names and self.overwrite:
            self._delete_study(spec)
        elif not resume and spec.study in names:
            raise HpoError(f"study {spec.study!r} already exists in {spec.storage} ({self._finished(spec)}); "
                           "`hpdl hpo resume` continues it, `hpdl hpo run --overwrite` deletes it and starts "
                           "afresh (or give the study another name)")
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
        self._phase_s: dict[str, float] = {}
        self.signals = StopSignals(self.exit_deadline_s, self._force_exit)
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
        self.launcher = self.backend or LocalLauncher(self._spec_dict, spec.warm_workers,
                                                      self.policy.max_concurrency())
        from optuna.trial import TrialState

        done = [t.value for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
        self._prior_best = ((max if spec.direction == "maximize" else min)(done)) if done else None
        self.ledger = Ledger(self.study, spec.max_retries, self.host, storage=self.storage)
        if resume:
            self.ledger.recover()  # safe: this driver holds the study's lock, no live driver runs its trials
        fuse = FuseOptions.parse(spec.fuse)
        self.queue = TrialQueue()
        self.asker = Asker(self.study, self.dists, self.ledger, self.queue, self.workload, spec.fixed, spec.n_trials,
                           spec.lookahead, fuse)
        self.placement = Placement(
            self.policy, self.profiles, self.workload, spec.fixed, self.queue, self.launcher, self.ledger, self.study,
            spec.direction, {"host": self.host, "study_uid": uid, "checkpoint_dir": self._spec_dict["checkpoint_dir"]},
            self.storage, CONTEXT_BYTES if self._cuda else 0, fuse, ray=self.backend is not None)
        self.faults = FaultHandler(self.queue, self.ledger, self.launcher, self.placement, self._on_message,
                                   self._improve, lambda: {d.id for d in self.pool.devices()}, spec.study,
                                   self.checkpoint_dir)

    def _finished(self, spec: StudySpec) -> str:
        """``"k/n configurations finished"`` of the stored study ``spec.study`` (for messages)."""
        import optuna

        old = optuna.load_study(study_name=spec.study, storage=self.storage)
        finished, _ = Ledger(old, spec.max_retries, socket.gethostname(), storage=self.storage).lineages()
        n = old.user_attrs.get("hpdl_spec", {}).get("n_trials", spec.n_trials)
        return f"{len(finished)}/{n} configurations finished"

    def _delete_study(self, spec: StudySpec) -> None:
        """``overwrite``: delete the stored study of this name and its checkpoint folder (this driver holds
        the study's lock: no live driver runs it)."""
        import shutil

        import optuna

        from hpdl.hpo.lock import live_drivers

        old = optuna.load_study(study_name=spec.study, storage=self.storage)
        live = [d for d in live_drivers(old.user_attrs) if not (d["host"] == self.host_name and
                                                               int(d.get("pid", 0)) == os.getpid())]
        if live:  # a driver of another host shares this store (many nodes): its study is not ours to delete
            raise HpoError(f"study {spec.study!r} is being run by a live driver on {live[0]['host']} (pid "
                           f"{live[0].get('pid')}); stop it before `hpdl hpo run --overwrite`")
        uid = old.user_attrs.get("hpdl_uid")
        optuna.delete_study(study_name=spec.study, storage=self.storage)
        if uid:
            shutil.rmtree(checkpoint_dir(self.run_dir, spec.study, uid), ignore_errors=True)

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.launcher.workers

    @property
    def pending(self) -> list:
        """Trials asked and waiting for a device (:class:`hpdl.hpo.runs.TrialRun`), in asking order."""
        return self.queue.pending

    @property
    def running(self) -> dict:
        """Trial number -> the trial (or fused group) running on a worker."""
        return self.queue.running

    def _device_states(self, devices) -> list[DeviceState]:
        """What the policy sees of ``devices`` (the live view, :mod:`hpdl.hpo.progress`, shows it)."""
        return self.placement.device_states(devices)

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

    def run(self) -> StudyResult:
        """Run until the budget is finished (or ``spec.timeout_s`` passes); return the summary."""
        from hpdl.hpo.progress import Progress

        view = None
        self._t_run = time.time()
        self.signals.catch()
        try:
            self._by_id = {d.id: d for d in self.pool.devices()}
            t = time.monotonic()
            self._start_mps()  # waits for the daemon started beside the study's set-up; counts as the pool's
            self.launcher.stop_requested = lambda: self.signals.signum is not None
            self._spawn_pool_and_estimate()
            self.launcher.warm_up(self.pool.devices(), min(WARM_TIMEOUT_S, self.spec.timeout_s or WARM_TIMEOUT_S),
                                  idle=self._prepare)
            self.warmup_s = time.monotonic() - t
            self.warmup_phases = _phases([w.startup for w in self.launcher.workers])
            self._t0 = time.monotonic()  # wall time counts from a ready pool, for every policy alike
            self._started_at = self._t_ready = time.time()
            view = Progress(self) if self.progress else None
            while self.signals.signum is None:
                tick = time.monotonic()
                self.lock.beat()
                devices = [d for d in self.pool.devices() if d.id not in self.faults.broken]
                self._by_id = {d.id: d for d in devices}
                self.placement.elastic(devices)
                self.launcher.replenish(devices)
                self.placement.migrate(devices)
                self.launcher.connect()
                conns = [w.conn for w in self.workers if w.conn is not None and not w.closed]
                tick = self._lap("other", tick)
                ready = mp_wait(conns, timeout=0.0 if self.asker.short else 0.05) if conns else []
                tick = self._lap("wait", tick)
                for conn in ready:
                    w = next(x for x in self.workers if x.conn is conn)
                    try:
                        while w.conn.poll():
                            self._on_message(w, w.conn.recv())
                    except (EOFError, OSError):
                        w.closed = True
                        w.proc.join(1)
                self.placement.rebind()
                if self.faults.fatal is not None:  # e.g. the checkpoint folder became unwritable
                    raise self.faults.fatal
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
                    self.placement.place(devices, filling=self.asker.short)
                tick = self._lap("place", tick)
                self._sample(finished, active)
                tick = self._lap("sample", tick)
                if not conns and not self.asker.short:
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
            stopped = self.faults.stop_workers() if self.running else 0
            self.faults.release_pending()
            self.shutdown()
            self._teardown_s = time.monotonic() - t
            self._t_end = time.time()
            self.signals.restore()
        if self.signals.signum is not None:
            raise self._interrupted(stopped, time.monotonic() - self.signals.since)
        return self.result()

    def _prepare(self) -> bool:
        """While the warm pool starts: ask for the first trials and estimate their demands (phase
        ``prepare`` of ``driver_s``), so the first placement finds them ready. True while there is more to
        do. Every policy asks here; only those that use profiles (``pack``, ``pack_hetero``) trace
        meta-device estimates, so from 2026-11-30 17:00 their ``wall_s`` no longer contains the first
        0.5-1.4 s of that work: compare policies with the pool's start-up included."""
        t = time.monotonic()
        self.lock.beat()
        if self.signals.signum is not None:
            return False
        finished, active = self.ledger.lineages()
        self._sample(finished, active)
        estimated = self.placement.demands(self.pool.devices()) if self.pending else {}
        self._lap("prepare", t)
        return self.asker.short or len(estimated) < len(self.pending)

    def _sample(self, finished: set[int], active: set[int]) -> None:
        """Ask for trials (:meth:`hpdl.hpo.asking.Asker.ask`) up to the lookahead: enough to fill every
        device of the pool up to the policy's concurrency."""
        self.asker.ask(finished, active, self.asker.want(self.policy.max_concurrency(), len(self.pool.devices())))

    def _reap(self) -> None:
        """Dead workers (:meth:`hpdl.hpo.faults.FaultHandler.reap`); idle ones beyond the warm pools stop."""
        self.faults.reap(self._by_id)

    def _on_message(self, w: WorkerHandle, msg: messages.Message) -> None:
        """Route one record from ``w`` (:mod:`hpdl.hpo.messages`): ``ready`` to the launcher, profiles and
        peaks to placement, outcomes to the fault handler. A record about a trial other than the one ``w``
        runs now (a late one) is ignored."""
        messages.check(msg)
        t = w.trial
        if isinstance(msg, messages.Ready):
            self.faults.worker_ready(w)
            self.launcher.on_ready(w)
        elif isinstance(t, FusedGroup) and isinstance(msg, OUTCOMES):
            self.faults.member_outcome(w, t, msg)
        elif t is None or not isinstance(msg, messages.TrialMessage) or msg.trial_id != t.trial_id:
            return
        elif isinstance(msg, messages.PeakMemory):  # the whole run's peak (evaluations included): plan with it
            self.placement.observe_peak(t, msg.kind, msg.bytes)
        elif isinstance(msg, messages.ProfileReport):
            self.placement.observe_profile(t, msg.profile)
        else:
            self.faults.outcome(w, t, msg)

    def _lap(self, phase: str, since: float) -> float:
        """Add the seconds since ``since`` to the driver's time in ``phase``; return now."""
        now = time.monotonic()
        self._phase_s[phase] = self._phase_s.get(phase, 0.0) + now - since
        return now

    def _spawn_pool_and_estimate(self) -> None:
        """Start the warm pool's processes and, meanwhile, trace the first meta-device estimate in this process
        (only for a policy that places by profiles: the others never trace one).

        The estimate's first trace imports much of torch and, through the workload's optimizer,
        ``torch._dynamo`` (0.9-2 s on the 2-core CPU machine; 3.6-6.2 s per process on the H200 host): paid
        in the driver's set-up it delayed the pool's start by as much, for every policy. A worker's start
        under ``forkserver`` blocks until the server has imported its preload, so the processes are started
        from a thread (it waits on a pipe, without the GIL) while this one traces."""
        devices = self.pool.devices()
        threaded = self.launcher.start_blocks()
        errors: list[BaseException] = []

        def spawn() -> None:
            try:
                self.launcher.replenish(devices)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the driver's thread
                errors.append(exc)

        starter = threading.Thread(target=spawn, name="hpdl-hpo-pool-start", daemon=True) if threaded else None
        if starter is not None:
            starter.start()
        if self.policy.uses_profiles:  # the baselines place blind (Placement.demand): nothing to warm up
            try:  # inside warmup_s, as before in no phase of driver_s (it is no trial's estimate)
                self.workload.estimate(dict(self.spec.fixed))
            except Exception:  # noqa: BLE001 - warm-up only; a workload that cannot build fails in its trials
                pass
        if starter is not None:
            starter.join()
        if errors:
            raise errors[0]

    def _begin_mps(self) -> None:
        """``mps: start`` on a local CUDA pool: start the daemon in a thread, beside the study's set-up
        (``nvidia-cuda-mps-control -d`` and the wait for its pid file); :meth:`_start_mps` waits for it."""
        if (self.spec.mps != "start" or self.spec.backend.get("name", "local") == "ray"
                or not any(d.torch_device.startswith("cuda") for d in self.pool.devices())):
            return
        from hpdl.hpo.mps import MpsDaemon

        self.mps_daemon = MpsDaemon(self.run_dir / "mps")  # set first: shutdown() stops a half-started one

        def start() -> None:
            try:
                self.mps_daemon.start()
            except BaseException as exc:  # noqa: BLE001 - raised by _start_mps in the driver's thread
                self._mps_error = exc

        self._mps_start = threading.Thread(target=start, name="hpdl-hpo-mps-start", daemon=True)
        self._mps_start.start()

    def _join_mps(self) -> None:
        """Wait for the daemon's start begun by :meth:`_begin_mps` (bounded by its own timeout)."""
        if self._mps_start is not None:
            self._mps_start.join()
            self._mps_start = None

    def _start_mps(self) -> None:
        """``mps: start``: a private MPS daemon for this study's worker processes (local GPUs only); waits
        for the start begun beside the study's set-up, or starts it now.

        Raises:
            HpoError, HpoConfigError: the daemon did not start (see :class:`hpdl.hpo.mps.MpsDaemon`)."""
        self._join_mps()
        if self._mps_error is not None:
            exc, self._mps_error = self._mps_error, None
            raise exc
        if self.spec.mps != "start" or self.backend is not None:
            return
        if self.mps_daemon is None:
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
            self._join_mps()
            if self.mps_daemon is not None:
                self.mps_daemon.stop()
        finally:
            self.lock.release()

    def _interrupted(self, stopped: int, took_s: float) -> HpoInterrupted:
        signum = self.signals.signum
        finished, _ = self.ledger.lineages(0.0)
        best = self.result().best_value
        return HpoInterrupted(
            f"interrupted by {signal.Signals(signum).name}: study {self.spec.study!r}: stopped {stopped} running "
            f"trials in {took_s:.1f} s (checkpointed and back to WAITING, no attempt spent), "
            f"{len(finished)}/{self.spec.n_trials} configurations finished, best {best}; `hpdl hpo resume` "
            "continues", signum)

    def _force_exit(self, signum: int) -> None:
        """The stop did not finish by ``exit_deadline_s`` after signal ``signum`` (the main thread is inside a
        blocking call): kill the workers, release the lock and end the process with the signal's status."""
        import sys

        for w in list(self.workers):
            with contextlib.suppress(Exception):
                w.proc.kill()
        self.lock.release()
        print(f"hpdl hpo: interrupted by {signal.Signals(signum).name}: study {self.spec.study!r}: the "
              f"driver did not stop within {self.exit_deadline_s:.1f} s; its workers were killed and "
              f"{len(self.running) + len(self.pending)} trials left for a resume to re-queue (no attempt spent); "
              "`hpdl hpo resume` continues", file=sys.stderr, flush=True)
        os._exit(128 + signum)

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
                           self.faults.preempted, self.warmup_s, self._teardown_s, self._started_at,
                           self.warmup_phases, {k: round(v, 4) for k, v in self._phase_s.items()},
                           **self.clocks())

    def clocks(self) -> dict[str, Any]:
        """``counted_s``, ``setup_s``, ``counted_from`` and ``setup_phases`` of :class:`StudyResult` (seconds;
        before the teardown ended, ``counted_s`` runs to now)."""
        end = self._t_end or time.time()
        ready = self._t_ready or end
        before = max(0.0, self._t_init - self._counted_from)
        driver = max(0.0, (self._t_run or ready) - self._t_init)
        return {"counted_s": end - self._counted_from, "setup_s": ready - self._counted_from,
                "counted_from": self._counted_from,
                "setup_phases": {"before_driver": round(before, 4), "driver": round(driver, 4),
                                 "pool": round(self.warmup_s, 4)}}


def _phases(startups: list[dict]) -> dict[str, dict[str, float]]:
    """Median and largest seconds per phase over the workers' start-up times."""
    names = dict.fromkeys(k for s in startups for k in s)
    return {k: {"median": statistics.median(v), "max": max(v)}
            for k in names if (v := [s[k] for s in startups if k in s])}


def run_study(spec: StudySpec, *, resume: bool = False, progress: bool = False,
              exit_deadline_s: float | None = None, overwrite: bool = False,
              started: float | None = None) -> StudyResult:
    """Run (or, with ``resume``, continue) the study described by ``spec`` to its budget.

    SIGINT/SIGTERM (main thread only) stop it: every worker is told at once to checkpoint and stop, the
    running trials are re-queued without spending an attempt, and :class:`HpoInterrupted` is raised with a
    one-line summary. ``exit_deadline_s`` (the CLI gives 4.5 s): if that has not finished so long after the
    signal (the driver was inside a blocking call, e.g. starting the first worker), kill the workers, print
    the summary line and end the process (``os._exit``); a later ``resume`` re-queues what was left RUNNING,
    without spending an attempt.

    ``overwrite`` (not with ``resume``): delete a stored study of the same name and its checkpoints first.

    ``started`` (Unix time): where the counted-in clock (``StudyResult.counted_s``) starts; default: this call.
    ``hpdl hpo run`` gives its process's start time.

    Returns:
        StudyResult with wall time (s), counts, best value/params and best-so-far history.
    Raises:
        HpoError: study exists (without ``resume`` or ``overwrite``) or is missing (with ``resume``), or
            ``timeout_s`` passed.
        HpoConfigError: invalid spec, pool or policy.
    """
    started = time.time() if started is None else started
    return Driver(spec, resume=resume, progress=progress, exit_deadline_s=exit_deadline_s,
                  overwrite=overwrite, started=started).run()
