"""The three communicators the applications run on: ``hpdl`` (hpdl.comm's algorithms), ``nccl`` (the process
group's own collectives: NCCL on CUDA, gloo on CPU) and ``mpi`` (mpi4py), behind one small interface.

An application only needs four things from a communicator: an in-place sum all-reduce, an all-to-all with
split sizes, non-blocking point-to-point halo exchanges, and sub-communicators. Halos go through hpdl.comm's
transport interface: ``hpdl`` and ``nccl`` over a :class:`~hpdl.comm.transport.torch_p2p.TorchTransport` on a
process group of their own (so halo messages never interleave with hpdl's tagged schedules), ``mpi`` over an
:class:`~hpdl.comm.transport.mpi.MpiTransport` on its communicator. ``hpdl`` and ``nccl`` therefore differ in the
collectives only, which keeps the comparison about the collectives; ``mpi`` keeps MPI's own ``Allreduce`` and
``Alltoallv``, the MPI baseline.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist

from hpdl.comm.transport.mpi import MpiTransport
from hpdl.comm.transport.torch_p2p import TorchTransport

COMMS = ("hpdl", "nccl", "mpi")
# halo messages' tag: a split TorchComm shares its group with hpdl's schedules, whose tags are all below 2000;
# under 32767, the least TAG_UB an MPI may have
HALO_TAG = 30000


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU); call before reading a host clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Comm:
    """Base communicator; ``LocalComm`` (one process, no communication) doubles as the single-process
    reference of every application.

    Attributes: ``name`` ("local", "hpdl", "nccl", "mpi"), ``rank``, ``size``, ``device``.
    """

    name = "local"

    def __init__(self, device: torch.device | str = "cpu"):
        self.rank, self.size, self.device = 0, 1, torch.device(device)

    def allreduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks, in place, bit-identical on every rank."""

    def alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                 in_splits: Sequence[int]) -> None:
        """1-D ``inp[in_offsets[q] : +in_splits[q]]`` goes to rank ``q``; ``out`` receives rank q's block at
        ``out_offsets[q]`` (element counts, as MPI_Alltoallv)."""
        out.copy_(inp)

    def start_halo(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]):
        """Post non-blocking sends ``(peer, tensor)`` and receives ``(peer, buffer)``; returns a handle whose
        ``wait()`` completes them. Contiguous tensors; one message per (peer, direction)."""
        return _Done()

    def split(self, colors: Sequence[int]) -> "Comm":
        """Sub-communicator of the ranks whose ``colors[rank]`` equals this rank's (ranks keep their order).
        Every rank passes the same list; collective over this communicator."""
        return self

    def barrier(self) -> None:
        """Wait for every rank."""


class _Done:
    def wait(self) -> None:
        pass


LocalComm = Comm


class _Reqs:
    def __init__(self, reqs):
        self.reqs = reqs

    def wait(self) -> None:
        for r in self.reqs:
            r.wait()


class TorchComm(Comm):
    """torch.distributed group; collectives through hpdl.comm (``use_hpdl``) or the group's backend.

    Args:
        use_hpdl: route all-reduce and all-to-all through :func:`hpdl.comm.all_reduce` /
            :func:`hpdl.comm.all_to_all_single` (keyword arguments only) instead of torch.distributed.
        group: the process group (None = world); ``ranks``: its global ranks (None = all).
        algorithm, alltoall_algorithm, window: hpdl's ``algorithm=`` and ``window=`` for each collective.
        timeout: seconds a halo wait may block before it raises :class:`hpdl.runtime.CollectiveTimeoutError`
            naming the peer (gloo; NCCL's own watchdog bounds its waits); None = ``HPDL_TIMEOUT``.

    hpdl's per-call argument check (``HPDL_CHECK``) runs on the first call of each collective only: an
    application loop repeats the same call on every rank, so later checks would only add latency.
    """

    def __init__(self, use_hpdl: bool, device: torch.device | str = "cpu", group=None,
                 ranks: Sequence[int] | None = None, algorithm: str = "auto", alltoall_algorithm: str = "auto",
                 window: int | None = None, timeout: float | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: use hpdl.apps.comm.launch() or "
                               "hpdl.runtime.init_from_env() first")
        super().__init__(device)
        self.name = "hpdl" if use_hpdl else "nccl"
        self.use_hpdl, self.group = use_hpdl, group
        self.algorithm, self.alltoall_algorithm, self.window = algorithm, alltoall_algorithm, window
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.ranks = list(ranks) if ranks is not None else list(range(self.size))
        self._checked: set[str] = set()
        self.timeout = timeout
        halo_group = group
        if group is None and self.size > 1:  # collective: every rank builds its communicator here
            halo_group = dist.new_group(self.ranks)
            dist.all_reduce(torch.zeros(1, device=self.device), group=halo_group)  # NCCL: create it now
        from hpdl.runtime import env

        self.halo = TorchTransport(halo_group, float(env.get("HPDL_TIMEOUT") if timeout is None else timeout),
                                   device=self.device)

    def _check(self, what: str):
        if what in self._checked and self.device.type == "cpu":
            return False
        self._checked.add(what)
        return None  # first call, and every CUDA call (HPDL_CHECK's auto is off there; None keeps hpdl's hot path)

    def allreduce(self, t: torch.Tensor) -> None:
        if self.size == 1:
            return
        if self.use_hpdl:
            import hpdl.comm as hc

            hc.all_reduce(t, op="sum", group=self.group, algorithm=self.algorithm, window=self.window,
                          check=self._check("all_reduce"))
        else:
            dist.all_reduce(t, group=self.group)

    def alltoall(self, out, inp, out_splits, in_splits) -> None:
        if self.size == 1:
            out.copy_(inp)
            return
        if self.use_hpdl:
            import hpdl.comm as hc

            hc.all_to_all_single(out, inp, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits),
                                 group=self.group, algorithm=self.alltoall_algorithm, window=self.window,
                                 check=self._check("all_to_all_single"))
        else:
            dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=self.group)

    def start_halo(self, sends, recvs):
        if not sends and not recvs:
            return _Done()
        s, r = self.halo.post([(t, peer) for peer, t in sends], [(buf, peer) for peer, buf in recvs], HALO_TAG)
        return _Reqs(r + s)

    def split(self, colors):
        if self.group is not None:
            raise ValueError("TorchComm.split splits the world communicator only (torch.distributed.new_group is "
                             "collective over the world)")
        if len(colors) != self.size:
            raise ValueError(f"colors must have one entry per rank ({self.size}), got {len(colors)}")
        mine = None
        for color in sorted(set(colors)):  # every rank creates every group, in the same order
            members = [r for r in range(self.size) if colors[r] == color]
            g = dist.new_group(members)
            if colors[self.rank] == color:
                mine = (g, members)
        sub = TorchComm(self.use_hpdl, self.device, group=mine[0], ranks=mine[1], algorithm=self.algorithm,
                        alltoall_algorithm=self.alltoall_algorithm, window=self.window, timeout=self.timeout)
        return sub

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


class MpiComm(Comm):
    """mpi4py communicator (``pip install 'hpdl[mpi]'`` plus an MPI library): MPI's own ``Allreduce`` and
    ``Alltoallv`` (the MPI baseline), halos over an :class:`~hpdl.comm.transport.mpi.MpiTransport` (``Isend`` /
    ``Irecv``, waits that time out naming the peer). CUDA tensors are passed through ``__cuda_array_interface__``
    after a device synchronisation (MPI ignores CUDA streams) and need a CUDA-aware MPI; CPU tensors as NumPy
    views (no copy).

    Args:
        comm: the mpi4py communicator (default ``COMM_WORLD``).
        timeout: seconds a halo wait may block; None = ``HPDL_TIMEOUT``.
    """

    name = "mpi"

    def __init__(self, device: torch.device | str = "cpu", comm=None, timeout: float | None = None):
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise RuntimeError("--comm mpi needs mpi4py and an MPI library: pip install 'hpdl[mpi]' (and e.g. "
                               "apt-get install mpich), then launch with mpirun") from exc
        super().__init__(device)
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout = timeout
        self.transport = MpiTransport(self.comm, timeout, self.device)

    def _buf(self, t: torch.Tensor):
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()
            return t
        return t.numpy()

    def allreduce(self, t: torch.Tensor) -> None:
        if self.size > 1:
            self.comm.Allreduce(self.MPI.IN_PLACE, self._buf(t), op=self.MPI.SUM)

    def alltoall(self, out, inp, out_splits, in_splits) -> None:
        def displs(counts):
            d, acc = [], 0
            for c in counts:
                d.append(acc)
                acc += c
            return d

        self.comm.Alltoallv([self._buf(inp), (list(in_splits), displs(in_splits))],
                            [self._buf(out), (list(out_splits), displs(out_splits))])

    def start_halo(self, sends, recvs):
        s, r = self.transport.post([(t, peer) for peer, t in sends], [(buf, peer) for peer, buf in recvs],
                                   HALO_TAG)
        return _Reqs(r + s)

    def split(self, colors):
        return MpiComm(self.device, self.comm.Split(colors[self.rank], self.rank), self.timeout)

    def barrier(self) -> None:
        self.comm.Barrier()


def comm_label(comm_name: str, algorithm: str = "") -> str:
    """What ran, for the result line: ``hpdl(ALGO)``, ``mpi``, or the process group's real backend for
    ``--comm nccl`` (``gloo`` on CPU, never a ``nccl`` that did not run)."""
    if comm_name == "hpdl":
        return f"hpdl({algorithm})" if algorithm else "hpdl"
    if comm_name == "nccl":
        backend = dist.get_backend() if dist.is_initialized() else "none"
        return backend if backend == "nccl" else f"{backend} (asked: nccl; NCCL needs --device cuda)"
    return comm_name


def launch(comm: str, device: str = "cpu", *, algorithm: str = "auto", alltoall_algorithm: str = "auto",
           window: int | None = None, timeout: float | None = None) -> Comm:
    """The communicator of a script started by torchrun, mpirun or srun, or of a plain single process.

    ``comm="mpi"`` uses mpi4py's COMM_WORLD (no torch.distributed); ``"hpdl"`` and ``"nccl"`` join the
    launcher's job through :func:`hpdl.runtime.init_from_env`, or form a one-rank group when no launcher
    variables are set. ``timeout`` (seconds; None = ``HPDL_TIMEOUT``) bounds the rendezvous and each halo wait.
    Raises ValueError for an unknown ``comm`` or ``device``, or ``cuda`` without CUDA.
    """
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device here; use --device cpu")
    if comm == "mpi":
        c = MpiComm("cpu", timeout=timeout)
        dev = torch.device("cpu")
        if device == "cuda":
            local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", c.rank)))
            dev = torch.device("cuda", local % torch.cuda.device_count())
            torch.cuda.set_device(dev)
        c.device = c.transport.device = dev
        return c
    from hpdl.runtime import init_from_env

    if not dist.is_initialized():   # under a launcher its job; otherwise a job of one rank
        init_from_env(device, timeout=timeout, standalone=True)
    from hpdl.runtime.launch import device_for, job_ranks_per_gpu

    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    dev = device_for(device, local, job_ranks_per_gpu(device, None))[0]   # shared GPUs too
    return TorchComm(comm == "hpdl", dev, algorithm=algorithm, alltoall_algorithm=alltoall_algorithm, window=window,
                     timeout=timeout)
