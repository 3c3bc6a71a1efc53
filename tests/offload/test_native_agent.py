"""The agent's native executor with real ranks (one node, 4 processes): plans whose ranks all share the agent
run on it (the request says so), exactly, many starts in a row, two plans at once; a peer that frees its
request fails the waiting rank at once; plans spanning nodes stay on the Python executor."""

import pytest
import torch
import torch.distributed as dist

import hpdl.offload as ho
from hpdl.offload import native, plans
from hpdl.testing import get_pool

def pool():
    return get_pool(4, timeout=200)


pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(native.load() is None, reason="native executor unavailable (no C compiler, or HPDL_OFFLOAD_NATIVE=0)")]


def _native_plans(ctx):
    P, r = ctx.world_size, ctx.rank
    with ho.Agent(threads=2, timeout=60):
        inp, out = ho.empty((P, 40000), torch.float32), ho.empty((P, 40000), torch.float32)
        data = ho.empty((1001,), torch.int64)
        u = ho.empty((6, 18, 18), torch.float32)
        a2a = ho.alltoall_init(inp, out, timeout=60)
        ar = ho.allreduce_init(data, "max", algorithm="ring", timeout=60)
        halo = ho.compile(plans.halo3d((4, 16, 16), (P, 1, 1), r, torch.float32), {"u": u}, timeout=60)
        natives = [req.executor == "native" for req in (a2a, ar, halo)]
        wrong = 0
        for i in range(8):
            inp.copy_(torch.arange(P * 40000, dtype=torch.float32).view(P, 40000) % 997 + 1000 * r + i)
            x = (torch.arange(1001) % 13) * (r + 1) + i
            data.copy_(x)
            u.fill_(-1)
            u[1:-1, 1:-1, 1:-1] = r
            ho.startall([a2a, ar, halo])
            ho.waitall([halo, ar, a2a], timeout=60)
            want = torch.empty(P * 40000)
            dist.all_to_all_single(want, inp.view(-1).clone())
            xs = x.clone()
            dist.all_reduce(xs, op=dist.ReduceOp.MAX)
            wrong += int((out.view(-1) != want).sum()) + int((data != xs).sum())
            wrong += int((u[0, 1:-1, 1:-1] != (r - 1) % P).sum()) + int((u[-1, 1:-1, 1:-1] != (r + 1) % P).sum())
        for req in (a2a, ar, halo):
            req.free()
        dist.barrier()
    return natives, wrong


def test_single_node_plans_run_on_the_native_executor_exactly():
    for natives, wrong in pool().run(_native_plans):
        assert natives == [True, True, True] and wrong == 0, (natives, wrong)


def _peer_frees(ctx):
    import time

    with ho.Agent(threads=1, timeout=60):
        P = ctx.world_size
        inp, out = ho.empty((P, 8), torch.float32), ho.empty((P, 8), torch.float32)
        req = ho.alltoall_init(inp, out, timeout=30)
        res = None
        if ctx.rank == 0:  # ranks 2 and 3 never start either: rank 1's free is what fails rank 0 first
            req.start()
            dist.barrier()  # rank 1 frees only once rank 0's halves wait for it
            t0 = time.monotonic()
            try:
                req.wait(timeout=30)
            except ho.OffloadError as exc:
                res = (type(exc).__name__, str(exc), time.monotonic() - t0)
        else:
            dist.barrier()
            if ctx.rank == 1:
                time.sleep(0.2)
                req.free()
        dist.barrier()
        if ctx.rank != 1:
            req.free()
        on_native = req._handle in req._backend.native or req.freed
    return res, on_native


def test_a_peer_that_frees_fails_the_waiting_rank_at_once():
    res = pool().run(_peer_frees)
    kind, msg, took = res[0][0]
    assert kind == "OffloadError" and "rank 1 (rank 1 of the plan's group) freed its request" in msg and \
        "cannot complete" in msg and took < 10, (kind, msg, took)


def _two_nodes(ctx):
    with ho.Agent(ranks_per_node=2, threads=1, timeout=60):
        P = ctx.world_size
        inp, out = ho.empty((P, 8), torch.float32), ho.empty((P, 8), torch.float32)
        inp.fill_(ctx.rank)
        with ho.alltoall_init(inp, out, timeout=60) as req:
            req.start()
            req.wait()
            on_native = req.executor == "native"
            assert req.executor == "agent"  # the Python executor, public name
        ok = bool((out == torch.arange(P, dtype=torch.float32)[:, None]).all())
        dist.barrier()
    return on_native, ok


def test_plans_spanning_nodes_stay_on_the_python_executor():
    assert pool().run(_two_nodes) == [(False, True)] * 4


def _reserved(ctx):
    import os

    os.environ["HPDL_OFFLOAD_CORES"] = "1"  # the agent (spawned with this environment) pins its thread to core 1
    before = os.sched_getaffinity(0)
    try:
        a = ho.Agent(threads=1, timeout=60, reserve_cores=True).start()
        during, cores = os.sched_getaffinity(0), a.client.cores
        a.stop()
    finally:
        del os.environ["HPDL_OFFLOAD_CORES"]
    return cores, sorted(during), os.sched_getaffinity(0) == before


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_reserve_cores_takes_the_agents_cores_out_of_the_ranks_affinity():
    for cores, during, restored in pool().run(_reserved):
        assert cores == (1,) and 1 not in during and during and restored, (cores, during, restored)


def test_jacobi_says_which_executor_ran_each_mode(tmp_path, capsys):
    """`hpdl offload jacobi` reports the executor of each mode (table column and JSON), so a run whose agent
    fell back to the Python executor cannot pass for a native one."""
    import json

    from hpdl.cli import main

    rc = main(["offload", "jacobi", "--np", "2", "--sizes", "2x8x8", "--steps", "2", "--repeats", "1",
               "--agent-threads", "1", "--timeout", "100", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "jacobi.json").read_text())["rows"]
    assert {r["mode"]: r["executor"] for r in rows} == {"blocking": "torch.distributed", "agent-blocking": "native",
                                                        "agent": "native", "thread": "thread"}
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["block", "mode"])
    assert lines[header].split()[-1] == "executor"
    assert [line.split()[-1] for line in lines[header + 2:header + 2 + len(rows)]] == \
        ["torch.distributed", "native", "native", "thread"]
