"""Review fixes of issue 41 that need no processes: the executor synchronises every GPU a request's copies
ran on before it writes DONE (not only the dispatcher thread's current device)."""

import types

import numpy as np
import torch

import hpdl.offload.executor as exm
from hpdl.offload import shm


def test_finish_synchronises_every_device_of_the_request(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    box = shm.Mailboxes(1, shared=False)
    done = []
    # buffers on cuda:2, a match copy from a peer's buffers on cuda:1 (the dispatcher's current device is 0)
    inst = types.SimpleNamespace(cuda=True, devices={2, 1}, active=True, mailbox=box.array, slot=0, gen=7,
                                 on_done=lambda: done.append(True))
    ex = exm.Executor()
    try:
        ex._finish(inst)
    finally:
        ex.stop()
    assert calls == [1, 2]
    assert box.array[0, shm.DONE] == 7 and done == [True] and not inst.active
    assert np.all(box.array[0, shm.FAILED] == 0)


def test_a_cpu_request_synchronises_no_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    box = shm.Mailboxes(1, shared=False)
    inst = types.SimpleNamespace(cuda=False, devices=set(), active=True, mailbox=box.array, slot=0, gen=1,
                                 on_done=None)
    ex = exm.Executor()
    try:
        ex._finish(inst)
    finally:
        ex.stop()
    assert calls == [] and box.array[0, shm.DONE] == 1


def test_graph_progress_accepts_single_phase_plans_only():
    import pytest

    from hpdl.offload import plans
    from hpdl.offload.compiler import compile_group
    from hpdl.offload.errors import PlanError
    from hpdl.offload.graph import check_single_phase

    def group(make, P=4):
        return compile_group([make(r).data() for r in range(P)], 0, [0] * P)

    check_single_phase(group(lambda r: plans.alltoall(r, 4, 8, torch.float32)))
    check_single_phase(group(lambda r: plans.halo((3, 4), (2, 2), r, torch.float32, corners=False)))
    with pytest.raises(PlanError, match="reductions need progress='agent'"):
        check_single_phase(group(lambda r: plans.allreduce(r, 4, 8, torch.float32)))
    with pytest.raises(PlanError, match="without after= dependencies"):
        check_single_phase(group(lambda r: plans.alltoall(r, 4, 8, torch.float32, window=1)))
    with pytest.raises(PlanError, match="without after= dependencies"):
        check_single_phase(group(lambda r: plans.halo((3, 4), (2, 2), r, torch.float32, corners=True)))
