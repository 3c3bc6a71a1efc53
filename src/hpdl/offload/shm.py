"""Host memory both the application and the agent map: buffers (``empty``/``zeros``), request mailboxes, the
agent's status block, and doorbells. All are files in ``HPDL_OFFLOAD_SHM_DIR`` (POSIX shared memory,
``/dev/shm``, by default) mapped ``MAP_SHARED``: the agent reads and writes the application's buffers in place.

A file's path is its memory key (the role of an exported memory key on a DPU): the creator registers it,
sends the path to the agent, and unlinks it when its tensor is freed or the process exits.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import mmap
import os
import secrets
import tempfile
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from hpdl.offload.errors import OffloadError
from hpdl.offload.plan import dtype_name, torch_dtype
from hpdl.runtime import env

_SEGMENTS: dict[str, tuple[int, int]] = {}  # path -> (address, nbytes) of buffers this process created
_LOCK = threading.Lock()
_COUNTER = itertools.count()


def shm_dir() -> str:
    d = env.get("HPDL_OFFLOAD_SHM_DIR")
    if d:
        return d
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def new_path(kind: str) -> str:
    return os.path.join(shm_dir(), f"hpdl-offload-{kind}-{os.getpid()}-{next(_COUNTER)}-{secrets.token_hex(3)}")


def _unlink(path: str) -> None:
    with _LOCK:
        _SEGMENTS.pop(path, None)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@atexit.register
def _unlink_all() -> None:
    for path in list(_SEGMENTS):
        _unlink(path)


def empty(shape, dtype=torch.float32) -> torch.Tensor:
    """A CPU tensor in shared memory that an offload agent can read and write in place (like
    ``MPI_Alloc_mem`` / ``MPI_Win_allocate_shared``). Contents are zero (a fresh file), as with :func:`zeros`.

    The file is unlinked when the tensor (and every view of it) is freed, or at exit.

    Raises:
        OffloadError: the shared-memory directory has no room for it (the message names the directory).
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dt = torch_dtype(dtype_name(dtype))
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
    path = new_path("buf")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:  # reserve the pages now: a full /dev/shm fails here, not as SIGBUS on first touch
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                fd = -1
                os.unlink(path)
                raise OffloadError(f"cannot allocate {nbytes} bytes of shared memory in {os.path.dirname(path)} "
                                   f"({exc.strerror}); free space there or set HPDL_OFFLOAD_SHM_DIR to a larger "
                                   "tmpfs") from None
            os.ftruncate(fd, max(nbytes, 1))
        mm = mmap.mmap(fd, max(nbytes, 1))
    finally:
        if fd >= 0:
            os.close(fd)
    # frombuffer keeps ``mm`` alive for as long as any view of the storage lives; then the file goes
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=max(nbytes, 1))
    with _LOCK:
        _SEGMENTS[path] = (raw.data_ptr(), nbytes)
    weakref.finalize(mm, _unlink, path)
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
    with _LOCK:
        for path, (addr, size) in _SEGMENTS.items():
            if addr <= start and start + n <= addr + size:
                return ShmHandle(path, start - addr, tuple(t.shape), dtype_name(t.dtype))
    return None


class Mapper:
    """The agent's side: maps handles' files once each and returns tensors on them."""

    def __init__(self):
        self._files: dict[str, torch.Tensor] = {}

    def tensor(self, h: ShmHandle) -> torch.Tensor:
        raw = self._files.get(h.path)
        if raw is None:
            size = os.path.getsize(h.path)
            raw = self._files[h.path] = torch.from_file(h.path, shared=True, size=size, dtype=torch.uint8)
        dt = torch_dtype(h.dtype)
        n = int(np.prod(h.shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
        if h.offset + n > raw.numel():
            raise ValueError(f"buffer {h.path}+{h.offset} of {n} bytes runs past the file's {raw.numel()} bytes")
        return raw[h.offset:h.offset + n].view(dt).view(h.shape)

    def forget(self, paths) -> None:
        for p in paths:
            self._files.pop(p, None)


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
            self.array = np.memmap(path, dtype=np.int64, mode="r+", shape=(slots, SLOT_WORDS))
        elif shared:
            self.path = new_path("mbox")
            with open(self.path, "wb") as fh:
                fh.truncate(slots * SLOT_WORDS * 8)
            self.array = np.memmap(self.path, dtype=np.int64, mode="r+", shape=(slots, SLOT_WORDS))
            weakref.finalize(self, _unlink_file, self.path)
        else:
            self.path = None
            self.array = np.zeros((slots, SLOT_WORDS), dtype=np.int64)
        self._free = list(range(slots - 1, -1, -1))

    def take(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.slots} request mailboxes are in use: free() requests you no longer need")
        i = self._free.pop()
        self.array[i, :] = 0
        return i

    def give_back(self, i: int) -> None:
        self._free.append(i)


def _unlink_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class RemoteBell:
    """A client's end of an agent's FIFO doorbell."""

    def __init__(self, fifo: str):
        self._w = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)

    def ring(self) -> None:
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        try:
            os.close(self._w)
        except OSError:
            pass
