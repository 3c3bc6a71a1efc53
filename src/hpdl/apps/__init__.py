"""Application-level proxies on hpdl.comm: nanoGPT training, conjugate gradient on 3-D Poisson, pencil 3-D FFT.

Each application runs over :mod:`hpdl.apps.comm` (``hpdl``, ``nccl`` or ``mpi``) on CPU or CUDA; the thin
scripts in ``examples/`` launch them, ``benchmarks/apps_cpu.py`` measures them (docs/apps.md).
"""

