"""How bytes move: the one point-to-point interface (``base.Transport``) and its backends (``torch_p2p``:
torch.distributed groups, ``gloo``: a private Gloo group on a store, ``mpi``: mpi4py, ``sub``: a subset of
ranks), shared CPU buffers (``shm``), and peer memory on the GPUs of one host (``symm``, ``resources``,
``kernels``)."""
