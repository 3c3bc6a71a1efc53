"""Rank functions for tests/apps (run on hpdl.testing pools: gloo, CPU)."""

import torch

from hpdl.apps import cg, fft3d
from hpdl.apps.comm import TorchComm


def _comm(ctx, kind, algorithm="auto", alltoall_algorithm="auto"):
    return TorchComm(kind == "hpdl", ctx.device, algorithm=algorithm, alltoall_algorithm=alltoall_algorithm)


def cg_run(ctx, kind, algorithm, n, iters):
    """Residual history and this rank's slab of x after ``iters`` CG iterations (2 warmup included)."""
    comm = _comm(ctx, kind, algorithm)
    res = cg.solve(comm, n, iters - 2, warmup=2, breakdown=True)
    lo, hi = cg.slab(n, ctx.world_size, ctx.rank)
    return res.residuals, res.x, lo, hi, res.allreduce_s is not None


def fft_run(ctx, kind, alltoall_algorithm, shape, grid):
    """This rank's output block and its place in the global array."""
    comm = _comm(ctx, kind, alltoall_algorithm=alltoall_algorithm)
    res = fft3d.run(comm, shape, 1, dtype=torch.complex128, warmup=1, grid=grid, breakdown=True)
    return res.y, res.box, res.alltoall_s is not None


def train_run(ctx, overrides):
    """Losses and bucket count of a short training run with ``TrainConfig(**overrides)``."""
    from hpdl.apps.train import TrainConfig, train

    out = train(TrainConfig(**overrides), log=None)
    return out["losses"], out["buckets"], out["world_size"]


def bench_job(ctx, plan):
    from hpdl.apps import bench

    return bench.job(ctx, plan, log=False)
