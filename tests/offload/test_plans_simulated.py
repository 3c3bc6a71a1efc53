"""Every ready-made plan, for many world sizes and shapes, run by one in-process executor serving all ranks
(hpdl.offload.simulate: the agent's copy path, no processes) against brute-force results, exactly."""

import os

import pytest
import torch

import hpdl.offload as ho
from hpdl.offload import plans

import _oracles as O


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("count", [0, 1, 7])
@pytest.mark.parametrize("window", [None, 1, 2])
def test_alltoall(P, count, window):
    ps = [plans.alltoall(r, P, count, torch.int32, window=window) for r in range(P)]
    ins = [torch.arange(P * count, dtype=torch.int32).view(P, count) + 1000 * r for r in range(P)]
    out = ho.simulate(ps, [{"input": x} for x in ins])
    for r in range(P):
        assert torch.equal(out[r]["output"], torch.stack([ins[q][r] for q in range(P)]))


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8])
def test_allreduce_every_op(algorithm, P):
    for count in sorted({0, 1, P - 1, P + 1, 97}):
        for op, dtype in (("sum", torch.float32), ("max", torch.int64), ("min", torch.float64), ("prod", torch.int32)):
            xs = [(torch.arange(count) % 5 + r + 1).to(dtype) for r in range(P)]
            want = {"sum": lambda: sum(xs), "prod": lambda: torch.stack(xs).prod(0).to(dtype),
                    "max": lambda: torch.stack(xs).max(0).values, "min": lambda: torch.stack(xs).min(0).values}[op]()
            ps = [plans.allreduce(r, P, count, dtype, op=op, algorithm=algorithm,
                                  window=2 if algorithm == "direct" else None) for r in range(P)]
            out = ho.simulate(ps, [{"data": x.clone()} for x in xs])
            for r in range(P):
                assert torch.equal(out[r]["data"], want), (op, count, r)


@pytest.mark.parametrize("shape,grid", [((3, 4), (2, 3)), ((2, 2), (1, 2)), ((3, 2, 2), (2, 1, 2)),
                                        ((2, 3, 2), (2, 2, 2))])
@pytest.mark.parametrize("periodic", [True, False])
@pytest.mark.parametrize("corners", [False, True])
def test_halo(shape, grid, periodic, corners):
    width = 1
    G, bufs = O.halo_buffers(shape, grid, width)
    P = len(bufs)
    ps = [plans.halo(shape, grid, r, torch.float32, width=width, periodic=periodic, corners=corners) for r in range(P)]
    out = ho.simulate(ps, [{"u": b} for b in bufs])
    for r in range(P):
        want = O.halo_expected(G, shape, grid, r, width, periodic, corners)
        assert torch.equal(out[r]["u"], want), r


def test_halo_wide_and_mixed_periodicity():
    shape, grid, width, periodic = (4, 3), (2, 2), 2, (True, False)
    G, bufs = O.halo_buffers(shape, grid, width)
    ps = [plans.halo2d(shape, grid, r, torch.float32, width=width, periodic=periodic, corners=True) for r in range(4)]
    out = ho.simulate(ps, [{"u": b} for b in bufs])
    for r in range(4):
        assert torch.equal(out[r]["u"], O.halo_expected(G, shape, grid, r, width, periodic, True))


@pytest.mark.parametrize("global_shape,grid", [((4, 6, 6), (2, 3)), ((2, 4, 4), (1, 4)), ((6, 6, 3), (3, 1))])
def test_pencil_transposes_forward_and_back(global_shape, grid):
    O.check_pencil_transposes(global_shape, grid)


def test_pencil_shape_errors():
    with pytest.raises(ValueError, match="NX=5 must be divisible by 2"):
        plans.pencil_shapes((4, 4, 5), (2, 2))


def test_one_sided_put_get_and_user_plan():
    """A user plan: rank 0 puts into rank 1, rank 1 gets from rank 0, local reduce after both."""
    ps = []
    for r in range(2):
        p = ho.Plan("mixed", rank=r, world_size=2)
        a = p.buffer("a", (4,), torch.float64)
        b = p.buffer("b", (4,), torch.float64)
        if r == 0:
            p.put(a[0:2], 1, b[2:4], name="put")
        else:
            g = p.get(b[0:2], 0, a[2:4], name="get")
            p.reduce(a[0:2], b[0:2], "sum", after=[g], name="fold")
        ps.append(p)
    f64 = torch.float64
    bufs = [{"a": torch.tensor([1., 2., 3., 4.], dtype=f64), "b": torch.zeros(4, dtype=f64)},
            {"a": torch.full((4,), 10., dtype=f64), "b": torch.zeros(4, dtype=f64)}]
    out = ho.simulate(ps, bufs)
    assert out[1]["b"].tolist() == [3., 4., 1., 2.]
    assert out[1]["a"].tolist() == [13., 14., 10., 10.]
    assert out[0]["a"].tolist() == [1., 2., 3., 4.] and out[0]["b"].tolist() == [0.] * 4


def test_started_many_times():
    P, count = 3, 5
    ps = [plans.allreduce(r, P, count, torch.float64, algorithm="ring") for r in range(P)]
    bufs = [{"data": torch.ones(count, dtype=torch.float64)} for _ in range(P)]
    ho.simulate(ps, bufs, starts=20)  # each start sums the previous results: 3**20
    for b in bufs:
        assert torch.equal(b["data"], torch.full((count,), 3.0 ** 20, dtype=torch.float64))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_simulate_closes_its_doorbells():
    """Each simulate() made an executor whose two doorbell pipes (4 fds) stayed open: a long-lived process
    (a pytest worker ran out of fds below 1024 for select()) leaked 4 fds a call."""
    P, xs = 4, [torch.arange(8.0) for _ in range(4)]
    run = lambda: ho.simulate([plans.allreduce(r, P, 8, torch.float32) for r in range(P)],
                              [{"data": x.clone()} for x in xs])
    run()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(10):
        run()
    assert len(os.listdir("/proc/self/fd")) - before < 20   # a leak: 40
