"""The study's bookkeeping in the Optuna storage: configurations (lineages), failures, retries, recovery.

A configuration's first trial is its lineage; a retry is ``study.enqueue_trial`` with the same parameters
and ``user_attrs`` ``hpdl_lineage`` and ``hpdl_attempt``. A lineage is finished when one attempt completes
or is pruned, when it failed more than ``max_retries`` times, or when a failure gave up on it
(``hpdl_gave_up``: too big for any device). Reading the storage is the truth after any restart.

A trial stopped for a reason that is not its own (Ctrl-C or SIGTERM, the driver killed, the run folder, or
never started) is not a failure: it goes back to ``WAITING``, Optuna's state for a trial that waits to run
(as an enqueued one), keeping its trial number, parameters and intermediate values, and the next ``ask``
takes it again (:meth:`Ledger.requeue`). So an interrupted study that is resumed shows one trial per
configuration, as an uninterrupted one does, never a FAIL for the interrupt. (Optuna's own
``Study.optimize`` stores a trial interrupted by Ctrl-C as FAIL, and its ``RetryFailedTrialCallback`` clones
stale trials into new ones; both count an interrupt as a failed trial, which misreads a study's
failures.) ``hpdl_requeued`` on the trial lists each such stop as ``"<kind>: <why>"``.
"""

from __future__ import annotations

import logging
import os
import signal
import time

# failures that are not the trial's own: re-queued as they were, no attempt spent (checkpoint_write: the
# run folder could not take a checkpoint; the driver stops the study, see hpdl.hpo.faults)
REQUEUE_KINDS = ("not_started", "interrupted", "driver_died", "checkpoint_write")


def _kind(failure: str) -> str:
    return str(failure).partition(":")[0]


def counts_as_attempt(failure: str) -> bool:
    """True when a FAIL trial's ``hpdl_failure`` (``"<kind>: <message>"``) spent one of its configuration's
    attempts, i.e. the trial itself failed (see :data:`REQUEUE_KINDS`)."""
    return _kind(failure) not in REQUEUE_KINDS


class Ledger:
    """Lineage accounting and failure handling for one driver (not thread-safe).

    Args:
        study: the ``optuna.Study`` (RDB storage).
        storage: the ``optuna.storages.BaseStorage`` the study was created on (the driver passes the one it
            made); None only for a study whose storage the caller did not make (an in-memory study).
        max_retries: retries after a configuration's first failed attempt.
        host: this driver's host name; recovery only touches trials started from this host.
        refresh_s: :meth:`lineages` re-reads the storage at least this often (seconds), so that other
            drivers sharing the storage (many nodes) are seen (their finished configurations end this
            driver's study too); between reads it counts this driver's own asks and tells (:meth:`asked`,
            :meth:`closed`). The driver asks for a younger read where the budget limits its asks.
    """

    def __init__(self, study, max_retries: int, host: str, refresh_s: float = 2.0, storage=None):
        self.study, self.max_retries, self.host, self.refresh_s = study, max_retries, host, refresh_s
        if storage is None:  # an in-memory study (tests): its storage is the one Optuna made for it
            storage = study._storage  # noqa: SLF001 - only when the caller did not create the storage
        self.storage = storage
        self.study_id = storage.get_study_id_from_name(study.study_name)
        self.failures: dict[str, int] = {}  # the trials' own failed attempts by kind
        self.requeued: dict[str, int] = {}  # trials stopped by a driver and re-queued, by kind
        self.dirty = True  # lineages() re-reads the storage: set after this ledger's failures and enqueues
        self.waiting = 0
        self._cache: tuple[set[int], set[int]] = (set(), set())
        self._read_at = 0.0
        self.stop_requested = False  # the sampler called study.stop(): ask no new configuration
        self.shared = False  # the storage holds configurations this ledger did not ask for (resume, many nodes)
        self._mine: set[int] = set()

    def tell(self, number: int, value: float | None = None, state=None):
        """``study.tell(number, value, state=state)``; returns the frozen trial. Optuna stores the state and
        then runs the sampler's ``after_trial``; an error there is the sampler's, not the trial's
        (``study.stop()``, which raises outside ``Study.optimize``: ``GridSampler`` once every grid point
        ran; ``GridSampler``'s ``KeyError`` for an enqueued retry): with the state stored it is logged and a
        stop sets ``stop_requested``. An error before the state was stored is raised."""
        try:
            return self.study.tell(number, value, state=state)
        except Exception as exc:
            ft = self.storage.get_trial(self.trial_id(number))
            if state is None or ft.state != state:
                raise
            if isinstance(exc, RuntimeError) and "Study.stop" in str(exc):
                self.stop_requested = True
            else:
                logging.getLogger("hpdl.hpo").warning("trial %d is %s, but the sampler's after_trial raised %r",
                                                      number, state.name, exc)
            return ft

    def trial_id(self, number: int) -> int:
        """The storage's id of this study's trial ``number``."""
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)

    def recover(self) -> None:
        """Trials left RUNNING by a dead driver of this host: kill leftover worker processes and put the
        trials back to WAITING (:meth:`requeue`; ``driver_died`` if a worker had started them, else
        ``not_started``): the driver's death spends no attempt, and a started trial continues from its
        configuration's checkpoint. Call it only while holding the study's lock
        (:class:`hpdl.hpo.lock.StudyLock`): the trials of a live driver must not be touched."""
        from optuna.trial import TrialState

        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if t.user_attrs.get("hpdl_host", self.host) != self.host:
                continue  # another node's driver owns it
            pid = t.user_attrs.get("hpdl_pid")
            if pid and _is_our_worker(int(pid), t.user_attrs.get("hpdl_started_at")):
                os.kill(int(pid), signal.SIGKILL)
            if pid:
                self.fail(t.number, t.params, t.user_attrs, "driver_died",
                          "the driver was killed while it ran (re-queued from its checkpoint)")
            else:
                self.fail(t.number, t.params, t.user_attrs, "not_started", "the driver was killed before it started")

    def lineages(self, max_age_s: float | None = None) -> tuple[set[int], set[int]]:
        """(finished, active) lineages according to the storage: re-read after this ledger's failures and
        enqueues, or when the last read is older than ``max_age_s`` (default ``refresh_s``); otherwise the
        last read plus this driver's own asks and tells. A re-read costs about 20 ms with 64 trials."""
        from optuna.trial import TrialState

        age = self.refresh_s if max_age_s is None else max_age_s
        if not self.dirty and time.monotonic() - self._read_at < age:
            return self._cache
        self.dirty, self._read_at = False, time.monotonic()
        fails: dict[int, int] = {}
        finished, active = set(), set()
        self.waiting = 0
        for t in self.study.get_trials(deepcopy=False):
            self.waiting += t.state == TrialState.WAITING
            lin = int(t.user_attrs.get("hpdl_lineage", t.number))
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
                finished.add(lin)
            elif t.state == TrialState.FAIL:
                if t.user_attrs.get("hpdl_gave_up"):
                    finished.add(lin)
                elif counts_as_attempt(t.user_attrs.get("hpdl_failure", "")):
                    fails[lin] = fails.get(lin, 0) + 1
            else:
                active.add(lin)
        finished |= {lin for lin, n in fails.items() if n > self.max_retries}
        self.shared = self.shared or bool((finished | active | set(fails)) - self._mine)
        self._cache = (finished, active - finished)
        return self._cache

    def asked(self, lineage: int) -> None:
        """Count a trial the driver just asked for without re-reading the storage: its ``lineage`` is active,
        and it was taken from the waiting queue if one was waiting (Optuna's ``ask`` pops a waiting trial
        first). Exact while the storage holds only this ledger's configurations; otherwise (``shared``: a
        resumed study, another driver, a user's enqueued trial) the driver reads afresh before it asks.
        A re-read every tick would cost about as much as an ``ask``."""
        self._mine.add(lineage)
        if not self.dirty:
            self.waiting = max(0, self.waiting - 1)
            self._cache[1].add(lineage)

    def closed(self, lineage: int) -> None:
        """Count a COMPLETE or PRUNED ``tell`` of ``lineage`` without re-reading the storage."""
        if not self.dirty:
            self._cache[0].add(lineage)
            self._cache[1].discard(lineage)

    def requeue(self, number: int, kind: str, message: str) -> None:
        """Put trial ``number`` (RUNNING) back to ``WAITING`` for a reason that is not its own (``kind`` in
        :data:`REQUEUE_KINDS`): no attempt is spent, and the next ``ask`` takes the same trial again, with
        its parameters, intermediate values and its configuration's checkpoint. Appends
        ``"<kind>: <message>"`` to its ``hpdl_requeued`` list. Needs an RDB storage, as the driver's: Optuna's
        in-memory storage looks for WAITING trials only after the last one it handed out."""
        from optuna.trial import TrialState

        self.dirty = True
        if kind != "not_started":
            self.requeued[kind] = self.requeued.get(kind, 0) + 1
        tid = self.trial_id(number)
        attrs = self.storage.get_trial(tid).user_attrs
        if "hpdl_lineage" not in attrs:  # asked, then stopped before the driver labelled it: its own lineage
            self.storage.set_trial_user_attr(tid, "hpdl_lineage", number)
        self.storage.set_trial_user_attr(tid, "hpdl_requeued",
                                         list(attrs.get("hpdl_requeued", [])) + [f"{kind}: {message[-300:]}"])
        self.storage.set_trial_state_values(tid, TrialState.WAITING)

    def fail(self, number: int, params: dict, attrs: dict, kind: str, message: str, retry: bool = True) -> None:
        """Tell trial ``number`` FAIL with ``hpdl_failure = "<kind>: <message>"`` and, while attempts are left
        and ``retry``, enqueue the configuration again (``attrs`` carry its lineage and attempt).
        Kinds: oom, error, died, too_big, nan, checkpoint (the trial's own: they spend an attempt). A kind
        of :data:`REQUEUE_KINDS` is no failure: the trial goes back to WAITING (:meth:`requeue`)."""
        from optuna.trial import TrialState

        if kind in REQUEUE_KINDS:
            self.requeue(number, kind, message)
            return
        self.dirty = True
        own = kind not in REQUEUE_KINDS
        if own:
            self.failures[kind] = self.failures.get(kind, 0) + 1
        elif kind != "not_started":
            self.requeued[kind] = self.requeued.get(kind, 0) + 1
        tid = self.trial_id(number)
        self.storage.set_trial_user_attr(tid, "hpdl_failure", f"{kind}: {message[-500:]}")
        attempt = int(attrs.get("hpdl_attempt", 0)) + own
        retry = retry or not own
        if not retry or attempt > self.max_retries:
            self.storage.set_trial_user_attr(tid, "hpdl_gave_up", True)
        self.tell(number, state=TrialState.FAIL)
        if retry and attempt <= self.max_retries:
            self.study.enqueue_trial(params, user_attrs={"hpdl_lineage": int(attrs.get("hpdl_lineage", number)),
                                                         "hpdl_attempt": attempt}, skip_if_exists=False)


def _is_our_worker(pid: int, trial_started_at: float | None = None) -> bool:
    """True when ``pid`` is alive, is a Python process and, given ``trial_started_at`` (Unix time the worker
    recorded when it took the trial), started before that trial: a process whose pid was recycled after our
    worker died started later, and a resume days after a crash must not SIGKILL someone's Python process
    that got the number (before, any live Python process with the recorded pid was killed)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"python" not in f.read():
                return False
    except OSError:
        return False
    if trial_started_at is None:
        return True
    started = _process_start_time(pid)
    return started is None or started <= float(trial_started_at) + 1.0  # 1 s: clock-tick rounding


def _process_start_time(pid: int) -> float | None:
    """Unix time at which process ``pid`` started (``/proc/<pid>/stat`` field 22 after boot), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(ln.split()[1]) for ln in f if ln.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
