"""Device-to-device copies on the GPU's copy engines: ``cudaMemcpyBatchAsync`` with
``cudaMemcpyFlagPreferOverlapWithCompute`` (CUDA runtime >= 12.8), called through ctypes.

Why: a plain ``cudaMemcpyAsync`` between two buffers of one GPU (what ``tensor.copy_`` and a captured CUDA
graph's memcpy node issue) is run by the driver as a copy *kernel* on the SMs, which is the fastest way to move
bytes inside one HBM but competes with the application's kernels for SMs, and, without MPS, is scheduled in its
process's time slice like any kernel. The flag asks the driver to use a copy engine instead (0 SMs; NCCL's
copy-engine collectives use the same call, and NVIDIA/nccl issue 2177 reports 0 SMs for local and peer copies
under it on CUDA 13.2, at a lower bandwidth than an SM copy). It is a hint: the driver may ignore it.

The signature changed in CUDA 13.0 (``failIdx`` removed); the one matching the loaded runtime's version is used.
The runtime is the one torch loaded (found in ``/proc/self/maps``), so streams and IPC-opened pointers are
the same objects.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Sequence

from hpdl.offload.errors import OffloadError

SRC_ACCESS_ORDER_STREAM = 0x1           # cudaMemcpySrcAccessOrderStream
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1  # cudaMemcpyFlagPreferOverlapWithCompute
MIN_RUNTIME = 12080                     # cudaMemcpyBatchAsync appeared in CUDA 12.8


class MemcpyAttributes(ctypes.Structure):
    """``struct cudaMemcpyAttributes`` (driver_types.h, CUDA 12.8-13.x): 24 bytes."""

    _fields_ = [("srcAccessOrder", ctypes.c_int),
                ("srcLocHint_type", ctypes.c_int), ("srcLocHint_id", ctypes.c_int),
                ("dstLocHint_type", ctypes.c_int), ("dstLocHint_id", ctypes.c_int),
                ("flags", ctypes.c_uint)]


def _loaded_cudart() -> str | None:
    """Path of the libcudart this process already mapped (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "libcudart.so" in path:
                    return path
    except OSError:
        pass
    return None


_LIB: list = []  # [(lib or None, version, reason)] once probed


def runtime():
    """``(lib, version, reason)``: the CUDA runtime library (ctypes) and its version, or ``(None, 0, why)``."""
    if _LIB:
        return _LIB[0]
    path = _loaded_cudart() or ctypes.util.find_library("cudart")
    lib, version, reason = None, 0, ""
    if path is None:
        reason = "no CUDA runtime library (libcudart) is loaded or installed"
    else:
        try:
            lib = ctypes.CDLL(path)
            v = ctypes.c_int(0)
            if lib.cudaRuntimeGetVersion(ctypes.byref(v)) != 0:
                raise OSError("cudaRuntimeGetVersion failed")
            version = v.value
            if version < MIN_RUNTIME:
                reason = f"CUDA runtime {version} has no cudaMemcpyBatchAsync (needs >= {MIN_RUNTIME}, CUDA 12.8)"
            elif not hasattr(lib, "cudaMemcpyBatchAsync"):
                reason = f"{path} exports no cudaMemcpyBatchAsync"
        except (OSError, AttributeError) as exc:  # AttributeError: a library without the runtime's symbols
            reason = f"cannot load {path}: {exc}"
        if reason:
            lib = None
    _LIB.append((lib, version, reason))
    return _LIB[0]


def unavailable_reason() -> str:
    """Empty when :class:`BatchCopy` can run here, else why not."""
    return runtime()[2]


class BatchCopy:
    """A fixed batch of contiguous device-to-device copies, issued with one ``cudaMemcpyBatchAsync`` call per
    :meth:`issue` (the pointer and size arrays are built once).

    Args:
        dsts, srcs: device addresses (ints), one per copy; the memory must stay mapped while copies run.
        sizes: bytes per copy (> 0).
        prefer_copy_engine: set ``cudaMemcpyFlagPreferOverlapWithCompute`` (else the default flag).
        lib, version: the runtime to call (default :func:`runtime`'s; tests pass a stand-in recording calls).

    Raises:
        OffloadError: the runtime has no batch copy (the reason), or the arrays differ in length / are empty.
    """

    def __init__(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], *,
                 prefer_copy_engine: bool = True, lib=None, version: int | None = None):
        if lib is None:
            lib, version, reason = runtime()
            if lib is None:
                raise OffloadError(f"copy-engine batch copies unavailable: {reason}")
        if not (len(dsts) == len(srcs) == len(sizes)) or not dsts:
            raise OffloadError(f"BatchCopy needs as many dsts, srcs and sizes (>= 1), got {len(dsts)}, "
                               f"{len(srcs)}, {len(sizes)}")
        if any(int(s) <= 0 for s in sizes):
            raise OffloadError(f"BatchCopy sizes must be > 0 bytes, got {list(sizes)}")
        n = len(dsts)
        self.count = n
        self._lib, self._version = lib, int(version)
        self._dsts = (ctypes.c_void_p * n)(*map(int, dsts))
        self._srcs = (ctypes.c_void_p * n)(*map(int, srcs))
        self._sizes = (ctypes.c_size_t * n)(*map(int, sizes))
        self._attrs = MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, 0, 0, 0, 0,
                                       FLAG_PREFER_OVERLAP_WITH_COMPUTE if prefer_copy_engine else 0)
        self._idx = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t(0)
        fn = lib.cudaMemcpyBatchAsync
        fn.restype = ctypes.c_int
        self._fn = fn

    def args(self, stream: int) -> tuple:
        """The C arguments for the loaded runtime: CUDA 13 has no ``failIdx`` before the stream."""
        head = (self._dsts, self._srcs, self._sizes, ctypes.c_size_t(self.count), ctypes.byref(self._attrs),
                self._idx, ctypes.c_size_t(1))
        if self._version >= 13000:
            return (*head, ctypes.c_void_p(stream))
        return (*head, ctypes.byref(self._fail), ctypes.c_void_p(stream))

    def issue(self, stream: int) -> None:
        """Enqueue the batch on ``stream`` (a ``cudaStream_t`` as an int: ``torch.cuda.Stream.cuda_stream``;
        not the legacy default stream 0, which the API refuses).

        Raises:
            OffloadError: the runtime's error code and string (e.g. an invalid pointer, the legacy stream).
        """
        if not stream:
            raise OffloadError("cudaMemcpyBatchAsync refuses the legacy default stream: pass a created stream")
        rc = self._fn(*self.args(stream))
        if rc:
            err = getattr(self._lib, "cudaGetErrorString", None)
            text = ""
            if err is not None:
                err.restype = ctypes.c_char_p
                text = (err(rc) or b"").decode(errors="replace")
            raise OffloadError(f"cudaMemcpyBatchAsync of {self.count} copies failed: error {rc} {text}".rstrip())
