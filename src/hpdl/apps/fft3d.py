"""Pencil-decomposed 3-D FFT: the bandwidth-bound HPC proxy (the pattern of heFFTe, P3DFFT and AccFFT).

The ``N0 x N1 x N2`` complex array is spread over a ``P0 x P1`` process grid; rank ``r = r0 * P1 + r1``.
A forward transform is three batches of 1-D FFTs separated by two all-to-alls inside sub-communicators
(Pekurovsky, "P3DFFT", SIAM J. Sci. Comput. 2012; Ayala et al., "heFFTe", ICCS 2020):

    input  (z-pencils): dim 0 split over P0 (by r0), dim 1 over P1 (by r1), dim 2 whole -> FFT along 2
    all-to-all in the row (same r0, P1 ranks): dim 2 becomes split, dim 1 whole       -> FFT along 1
    all-to-all in the column (same r1, P0 ranks): dim 1 becomes split over P0, dim 0 whole -> FFT along 0
    output (x-pencils): dim 0 whole, dim 1 split over P0 (by r0), dim 2 over P1 (by r1)

Uneven sizes are split as :func:`hpdl.apps.cg.slab` does. Blocks are packed contiguously per destination
(complex viewed as pairs of reals, so every communicator moves plain floats) and unpacked after the exchange;
the all-to-alls move data only, so the result does not depend on the communicator, bit for bit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from hpdl.apps.cg import slab
from hpdl.apps.comm import Comm, synchronize


def process_grid(size: int) -> tuple[int, int]:
    """The most square ``P0 x P1 = size`` with ``P0 <= P1`` (``1 x size`` for a prime: slabs)."""
    p0 = max(d for d in range(1, math.isqrt(size) + 1) if size % d == 0)
    return p0, size // p0


def _sizes(n: int, p: int) -> list[int]:
    return [slab(n, p, q)[1] - slab(n, p, q)[0] for q in range(p)]


def pencil_boxes(shape, grid, r0: int, r1: int) -> tuple[tuple[slice, slice, slice], tuple[slice, slice, slice]]:
    """The (input z-pencil, output x-pencil) boxes of rank ``(r0, r1)`` of a ``grid = (P0, P1)`` decomposition of
    a global ``shape = (N0, N1, N2)`` array: input dims 0 and 1 split over P0 and P1, output dims 1 and 2."""
    p0, p1 = grid
    return ((slice(*slab(shape[0], p0, r0)), slice(*slab(shape[1], p1, r1)), slice(None)),
            (slice(None), slice(*slab(shape[1], p0, r0)), slice(*slab(shape[2], p1, r1))))

class PencilFFT:
    """Forward 3-D FFT of a pencil-distributed array (``torch.fft.fftn`` of the global array).

    Args:
        shape: global ``(N0, N1, N2)``; each ``N`` >= the grid size it is split over.
        comm: the world :class:`hpdl.apps.comm.Comm`; the row and column communicators are split from it
            (collective).
        grid: ``(P0, P1)``, positive, with ``P0 * P1 == comm.size`` (default :func:`process_grid`).

    Raises:
        ValueError: a grid that does not multiply to the number of ranks, or a dimension smaller than the
            number of ranks it is split over.
    """

    def __init__(self, shape: tuple[int, int, int], comm: Comm, grid: tuple[int, int] | None = None):
        self.shape = tuple(int(s) for s in shape)
        self.grid = tuple(grid) if grid is not None else process_grid(comm.size)
        p0, p1 = self.grid
        if len(self.shape) != 3 or p0 < 1 or p1 < 1 or p0 * p1 != comm.size:
            raise ValueError(f"need a 3-D shape and a grid of positive P0, P1 with P0*P1 == {comm.size} ranks, got "
                             f"shape={shape} grid={grid}")
        n0, n1, n2 = self.shape
        for name, n, p in (("N0", n0, p0), ("N1", n1, max(p0, p1)), ("N2", n2, p1)):
            if n < p:
                raise ValueError(f"{name}={n} is split over {p} ranks and must be >= {p}")
        self.comm = comm
        self.r0, self.r1 = divmod(comm.rank, p1)
        self.row = comm.split([r // p1 for r in range(comm.size)])  # same r0: P1 ranks, index r1
        self.col = comm.split([r % p1 for r in range(comm.size)])   # same r1: P0 ranks, index r0
        self.timers: dict[str, float] | None = None  # {"fft", "pack", "alltoall"} seconds when timing (CPU)

    def input_box(self) -> tuple[slice, slice, slice]:
        """This rank's part of the global input (z-pencil)."""
        return pencil_boxes(self.shape, self.grid, self.r0, self.r1)[0]

    def output_box(self) -> tuple[slice, slice, slice]:
        """This rank's part of the global output (x-pencil)."""
        return pencil_boxes(self.shape, self.grid, self.r0, self.r1)[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: complex ``[len(input_box)]`` -> complex ``[len(output_box)]`` of the global 3-D DFT (unnormalised)."""
        p0, p1 = self.grid
        n0, n1, n2 = self.shape
        x = self._fft(x, 2)
        x = self._transpose(x, self.row, split_dim=2, gather_dim=1, split=_sizes(n2, p1), gather=_sizes(n1, p1))
        x = self._fft(x, 1)
        x = self._transpose(x, self.col, split_dim=1, gather_dim=0, split=_sizes(n1, p0), gather=_sizes(n0, p0))
        return self._fft(x, 0)

    def _clock(self, key: str, t: float) -> float:
        now = time.perf_counter()
        if self.timers is not None:
            self.timers[key] += now - t
        return now

    def _fft(self, x, dim):
        t = time.perf_counter()
        y = torch.fft.fft(x, dim=dim)
        self._clock("fft", t)
        return y

    def _transpose(self, x, comm: Comm, split_dim: int, gather_dim: int, split: list[int], gather: list[int]):
        """Split ``split_dim`` by ``split`` (block q to rank q of ``comm``); concatenate the blocks received
        along ``gather_dim`` (rank q's is ``gather[q]`` long). Returns the new local block."""
        t = time.perf_counter()
        me = comm.rank
        offs = [sum(split[:q]) for q in range(comm.size)]
        send = torch.cat([x.narrow(split_dim, offs[q], split[q]).reshape(-1) for q in range(comm.size)])
        per_row = x.numel() // x.shape[split_dim]  # elements per unit of split_dim
        in_counts = [2 * per_row * s for s in split]
        block = list(x.shape)
        block[split_dim] = split[me]
        out_shapes = []
        for q in range(comm.size):
            b = list(block)
            b[gather_dim] = gather[q]
            out_shapes.append(b)
        out_counts = [2 * math.prod(b) for b in out_shapes]
        recv = torch.empty(sum(out_counts) // 2, dtype=x.dtype, device=x.device)
        t = self._clock("pack", t)
        comm.alltoall(torch.view_as_real(recv).view(-1), torch.view_as_real(send).view(-1), out_counts, in_counts)
        t = self._clock("alltoall", t)
        parts, off = [], 0
        for b, c in zip(out_shapes, out_counts):
            parts.append(recv[off:off + c // 2].view(b))
            off += c // 2
        y = torch.cat(parts, dim=gather_dim)
        self._clock("pack", t)
        return y


def global_input(shape: tuple[int, int, int], box=(slice(None),) * 3, dtype=torch.complex128,
                 device="cpu") -> torch.Tensor:
    """A deterministic complex test array (a hash of the global indices), or its ``box``; any rank can make
    its own part without communication."""
    idx = [torch.arange(n, device=device)[b] for n, b in zip(shape, box)]
    i, j, k = torch.meshgrid(*idx, indexing="ij")
    h = (i * 73856093) ^ (j * 19349663) ^ (k * 83492791)
    real = (h % 1009).double() / 1009.0 - 0.5
    imag = ((h // 1009) % 997).double() / 997.0 - 0.5
    return torch.complex(real, imag).to(dtype)


@dataclass
class FFTResult:
    """``y``: this rank's output block, ``box`` its place in the global output (:meth:`PencilFFT.output_box`);
    ``time_s``: seconds per forward transform (after warmup);
    ``fft_s``, ``pack_s``, ``alltoall_s``: per transform, inside local FFTs, packing and the all-to-alls
    (CPU only, else None)."""

    y: torch.Tensor
    box: tuple
    time_s: float
    fft_s: float | None = None
    pack_s: float | None = None
    alltoall_s: float | None = None
    meta: dict = field(default_factory=dict)


def run(comm: Comm, shape: tuple[int, int, int], iters: int, *, dtype=torch.complex64, warmup: int = 1,
        grid: tuple[int, int] | None = None, breakdown: bool = False) -> FFTResult:
    """Build the plan, make this rank's input, run ``warmup`` untimed and ``iters`` timed forward transforms."""
    fft = PencilFFT(shape, comm, grid)
    x = global_input(fft.shape, fft.input_box(), dtype, comm.device)
    y = None
    for _ in range(warmup):
        y = fft.forward(x)
    synchronize(comm.device)
    comm.barrier()
    timed = breakdown and comm.device.type == "cpu"
    if timed:
        fft.timers = {"fft": 0.0, "pack": 0.0, "alltoall": 0.0}
    t0 = time.perf_counter()
    for _ in range(iters):
        y = fft.forward(x)
    synchronize(comm.device)
    per = (time.perf_counter() - t0) / max(iters, 1)
    tm = fft.timers or {}
    n = max(iters, 1)
    return FFTResult(y, fft.output_box(), per, tm["fft"] / n if timed else None, tm["pack"] / n if timed else None,
                     tm["alltoall"] / n if timed else None,
                     {"shape": list(fft.shape), "grid": list(fft.grid), "ranks": comm.size, "comm": comm.name,
                      "dtype": str(dtype).removeprefix("torch.")})


class OffloadPencilFFT:
    """:class:`PencilFFT` with its two transposes offloaded and pipelined (the P3DFFT case of Suresh et al.,
    IPDPS 2023, on hpdl.offload): the local array is cut into ``chunks`` slabs along dimension 0, which
    neither transpose splits; as soon as a slab's 1-D FFTs are written into the shared send buffer its part
    of the transpose starts (a persistent request on the node's agent, or the progress thread), and the next
    slab's FFTs run meanwhile. Each transpose is one plan per slab, its blocks strided boxes read in place
    (no packing): rank ``(r0, r1)`` sends ``a[slab, :, block q of dim 2]`` to row peer ``(r0, q)``, whose
    ``b[slab, rows of r1 in dim 1, :]`` receives it; then ``c[slab, block q of dim 1, :]`` to column peer
    ``(q, r1)``, into its ``d[rows of the slab in dim 0, :, :]``.

    Collective over the world group (torch.distributed); the result equals :class:`PencilFFT`'s bit for bit
    (the transposes move data only).

    Args:
        shape, grid: as :class:`PencilFFT` (the world group is the process grid).
        dtype: complex64 or complex128.
        chunks: slabs per transpose (>= 1; more overlap, more messages).
        progress: hpdl.offload's ``progress=`` ("agent" needs an :class:`hpdl.offload.Agent`).
        timeout: seconds a transpose may take.

    Raises:
        ValueError: as :class:`PencilFFT`, a non-complex dtype, or ``chunks < 1``.
    """

    def __init__(self, shape: tuple[int, int, int], grid: tuple[int, int] | None = None, *,
                 dtype=torch.complex64, chunks: int = 4, progress: str | None = None, timeout: float | None = None):
        import torch.distributed as dist

        import hpdl.offload as ho

        if dtype not in (torch.complex64, torch.complex128):
            raise ValueError(f"dtype must be torch.complex64 or torch.complex128, got {dtype}")
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        size, rank = dist.get_world_size(), dist.get_rank()
        self.shape = tuple(int(s) for s in shape)
        self.grid = tuple(grid) if grid is not None else process_grid(size)
        p0, p1 = self.grid
        if len(self.shape) != 3 or p0 < 1 or p1 < 1 or p0 * p1 != size:
            raise ValueError(f"need a 3-D shape and a grid of positive P0, P1 with P0*P1 == {size} ranks, got "
                             f"shape={shape} grid={grid}")
        n0, n1, n2 = self.shape
        for name, n, p in (("N0", n0, p0), ("N1", n1, max(p0, p1)), ("N2", n2, p1)):
            if n < p:
                raise ValueError(f"{name}={n} is split over {p} ranks and must be >= {p}")
        self.rank, self.dtype, self.chunks = rank, dtype, chunks
        self.r0, self.r1 = divmod(rank, p1)
        real = torch.float32 if dtype == torch.complex64 else torch.float64
        l0s, l1s, m2s, k1s = _sizes(n0, p0), _sizes(n1, p1), _sizes(n2, p1), _sizes(n1, p0)
        l0, l1, m2, k1 = l0s[self.r0], l1s[self.r1], m2s[self.r1], k1s[self.r0]
        off = lambda sizes, q: sum(sizes[:q])  # noqa: E731
        alloc = ho.empty if (progress or "auto") != "thread" else (lambda s, d: torch.zeros(s, dtype=d))
        self._a = alloc((l0, l1, n2, 2), real)   # FFT along 2, sent by the row transpose
        self._b = alloc((l0, n1, m2, 2), real)   # received: dim 1 whole, dim 2 split
        self._c = alloc((l0, n1, m2, 2), real)   # FFT along 1, sent by the column transpose
        self._d = alloc((n0, k1, m2, 2), real)   # received: dim 0 whole, dim 1 split over P0
        self._slabs = [slab(l0, chunks, c) for c in range(chunks)]
        self.row_reqs, self.col_reqs = [], []
        for c, (s0, s1) in enumerate(self._slabs):
            p = ho.Plan(f"fft-row-{c}", rank=rank, world_size=size)
            a = p.buffer("a", self._a.shape, real)
            b = p.buffer("b", self._b.shape, real)
            for q in range(p1):
                peer = self.r0 * p1 + q
                if q == self.r1:
                    p.copy(b[s0:s1, off(l1s, q):off(l1s, q) + l1, :, :], a[s0:s1, :, off(m2s, q):off(m2s, q) + m2s[q], :])
                    continue
                p.send(a[s0:s1, :, off(m2s, q):off(m2s, q) + m2s[q], :], peer)
                p.recv(b[s0:s1, off(l1s, q):off(l1s, q) + l1s[q], :, :], peer)
            self.row_reqs.append(ho.compile(p, {"a": self._a, "b": self._b}, progress=progress, timeout=timeout))
            p = ho.Plan(f"fft-col-{c}", rank=rank, world_size=size)
            cc = p.buffer("c", self._c.shape, real)
            d = p.buffer("d", self._d.shape, real)
            for q in range(p0):
                peer = q * p1 + self.r1
                q0, q1 = slab(l0s[q], chunks, c)  # the sender's slab c, in the receiver's global dim 0
                if q == self.r0:
                    p.copy(d[off(l0s, q) + s0:off(l0s, q) + s1, :, :, :], cc[s0:s1, off(k1s, q):off(k1s, q) + k1s[q], :, :])
                    continue
                p.send(cc[s0:s1, off(k1s, q):off(k1s, q) + k1s[q], :, :], peer)
                p.recv(d[off(l0s, q) + q0:off(l0s, q) + q1, :, :, :], peer)
            self.col_reqs.append(ho.compile(p, {"c": self._c, "d": self._d}, progress=progress, timeout=timeout))

    def input_box(self) -> tuple[slice, slice, slice]:
        """This rank's part of the global input (z-pencil), as :meth:`PencilFFT.input_box`."""
        return pencil_boxes(self.shape, self.grid, self.r0, self.r1)[0]

    def output_box(self) -> tuple[slice, slice, slice]:
        """This rank's part of the global output (x-pencil), as :meth:`PencilFFT.output_box`."""
        return pencil_boxes(self.shape, self.grid, self.r0, self.r1)[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: complex ``[len(input_box)]`` -> complex ``[len(output_box)]`` (a new tensor), as
        :meth:`PencilFFT.forward`."""
        a, b = torch.view_as_complex(self._a), torch.view_as_complex(self._b)
        c, d = torch.view_as_complex(self._c), torch.view_as_complex(self._d)
        x = x.to(self.dtype)
        for (s0, s1), req in zip(self._slabs, self.row_reqs):
            if s1 > s0:  # an empty slab (more slabs than rows) still starts: its peers' parts may not be empty
                torch.fft.fft(x[s0:s1], dim=2, out=a[s0:s1])
            req.start()  # this slab travels while the next one's FFTs run
        for (s0, s1), rreq, creq in zip(self._slabs, self.row_reqs, self.col_reqs):
            rreq.wait()
            if s1 > s0:
                torch.fft.fft(b[s0:s1], dim=1, out=c[s0:s1])
            creq.start()
        for creq in self.col_reqs:
            creq.wait()
        return torch.fft.fft(d, dim=0)

    def free(self) -> None:
        for r in self.row_reqs + self.col_reqs:
            r.free()
        self.row_reqs, self.col_reqs = [], []
