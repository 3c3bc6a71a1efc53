"""GroupResources as the one owner of a group's state, checked without GPUs or process groups: the peer
kernels' hot-path launchers read their group's registrations, step aside after ``release`` and re-register;
``forget_group`` / ``reset`` close the group's resources and drop its hot-path entries; no comm module
imports hpdl.bench; bench's ``auto`` labels come from hpdl.comm.resolve."""

import ast
from pathlib import Path

import pytest
import torch

import hpdl.comm as hc
from hpdl.comm import api, tuning
from hpdl.comm.algorithms import peer_alltoall
from hpdl.comm.algorithms.alltoall import TwoLevelPush, make_layout
from hpdl.comm.transport import resources
from hpdl.runtime.topology import Topology


class _FakeA2AExt:
    def __init__(self):
        self.plans, self.launches, self.released = [], [], []

    def a2a_plan(self, handle, layout, chunks, window):
        self.plans.append((layout, chunks, window))
        return len(self.plans) - 1

    def all_to_all(self, *args):
        self.launches.append(args)

    def a2a_release(self, handle):
        self.released.append(handle)


def _fake_a2a_comm():
    comm = peer_alltoall._A2AComm.__new__(peer_alltoall._A2AComm)   # registered, without GPU or group
    comm.ext, comm.handle, comm.world, comm.rank, comm.grid = _FakeA2AExt(), 3, 2, 0, 4
    comm.slot, comm.plans, comm.generation = peer_alltoall.slot_bytes(2), {}, 0

    class _Buffer:
        closed = False

        def close(self):
            self.closed = True
    comm.buffer = _Buffer()
    return comm


def _fake_resources(monkeypatch, group=None):
    res = resources.GroupResources.__new__(resources.GroupResources)
    res.group, res.registered, res._algos, res.world_size, res.rank = group, {}, {}, 2, 0
    res.topology, res.side_pending = Topology.emulate(2, 2), None
    monkeypatch.setitem(resources._GROUPS, group, res)
    return res


def test_push_launcher_reads_the_groups_registration_and_steps_aside_after_release(monkeypatch):
    res = _fake_resources(monkeypatch)
    comm = _fake_a2a_comm()
    res.registered[(peer_alltoall.KIND, 0)] = comm
    algo = TwoLevelPush(res, None, 1.0)          # topology from the resources
    out, inp = torch.empty(8), torch.arange(8.0)
    lay, _, _ = make_layout(out, inp, None, None, 2, 0)
    fn = algo.all_to_all_launcher(lay, torch.device("cuda", 0))
    assert fn(out, inp) is True and len(comm.ext.launches) == 1
    handle, pid, sp, dp, code, unit, limit = comm.ext.launches[0]
    assert (handle, pid, sp, dp, code) == (3, 0, inp.data_ptr(), out.data_ptr(), peer_alltoall.ALGORITHMS["push"])
    assert not fn(out[:0], inp) and not fn(inp, inp)   # empty or overlapping: the general path
    peer_alltoall.release(None)                       # collective free through the group's resources
    assert res.registered == {} and comm.buffer.closed and comm.ext.released == [3]
    assert fn(out, inp) is False and len(comm.ext.launches) == 1   # a stale plan is never launched


def test_forget_group_and_reset_close_the_groups_resources(monkeypatch):
    res = _fake_resources(monkeypatch)
    comm = _fake_a2a_comm()
    res.registered[(peer_alltoall.KIND, 0)] = comm
    other = _fake_resources(monkeypatch, "other")
    monkeypatch.setattr(api, "_FAST", {"a": (res, None), "b": (other, None)})
    hc.forget_group(None)
    assert list(api._FAST) == ["b"] and None not in resources._GROUPS and "other" in resources._GROUPS
    assert res.registered == {} and comm.ext.released == [3] and not comm.buffer.closed   # local only
    hc.reset()
    assert api._FAST == {} and resources._GROUPS == {}


def test_no_comm_module_imports_bench():
    comm = Path(hc.__file__).parent
    for path in comm.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("hpdl.bench"), (path.name, node.module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("hpdl.bench") for a in node.names), path.name


def test_bench_auto_labels_follow_hpdl_comm_resolve(monkeypatch):
    from hpdl.bench.harness import resolve_auto

    table = tuning.TuningTable([tuning.Rule("cpu", 100, "ring"), tuning.Rule("cpu", tuning.INF, "direct", window=2),
                                tuning.Rule("cpu", tuning.INF, "pairwise", collective="all_to_all")], "test")
    monkeypatch.setattr(tuning, "_active", table)
    assert resolve_auto("allreduce", 64, 4, "cpu") == ("ring", None)
    assert resolve_auto("allreduce", 1 << 20, 4, "cpu") == ("direct", 2)
    assert resolve_auto("all_gather", 4 * 64, 4, "cpu") == ("ring", None)   # by its input: a 1/world block
    assert resolve_auto("alltoall", 1 << 20, 4, "cpu") == ("pairwise", None)
    monkeypatch.setattr(tuning, "_active", None)
    for k in range(0, 30, 3):
        want = hc.resolve("all_reduce", 8 << k, 2, "cuda", dtype=torch.float64, gpus=torch.cuda.device_count())
        assert resolve_auto("allreduce", 8 << k, 2, "cuda", torch.float64) == want == ("native", None)
    with pytest.raises(ValueError, match="collective must be one of"):
        resolve_auto("scatter", 8, 2, "cpu")   # (broadcast is a collective since issue 37)
