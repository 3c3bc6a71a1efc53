"""hpdl.runtime.WorkerGroup: the one place local ranks are started (spawn and the test pool are built on it)."""

import multiprocessing as mp

import pytest

from hpdl.runtime import WorkerFailedError, WorkerGroup, init_from_env

import _rt_cases as R


def test_ranks_live_across_calls_and_survive_a_failed_call():
    with WorkerGroup(3, timeout=60) as group:
        first = group.run(R.pid_and_sum, 2)
        assert [s for _, s, _ in first] == [6.0] * 3 and {w for *_, w in first} == {3}
        with pytest.raises(WorkerFailedError, match=r"rank 1 failed"):
            group.run(R.raise_on_rank, 1, grace=2)
        assert not group.broken   # every rank answered: the group stays usable
        again = group.run(R.pid_and_sum, 1)
        assert [p for p, _, _ in again] == [p for p, _, _ in first]   # the same processes
        procs = list(group._procs)
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="torn down .* or closed"):
        group.run(R.pid_and_sum, 1)


def test_bad_world_size_and_device_are_named():
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        WorkerGroup(0)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        WorkerGroup(2, device="tpu")
    with pytest.raises(ValueError, match="threads must be an int >= 1 or None"):
        WorkerGroup(2, threads=0)


def test_a_rank_stuck_in_a_collective_breaks_the_group():
    with WorkerGroup(2, timeout=60) as group:
        with pytest.raises(WorkerFailedError, match=r"rank 1 failed"):
            group.run(R.fail_on_rank, 1, grace=1)   # rank 0 waits in a barrier for the failed rank
        assert group.broken and not any(p.is_alive() for p in group._procs)


def test_init_from_env_standalone_is_a_world_of_one(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "MV2_COMM_WORLD_RANK"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="no launcher found"):
        init_from_env("cpu")
    with mp.get_context("spawn").Pool(1) as pool:
        assert pool.apply(R.standalone_world) == (0, 1, 1)


def test_a_result_that_cannot_be_pickled_fails_the_call_at_once():
    with WorkerGroup(2, timeout=60) as g:
        with pytest.raises(WorkerFailedError, match="cannot be sent to the parent"):
            g.run(R.unpicklable_result, timeout=120)
        assert g.run(R.pid_and_sum, 1)   # the ranks live on


def test_a_group_works_in_a_process_with_more_than_1024_open_files():
    """A long-lived process (a pytest worker, a server) holds many fds: the group's pipes then get numbers
    >= 1024, which select.select() refuses (every WorkerGroup call failed so in the full test suite)."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1400")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with WorkerGroup(2, timeout=60) as group:
            assert [s for _, s, _ in group.run(R.pid_and_sum, 2)] == [4.0, 4.0]
            with pytest.raises(WorkerFailedError, match=r"rank 1 failed"):
                group.run(R.raise_on_rank, 1, grace=2)
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
