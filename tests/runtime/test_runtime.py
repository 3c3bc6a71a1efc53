import sys

import pytest

from hpdl.runtime import CollectiveTimeoutError, Topology, WorkerFailedError, detect_launcher, env, spawn

import _rt_cases as R


def test_topology_emulated_equal_and_uneven():
    t = Topology.emulate(8, 4)
    assert t.num_nodes == 2 and t.ranks_per_node() == [4, 4]
    assert [t.local_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert t.rail_ranks(1) == [1, 5] and t.num_rails == 4
    u = Topology.emulate(5, [3, 2])
    assert u.node_ranks(1) == [3, 4] and u.rail_ranks(2) == [2] and u.num_rails == 3
    with pytest.raises(ValueError, match="sum to world_size=5"):
        Topology.emulate(5, [3, 3])
    with pytest.raises(ValueError, match="ranks_per_node must be >= 1"):
        Topology.emulate(4, 0)


def test_topology_from_hostnames():
    t = Topology.from_hostnames(["b", "a", "b", "a", "c"])
    assert t.node_of == (0, 1, 0, 1, 2) and t.local_rank(2) == 1 and not t.emulated


def test_detect_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
                "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert detect_launcher() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert detect_launcher() == ("openmpi", 3, 8, 1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert detect_launcher()[0] == "torchrun"


def test_env_registry(monkeypatch):
    monkeypatch.setenv("HPDL_TIMEOUT", "12.5")
    assert env.get("HPDL_TIMEOUT") == 12.5
    monkeypatch.setenv("HPDL_CHECK", "maybe")
    with pytest.raises(ValueError, match="HPDL_CHECK"):
        env.get("HPDL_CHECK")
    assert "HPDL_TIMEOUT" in env.table()


@pytest.mark.timeout(120)
def test_spawn_runs_and_emulates_nodes():
    out = spawn(R.allreduce_rank, 3, ranks_per_node=[2, 1], timeout=90)
    assert [o[0] for o in out] == [3.0] * 3
    assert out[0][1] == (0, 0, 1)


@pytest.mark.timeout(120)
def test_spawn_reports_failed_rank_with_traceback():
    with pytest.raises(WorkerFailedError, match=r"rank 1 failed[\s\S]*boom on 1"):
        spawn(R.fail_on_rank, 3, args=(1,), timeout=60, grace=2)


@pytest.mark.timeout(120)
def test_spawn_reports_dead_rank():
    with pytest.raises(WorkerFailedError, match="rank 0 died: exited with code 3"):
        spawn(R.exit_on_rank, 2, args=(0,), timeout=60, grace=2)


@pytest.mark.timeout(120)
def test_spawn_timeout_names_stuck_rank():
    # rank 1 never returns; rank 0 returns once started, which a loaded machine may not manage in 15 s
    with pytest.raises(CollectiveTimeoutError, match=r"ranks still running: \[(0, )?1\]"):
        spawn(R.hang_on_rank, 2, args=(1,), job_timeout=15)


def test_source_commit_prefers_hpdl_commit_then_the_checkout(monkeypatch):
    from hpdl.bench.report import source_commit

    monkeypatch.setenv("HPDL_COMMIT", "abc1234")
    assert source_commit() == "abc1234"
    monkeypatch.delenv("HPDL_COMMIT")
    sha = source_commit().removesuffix("+dirty")  # the tests run from a git checkout (CI clones the repository)
    assert len(sha) == 40 and int(sha, 16) >= 0
    monkeypatch.chdir("/")
    assert source_commit() == "unknown"
