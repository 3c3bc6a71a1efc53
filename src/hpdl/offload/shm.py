"""Host memory both the application and the agent map: buffers (``empty``/``zeros``), request mailboxes, the
agent's status block, and doorbells. All are files in ``HPDL_OFFLOAD_SHM_DIR`` (POSIX shared memory,
``/dev/shm``, by default) mapped ``MAP_SHARED``: the agent reads and writes the application's buffers in place.

A file's path is its memory key (the role of an exported memory key on a DPU): the creator registers it,
sends the path to the agent, and unlinks it when its tensor is freed or the process exits.

Files of processes that were killed (SIGKILL, ``os._exit``, an OOM kill) would stay in ``/dev/shm`` and hold
its memory until reboot. Each creating process therefore holds an exclusive ``flock`` on an *owner* file
``hpdl-offload-owner-<token>`` for its lifetime, and names its files with the same token; :func:`sweep`
(run once by every process that creates such files, and by an agent when a client leaves) removes the
files of owners whose lock can be taken, i.e. whose process is gone. A lock, unlike a pid, is right across
pid namespaces (containers sharing ``/dev/shm``) and is never held by a recycled pid.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
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


_OWNER: dict = {"pid": None, "dirs": {}}  # this process's owner token per directory (re-made after a fork)
OWNER_PREFIX = "hpdl-offload-owner-"


def _owner(d: str) -> str:
    """This process's owner token in directory ``d``, creating (and locking) its owner file the first time."""
    pid = os.getpid()
    with _LOCK:
        if _OWNER["pid"] != pid:  # first call, or a forked child: the parent's tokens are the parent's
            _OWNER["pid"], _OWNER["dirs"] = pid, {}
        token = _OWNER["dirs"].get(d)
        if token is not None:
            return token
        token = f"{pid}x{secrets.token_hex(4)}"
        tmp = os.path.join(d, f".hpdl-offload-tmp-{token}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # locked before it gets the name sweep() looks for; held until exit
        os.rename(tmp, os.path.join(d, OWNER_PREFIX + token))
        _OWNER["dirs"][d] = token
        _OWNER.setdefault("fds", []).append(fd)
    sweep(d)
    return token


def new_path(kind: str) -> str:
    d = shm_dir()
    return os.path.join(d, f"hpdl-offload-{kind}-{_owner(d)}-{next(_COUNTER)}")


def sweep(directory: str | None = None) -> list[str]:
    """Remove the shared-memory files of hpdl processes that are gone (their owner lock is free).

    Safe to call at any time from any process: files of a live owner are never touched. Returns the paths
    removed.
    """
    d = directory or shm_dir()
    try:
        names = os.listdir(d)
    except OSError:
        return []
    removed = []
    for name in names:
        if not name.startswith(OWNER_PREFIX):
            continue
        token = name[len(OWNER_PREFIX):]
        if _OWNER["pid"] == os.getpid() and token in _OWNER["dirs"].values():
            continue
        path = os.path.join(d, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its owner lives
            tail = f"-{token}-"
            for other in names:
                if other.startswith("hpdl-offload-") and tail in other:
                    try:
                        os.unlink(os.path.join(d, other))
                        removed.append(os.path.join(d, other))
                    except OSError:
                        pass
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
        finally:
            os.close(fd)
    return removed


def _unlink(path: str) -> None:
    if _OWNER["pid"] != os.getpid():
        return  # a forked child exiting: the files are its parent's
    with _LOCK:
        _SEGMENTS.pop(path, None)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@atexit.register
def _unlink_all() -> None:
    if _OWNER["pid"] != os.getpid():
        return
    for path in list(_SEGMENTS):
        _unlink(path)
    for d, token in _OWNER["dirs"].items():
        try:
            os.unlink(os.path.join(d, OWNER_PREFIX + token))
        except OSError:
            pass


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
                size = os.path.getsize(h.path)
                raw = self._files[h.path] = torch.from_file(h.path, shared=True, size=size, dtype=torch.uint8)
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
            raise OffloadError(f"all {self.slots} request mailboxes of this process are in use: free() requests "
                               "you no longer need")
        i = self._free.pop()
        self.array[i, :] = 0
        return i

    def give_back(self, i: int) -> None:
        self._free.append(i)


def _unlink_file(path: str) -> None:
    if _OWNER["pid"] != os.getpid():
        return  # a forked child exiting: the file is its parent's
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
