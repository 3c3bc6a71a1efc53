"""Host memory both the application and the agent map: buffers (``empty``/``zeros``), request mailboxes, and
doorbells. Buffers and mailboxes are segments of hpdl's one shared-memory module
(:mod:`hpdl.comm.transport.shm`) in ``HPDL_OFFLOAD_SHM_DIR`` (POSIX shared memory, ``/dev/shm``, by default):
files mapped ``MAP_SHARED``, which the agent reads and writes in place.

A file's path is its memory key (the role of an exported memory key on a DPU): the creator registers it,
sends the path to the agent, and unlinks it when its tensor is freed or the process exits.

Crash safety is that module's: names carry the creating process's owner token, whose ``flock`` it holds for
its lifetime, and :func:`sweep` (run when a process first allocates in the directory, and by an agent when a
client leaves) removes the files of owners whose lock is free, i.e. whose process is gone (SIGKILL,
``os._exit``, an OOM kill), right across pid namespaces and never fooled by a recycled pid.
"""

from __future__ import annotations

import operator
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from hpdl.comm.transport import shm as _shm
from hpdl.offload.errors import OffloadError
from hpdl.offload.plan import dtype_name, torch_dtype
from hpdl.runtime import env

_SEGMENTS: dict[str, tuple[int, int]] = {}  # path -> (address, nbytes) of buffers this process created
_LOCK = threading.Lock()


def shm_dir() -> str:
    """The directory of offload's shared memory: ``HPDL_OFFLOAD_SHM_DIR``, else ``/dev/shm`` (else the temporary
    directory)."""
    return env.get("HPDL_OFFLOAD_SHM_DIR") or _shm.default_dir()


def sweep(directory: str | None = None) -> list[str]:
    """Remove the shared-memory files of hpdl processes that are gone (their owner lock is free), in
    ``directory`` (default :func:`shm_dir`): :func:`hpdl.comm.transport.shm.sweep`.

    Safe to call at any time from any process: files of a live owner are never touched. Returns the paths
    removed.
    """
    return _shm.sweep(directory or shm_dir())


def _create(kind: str, nbytes: int) -> _shm.Segment:
    d = shm_dir()
    if not os.path.isdir(d):   # else the error would name a temporary file in it
        where = (f"HPDL_OFFLOAD_SHM_DIR={env.get('HPDL_OFFLOAD_SHM_DIR')}" if env.get("HPDL_OFFLOAD_SHM_DIR")
                 else f"the default directory {d}")
        raise OffloadError(f"offload's shared-memory directory does not exist: {where} is not a directory; create "
                           "it, or point HPDL_OFFLOAD_SHM_DIR at an existing tmpfs such as /dev/shm")
    try:
        return _shm.create(f"offload-{kind}", nbytes, directory=d)
    except _shm.NoSpaceError as exc:
        raise OffloadError(f"{exc.strerror}; free space there or set HPDL_OFFLOAD_SHM_DIR to a larger tmpfs") from None


def _unlink(path: str) -> None:
    with _LOCK:
        _SEGMENTS.pop(path, None)
    _shm.unlink(path)  # a forked child's call leaves its parent's file alone


def _shape(shape) -> tuple[int, ...]:
    """``shape`` (an int or a sequence of ints >= 0) as a tuple of ints."""
    if isinstance(shape, torch.Size):
        dims = tuple(shape)
    else:
        try:
            dims = (operator.index(shape),) if not isinstance(shape, bool) else None
        except TypeError:
            try:
                dims = tuple(shape)
            except TypeError:
                dims = None
    try:
        if dims is None or any(isinstance(s, bool) for s in dims):
            raise TypeError
        dims = tuple(operator.index(s) for s in dims)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints >= 0, got {shape!r}") from None
    if any(s < 0 for s in dims):
        raise ValueError(f"shape must be an int or a sequence of ints >= 0, got {shape!r}")
    return dims


def empty(shape, dtype=torch.float32) -> torch.Tensor:
    """A CPU tensor in shared memory that an offload agent can read and write in place (like
    ``MPI_Alloc_mem`` / ``MPI_Win_allocate_shared``). Contents are zero (a fresh file), as with :func:`zeros`.

    The file is unlinked when the tensor (and every view of it) is freed, or at exit.

    Args:
        shape: an int or a sequence of ints >= 0.
        dtype: a torch dtype offload can move (:func:`hpdl.offload.plan.dtype_name`).

    Raises:
        TypeError: ``shape`` not an int or a sequence of ints (a float is refused, not truncated).
        ValueError: a negative size in ``shape``.
        OffloadError: the shared-memory directory (``HPDL_OFFLOAD_SHM_DIR``) does not exist or has no room for it
            (the message names the directory).
    """
    shape = _shape(shape)
    dt = torch_dtype(dtype_name(dtype))
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
    seg = _create("buf", nbytes)
    # the tensor keeps the mapping alive for as long as any view of its storage lives; then the file goes
    raw = torch.frombuffer(seg.buf, dtype=torch.uint8, count=max(nbytes, 1))
    with _LOCK:
        _SEGMENTS[seg.path] = (raw.data_ptr(), nbytes)
    weakref.finalize(seg.buf, _unlink, seg.path)
    return raw[:nbytes].view(dt).view(shape)


zeros = empty


@dataclass(frozen=True)
class ShmHandle:
    """Where a buffer lives: file ``path``, byte ``offset`` into it, and its ``shape`` and ``dtype``."""

    path: str
    offset: int
    shape: tuple[int, ...]
    dtype: str


def handle_of(t: torch.Tensor) -> ShmHandle | None:
    """The :class:`ShmHandle` of a C-contiguous CPU tensor made by :func:`empty` (or a view into one), else None."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    start, n = t.data_ptr(), t.numel() * t.element_size()
    if n == 0:  # nothing to share, and torch gives empty tensors no address inside their storage (data_ptr 0)
        return ShmHandle(_empty_segment(), 0, tuple(t.shape), dtype_name(t.dtype))
    with _LOCK:
        for path, (addr, size) in _SEGMENTS.items():
            if addr <= start and start + n <= addr + size:
                return ShmHandle(path, start - addr, tuple(t.shape), dtype_name(t.dtype))
    return None


_EMPTY: dict[int, torch.Tensor] = {}  # pid -> a one-byte segment that zero-size buffers name


def _empty_segment() -> str:
    """The path of this process's segment for zero-size buffers (made at first use, kept to exit)."""
    with _LOCK:
        t = _EMPTY.get(os.getpid())
    if t is None:
        t = empty((1,), torch.uint8)
        with _LOCK:
            t = _EMPTY.setdefault(os.getpid(), t)
    start = t.data_ptr()
    with _LOCK:
        return next(p for p, (addr, _) in _SEGMENTS.items() if addr == start)


class Mapper:
    """The agent's side: maps each handle's file once and returns tensors on it; counts the registrations
    using each file and drops the mapping when the last is released, so that a long-lived agent does not
    keep the pages of every buffer it ever served (a tmpfs file's memory lives while anyone maps it)."""

    def __init__(self):
        self._files: dict[str, torch.Tensor] = {}
        self._refs: dict[str, int] = {}
        self._lock = threading.Lock()  # the agent's client threads map concurrently

    def tensor(self, h: ShmHandle) -> torch.Tensor:
        """A tensor on ``h``'s bytes; pair every call with one :meth:`release` of ``h.path``."""
        with self._lock:
            raw = self._files.get(h.path)
            if raw is None:
                raw = self._files[h.path] = _shm.attach(h.path).tensor()
            self._refs[h.path] = self._refs.get(h.path, 0) + 1
        dt = torch_dtype(h.dtype)
        n = int(np.prod(h.shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
        if h.offset + n > raw.numel():
            self.release([h.path])
            raise ValueError(f"buffer {h.path}+{h.offset} of {n} bytes runs past the file's {raw.numel()} bytes")
        return raw[h.offset:h.offset + n].view(dt).view(h.shape)

    def release(self, paths) -> None:
        with self._lock:
            for p in paths:
                left = self._refs.get(p, 0) - 1
                if left > 0:
                    self._refs[p] = left
                else:
                    self._refs.pop(p, None)
                    self._files.pop(p, None)

    @property
    def mapped(self) -> list[str]:
        return sorted(self._files)


# Mailbox words of one request slot: the application writes START (the generation it started); the executor
# writes PICKED (the generation it took up), DONE (the generation it finished), FAILED (the generation that
# failed), and the CLOCK_MONOTONIC times of the last pick-up and completion (ns).
START, PICKED, DONE, FAILED, T_PICKED, T_DONE = range(6)
SLOT_WORDS = 8


class Mailboxes:
    """``slots`` request mailboxes: an int64 array ``[slots, SLOT_WORDS]``, in a shared file or private."""

    def __init__(self, slots: int = 256, *, shared: bool = True, path: str | None = None):
        self.slots = slots
        if path is not None:  # the agent maps a client's mailboxes
            self.path = path
            self.array = _shm.attach(path, slots * SLOT_WORDS * 8).array(np.int64).reshape(slots, SLOT_WORDS)
        elif shared:
            seg = _create("mbox", slots * SLOT_WORDS * 8)
            self.path = seg.path
            self.array = seg.array(np.int64).reshape(slots, SLOT_WORDS)
            weakref.finalize(self, _shm.unlink, self.path)
        else:
            self.path = None
            self.array = np.zeros((slots, SLOT_WORDS), dtype=np.int64)
        self._free = list(range(slots - 1, -1, -1))

    def take(self) -> int:
        if not self._free:
            raise OffloadError(f"all {self.slots} request mailboxes of this process are in use: free() requests "
                               "you no longer need")
        i = self._free.pop()
        self.array[i, :] = 0
        return i

    def give_back(self, i: int) -> None:
        self._free.append(i)


class Bell:
    """Doorbell that wakes the executor: a pipe (in-process) or a named FIFO (an agent's, rung by clients).

    ``ring()`` never blocks: a full pipe already holds a wake-up.
    """

    def __init__(self, fifo: str | None = None):
        if fifo is None:
            self._r, self._w = os.pipe()
        else:
            os.mkfifo(fifo, 0o600)
            self._r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            self._w = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # our own writer: no EOF when clients go
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    def ring(self) -> None:
        if self._w < 0:
            return
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):
            pass

    def drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        fds, self._r, self._w = (self._r, self._w), -1, -1  # a closed number may be reused by another file
        for fd in fds:
            if fd < 0:
                continue
            try:
                os.close(fd)
            except OSError:
                pass


class RemoteBell:
    """A client's end of an agent's FIFO doorbell."""

    def __init__(self, fifo: str):
        self._w = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)

    def ring(self) -> None:
        if self._w < 0:  # closed: never write to a descriptor number another file may have taken
            return
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        fd, self._w = self._w, -1
        if fd < 0:
            return
        try:
            os.close(fd)
        except OSError:
            pass
