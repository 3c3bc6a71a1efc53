"""hpdl.runtime.WorkerGroup under misuse and faults: a rank that stops reading, a killed parent, two threads, bad
arguments, data that cannot be unpickled, Ctrl-C while the driver joins, a launcher's identity variables."""

import math
import os
import signal
import subprocess
import sys
import threading
import time
import types
from unittest import mock

import pytest
import torch.distributed as dist

from hpdl.runtime import CollectiveTimeoutError, WorkerFailedError, WorkerGroup
from hpdl.runtime import launch

import _wg_cases as C

HERE = os.path.dirname(os.path.abspath(__file__))
# what torchrun, mpiexec (hydra/PMI, Open MPI) and srun tell the process they start about itself
IDENTITY = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
            "MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x", "PMI_RANK": "3",
            "PMI_SIZE": "4", "PMI_FD": "99", "PMIX_RANK": "3", "OMPI_COMM_WORLD_RANK": "3", "MPI_LOCALRANKID": "3",
            "SLURM_PROCID": "3", "SLURM_LOCALID": "3", "SLURM_NTASKS": "4"}


@pytest.fixture(scope="module")
def group():
    """One group for the tests that must leave it usable (started under a launcher's identity variables)."""
    with mock.patch.dict(os.environ, IDENTITY):
        g = WorkerGroup(2, timeout=60, start_timeout=120)
    with g:
        yield g


def _usable(g):
    assert not g.broken and g.run(C.rank_of, timeout=60) == [0, 1]


@pytest.mark.timeout(120)
def test_a_post_to_a_rank_that_stopped_reading_times_out_naming_it():
    with WorkerGroup(2, timeout=60, start_timeout=120) as g:
        procs = list(g._procs)
        svc = g.start_service(C.StopsReadingOn, 1)
        svc.wait_started()
        g.timeout = 2.0   # the send deadline is the group's timeout (its ranks keep the 60 s they started with)
        with pytest.raises(CollectiveTimeoutError, match=r"post: sending to rank 1 \(it stopped reading"):
            for _ in range(100):   # 6.4 MB: more than the pipe holds
                svc.post(b"x" * 65536)
        assert g.broken
    assert not any(p.is_alive() for p in procs)


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(120)
def test_a_rank_dies_with_its_parent(tmp_path):
    pidfile = tmp_path / "rank.pid"
    parent = subprocess.Popen([sys.executable, os.path.join(HERE, "_wg_cases.py"), "orphan", str(pidfile)])
    try:
        while not pidfile.exists():   # the rank is inside its task
            assert parent.poll() is None, "the parent script ended early"
            time.sleep(0.05)
        rank_pid = int(pidfile.read_text())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 60
        while not _gone(rank_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = not _gone(rank_pid)
        if alive:
            os.kill(rank_pid, signal.SIGKILL)
        assert not alive, "the rank outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.timeout(180)
def test_two_threads_may_call_one_group_at_once(group):
    errors, results = [], []

    def calls():
        try:
            for _ in range(4):
                results.append(group.run(C.nap_then_rank, 0.05, timeout=60))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=calls) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == [[0, 1]] * 8
    _usable(group)


@pytest.mark.timeout(120)
def test_close_from_another_thread_ends_a_call_in_progress(tmp_path):
    """A watchdog closing a group whose call hangs: the call fails at once, the ranks are gone, close returns."""
    pidfile = tmp_path / "rank.pid"
    with WorkerGroup(1, timeout=60, start_timeout=120) as g:
        procs, outcome = list(g._procs), []

        def call():
            try:
                g.run(C.write_pid_and_sleep, str(pidfile))
            except BaseException as exc:  # noqa: BLE001 - checked below
                outcome.append(exc)

        t = threading.Thread(target=call)
        t.start()
        while not pidfile.exists():
            assert t.is_alive(), outcome
            time.sleep(0.05)
        g.close()
        t.join(60)
        assert not t.is_alive() and len(outcome) == 1 and isinstance(outcome[0], WorkerFailedError), outcome
    assert g.broken and not any(p.is_alive() for p in procs)


@pytest.mark.timeout(180)
def test_a_bad_timeout_is_refused_and_the_group_stays_usable(group):
    for bad in ("5", math.nan, -1, True):
        with pytest.raises(ValueError, match=r"timeout must be a number of seconds >= 0"):
            group.run(C.rank_of, timeout=bad)
    with pytest.raises(ValueError, match=r"grace must be a number of seconds"):
        group.run(C.rank_of, grace=-1)
    svc = group.start_service(C.Echo)
    svc.wait_started(timeout=60)
    for bad in ("5", math.nan, -1):
        with pytest.raises(ValueError, match=r"timeout must be a number of seconds >= 0"):
            svc.request(1, timeout=bad)
    assert svc.request(7, timeout=60) == [(0, 7), (1, 7)]
    for long in (1e7, 1e300):   # past poll()'s 2**31 ms: an OverflowError tore the group down
        assert svc.request(8, timeout=long) == [(0, 8), (1, 8)]
        assert group.run(C.rank_of, timeout=long) is not None
    svc.stop()
    _usable(group)


@pytest.mark.parametrize("kwargs, name", [
    ({"timeout": math.inf}, "timeout"), ({"timeout": 1e308}, "timeout"),   # a process group's timedelta overflowed
    ({"timeout": -1}, "timeout"), ({"timeout": 0}, "timeout"), ({"timeout": "x"}, "timeout"),
    ({"timeout": math.nan}, "timeout"), ({"start_timeout": -1}, "start_timeout"),
    ({"ranks_per_node": 0}, "ranks_per_node"), ({"ranks_per_node": [1]}, "ranks_per_node"),
    ({"ranks_per_node": "a"}, "ranks_per_node"), ({"ranks_per_node": [1, 0, 1]}, "ranks_per_node"),
    ({"driver": "yes"}, "driver")])
def test_bad_constructor_arguments_are_refused_before_any_rank_starts(monkeypatch, kwargs, name):
    def no_spawning(*args, **kw):
        raise AssertionError("a rank was started before the arguments were checked")

    monkeypatch.setattr(launch, "mp", types.SimpleNamespace(get_context=no_spawning))
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        WorkerGroup(2, **kwargs)


@pytest.mark.timeout(180)
def test_arguments_a_rank_cannot_unpickle_fail_that_call_only(group):
    with pytest.raises(WorkerFailedError, match=r"rank (\d) failed \(failed ranks: \[0, 1\]\):\nrank \1 cannot "
                                                r"unpickle the arguments of the parent's Task message \d+ "
                                                r"\(ValueError: boom while unpickling\)"):
        group.run(C.rank_of, C.Unpicklable(), timeout=60)
    _usable(group)
    svc = group.start_service(C.Echo)
    svc.wait_started(timeout=60)
    with pytest.raises(WorkerFailedError, match=r"cannot unpickle the payload of the parent's Call message \d+ "
                                                r"\(ValueError: boom while unpickling\)"):
        svc.request(C.Unpicklable(), timeout=60)
    assert svc.request(2, timeout=60) == [(0, 2), (1, 2)]   # the service lives on
    svc.stop()
    _usable(group)


@pytest.mark.timeout(180)
def test_a_result_this_process_cannot_unpickle_names_the_rank(group):
    with pytest.raises(WorkerFailedError, match=r"rank (\d) failed \(failed ranks: \[0, 1\]\):\nrank \1's result "
                                                r"cannot be unpickled in this process \(ValueError: boom while "
                                                r"unpickling"):
        group.run(C.unpicklable_here, timeout=60)
    _usable(group)


@pytest.mark.timeout(180)
def test_ranks_do_not_inherit_the_launchers_identity(group):
    assert group.run(C.environment_of, sorted(IDENTITY), timeout=60) == [dict.fromkeys(IDENTITY)] * 2


@pytest.mark.timeout(180)
def test_a_rank_under_mpiexec_can_use_mpi4py(tmp_path):
    import shutil

    pytest.importorskip("mpi4py")
    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec")
    out = subprocess.run(["mpiexec", "-n", "1", sys.executable, os.path.join(HERE, "_wg_cases.py"), "mpi"],
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0 and "world sizes [1]" in out.stdout, out.stdout + out.stderr


@pytest.mark.timeout(180)
def test_ctrl_c_just_after_the_driver_joined_leaves_no_process_group():
    """The join (on a helper thread) succeeded, Ctrl-C reaches the main thread before it saw so: close() must
    still destroy the group the join made."""
    assert not dist.is_initialized()
    joined = threading.Event()
    real = launch._init_local_group

    def join_then_interrupt(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        joined.wait(30)   # returns only after the main thread's teardown ran: the worst order

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with mock.patch.object(launch, "_init_local_group", join_then_interrupt):
            with pytest.raises(KeyboardInterrupt):
                try:
                    WorkerGroup(2, timeout=60, start_timeout=120, driver=True)
                finally:
                    joined.set()
        deadline = time.monotonic() + 30
        while dist.is_initialized() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not dist.is_initialized(), "the driver's process group outlived the failed start"
    finally:
        signal.signal(signal.SIGINT, previous)
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("kwargs, name", [({"job_timeout": 0}, "job_timeout"), ({"grace": math.nan}, "grace"),
                                          ({"timeout": "5"}, "timeout")])
def test_spawn_names_its_own_bad_arguments_before_any_rank_starts(monkeypatch, kwargs, name):
    def no_spawning(*args, **kw):
        raise AssertionError("a rank was started before the arguments were checked")

    monkeypatch.setattr(launch, "mp", types.SimpleNamespace(get_context=no_spawning))
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        launch.spawn(C.rank_of, 2, **kwargs)
