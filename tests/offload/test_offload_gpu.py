"""CUDA buffers: the agent maps them by CUDA IPC and copies between the ranks' GPU memory in place; the
progress thread stages transfers to other ranks through pinned host memory. Two ranks share GPU 0
(their process group is Gloo: only the plan's buffers live on the GPU)."""

import pytest
import torch

from hpdl.runtime import spawn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _gpu_plans(ctx, mode):
    import os

    import torch.distributed as dist

    import hpdl.offload as ho

    if mode == "agent-ce":  # the agent (started below, inheriting it) copies contiguous boxes on the copy engines
        os.environ["HPDL_OFFLOAD_CUDA_COPY"], mode = "ce", "agent"
    dev = torch.device("cuda", 0)
    agent = ho.Agent(timeout=60).start() if mode == "agent" else None
    try:
        P, r = ctx.world_size, ctx.rank
        inp = (torch.arange(P * 4096, dtype=torch.float32) + 100000 * r).view(P, 4096).to(dev)
        out = torch.zeros(P, 4096, device=dev)
        data = torch.zeros(10001, device=dev)
        wrong = 0
        with ho.alltoall_init(inp, out, progress=mode) as a2a, \
                ho.allreduce_init(data, algorithm="direct", progress=mode) as ar:
            for i in range(20):
                inp.add_(1)
                x = torch.arange(10001, dtype=torch.float32, device=dev) % 17 * (r + 1) + i
                data.copy_(x)
                ho.startall([a2a, ar])
                ho.waitall([a2a, ar], timeout=60)
                want = torch.empty(P * 4096)
                dist.all_to_all_single(want, inp.view(-1).cpu())
                xs = x.cpu()
                dist.all_reduce(xs)
                wrong += int((out.view(-1).cpu() != want).sum()) + int((data.cpu() != xs).sum())
        return wrong
    finally:
        if agent is not None:
            agent.stop()


@pytest.mark.parametrize("mode", ["agent", "thread", "agent-ce"])
def test_cuda_buffers_exact(mode):
    assert spawn(_gpu_plans, 2, args=(mode,), timeout=120) == [0, 0]


def _start_without_host_sync(ctx, mode):
    """start() right after a long kernel queued on the application's stream returns at once (no stream
    synchronisation on the host), and the executor's copies still see what the stream wrote (an event)."""
    import time

    import torch.distributed as dist

    import hpdl.offload as ho

    dev = torch.device("cuda", 0)
    agent = ho.Agent(timeout=60).start() if mode == "agent" else None
    try:
        P, r = ctx.world_size, ctx.rank
        inp = torch.zeros(P, 1 << 16, device=dev)
        out = torch.zeros(P, 1 << 16, device=dev)
        slow, wrong = [], 0
        with ho.alltoall_init(inp, out, progress=mode) as req:
            for i in range(5):
                torch.cuda.synchronize()
                dist.barrier()
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the application's stream
                inp.fill_(1000 * r + i)         # queued behind it: the executor must read these values
                t0 = time.perf_counter()
                req.start()
                slow.append(time.perf_counter() - t0)
                req.wait(timeout=60)
                want = torch.tensor([1000.0 * q + i for q in range(P)], device=dev)[:, None].expand(P, 1 << 16)
                wrong += int((out != want).sum())
        return wrong, min(slow)
    finally:
        if agent is not None:
            agent.stop()


@pytest.mark.parametrize("mode", ["agent", "thread"])
def test_start_queues_an_event_instead_of_synchronising_the_stream(mode):
    for wrong, start_s in spawn(_start_without_host_sync, 2, args=(mode,), timeout=120):
        assert wrong == 0 and start_s < 0.02, (wrong, start_s)


def _graph_plans(ctx, copy="kernel"):
    """progress='graph': the copy engines pull every receive box from the peers' buffers (CUDA IPC) in a
    replayed CUDA graph; start/wait are stream events. Alltoall (buffers are views at storage offsets) and a
    halo exchange, many starts, exact; the peers' mappings live as long as the requests (the first device run
    died here with an illegal memory access: they were closed right after capture)."""
    import torch.distributed as dist

    import os

    import hpdl.offload as ho
    from hpdl.offload import plans

    os.environ["HPDL_OFFLOAD_CUDA_COPY"] = copy  # ce: contiguous pulls on the copy engines (one batch call)
    dev = torch.device("cuda", 0)
    P, r = ctx.world_size, ctx.rank
    # views with storage offsets, different on every rank (the pulls must add the peer's offsets)
    inp_base = torch.full((P * 4096 + 37 + r,), -7.0, device=dev)
    inp = inp_base[37 + r:].view(P, 4096)
    out_base = torch.full((P * 4096 + 5 + 3 * r + 11,), -7.0, device=dev)
    out = out_base[5 + 3 * r:5 + 3 * r + P * 4096].view(P, 4096)
    u = torch.zeros(4, 6, 6, device=dev)
    wrong = 0
    a2a = ho.alltoall_init(inp, out, progress="graph", timeout=60)
    halo = ho.compile(plans.halo3d((2, 4, 4), (P, 1, 1), r, torch.float32), {"u": u}, progress="graph", timeout=60)
    for i in range(20):
        torch.cuda._sleep(1_000_000)  # the stream is busy when start() comes: the copies must wait for it
        inp.copy_((torch.arange(P * 4096, device=dev, dtype=torch.float32) % 991 + 10000 * r + i).view(P, 4096))
        u.fill_(-1)
        u[1:-1, 1:-1, 1:-1] = 100 * r + i
        ho.startall([a2a, halo])
        ho.waitall([halo, a2a], timeout=60)
        got, got_u = out.cpu(), u.cpu()  # ordered after the waits on this stream
        want = torch.empty(P * 4096)
        dist.all_to_all_single(want, inp.view(-1).cpu())
        wrong += int((got.view(-1) != want).sum())
        wrong += int((got_u[0, 1:-1, 1:-1] != 100 * ((r - 1) % P) + i).sum())
        wrong += int((got_u[-1, 1:-1, 1:-1] != 100 * ((r + 1) % P) + i).sum())
        rest = out_base.cpu()  # nothing written outside the receive box
        wrong += int((rest[:5 + 3 * r] != -7).sum()) + int((rest[5 + 3 * r + P * 4096:] != -7).sum())
    a2a.free()
    halo.free()
    dist.barrier()
    return wrong


@pytest.mark.parametrize("world,copy", [(2, "kernel"), (4, "kernel"), (4, "ce")])
def test_graph_progress_exact(world, copy):
    assert spawn(_graph_plans, world, args=(copy,), timeout=120) == [0] * world
