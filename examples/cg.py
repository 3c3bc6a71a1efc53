"""Distributed conjugate gradient on the 3-D Poisson problem (two dot-product all-reduces per iteration).

    torchrun --nproc-per-node 8 examples/cg.py --comm hpdl --size 32        # hpdl.comm (auto: native, gloo's own, at 8 B)
    torchrun --nproc-per-node 8 examples/cg.py --comm nccl --size 32        # torch.distributed (gloo on CPU)
    mpirun -n 8 python examples/cg.py --comm mpi --size 32                  # mpi4py
    torchrun --nproc-per-node 2 examples/cg.py --device cuda --dtype float32 --comm hpdl --size 64

Every option: `python examples/cg.py --help`; design and numbers: docs/apps.md.
"""

import sys

from hpdl.apps.cli import main_cg

if __name__ == "__main__":
    sys.exit(main_cg())
