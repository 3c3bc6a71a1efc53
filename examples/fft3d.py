"""Pencil-decomposed 3-D FFT (two all-to-alls per transform, in the rows and columns of a P0 x P1 grid).

    torchrun --nproc-per-node 8 examples/fft3d.py --comm hpdl --algorithm direct --shape 64,64,64
    torchrun --nproc-per-node 8 examples/fft3d.py --comm nccl --shape 64,64,64
    mpirun -n 8 python examples/fft3d.py --comm mpi --shape 64,64,64
    torchrun --nproc-per-node 2 examples/fft3d.py --device cuda --comm hpdl --shape 256,256,256

Every option: `python examples/fft3d.py --help`; design and numbers: docs/apps.md.
"""

import sys

from hpdl.apps.cli import main_fft

if __name__ == "__main__":
    sys.exit(main_fft())
