"""CG on 3-D Poisson and the pencil 3-D FFT: every decomposition and communicator against one process.

CG: the distributed dot products sum the same terms as the single process in another order, so residuals
can differ by rounding only (relative 1e-16 per dot product, n^3 <= 1000 terms); rtol 1e-10 over 40
iterations is far below any decomposition or halo bug (those are O(1)) and leaves room for the growth of
rounding differences in CG. Across ranks and, on 2 ranks (a + b == b + a), across communicators the
numbers must be bit-identical. FFT: the all-to-alls only move data and every rank runs the same 1-D FFTs as
the sequential reference, so the output must equal it bit for bit.
"""

import math

import pytest
import torch

from hpdl.apps import cg, fft3d
from hpdl.apps.comm import LocalComm
from hpdl.testing import get_pool

import _apps_cases as C

N, ITERS = 10, 40  # 10 planes over 4 ranks: 3, 3, 2, 2 (uneven)
SHAPE = (6, 10, 7)  # uneven over 2 x 2: 3+3, 5+5, 4+3


def _cg_reference():
    return cg.solve(LocalComm(), N, ITERS)


def _fft_reference():
    x = fft3d.global_input(SHAPE)
    return torch.fft.fftn(x), torch.fft.fft(torch.fft.fft(torch.fft.fft(x, dim=2), dim=1), dim=0)


def test_operator_closed_form_and_convergence():
    comm = LocalComm()
    op = cg.Poisson3D(12, comm)
    i, j, k = (t.double() + 1 for t in op.grid())
    h = 1 / 13
    v = torch.sin(math.pi * i * h) * torch.sin(math.pi * j * h) * torch.sin(math.pi * k * h)  # an eigenvector
    out = torch.empty_like(v)
    op.matvec(v, out)
    torch.testing.assert_close(out, 3 * (2 - 2 * math.cos(math.pi * h)) * v, rtol=0, atol=1e-14)
    res = cg.solve(comm, 8, 60)
    assert res.residuals[-1] < 1e-10 * res.residuals[0]  # converged: CG on 512 unknowns
    b = op.__class__(8, comm).rhs()
    ax = torch.empty_like(b)
    op.__class__(8, comm).matvec(res.x, ax)
    assert float((ax - b).norm()) < 1e-9 * float(b.norm())
    four = LocalComm()
    four.size = 4  # only the size is read before the check
    with pytest.raises(ValueError, match="n=3 must be >= the number of ranks"):
        cg.Poisson3D(3, four)


def _check_cg(out, ref):
    res0 = out[0][0]
    assert all(o[0] == res0 for o in out)  # every rank saw the same all-reduced scalars, bit for bit
    torch.testing.assert_close(torch.tensor(res0), torch.tensor(ref.residuals), rtol=1e-10, atol=0)
    x = torch.cat([o[1] for o in out])
    assert [(o[2], o[3]) for o in out] == [cg.slab(N, len(out), r) for r in range(len(out))]
    torch.testing.assert_close(x, ref.x, rtol=1e-10, atol=1e-12)
    assert all(o[4] for o in out)  # breakdown timers ran
    return res0


@pytest.mark.timeout(300)
def test_cg_and_fft_on_two_ranks_equal_single_process():
    pool, ref = get_pool(2), _cg_reference()
    native = _check_cg(pool.run(C.cg_run, "nccl", "auto", N, ITERS), ref)
    for algorithm in ("auto", "recursive_doubling", "direct"):
        assert _check_cg(pool.run(C.cg_run, "hpdl", algorithm, N, ITERS), ref) == native, algorithm
    full, seq = _fft_reference()
    for kind, algorithm in (("nccl", "auto"), ("hpdl", "pairwise")):
        for y, box, timed in pool.run(C.fft_run, kind, algorithm, SHAPE, None):
            assert torch.equal(y, seq[box]) and timed
            torch.testing.assert_close(y, full[box], rtol=0, atol=1e-13)


@pytest.mark.timeout(300)
def test_cg_and_pencil_fft_on_four_ranks_equal_single_process():
    pool, ref = get_pool(4), _cg_reference()
    _check_cg(pool.run(C.cg_run, "nccl", "auto", N, ITERS), ref)
    _check_cg(pool.run(C.cg_run, "hpdl", "auto", N, ITERS), ref)
    full, seq = _fft_reference()
    for kind, algorithm, grid in (("nccl", "auto", None), ("hpdl", "direct", None), ("hpdl", "pairwise", (1, 4))):
        out = pool.run(C.fft_run, kind, algorithm, SHAPE, grid)
        covered = torch.zeros(SHAPE, dtype=torch.int64)
        for y, box, _ in out:
            assert torch.equal(y, seq[box]), (kind, algorithm, grid)
            covered[box] += 1
        assert bool((covered == 1).all())  # the output boxes tile the global array


def test_cg_stays_finite_after_it_converges():
    # small grids converge (to exact zero or underflow) well inside a fixed iteration count: 0 / 0 gave NaN
    for n, iters in ((1, 5), (2, 40), (4, 300)):
        res = cg.solve(LocalComm(), n, iters)
        assert all(math.isfinite(r) for r in res.residuals) and bool(torch.isfinite(res.x).all()), n
        assert res.residuals[-1] < 1e-12 * res.residuals[0], n
    assert cg.solve(LocalComm(), 1, 3).residuals[1:] == [0.0, 0.0, 0.0]   # A = 6: one step solves it


def test_fft_plan_errors():
    assert fft3d.process_grid(8) == (2, 4) and fft3d.process_grid(7) == (1, 7) and fft3d.process_grid(1) == (1, 1)
    with pytest.raises(ValueError, match=r"P0\*P1 == 1 ranks"):
        fft3d.PencilFFT((4, 4, 4), LocalComm(), grid=(2, 1))
    with pytest.raises(ValueError, match="positive P0, P1"):   # (-1) x (-1) == 1 rank: an MKL error before
        fft3d.PencilFFT((4, 4, 4), LocalComm(), grid=(-1, -1))


def test_launch_rejects_unknown_comm_and_device():
    from hpdl.apps.comm import launch

    with pytest.raises(ValueError, match=r"comm must be one of \('hpdl', 'nccl', 'mpi'\), got 'gloo'"):
        launch("gloo")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        launch("hpdl", "tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' but torch sees no CUDA device"):
            launch("hpdl", "cuda")
