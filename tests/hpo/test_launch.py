"""Local worker processes: start method (forkserver with preloaded imports, or spawn) and environment."""

import multiprocessing as mp
import os
import signal
import sys
import time

import pytest

from hpdl.hpo.driver import run_study
from hpdl.hpo.errors import HpoError
from hpdl.hpo.launch import START_METHOD_ENV, worker_context
from hpdl.hpo.messages import Ready, RunTask, Task
from hpdl.hpo.spec import StudySpec
from hpdl.runtime.procs import pid_alive
from hpo_fixture_workloads import start_driver

FIXED = {"depth": 1, "batch_size": 16, "image_size": 8, "steps": 10, "eval_every": 10, "width": 4}


def test_worker_context_defaults_to_a_preloading_forkserver(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    expected = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    assert worker_context().get_start_method() == expected
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert worker_context().get_start_method() == "spawn"
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(HpoError, match="HPDL_HPO_START_METHOD='fork' is invalid: expected 'forkserver' or 'spawn'"):
        worker_context()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_see_the_drivers_environment_at_their_own_start(tmp_path, monkeypatch, method):
    """A forkserver keeps the environment it started with; workers must still see the driver's current
    one (a second study after the variable changed), as spawned workers do. Warm pool of one worker."""
    monkeypatch.setenv(START_METHOD_ENV, method)
    for mark in ("first", "second"):
        monkeypatch.setenv("HPDL_TEST_MARK", mark)
        out = tmp_path / mark
        out.mkdir()
        spec = StudySpec.from_dict({
            "study": mark, "workload": "hpo_fixture_workloads:EnvRecordingCNN", "n_trials": 1,
            "run_dir": str(tmp_path / f"run-{mark}"), "warm_workers": 1,
            "space": {"lr": {"type": "float", "low": 0.02, "high": 0.2}},
            "fixed": {**FIXED, "crash_dir": str(out), "env_var": "HPDL_TEST_MARK"},
            "pool": {"fake": 1, "memory_gb": 2}, "policy": {"name": "one_per_gpu"}})
        res = run_study(spec)
        assert res.complete == 1 and not res.failures
        assert (out / "env-0").read_text() == mark


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_killed_driver_leaves_no_process_even_when_trials_never_step(tmp_path, method):
    """SIGKILL the driver while both trials block outside a training step: every process it started
    (workers, a forkserver, the resource tracker) is gone within 20 s."""
    spec = {"study": "b", "workload": "hpo_fixture_workloads:BlockingCNN", "n_trials": 2,
            "run_dir": str(tmp_path / "run"), "warm_workers": 2,
            "space": {"lr": {"type": "float", "low": 0.02, "high": 0.2}},
            "fixed": {**FIXED, "crash_dir": str(tmp_path)},
            "pool": {"fake": 1, "memory_gb": 2}, "policy": {"name": "fixed_fraction", "fraction": 0.5}}
    proc = start_driver(f"StudySpec.from_dict({spec!r})", **{START_METHOD_ENV: method})
    try:
        deadline = time.monotonic() + 150
        while len(list(tmp_path.glob("pid-*[0-9]"))) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, "the driver exited before its trials started"
            time.sleep(0.3)
        trial_pids = {int(p.read_text()) for p in tmp_path.glob("pid-*[0-9]")}
        assert len(trial_pids) == 2, "the two trials did not start within 150 s"
        started = _descendants(proc.pid)
        assert trial_pids <= started
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 20
    while any(pid_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {p for p in started if pid_alive(p)}
    for p in left:  # do not leak them into the rest of the test session
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes outlived the killed driver ({method}): {sorted(left)}"


class _Proc:
    """Stands in for a worker process in late-binding tests: alive (or dead with exit code 1), never started."""
    pid = 0

    def __init__(self, alive: bool = True):
        self.alive, self.exitcode = alive, None if alive else 1

    def is_alive(self):
        return self.alive

    def join(self, timeout=None):
        pass


def _late_driver(tmp_path, fake: int = 1):
    from hpdl.hpo.driver import Driver

    return Driver(StudySpec.from_dict({
        "study": "late", "workload": "cnn", "n_trials": 2, "run_dir": str(tmp_path / "run"),
        "space": {"lr": {"type": "float", "low": 0.02, "high": 0.2}}, "fixed": FIXED,
        "pool": {"fake": fake, "memory_gb": 2}, "policy": {"name": "pack"}}))


@pytest.mark.timeout(60)
def test_a_task_queued_on_a_starting_worker_moves_to_a_warm_worker_that_frees_first(tmp_path):
    """A trial placed while every warm worker was busy waits for a new worker's cold start (2.5-3.5 s on an
    H200 under MPS); a warm worker that finishes first must take it, and the new worker must not get it too
    (2026-11-30: 8 warm workers idle for 2 s on 1 x H200 while their replacements started)."""
    from hpdl.hpo.runs import TrialRun
    from hpdl.hpo.launch import WorkerHandle

    drv = _late_driver(tmp_path)
    launcher, dev = drv.launcher, drv.pool.devices()[0]
    pipes = [mp.Pipe() for _ in range(4)]
    warm = WorkerHandle(_Proc(), pipes[0][0], dev.id, ready=True)
    other = WorkerHandle(_Proc(), pipes[2][0], "fake:elsewhere", ready=True)  # another device: never used
    capped = WorkerHandle(_Proc(), pipes[3][0], dev.id, sm_percent=50, ready=True)  # another MPS cap: never used
    launcher.workers[:] = [warm, other, capped]
    busy = TrialRun(0, 0, 0, {}, "k", time.monotonic(), dev.id, warm)
    warm.trial = busy
    cold = WorkerHandle(_Proc(), pipes[1][0], dev.id)  # still starting
    launcher._spawn = lambda device, sm_percent=100: launcher.workers.append(cold) or cold
    task = Task(1, 1, 1, {})
    assert launcher.start(dev, task) is cold and cold.queued == task
    t = TrialRun(1, 1, 1, {}, "k", time.monotonic(), dev.id, cold)
    cold.trial, drv.running[1] = t, t
    assert not pipes[1][1].poll()  # nothing sent before the worker is ready

    drv.placement.rebind()  # the warm worker is still busy: nothing moves
    assert cold.trial is t and cold.queued == task and not pipes[0][1].poll()
    warm.trial = None  # it finished its trial
    drv.placement.rebind()
    assert warm.trial is t and t.worker is warm and pipes[0][1].recv() == RunTask(task=task)
    assert cold.trial is None and cold.queued is None and not pipes[2][1].poll() and not pipes[3][1].poll()
    launcher.on_ready(cold)  # the cold worker comes up with nothing to do
    assert cold.ready and not pipes[1][1].poll()

    # a queued trial asked to move (device removed, migration) returns to pending without a message
    cold2 = WorkerHandle(_Proc(), pipes[1][0], dev.id, queued=Task(2, 2, 2, {}), trial=None)
    t2 = TrialRun(2, 2, 2, {}, "k", time.monotonic(), dev.id, cold2)
    cold2.trial, drv.running[2] = t2, t2
    drv.placement.preempt(t2)
    assert drv.pending[0] is t2 and 2 not in drv.running and cold2.trial is None and cold2.queued is None
    assert t2.worker is None and not t2.preempt_at and not pipes[1][1].poll()
    for a, b in pipes:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_a_worker_dying_before_ready_returns_its_queued_trial_and_repeated_deaths_leave_the_device_out(tmp_path):
    """The trial queued on a worker that died during its start-up never ran: it goes back to pending, no
    attempt is used. Three such deaths in a row on a device leave that device out (not an endless respawn);
    a ready worker in between resets the count, a worker told to stop does not count, and the study fails
    only when no device is left."""
    from hpdl.hpo.runs import TrialRun
    from hpdl.hpo.launch import WorkerHandle

    drv = _late_driver(tmp_path, fake=2)
    a, b = mp.Pipe()

    def die(n: int, device: str, stopping: bool = False) -> None:
        dead = WorkerHandle(_Proc(alive=False), a, device, closed=True, stopping=stopping)
        if not stopping:  # a stopped worker is an idle one; this one had a trial queued
            dead.queued, dead.trial = Task(n, n, n, {}), TrialRun(n, n, n, {}, "k", time.monotonic(), device, dead)
            drv.running[n] = dead.trial
        drv.launcher.workers[:] = [dead]
        drv._reap()
        if not stopping:
            t = drv.pending[0]
            assert t.number == n and n not in drv.running and t.worker is None
        assert not drv.ledger.failures and not drv.launcher.workers

    try:
        die(1, "fake:0")
        die(2, "fake:0")
        drv._on_message(WorkerHandle(_Proc(), None, "fake:0"), Ready(pid=0))  # one came up: count again
        die(3, "fake:0")
        die(4, "fake:0", stopping=True)  # stopped on purpose (e.g. its device was removed): not counted
        die(5, "fake:0")
        assert not drv.faults.broken
        die(6, "fake:0")
        assert drv.faults.broken == {"fake:0"}  # left out; fake:1 goes on
        for n in (7, 8):
            die(n, "fake:1")
        with pytest.raises(HpoError, match="every device's workers die during start-up"):
            die(9, "fake:1")
        assert drv.pending[0].number == 9  # returned before the error: released as not_started
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_a_rebind_to_a_spare_that_just_died_keeps_the_trial_queued(tmp_path):
    from hpdl.hpo.runs import TrialRun
    from hpdl.hpo.launch import WorkerHandle

    drv = _late_driver(tmp_path)
    dev = drv.pool.devices()[0]
    (a, b), (c, d) = mp.Pipe(), mp.Pipe()
    d.close()  # the spare's end: sending to it fails
    try:
        spare = WorkerHandle(_Proc(), c, dev.id, ready=True)
        cold = WorkerHandle(_Proc(), a, dev.id, queued=Task(1, 1, 1, {}))
        t = TrialRun(1, 1, 1, {}, "k", time.monotonic(), dev.id, cold)
        cold.trial, drv.running[1] = t, t
        drv.launcher.workers[:] = [spare, cold]
        drv.placement.rebind()
        assert cold.trial is t and cold.queued == Task(1, 1, 1, {}) and t.worker is cold and spare.trial is None
    finally:
        for p in (a, b, c):
            p.close()


@pytest.mark.timeout(60)
def test_a_trial_queued_on_a_starting_worker_is_released_when_the_driver_stops(tmp_path):
    """It never started, like a pending one: back to WAITING as the same trial (issue 37: never FAIL plus a
    clone), not left RUNNING."""
    from hpdl.hpo.runs import TrialRun
    from hpdl.hpo.launch import WorkerHandle

    drv = _late_driver(tmp_path)
    asked = drv.study.ask(drv.dists)
    cold = WorkerHandle(_Proc(), None, "fake:0", queued=Task(asked._trial_id, asked.number, asked.number, {}))
    t = TrialRun(asked.number, asked._trial_id, asked.number, dict(asked.params), "k", time.monotonic(), "fake:0", cold)
    cold.trial, drv.running[t.number] = t, t
    drv.faults.release_pending()
    states = sorted(x.state.name for x in drv.study.get_trials(deepcopy=False))
    assert states == ["WAITING"] and not drv.ledger.failures
