"""hpdl.offload on real ranks (a pool of 4, Gloo): the in-process progress thread and the agents (two
emulated nodes of two ranks: the agents talk over Gloo as on separate hosts)."""

import os
import subprocess
import sys
import time

import pytest

from hpdl.testing import get_pool

import _offload_cases as C

MODES = ["thread", "agent"]
pytestmark = pytest.mark.timeout(300)


def pool():
    return get_pool(4, timeout=240)


@pytest.fixture(scope="module", autouse=True)
def _stop_agents_at_the_end():
    yield
    pool().run(C.stop_agent)  # agents would notice their parents' exit too, a second later


@pytest.mark.parametrize("mode", MODES)
def test_ready_made_plans_match_torch_distributed(mode):
    for wrong in pool().run(C.ready_made, mode):
        assert wrong and all(v == 0 for v in wrong.values()), wrong


@pytest.mark.parametrize("mode", MODES)
def test_started_100_times_in_a_row(mode):
    assert pool().run(C.hundred_starts, mode) == [0, 0, 0, 0]


@pytest.mark.parametrize("mode", MODES)
def test_large_messages_through_the_copy_threads(mode):
    assert pool().run(C.large_messages, mode) == [0, 0, 0, 0]


@pytest.mark.parametrize("mode", MODES)
def test_sub_groups(mode):
    res = pool().run(C.subgroups, mode)
    assert [w for w, _ in res] == [0, 0, 0, 0]
    assert [k for _, k in res] == [["a2a"], ["ar"], ["a2a", "ar"], ["a2a"]]


@pytest.mark.parametrize("mode", MODES)
def test_two_plans_outstanding(mode):
    assert pool().run(C.two_outstanding, mode) == [0, 0, 0, 0]


@pytest.mark.parametrize("mode", MODES)
def test_progress_while_the_application_never_calls_test(mode):
    for ok, picked, done, waited in pool().run(C.no_test_progress, mode):
        assert ok
        assert 0 < picked <= done < waited, (picked, done, waited)  # finished during the 3 s of compute


@pytest.mark.parametrize("mode", MODES)
def test_wait_timeout_names_the_missing_rank(mode):
    res = pool().run(C.timeout_names_missing, mode)
    assert res[1][0] is None
    for rank, (err, ok) in enumerate(res):
        assert ok
        if rank != 1:
            msg, missing, elapsed = err
            assert 1 in missing and "waiting for ranks" in msg and "rank 1" in msg, msg
            assert 1.4 < elapsed < 15, elapsed


def test_agent_stop_and_restart():
    for gone, err, wrong, auto in pool().run(C.agent_stop_start):
        assert gone
        assert "progress='agent' but this process has no agent" in err
        assert wrong == 0 and auto == "agent"


def test_agent_crash_gives_waiting_ranks_a_typed_error_naming_it():
    res = pool().run(C.agent_crash)
    for rank, (err, elapsed, pid0) in enumerate(res):
        kind, msg, agent = err
        assert kind == "AgentError", (rank, msg)
        assert "offload agent 0" in agent and "offload agent 0" in msg, (rank, msg, agent)
        if rank in (0, 1):  # their own agent died: noticed by its pid
            assert f"pid {pid0}" in msg and "died" in msg, msg
        assert elapsed < 20, elapsed
    assert pool().run(C.stop_agent) == [True] * 4  # and the pool is still usable


def test_agent_that_does_not_start_in_time_is_killed_and_named():
    for msg, agent, elapsed in pool().run(C.agent_start_timeout):
        assert msg is not None and "did not become ready within 0.3s" in msg, msg
        assert agent.startswith("offload agent ") and "pid" in agent
        assert elapsed < 30


def test_cli_agent_serves_ranks(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    address = str(tmp_path / "agent.sock")
    proc = subprocess.Popen([sys.executable, "-m", "hpdl.cli", "offload", "agent", "--address", address],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "ready: export HPDL_OFFLOAD_AGENT=" + address in line, line
        assert pool().run(C.external_agent, address) == [(0, 1)] * 4
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert not os.path.exists(address)


def test_agent_rendezvous_failure_names_the_agent(tmp_path):
    from hpdl.offload.agent import run_agent
    from hpdl.offload.errors import AgentError
    from hpdl.runtime.launch import free_port

    t0 = time.monotonic()
    with pytest.raises(AgentError, match=r"offload agent 1 \(pid \d+, .*b.sock\): rendezvous of 2 agents at "
                                         r"127.0.0.1:\d+ failed within 2s") as info:
        run_agent(index=1, agents=2, rendezvous=f"127.0.0.1:{free_port()}", address=str(tmp_path / "b.sock"),
                  timeout=2)
    assert info.value.agent.startswith("offload agent 1 (pid")
    assert time.monotonic() - t0 < 30
    assert list(tmp_path.iterdir()) == []  # nothing left behind
