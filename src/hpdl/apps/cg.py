"""Distributed conjugate gradient on the 3-D Poisson problem: the latency-bound HPC proxy.

``-laplace(u) = f`` on the unit cube with zero Dirichlet boundaries, discretised by the 7-point stencil on
``n^3`` interior points (``A = 6I - neighbours``, symmetric positive definite; unscaled by ``h^2``). The grid
is split into slabs of x-planes, one per rank (balanced: the first ``n % size`` ranks hold one plane more).
Each iteration of CG (Hestenes & Stiefel 1952; Saad, *Iterative Methods for Sparse Linear Systems*, Alg. 6.18)
does one matrix-vector product, whose two halo planes travel point-to-point while the interior is computed,
and two dot products, each a one-element all-reduce: at small local sizes these all-reduces are the
critical path, which is what hpdl's latency algorithms (recursive doubling) target.

Scalars (alpha, beta, residuals) stay on the device as one-element tensors, so a CUDA run never waits for
the host; iterations are fixed (``iters``), so every rank runs the same sequence of collectives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hpdl.apps.comm import Comm, synchronize


def slab(n: int, size: int, rank: int) -> tuple[int, int]:
    """Planes ``[lo, hi)`` of rank ``rank`` when ``n`` planes are split over ``size`` ranks (balanced)."""
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


class Poisson3D:
    """The 7-point operator on this rank's slab ``x[lo:hi]`` of the ``n^3`` grid.

    Args:
        n: interior points per dimension (>= the number of ranks).
        comm: :class:`hpdl.apps.comm.Comm`; dtype: float32 or float64.

    Raises:
        ValueError: ``n`` smaller than the number of ranks (a rank would own no plane).
    """

    def __init__(self, n: int, comm: Comm, dtype: torch.dtype = torch.float64):
        if n < comm.size:
            raise ValueError(f"n={n} must be >= the number of ranks ({comm.size}): every rank owns one x-plane or more")
        self.n, self.comm, self.dtype, self.device = n, comm, dtype, comm.device
        self.lo, self.hi = slab(n, comm.size, comm.rank)
        self.shape = (self.hi - self.lo, n, n)
        self.below = comm.rank - 1 if comm.rank > 0 else None           # owner of plane lo - 1
        self.above = comm.rank + 1 if comm.rank < comm.size - 1 else None  # owner of plane hi
        self.halo_lo = torch.zeros(n, n, dtype=dtype, device=self.device)
        self.halo_hi = torch.zeros(n, n, dtype=dtype, device=self.device)
        self.timers: dict[str, float] | None = None  # {"allreduce": s, "halo": s} when timing (CPU)

    def grid(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global integer indices (i, j, k) of this slab's points, each ``[nl, n, n]`` int64."""
        i = torch.arange(self.lo, self.hi, device=self.device)
        j = torch.arange(self.n, device=self.device)
        return torch.meshgrid(i, j, j, indexing="ij")

    def rhs(self) -> torch.Tensor:
        """A right-hand side in [-0.5, 0.5) from a hash of the global indices: the same global vector for any
        decomposition, and rich in eigenmodes (CG needs many iterations, unlike a smooth f)."""
        i, j, k = self.grid()
        h = (i * 73856093) ^ (j * 19349663) ^ (k * 83492791)
        return ((h % 1000).to(self.dtype) / 1000.0 - 0.5).contiguous()

    def matvec(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out = A x`` for this slab (``x`` and ``out``: ``[nl, n, n]``); exchanges the two halo planes."""
        sends, recvs = [], []
        if self.below is not None:
            sends.append((self.below, x[0]))
            recvs.append((self.below, self.halo_lo))
        if self.above is not None:
            sends.append((self.above, x[-1]))
            recvs.append((self.above, self.halo_hi))
        halo = self.comm.start_halo(sends, recvs)
        torch.mul(x, 6.0, out=out)  # the interior stencil overlaps the halo transfer
        out[1:] -= x[:-1]
        out[:-1] -= x[1:]
        out[:, 1:] -= x[:, :-1]
        out[:, :-1] -= x[:, 1:]
        out[:, :, 1:] -= x[:, :, :-1]
        out[:, :, :-1] -= x[:, :, 1:]
        t = time.perf_counter()
        halo.wait()
        if self.timers is not None:
            self.timers["halo"] += time.perf_counter() - t
        if self.below is not None:
            out[0] -= self.halo_lo
        if self.above is not None:
            out[-1] -= self.halo_hi

    def dot(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Global ``a . b`` as a one-element tensor (one all-reduce), bit-identical on every rank."""
        d = torch.dot(a.reshape(-1), b.reshape(-1)).reshape(1)
        t = time.perf_counter()
        self.comm.allreduce(d)
        if self.timers is not None:
            self.timers["allreduce"] += time.perf_counter() - t
        return d


@dataclass
class CGResult:
    """``residuals[k] = ||r_k||_2`` for k = 0..iters (float64 list, the same on every rank); ``x``: this rank's
    slab of the solution; ``time_s``: seconds per iteration (after ``warmup`` iterations); ``allreduce_s``,
    ``halo_s``: seconds per iteration inside dot-product all-reduces and halo waits (CPU only, else None)."""

    residuals: list[float]
    x: torch.Tensor
    time_s: float
    iters: int
    allreduce_s: float | None = None
    halo_s: float | None = None
    meta: dict = field(default_factory=dict)


def solve(comm: Comm, n: int, iters: int, *, dtype: torch.dtype = torch.float64, warmup: int = 0,
          breakdown: bool = False) -> CGResult:
    """Run ``warmup + iters`` CG iterations from ``x = 0`` on the ``n^3`` Poisson problem.

    The first ``warmup`` iterations are part of the same solve (so the residuals of a warmed-up run equal a
    cold one's) but not timed. ``breakdown`` (CPU) also times the all-reduces and halo waits, with host
    clocks around each call. Returns a :class:`CGResult`; raises ValueError as :class:`Poisson3D`.
    """
    op = Poisson3D(n, comm, dtype)
    b = op.rhs()
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    q = torch.empty_like(b)
    timed = breakdown and comm.device.type == "cpu"
    tiny = torch.finfo(dtype).tiny
    dot = op.dot
    rr = dot(r, r)
    history = [rr]
    t0 = None
    for k in range(warmup + iters):
        if k == warmup:
            synchronize(comm.device)
            comm.barrier()
            if timed:
                op.timers = {"allreduce": 0.0, "halo": 0.0}
            t0 = time.perf_counter()
        op.matvec(p, q)
        # once converged exactly (or to underflow), r . r and p . A p are 0: the clamps make alpha and beta 0
        # instead of 0 / 0, so a fixed iteration count stays finite on any problem size
        alpha = rr / dot(p, q).clamp_min_(tiny)
        x.add_(alpha * p)
        r.sub_(alpha * q)
        rr_new = dot(r, r)
        p.mul_(rr_new / rr.clamp_min(tiny)).add_(r)
        rr = rr_new
        history.append(rr)
    synchronize(comm.device)
    elapsed = time.perf_counter() - (t0 if t0 is not None else time.perf_counter())
    res = torch.cat(history).double().sqrt().cpu().tolist()
    per = max(iters, 1)
    timers = op.timers or {}
    return CGResult(res, x, elapsed / per, iters, timers["allreduce"] / per if timed else None,
                    timers["halo"] / per if timed else None,
                    {"n": n, "ranks": comm.size, "comm": comm.name, "dtype": str(dtype).removeprefix("torch.")})

