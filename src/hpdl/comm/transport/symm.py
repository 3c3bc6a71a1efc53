"""A persistent device buffer that every rank of a one-node process group can load from and store into.

Each rank allocates ``nbytes`` on its GPU once; the buffer is mapped into every other rank's address space, so a
kernel on rank r reaches rank q's buffer through the plain pointer ``ptrs[q]`` (NVLink or PCIe peer access).
Two ways to build it, tried in this order:

* ``"symm"``: PyTorch symmetric memory (``torch.distributed._symmetric_memory.empty`` + ``rendezvous``, torch
  >= 2.5). NVLink multicast is never used: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set before allocation.
* ``"ipc"``: a plain ``cudaMalloc`` allocation whose ``cudaIpcGetMemHandle`` is exchanged with
  ``all_gather_object`` and opened by each peer in its own device's context (vLLM's custom all-reduce does
  the same; torch's ``rebuild_cuda_tensor`` opens it under the owner's device instead, which the kernels on
  this rank's device cannot use without separately enabled peer access). It also works between processes
  that share one GPU (``HPDL_RANKS_PER_GPU``), where ``"auto"`` takes it directly.

The first 64 KiB (``header_bytes``) are zeroed before the ranks exchange addresses, so barrier flags start at 0.
Creation and :meth:`PeerBuffer.close` are collective over the group; nothing else is.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

BACKENDS = ("auto", "symm", "ipc")


def device_census(group, device: torch.device) -> tuple[int, int]:
    """``(fewest SMs of any rank's GPU, most ranks of the group on one GPU)``; collective over ``group``.

    Ranks that share a GPU (``HPDL_RANKS_PER_GPU``) share its SMs: a kernel whose blocks wait for a peer's
    blocks must then launch at most ``sms // sharing`` blocks a rank, or, under MPS, the waiting blocks of one
    rank can occupy the SMs that the peer's blocks need, and both wait until the timeout.
    """
    me = (socket.gethostname(), torch.device(device).index,
          torch.cuda.get_device_properties(device).multi_processor_count)
    everyone: list = [None] * dist.get_world_size(group)
    with torch.cuda.device(device):
        dist.all_gather_object(everyone, me, group=group)
    per_gpu: dict[tuple[str, int], int] = {}
    for host, dev, _ in everyone:
        per_gpu[(host, dev)] = per_gpu.get((host, dev), 0) + 1
    return min(sm for _, _, sm in everyone), max(per_gpu.values())


class PeerBuffer:
    """``nbytes`` of device memory per rank, mapped into every rank of ``group`` (all on one host).

    Args:
        group: the process group (None = the default group); its backend must run collectives on ``device``
            (NCCL) or on CPU objects (gloo); only ``all_gather_object`` and ``barrier`` are used.
        device: this rank's CUDA device.
        nbytes: bytes per rank (> 0).
        header_bytes: leading bytes zeroed before the exchange (barrier flags).
        backend: "auto" (symmetric memory, else IPC), "symm" or "ipc".

    Attributes:
        ptrs: ``ptrs[q]`` is the address of rank q's buffer, valid in this process (``ptrs[rank]`` is local).
        rank, world: this rank and the group size. backend: the backend used.
        min_sm_count: the smallest SM count among the group's GPUs.

    Raises:
        ValueError: bad ``nbytes`` or ``backend``.
        RuntimeError: ranks are on different hosts, a GPU cannot reach a peer's memory, or both backends failed
            (the message carries each backend's error).
    """

    def __init__(self, group, device: torch.device, nbytes: int, header_bytes: int = 65536,
                 backend: str = "auto"):
        if nbytes <= 0 or header_bytes > nbytes:
            raise ValueError(f"nbytes must be > 0 and >= header_bytes={header_bytes}, got {nbytes}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.group = group
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.nbytes = int(nbytes)
        self.header_bytes = int(header_bytes)
        self._keep: list = []
        with torch.cuda.device(self.device):
            shared = self._check_one_node()
            errors = []
            # ranks sharing a GPU: CUDA IPC between processes of one device is the measured path; symmetric
            # memory's rendezvous is not made for two ranks on one device
            auto = ("ipc",) if shared else ("symm", "ipc")
            for name in (auto if backend == "auto" else (backend,)):
                try:
                    self.ptrs = self._alloc_symm() if name == "symm" else self._alloc_ipc()
                    self.backend = name
                    break
                except Exception as exc:  # noqa: BLE001 - try the next backend, report all if none works
                    self._keep = []
                    errors.append(f"{name}: {exc!r}")
            else:
                raise RuntimeError("could not register a peer buffer: " + "; ".join(errors))

    def _check_one_node(self) -> bool:
        """Raise unless every rank is on this host and can reach every peer's GPU; True when ranks share GPUs."""
        me = (socket.gethostname(), self.device.index, torch.cuda.get_device_properties(self.device).multi_processor_count)
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, me, group=self.group)
        hosts = {h for h, _, _ in everyone}
        if len(hosts) != 1:
            raise RuntimeError(f"peer memory needs every rank on one host; group spans {sorted(hosts)}")
        for q, (_, dev, _) in enumerate(everyone):
            if dev != self.device.index and not torch.cuda.can_device_access_peer(self.device.index, dev):
                raise RuntimeError(f"GPU {self.device.index} (rank {self.rank}) cannot access GPU {dev} (rank {q})")
        self.min_sm_count = min(sm for _, _, sm in everyone)
        return len({dev for _, dev, _ in everyone}) < self.world

    def _alloc_symm(self) -> list[int]:
        import torch.distributed._symmetric_memory as symm_mem

        name = (self.group or dist.group.WORLD).group_name
        t = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        t[: self.header_bytes].zero_()
        torch.cuda.synchronize(self.device)
        handle = symm_mem.rendezvous(t, name)
        if handle.world_size != self.world or handle.rank != self.rank:
            raise RuntimeError(f"symmetric memory saw rank {handle.rank}/{handle.world_size}, "
                               f"expected {self.rank}/{self.world}")
        base = list(handle.buffer_ptrs)
        offset = t.data_ptr() - base[self.rank]   # the tensor may sit inside a larger symmetric allocation
        self._keep = [t, handle]
        return [b + offset for b in base]

    def _alloc_ipc(self) -> list[int]:
        from hpdl.comm.transport.kernels import load_peer_allreduce

        ext = load_peer_allreduce()
        dev = self.device.index
        ptr, handle = ext.ipc_alloc(self.nbytes, dev)   # zeroed, synchronised
        self._keep = [("free", ptr)]
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, handle, group=self.group)
        ptrs = []
        for q, h in enumerate(everyone):
            if q == self.rank:
                ptrs.append(ptr)
            else:
                ptrs.append(ext.ipc_open(h, dev))
                self._keep.append(("close", ptrs[-1]))
        self._ext = ext
        return ptrs

    def close(self) -> None:
        """Free the buffer after every rank is done with it (collective: synchronises, then barriers)."""
        if not self._keep:
            return
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)
            for kind, ptr in reversed([k for k in self._keep if isinstance(k, tuple)]):
                (self._ext.ipc_close if kind == "close" else self._ext.ipc_free)(ptr, self.device.index)
        self._keep = []
        self.ptrs = []
