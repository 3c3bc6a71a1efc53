"""The executor's copy threads (an agent's ``threads``): exact results for every ready-made plan with every
copy on them, and counted properties of the GIL-friendly hand-out (issue 23's 64 KiB cliff: one task per
copy and a dispatcher spinning against the copy threads made an 8-rank Alltoall ~10x slower than Gloo).
Counts, not times: they hold on a loaded 2-core machine."""

import threading

import pytest
import torch

import hpdl.offload as ho
import hpdl.offload.executor as exm
from hpdl.offload import plans, shm
from hpdl.offload.compiler import compile_group

import _oracles as O

POOLED = {"copy_threads": 3, "copy_min_bytes": 0}  # every local copy and reduction goes to the copy threads


def _alltoall_inputs(P, count, dtype=torch.float32):
    return [(torch.arange(P * count) % 1013 + 1000 * r).to(dtype).view(P, count) for r in range(P)]


@pytest.mark.parametrize("P", [2, 5, 8])
def test_alltoall_on_copy_threads_exact(P):
    count = 33
    ins = _alltoall_inputs(P, count)
    stats = {}
    out = ho.simulate([plans.alltoall(r, P, count, torch.float32) for r in range(P)], [{"input": x} for x in ins],
                      starts=3, stats=stats, **POOLED)
    for r in range(P):
        assert torch.equal(out[r]["output"], torch.stack([ins[q][r] for q in range(P)]))
    assert stats["inline_copies"] == 0 and stats["pooled_copies"] == 3 * P * P, stats
    assert stats["foreach_copies"] > 0, stats  # rows are views: batched into one foreach call per task


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_allreduce_reductions_on_copy_threads_exact(algorithm):
    P = 5
    for count, op, dtype in ((97, "sum", torch.float32), (11, "max", torch.int64), (4, "prod", torch.int32)):
        xs = [(torch.arange(count) % 5 + r + 1).to(dtype) for r in range(P)]
        want = {"sum": lambda: sum(xs), "prod": lambda: torch.stack(xs).prod(0).to(dtype),
                "max": lambda: torch.stack(xs).max(0).values}[op]()
        ps = [plans.allreduce(r, P, count, dtype, op=op, algorithm=algorithm) for r in range(P)]
        out = ho.simulate(ps, [{"data": x.clone()} for x in xs], starts=2 if op == "max" else 1, **POOLED)
        for r in range(P):
            assert torch.equal(out[r]["data"], want), (op, r)


@pytest.mark.parametrize("corners", [False, True])
def test_halo_strided_boxes_on_copy_threads_exact(corners):
    shape, grid = (3, 2, 2), (2, 1, 2)
    G, bufs = O.halo_buffers(shape, grid, 1)
    ps = [plans.halo(shape, grid, r, torch.float32, corners=corners) for r in range(len(bufs))]
    out = ho.simulate(ps, [{"u": b} for b in bufs], **POOLED)
    for r in range(len(bufs)):
        assert torch.equal(out[r]["u"], O.halo_expected(G, shape, grid, r, 1, True, corners)), r


def test_pencil_transposes_on_copy_threads_exact():
    global_shape, grid = (4, 6, 6), (2, 3)
    O.check_pencil_transposes(global_shape, grid, **POOLED)


def test_failed_foreach_falls_back_to_single_copies(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no foreach here")

    monkeypatch.setattr(torch, "_foreach_copy_", broken)
    P, count = 4, 9
    ins = _alltoall_inputs(P, count)
    stats = {}
    out = ho.simulate([plans.alltoall(r, P, count, torch.float32) for r in range(P)], [{"input": x} for x in ins],
                      stats=stats, **POOLED)
    for r in range(P):
        assert torch.equal(out[r]["output"], torch.stack([ins[q][r] for q in range(P)]))
    assert stats["foreach_copies"] == 0 and stats["pooled_copies"] == P * P, stats


def test_one_task_per_copy_thread_per_pass():
    """The 64 copies of an 8-rank Alltoall of 64 KiB per peer, all started at once, go to the 4 copy threads as
    4 tasks (not 64), each one foreach call: a handful of GIL hand-offs per start instead of hundreds."""
    P, count, starts = 8, 16384, 3
    ins = _alltoall_inputs(P, count)
    stats = {}
    out = ho.simulate([plans.alltoall(r, P, count, torch.float32) for r in range(P)], [{"input": x} for x in ins],
                      starts=starts, copy_threads=4, copy_min_bytes=65536, stats=stats)
    for r in range(P):
        assert torch.equal(out[r]["output"], torch.stack([ins[q][r] for q in range(P)]))
    assert stats["pooled_copies"] == starts * P * P and stats["inline_copies"] == 0, stats
    assert stats["copy_tasks"] == starts * 4, stats
    assert stats["foreach_copies"] == starts * P * P, stats


def test_a_small_batch_is_one_task():
    """Four 64 KiB copies in one pass are not worth four thread hand-offs: one task (task_bytes = 256 KiB)."""
    P, count = 2, 16384  # 2 self copies + 2 messages of 64 KiB each
    ins = _alltoall_inputs(P, count)
    stats = {}
    out = ho.simulate([plans.alltoall(r, P, count, torch.float32) for r in range(P)], [{"input": x} for x in ins],
                      starts=2, copy_threads=4, stats=stats)
    for r in range(P):
        assert torch.equal(out[r]["output"], torch.stack([ins[q][r] for q in range(P)]))
    assert stats["copy_tasks"] == 2 and stats["pooled_copies"] == 2 * P * P, stats


def test_below_the_threshold_copies_stay_inline():
    P, count = 4, 1000  # 4000 B per peer < 65536
    ins = _alltoall_inputs(P, count)
    stats = {}
    ho.simulate([plans.alltoall(r, P, count, torch.float32) for r in range(P)], [{"input": x} for x in ins],
                copy_threads=4, stats=stats)
    assert stats["copy_tasks"] == 0 and stats["inline_copies"] == P * P, stats


def test_dispatcher_sleeps_instead_of_spinning_while_copies_run():
    """With copy tasks out, the dispatcher thread sleeps on its doorbells (GIL released) however long its spin
    window: it makes a few passes per finished task, not the thousands a spinning loop makes (and each of
    those held the GIL that a copy thread needed to report, 5 ms at a time)."""
    P, count, starts = 8, 32768, 3  # 128 KiB per peer
    comp = compile_group([plans.alltoall(r, P, count, "float32").data() for r in range(P)], key=1,
                         endpoints=[0] * P)
    ex = exm.Executor(copy_threads=4, spin_us=200_000.0, idle_s=30.0, name="test-copy-threads")
    boxes = shm.Mailboxes(P, shared=False)
    ins = _alltoall_inputs(P, count)
    done = threading.Semaphore(0)
    insts = []
    for r in range(P):
        inst = exm.Instance(comp[r], {"input": ins[r], "output": torch.zeros(P, count)}, boxes.array, r, None, "t",
                            f"rank {r}")
        inst.on_done = done.release
        ex.register(inst)
        insts.append(inst)
    ex.start_thread()
    try:
        for g in range(1, starts + 1):
            boxes.array[:, shm.START] = g  # one numpy store: the dispatcher sees all eight starts in one pass
            ex.bell.ring()
            for _ in range(P):
                assert done.acquire(timeout=60), "the alltoall did not finish within 60 s"
            assert not any(i.error for i in insts)
        stats = dict(ex.stats)
    finally:
        ex.stop()
    for r in range(P):
        assert torch.equal(insts[r].tensors["output"], torch.stack([ins[q][r] for q in range(P)]))
    assert stats["copy_tasks"] == starts * 4, stats
    # per task: the pass that takes its completion plus an idle one (a ring can also find nothing left)
    assert stats["passes_out"] <= 3 * stats["copy_tasks"] + 2 * starts, stats
