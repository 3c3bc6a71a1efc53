"""Run under mpirun by test_mpi.py: CG and the pencil FFT on MpiComm; each rank saves its results."""

import sys

import torch

from hpdl.apps import cg, fft3d
from hpdl.apps.comm import launch

if __name__ == "__main__":
    out, n, iters, shape = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), tuple(map(int, sys.argv[4].split(",")))
    comm = launch("mpi", "cpu")
    res = cg.solve(comm, n, iters)
    fft = fft3d.run(comm, shape, 1, dtype=torch.complex128, warmup=0)
    torch.save({"residuals": res.residuals, "x": res.x, "slab": cg.slab(n, comm.size, comm.rank), "y": fft.y,
                "box": fft.box}, f"{out}/rank{comm.rank}.pt")
