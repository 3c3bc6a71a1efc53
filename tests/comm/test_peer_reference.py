"""CPU tests of the peer all-reduce schedule (hpdl.comm.algorithms.peer): the reference that mirrors the CUDA
kernels is checked against torch.distributed (gloo) and against a float64 oracle; CI has no GPU."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpdl.comm.algorithms import peer

ALGOS = ("one_shot_ll", "one_shot_barrier", "two_shot")   # the kernel variants
COUNTS = (0, 1, 7, 9, 65, 1031)
INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _inputs(world: int, n: int, dtype: torch.dtype, seed: int, lo: int = -8, hi: int = 9) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, hi, (n,), generator=g).to(dtype) for _ in range(world)]


def _oracle(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    st = torch.stack([x.double() for x in inputs])
    if st.shape[1] == 0:
        return inputs[0].clone()
    out = {"sum": st.sum(0), "avg": st.sum(0) / len(inputs), "min": st.min(0).values, "max": st.max(0).values,
           "product": st.prod(0)}[op]
    return out.to(inputs[0].dtype)


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INT_DTYPES)
def test_reference_exact_on_integer_inputs(algorithm, world, dtype):
    for n in COUNTS:
        for op in ("sum", "min", "max", "product") + (("avg",) if dtype.is_floating_point else ()):
            hi = 3 if op == "product" else 9   # products of 8 ranks stay exact in bf16
            xs = _inputs(world, n, dtype, seed=n * 31 + world, lo=-hi + 1, hi=hi)
            exp = _oracle(xs, op)
            outs = peer.reference_all_reduce(xs, op, algorithm, window=2)
            for r, out in enumerate(outs):
                assert out.dtype == dtype and out.shape == xs[0].shape
                assert torch.equal(out, exp), f"rank {r}, n={n}, op={op}"


@pytest.mark.parametrize("world", [2, 3, 4, 7, 8])
def test_reference_rank_order_fp32_accumulation_and_identical_bits(world):
    """Random bf16: every rank holds the same bits, equal to x0 + x1 + ... accumulated in float32, rounded once."""
    n = 1000
    g = torch.Generator().manual_seed(world)
    xs = [torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(world)]
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    exp = acc.to(torch.bfloat16)
    for algorithm in ALGOS:
        for window in (1, 2, None):
            outs = peer.reference_all_reduce(xs, "sum", algorithm, window, max_blocks=3, slot_bytes=256)
            for out in outs:
                assert torch.equal(out.view(torch.int16), exp.view(torch.int16))
    if world == 2:   # one addition rounds once either way
        return
    # accumulating in bf16 instead would differ: the test can tell the two apart
    acc16 = xs[0]
    for x in xs[1:]:
        acc16 = acc16 + x
    assert not torch.equal(acc16, exp)


def test_reference_keeps_shape_and_does_not_modify_inputs():
    xs = [torch.arange(12, dtype=torch.float32).reshape(3, 4) * (r + 1) for r in range(3)]
    before = [x.clone() for x in xs]
    outs = peer.reference_all_reduce(xs, "sum", "two_shot")
    assert all(torch.equal(a, b) for a, b in zip(xs, before))
    assert outs[0].shape == (3, 4) and torch.equal(outs[0], sum(before))


@pytest.mark.parametrize("variant", ALGOS)
def test_schedule_covers_every_unit_once(variant):
    for world in (1, 2, 3, 8):
        for n in (1, 7, 8, 9, 4097, 100003, 2_000_001):
            for itemsize in (2, 4, 8):
                grid, chunk = peer.schedule(n, itemsize, world, variant, max_blocks=7, slot_units=600)
                units = math.ceil(n / (peer.UNIT_BYTES[variant] // itemsize))
                span = math.ceil(units / world) if variant == "two_shot" else units
                assert 1 <= grid <= 7 and 1 <= chunk <= 600
                seen = torch.zeros(span, dtype=torch.int32)
                for b in range(grid):
                    for first in range(b * chunk, span, grid * chunk):
                        seen[first:first + chunk] += 1
                assert bool((seen == 1).all()), (world, n, itemsize)
    assert peer.schedule(0, 2, 2, variant, 7, 600) == (0, 1)


def test_one_shot_resolves_to_ll_for_small_messages():
    assert peer.variant("one_shot", peer.LL_MAX_BYTES) == "one_shot_ll"
    assert peer.variant("one_shot", peer.LL_MAX_BYTES + 1) == "one_shot_barrier"
    assert peer.variant("two_shot", 1) == "two_shot"
    with pytest.raises(ValueError, match="algorithm"):
        peer.variant("three_shot", 1)
    xs = _inputs(3, 101, torch.bfloat16, 5)
    assert torch.equal(peer.reference_all_reduce(xs, "sum", "one_shot")[1],
                       peer.reference_all_reduce(xs, "sum", "one_shot_ll")[1])


def test_reference_rejects_bad_input():
    xs = _inputs(2, 5, torch.float32, 0)
    with pytest.raises(ValueError, match="op"):
        peer.reference_all_reduce(xs, "xor", "one_shot")
    with pytest.raises(ValueError, match="avg"):
        peer.reference_all_reduce(_inputs(2, 5, torch.int32, 0), "avg", "one_shot")
    with pytest.raises(ValueError, match="same shape"):
        peer.reference_all_reduce([xs[0], xs[1][:3]], "sum", "one_shot")
    with pytest.raises(ValueError, match="1..8"):
        peer.reference_all_reduce(xs * 5, "sum", "one_shot")


def test_peer_path_refuses_cpu_tensors():
    x = torch.ones(4)
    assert not peer.peer_available(x, None)
    assert not peer.peer_available(torch.ones(4, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="CUDA"):
        peer.peer_all_reduce(x, "sum", None)


class _FakeExt:
    def __init__(self):
        self.calls = []

    def all_reduce(self, *args):
        self.calls.append(args)


class _FakeCudaTensor:
    """Quacks like a CUDA tensor for the fast path only (no CUDA in CI)."""

    def __init__(self, n, dtype, ptr, contiguous=True):
        self.n, self.dtype, self.ptr, self.contiguous = n, dtype, ptr, contiguous

    def get_device(self):
        return 0

    def numel(self):
        return self.n

    def is_contiguous(self):
        return self.contiguous

    def data_ptr(self):
        return self.ptr


def _fake_resources(monkeypatch, group=None):
    """A group's GroupResources without a process group, registered as the resources of ``group``."""
    from hpdl.comm.transport import resources

    res = resources.GroupResources.__new__(resources.GroupResources)
    res.group, res.registered, res._algos = group, {}, {}
    monkeypatch.setitem(resources._GROUPS, group, res)
    return res


def _fake_comm():
    comm = peer._Comm.__new__(peer._Comm)   # a registered communicator without GPU or process group
    comm.ext, comm.handle, comm.world, comm.window, comm.plans = _FakeExt(), 7, 2, 1, {}
    comm.max_blocks = {"one_shot_ll": 64, "one_shot_barrier": 64, "two_shot": 132}
    comm.slot_units = {"one_shot_ll": 1024, "one_shot_barrier": 2048, "two_shot": 16384}
    return comm


def test_fast_path_launches_the_cached_plan_once_per_call(monkeypatch):
    comm = _fake_comm()
    res = _fake_resources(monkeypatch)
    res.registered[(peer.KIND, 0)] = comm   # the group's registration, as peer.communicator leaves it
    n = 3 * (1 << 20) + 5
    plan = comm.plan(torch.empty(n, dtype=torch.bfloat16), "sum", "two_shot", None)
    grid, chunk = peer.schedule(n, 2, 2, "two_shot", 132, 16384)
    assert plan == (n, peer.DTYPES[torch.bfloat16], peer.OPS["sum"], peer.VARIANTS["two_shot"], 1, grid, chunk)
    peer.peer_all_reduce(_FakeCudaTensor(n, torch.bfloat16, 4096), "sum", None, "two_shot")
    assert comm.ext.calls == [(7, 4096) + plan]
    small = comm.plan(torch.empty(100, dtype=torch.float32), "max", "one_shot", 1)
    assert small[3] == peer.VARIANTS["one_shot_ll"] and small[4] == 1
    peer.peer_all_reduce(_FakeCudaTensor(100, torch.float32, 512), "max", None, "one_shot", 1)
    assert comm.ext.calls[-1] == (7, 512) + small
    assert comm.plan(torch.empty(0), "sum", "one_shot", None) == ()
    peer.peer_all_reduce(_FakeCudaTensor(0, torch.float32, 0), "sum", None, "one_shot")   # no launch
    assert len(comm.ext.calls) == 2
    # a misaligned or strided view, or an uncached call, leaves the fast path (and is checked there)
    for t in (_FakeCudaTensor(n, torch.bfloat16, 4104), _FakeCudaTensor(n, torch.bfloat16, 4096, False),
              _FakeCudaTensor(n, torch.float16, 4096)):
        with pytest.raises(ValueError, match="CUDA tensor"):
            peer.peer_all_reduce(t, "sum", None, "two_shot")
    assert len(comm.ext.calls) == 2
    # the API's hot path: the registry's TwoShot launcher, one launch per call from the same plan
    algo = peer.TwoShot(res, None, 1.0)
    fn = algo.all_reduce_launcher("sum", torch.device("cuda", 0))
    fn(_FakeCudaTensor(n, torch.bfloat16, 8192))
    assert comm.ext.calls[-1] == (7, 8192) + plan and len(comm.ext.calls) == 3
    peer.set_chunk_cap("two_shot", 512)
    assert comm.plans == {}
    peer.set_chunk_cap("two_shot", None)


def test_release_frees_each_buffer_once_under_every_alias(monkeypatch):
    from hpdl.comm.transport import resources

    closed, forgotten = [], []

    class _Closable:
        def close(self):
            closed.append(self)

        def forget(self):
            forgotten.append(self)

    shared, other, a2a = _Closable(), _Closable(), _Closable()
    group = object()
    res = _fake_resources(monkeypatch)
    monkeypatch.setitem(resources._GROUPS, "alias", res)   # the world group under a second spelling
    res.registered.update({(peer.KIND, 0): shared, (peer_alltoall_kind(), 0): a2a})
    res2 = _fake_resources(monkeypatch, group)
    res2.registered[(peer.KIND, 1)] = other
    peer.release("alias")
    assert closed == [shared] and list(res.registered) == [(peer_alltoall_kind(), 0)]
    peer.release(group)
    assert closed == [shared, other] and res2.registered == {}
    # forgetting the group (hpdl.comm.forget_group) drops every spelling and forgets, without communicating
    assert resources.forget(None) is res and "alias" not in resources._GROUPS
    assert forgotten == [a2a] and res.registered == {}


def peer_alltoall_kind():
    from hpdl.comm.algorithms import peer_alltoall

    return peer_alltoall.KIND
