"""A demanding user's mistakes and failures (review of hpdl.offload): asymmetric bad arguments, test() loops
on dead agents or absent peers, more messages than I/O threads, late peers, freed peers, killed processes'
shared memory, agents that would steal a live agent's address, and the control channel after a timeout."""

import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener

import pytest
import torch

import hpdl.offload as ho
from hpdl.testing import get_pool

import _misuse_cases as M
import _offload_cases as C

pytestmark = pytest.mark.timeout(300)


def pool():
    return get_pool(4, timeout=240)


@pytest.fixture(scope="module", autouse=True)
def _stop_agents_at_the_end():
    yield
    pool().run(C.stop_agent)


def test_a_bad_argument_on_one_rank_raises_on_every_rank_at_once():
    for res in pool().run(M.one_rank_is_wrong):
        kind, msg, elapsed = res["alltoall"]
        assert kind == "PlanError" and msg.startswith("rank 2: alltoall_init: input and output need") and \
            "got 17 and 17" in msg, msg
        kind, msg, _ = res["allreduce"]
        assert kind == "PlanError" and msg.startswith("rank 3: ") and "'avg'" in msg, msg
        kind, msg, _ = res["progress"]
        assert kind == "PlanError" and "rank 1: progress must be one of" in msg, msg
        assert all(r[2] < 20 for r in res.values()), res


def test_parameters_bind_in_thread_mode():
    assert pool().run(M.parameter_buffer) == [True] * 4


def test_more_messages_in_flight_than_io_threads():
    for got, wrong in pool().run(M.many_messages, 520):  # the executor has 512 I/O threads
        assert got == (None, None) and wrong == 0, got


def test_a_peer_later_than_the_first_compiles_timeout_still_completes():
    for res, ok in pool().run(M.late_peer):
        assert res == (None, None) and ok, res


@pytest.mark.parametrize("mode", ["thread", "agent"])
def test_a_test_loop_raises_the_request_timeout_naming_the_absent_rank(mode):
    res = pool().run(M.test_loop_times_out, mode)
    for rank, (err, ok) in enumerate(res):
        assert ok
        if rank != 3:
            kind, msg, elapsed, missing = err
            assert kind == "OffloadTimeoutError" and 3 in missing and "after start()" in msg, msg
            assert 0.9 < elapsed < 10, elapsed


def test_an_error_leaving_a_with_block_does_not_wait_a_second_timeout():
    res = pool().run(M.with_block_error)
    for rank in range(3):
        assert 0.9 < res[rank] < 1.9, res


def test_a_test_loop_raises_when_the_agent_dies():
    res = pool().run(M.test_loop_dead_agent)
    for rank in (0, 1):
        kind, msg, elapsed = res[rank]
        assert kind == "AgentError" and "offload agent 0" in msg and "died" in msg, msg
        assert elapsed < 10, elapsed
    assert pool().run(C.stop_agent) == [True] * 4


def test_a_peer_that_frees_its_request_fails_the_waiting_rank_at_once():
    res = pool().run(M.peer_frees_while_waited)
    kind, msg, elapsed = res[0]
    assert kind == "OffloadError" and "rank 1" in msg and "freed its request" in msg, msg
    assert elapsed < 10, elapsed


def test_the_agent_unmaps_buffers_of_freed_requests():
    for mapped, paths in pool().run(M.agent_unmaps_freed_buffers):
        assert not set(mapped) & set(paths), (mapped, paths)


def test_shared_memory_of_a_killed_process_is_swept(tmp_path, monkeypatch):
    monkeypatch.setenv("HPDL_OFFLOAD_SHM_DIR", str(tmp_path))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    code = ("import sys, time, torch, hpdl.offload as ho\n"
            "bufs = [ho.empty((1000,), torch.float32) for _ in range(3)]\n"
            "print(' '.join(ho.shm.handle_of(b).path for b in bufs), flush=True)\n"
            "time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        theirs = p.stdout.readline().split()
    finally:
        p.kill()  # SIGKILL: no atexit, no finalizers
        p.wait()
    assert len(theirs) == 3 and all(os.path.exists(t) for t in theirs)
    keep = ho.empty((10,), torch.float32)  # this process's first file in the directory sweeps it
    assert not any(os.path.exists(t) for t in theirs)
    assert os.path.exists(ho.shm.handle_of(keep).path)  # a live process's buffer is kept
    assert ho.shm.sweep(str(tmp_path)) == []
    left = sorted(os.listdir(tmp_path))  # ours: one buffer and the owner file whose lock this process holds
    assert len(left) == 2 and left[0].startswith("hpdl-offload-buf-") and left[1].startswith("hpdl-owner-"), left


def test_a_forked_child_leaves_its_parents_buffers_alone(tmp_path, monkeypatch):
    from hpdl.comm.transport import shm as cshm

    monkeypatch.setenv("HPDL_OFFLOAD_SHM_DIR", str(tmp_path))
    x = ho.empty((4,), torch.float32)
    path = ho.shm.handle_of(x).path
    pid = os.fork()
    if pid == 0:  # the child runs what its normal exit runs (atexit, finalizers), then leaves
        cshm.cleanup()
        del x
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.exists(path)


def test_an_agent_refuses_an_address_a_live_agent_serves(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    address = str(tmp_path / "agent.sock")
    cmd = [sys.executable, "-m", "hpdl.cli", "offload", "agent", "--address", address]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert "ready" in first.stdout.readline()
        second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert second.returncode != 0
        assert f"pid {first.pid}" in second.stderr and "serves it already" in second.stderr, second.stderr
        assert os.path.exists(address) and os.path.exists(address + ".key")  # the live agent's files stay
        c = ho.AgentClient(address, label="test")  # and it still serves
        assert c.request(ho.control.Query(0)) is None
        c.close()
    finally:
        first.terminate()
        assert first.wait(timeout=30) == 0


def test_a_late_reply_is_not_taken_for_the_next_ones(tmp_path):
    """The client's first request times out; the agent's late answer to it must not answer the second."""
    from hpdl.offload import control as P
    from hpdl.offload.client import AgentClient

    address, key = str(tmp_path / "fake.sock"), b"k" * 16
    listener = Listener(address, family="AF_UNIX", authkey=key)

    def fake_agent():
        conn = listener.accept()
        seq, _ = conn.recv()  # Hello
        conn.send((seq, P.Reply(True, P.Welcome(0, 1, os.getpid(), "h", str(tmp_path / "st"),
                                                str(tmp_path / "bell")))))
        seq, _ = conn.recv()  # first: answered late
        time.sleep(0.5)
        conn.send((seq, P.Reply(True, "first")))
        seq, _ = conn.recv()
        conn.send((seq, P.Reply(True, "second")))
        time.sleep(0.5)
        conn.close()

    import numpy as np

    np.zeros(8, dtype=np.int64).tofile(str(tmp_path / "st"))
    os.mkfifo(str(tmp_path / "bell"))
    r = os.open(str(tmp_path / "bell"), os.O_RDONLY | os.O_NONBLOCK)
    t = threading.Thread(target=fake_agent, daemon=True)
    t.start()
    c = AgentClient(address, key, label="test", timeout=10)
    with pytest.raises(ho.AgentError, match="did not answer Query within 0s"):
        c.request(P.Query(0), timeout=0.1)
    assert c.request(P.Query(1)) == "second"
    c.close()
    os.close(r)
    t.join()
    listener.close()


def test_a_closed_doorbell_never_writes_to_a_reused_descriptor(tmp_path):
    fifo = str(tmp_path / "bell")
    b = ho.shm.Bell(fifo=fifo)
    rb = ho.shm.RemoteBell(fifo)
    numbers = (rb._w, b._w)
    rb.close()
    b.close()
    with open(tmp_path / "other", "wb+") as fh:
        for n in numbers:  # another file takes the numbers just closed, as the next open() may
            os.dup2(fh.fileno(), n)
        try:
            rb.ring()
            b.ring()
        finally:
            for n in numbers:
                os.close(n)
        fh.seek(0)
        assert fh.read() == b""


def test_compile_on_a_rank_outside_the_group_is_a_value_error():
    kind, msg = pool().run(M.not_a_member)[3]
    assert kind == "ValueError" and "global rank 3 is not a member" in msg, msg


def test_a_plan_for_another_world_size_or_rank_says_so():
    for q, res in enumerate(pool().run(M.plan_for_another_grid)):
        kind, msg, _ = res["world"]
        assert kind == "PlanError" and "was built for world_size 8 but the group has 4 ranks" in msg, msg
        kind, msg, _ = res["rank"]
        assert kind == "PlanError" and "was built for rank 1 but is compiled on rank 0" in msg, msg


def test_a_start_after_a_same_node_peer_freed_fails_at_once():
    kind, msg, elapsed = pool().run(M.peer_freed_before_start)[0]
    assert kind == "OffloadError" and "rank 1" in msg and "freed its request" in msg, msg
    assert "will never come" in msg and elapsed < 10, (msg, elapsed)


def test_a_request_that_timed_out_can_be_freed():
    res = pool().run(M.free_after_timeout)
    assert res[3] is None
    for r in res[:3]:
        assert r == ("OffloadTimeoutError", (None, None), True), r


def test_a_rank_that_never_compiles_is_named_within_the_timeout():
    res = pool().run(M.rank_never_compiles)
    assert res[3] is None
    for kind, msg, quick in res[:3]:
        assert kind == "OffloadTimeoutError" and "rank(s) [3]" in msg and quick, msg


def test_files_of_killed_agents_are_swept_and_live_ones_kept(tmp_path):
    """A killed job leaves hpdl-offload-*.sock and its .status/.bell/.key/.log behind; sweep_stale removes
    the set whose agent pid is dead (or, without a status, that nobody serves and is old) and keeps a live
    agent's files."""
    import numpy as np

    from hpdl.offload import agent as A

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()

    def make(base, pid, status=True):
        addr = tmp_path / base
        for suffix in ("", ".bell", ".key", ".log"):
            (tmp_path / (base + suffix)).write_bytes(b"")
        if status:
            st = np.zeros(A.STATUS_WORDS, dtype=np.int64)
            st[A.PID], st[A.STATE] = pid, A.READY
            st.tofile(str(addr) + ".status")
        return addr

    dead = make("hpdl-offload-aa11-0.sock", gone.pid)
    live = make("hpdl-offload-bb22-0.sock", os.getpid())
    orphan = make("hpdl-offload-agent-0-cc.sock", 0, status=False)  # killed before it wrote its status
    old = time.time() - 3600
    for p in tmp_path.iterdir():
        if p.name.startswith("hpdl-offload-agent-0-cc"):
            os.utime(p, (old, old))
    (tmp_path / "unrelated.sock").write_bytes(b"")
    removed = A.sweep_stale(str(tmp_path))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not any(n.startswith("hpdl-offload-aa11") or n.startswith("hpdl-offload-agent-0-cc") for n in left), left
    assert sorted(n for n in left if n.startswith("hpdl-offload-bb22")) == sorted(
        live.name + s for s in ("", ".bell", ".key", ".log", ".status"))
    assert "unrelated.sock" in left and str(dead) + ".status" in removed and str(orphan) in removed


def test_sweep_keeps_the_files_of_an_agent_still_in_its_rendezvous(tmp_path):
    """An agent waits up to its timeout for the other nodes' agents before it serves; its key (written before)
    grew older than the sweep's 60 s meanwhile, with no status and no listener, and another job's agent
    starting on the host deleted it (ranks then cannot read the key). The agent names its pid from the start."""
    from hpdl.offload import agent as A
    from hpdl.runtime.launch import free_port

    address = str(tmp_path / "hpdl-offload-rdv-0.sock")
    code = ("import sys; from hpdl.offload.agent import run_agent; "
            f"run_agent(index=0, agents=2, rendezvous='127.0.0.1:{free_port()}', address={address!r}, timeout=60)")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(address + ".key"):   # it is in its rendezvous once its key exists
            assert proc.poll() is None and time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.1)
        time.sleep(0.5)
        old = time.time() - 3600   # as if the other agents took longer than a minute to come up
        for p in tmp_path.iterdir():
            os.utime(p, (old, old))
        assert proc.poll() is None
        removed = A.sweep_stale(str(tmp_path))
        assert removed == [] and os.path.exists(address + ".key"), removed
    finally:
        proc.kill()
        proc.wait()
    assert A.sweep_stale(str(tmp_path)) and not os.path.exists(address + ".key")   # once it is gone: swept


def test_a_rank_that_dies_on_another_node_is_named_not_its_agent(tmp_path):
    import json

    from hpdl.runtime import spawn
    from hpdl.runtime.errors import WorkerFailedError

    path = tmp_path / "rank0.json"
    with pytest.raises(WorkerFailedError):
        spawn(M.remote_rank_dies, 2, args=(str(path),), timeout=90)
    kind, msg, took, _ = json.loads(path.read_text())
    assert kind == "OffloadPeerError" and "rank 1 (pid" in msg and "died" in msg, (kind, msg)
    assert took < 20, took


def test_graph_progress_on_cpu_buffers_is_a_plan_error_on_every_rank():
    for kind, msg in pool().run(M.graph_needs_cuda):
        assert kind == "PlanError" and "progress='graph' needs every buffer on one CUDA device" in msg, msg


def test_zero_size_shared_buffers_run_on_the_agent():
    for res in pool().run(M.zero_size_buffers):
        assert res == {"alltoall": (None, None), "allreduce_view": (None, None)}, res


def test_a_plan_the_native_executor_takes_on_some_ranks_only_runs_on_one_executor():
    res = pool().run(M.native_on_some_ranks_only)
    assert [r[0] for r in res] == [(None, None)] * 4, res
    assert len({r[1] for r in res}) == 1, res   # the same executor for every rank
    assert res[1][2] == [7.0] * 4 and res[3][2] == [9.0] * 4, res


def test_the_native_executor_names_the_rank_that_freed_the_other_half():
    res = pool().run(M.native_peer_freed_before_start)
    assert [r[0] for r in res] == ["native"] * 4, res
    for rank in (0, 2):
        kind, msg, elapsed = res[rank][1]
        assert kind == "OffloadError" and f"rank {rank + 1}" in msg and "freed its request" in msg, msg
        assert "will never come" in msg and elapsed < 10, (msg, elapsed)


def test_bad_arguments_on_one_rank_are_plan_errors_on_every_rank():
    want = {"list": (1, "input must be a torch.Tensor, got list"),
            "none": (2, "tensor must be a torch.Tensor, got NoneType"),
            "timeout": (3, "timeout must be a finite number of seconds > 0"),
            "sparse": (0, "must be a dense (strided) tensor"),
            "meta": (1, "is on meta; bind CPU or CUDA tensors")}
    for res in pool().run(M.bad_arguments_everywhere):
        for k, (rank, text) in want.items():
            kind, msg, quick = res[k]
            assert kind == "PlanError" and msg.startswith(f"rank {rank}: ") and text in msg and quick, (k, res[k])


def test_two_threads_starting_one_request_start_it_once():
    # the second thread enters start() while the first is between its 'active?' check and setting it: before
    # the fix both started it (two generations rung: the executor could run the plan twice for one start of
    # the peers, pairing this rank's second run with their next iteration); now the second one is refused
    import types

    import numpy as np

    from hpdl.offload.api import PersistentRequest

    inside, release = threading.Event(), threading.Event()
    rings = []

    class Backend:
        kind = "thread"
        mailboxes = types.SimpleNamespace(array=np.zeros((1, 8), dtype=np.int64))

        @property
        def closed(self):
            inside.set()
            release.wait(10)
            return False

        def ring(self, handle=None):
            rings.append(handle)

    plan = types.SimpleNamespace(name="p", rank=0)
    req = PersistentRequest(plan, {"x": torch.zeros(1)}, Backend(), 0, 0, threading.Event(), 30)
    errors = []

    def start():
        try:
            req.start()
        except ho.OffloadError as exc:
            errors.append(str(exc))

    first = threading.Thread(target=start)
    first.start()
    assert inside.wait(10)
    inside.clear()
    second = threading.Thread(target=start)
    second.start()
    inside.wait(0.5)   # before the fix the second thread reaches 'closed' too; after it, it waits for the lock
    release.set()
    first.join(10)
    second.join(10)
    assert len(rings) == 1 and req._mb[0] == 1, (rings, req._mb[0])
    assert len(errors) == 1 and "start() of an active request" in errors[0], errors
