"""POSIX shared memory of hpdl's processes on one host: the one segment primitive and its crash safety, used by
hpdl.comm (:class:`NodeSharedBuffer`, the CPU form of seed 2's shared buffer) and by hpdl.offload (buffers and
request mailboxes, :mod:`hpdl.offload.shm`).

**Segments.** A segment is a file in a shared-memory directory (``/dev/shm``, POSIX shared memory, by default;
any tmpfs works) mapped ``MAP_SHARED``; its path is its key: another process maps the same pages by opening
it. :func:`create` makes one and reserves its pages at once (a full tmpfs, e.g. a container's 64 MiB ``/dev/shm``,
fails there with :class:`NoSpaceError` instead of a SIGBUS on first touch); :func:`attach` maps one another
process made; :func:`unlink` removes a name (the pages live while any process maps them). A
:class:`Segment`'s :meth:`~Segment.tensor` and :meth:`~Segment.array` are torch / numpy views that keep the
mapping alive.

**Crash safety: one scheme, one sweep.** A segment's name carries its creator's *owner token*:
``hpdl-<kind>-<token>-<tail>``. A process that creates segments holds an exclusive ``flock`` on the owner file
``hpdl-owner-<token>`` of that directory for its whole life (the kernel drops the lock however the process
ends: SIGKILL, an OOM kill, ``os._exit``). :func:`sweep` removes the segments and owner files of owners whose
lock it can take, i.e. whose process is gone. A lock, unlike a pid, is right across pid namespaces (containers
sharing ``/dev/shm``) and is never held by a recycled pid. A process sweeps a directory when it first creates a
segment there; hpdl.comm's node-buffer creators sweep at every creation, offload's agent whenever a client
leaves. At a normal exit a process unlinks the segments it still names and its owner files; a forked child never
unlinks its parent's (it drops its inherited copy of the owner lock at the fork, so the parent's death is seen
even while the child lives).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import itertools
import mmap
import operator
import os
import re
import secrets
import tempfile
import threading
import time
from typing import Sequence

import numpy as np
import torch

from hpdl.runtime.errors import CollectiveTimeoutError
from hpdl.runtime.procs import pid_alive

PREFIX = "hpdl-"
OWNER_PREFIX = "hpdl-owner-"
# owner files of hpdl versions whose offload kept its own scheme (same lock, same segment naming): swept too
_LEGACY_OWNER_PREFIXES = ("hpdl-offload-owner-",)
MIN_DATA_BYTES = 1 << 20
_NAME_PART = re.compile(r"[A-Za-z0-9-]+")

_LOCK = threading.Lock()
_COUNTER = itertools.count()
# this process's owner token per directory, the descriptors holding their locks, and the segment paths it
# created and has not unlinked (all re-made empty in a forked child)
_STATE: dict = {"pid": None, "owners": {}, "fds": [], "created": set()}


# ---------------------------------------------------------------------------------------------- directory, owner
def default_dir() -> str:
    """``/dev/shm`` where it exists, else the temporary directory (a disk file: slower, still shared)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _current() -> dict:
    """The state of this process (caller holds ``_LOCK``); a forked child's first call forgets the parent's."""
    if _STATE["pid"] != os.getpid():
        _STATE.update(pid=os.getpid(), owners={}, fds=[], created=set())
    return _STATE


def _after_fork_in_child() -> None:
    # Close the inherited descriptors of the parent's owner locks: a flock is held while any descriptor of its
    # open file lives, so a child keeping them would hide the parent's death from every sweep. The lock is made
    # anew: another thread of the parent may have held it at the fork.
    global _LOCK
    _LOCK = threading.Lock()
    fds = _STATE["fds"] if _STATE["pid"] is not None else []
    _STATE.update(pid=os.getpid(), owners={}, fds=[], created=set())
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)


def owner_token(directory: str | None = None) -> str:
    """This process's owner token in ``directory`` (default :func:`default_dir`), ``"<pid>x<8 hex digits>"``.

    The first call per directory creates the owner file ``hpdl-owner-<token>``, takes its lock (held until the
    process ends) and then sweeps the directory (:func:`sweep`).

    Raises:
        FileNotFoundError: the directory does not exist (the message names it).
        OSError: the directory is not writable.
    """
    d = os.path.abspath(directory or default_dir())
    with _LOCK:
        st = _current()
        token = st["owners"].get(d)
        if token is not None:
            return token
        if not os.path.isdir(d):   # else the error would name a temporary file in it
            raise FileNotFoundError(errno.ENOENT, f"shared-memory directory {d} does not exist (or is not a "
                                                  "directory)", d)
        token = f"{os.getpid()}x{secrets.token_hex(4)}"
        tmp = os.path.join(d, f".{OWNER_PREFIX}tmp-{token}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # locked before it gets the name sweep() looks for; held until exit
        os.rename(tmp, os.path.join(d, OWNER_PREFIX + token))
        st["owners"][d] = token
        st["fds"].append(fd)
    sweep(d)
    return token


def segment_path(kind: str, owner: str, tail: str, directory: str | None = None) -> str:
    """The path of segment ``hpdl-<kind>-<owner>-<tail>`` in ``directory`` (default :func:`default_dir`): how a
    peer names a segment whose creator's token and tail it was told."""
    return os.path.join(os.path.abspath(directory or default_dir()), f"{PREFIX}{kind}-{owner}-{tail}")


def sweep(directory: str | None = None) -> list[str]:
    """Remove the segments and owner files of hpdl processes that are gone (their owner lock is free).

    Safe to call at any time from any process: files of a live owner are never touched. Returns the paths
    removed.
    """
    d = os.path.abspath(directory or default_dir())
    try:
        names = os.listdir(d)
    except OSError:
        return []
    with _LOCK:
        mine = set(_STATE["owners"].values()) if _STATE["pid"] == os.getpid() else set()
    removed = []
    for name in names:
        prefix = next((p for p in (OWNER_PREFIX, *_LEGACY_OWNER_PREFIXES) if name.startswith(p)), None)
        if prefix is None:
            continue
        token = name[len(prefix):]
        if token in mine:
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
                if other.startswith(PREFIX) and tail in other:
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


# ---------------------------------------------------------------------------------------------- segments
class NoSpaceError(OSError):
    """The shared-memory directory has no room for a segment (``errno`` says why, usually ``ENOSPC``)."""


class Segment:
    """One mapped shared-memory segment: ``path``, ``nbytes`` (its usable size) and the mapping ``buf``.

    Made by :func:`create` or :func:`attach`, not directly.
    """

    def __init__(self, path: str, nbytes: int, buf: mmap.mmap, created: bool):
        self.path, self.nbytes, self.buf, self.created = path, nbytes, buf, created

    def tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The first ``nbytes`` bytes as a 1-D CPU tensor of ``dtype`` (``nbytes`` must be a multiple of its
        size); the tensor keeps the mapping alive."""
        return torch.frombuffer(self.buf, dtype=torch.uint8, count=len(self.buf))[:self.nbytes].view(dtype)

    def array(self, dtype=np.uint8) -> np.ndarray:
        """The first ``nbytes`` bytes as a writable 1-D numpy array of ``dtype``; it keeps the mapping alive."""
        return np.frombuffer(self.buf, dtype=np.uint8)[:self.nbytes].view(dtype)

    def unlink(self) -> None:
        """Remove the segment's name if this process created it (see :func:`unlink`)."""
        unlink(self.path)

    def close(self) -> None:
        """Unmap now if no tensor or array view is left, else when the last one goes."""
        try:
            self.buf.close()
        except BufferError:
            pass  # a view still exports the buffer; the mapping goes with it


def create(kind: str, nbytes: int, *, tail: str | None = None, directory: str | None = None) -> Segment:
    """Create and map segment ``hpdl-<kind>-<owner>-<tail>`` of ``nbytes`` zero bytes, owned by this process.

    Args:
        kind: what it holds (letters, digits and dashes), e.g. ``"comm"``, ``"offload-buf"``.
        nbytes: size in bytes (>= 0; an empty segment still maps one byte).
        tail: the rest of the name (letters, digits and dashes), for names peers derive (:func:`segment_path`);
            default a counter unique in this process.
        directory: default :func:`default_dir`.

    Raises:
        TypeError: ``nbytes`` not an int (a float is refused, not truncated).
        ValueError: ``nbytes < 0``, or ``kind`` / ``tail`` holds another character.
        FileExistsError: the name exists.
        FileNotFoundError: the directory does not exist.
        NoSpaceError: the directory has no room for ``nbytes`` (the message names the size and directory).
    """
    nbytes = _nbytes(nbytes)
    for arg, value in (("kind", kind), ("tail", tail)):
        if value is not None and not _NAME_PART.fullmatch(value):
            raise ValueError(f"{arg}={value!r}: expected letters, digits and dashes")
    d = os.path.abspath(directory or default_dir())
    path = segment_path(kind, owner_token(d), str(next(_COUNTER)) if tail is None else tail, d)
    size = max(nbytes, 1)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:  # reserve the pages now: a full tmpfs fails here, not as SIGBUS on first touch
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                os.unlink(path)
                raise NoSpaceError(exc.errno, f"cannot allocate {nbytes} bytes of shared memory in {d} "
                                         f"({exc.strerror})") from None
            os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    with _LOCK:
        _current()["created"].add(path)
    return Segment(path, nbytes, buf, True)


def _nbytes(value, name: str = "nbytes") -> int:
    """``value`` as an int >= 0 (a bool or a float is refused, not truncated)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int >= 0 (bytes), got {value!r} ({type(value).__name__})") from None
    if n < 0:
        raise ValueError(f"{name} must be an int >= 0 (bytes), got {n}")
    return n


def attach(path: str, nbytes: int | None = None) -> Segment:
    """Map the segment at ``path`` that another process created.

    Args:
        nbytes: the size to map; default the file's size.

    Raises:
        FileNotFoundError: no such segment.
        TypeError: ``nbytes`` not an int.
        ValueError: ``nbytes < 0``, or the file is smaller than ``nbytes`` (e.g. its creator has not sized it yet)
            or empty.
    """
    if nbytes is not None:
        nbytes = _nbytes(nbytes)
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        want = size if nbytes is None else nbytes
        if size < max(want, 1):
            raise ValueError(f"segment {path} has {size} bytes, expected at least {max(want, 1)}")
        buf = mmap.mmap(fd, max(want, 1))
    finally:
        os.close(fd)
    return Segment(path, want, buf, False)


def unlink(path: str) -> bool:
    """Remove the name of a segment this process created (peers keep their mappings). Anyone else's segment,
    e.g. its parent's in a forked child, is left alone. Returns whether this call removed it."""
    with _LOCK:
        st = _current()
        if path not in st["created"]:
            return False
        st["created"].discard(path)
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def cleanup() -> None:
    """Unlink the segments this process created and still names, then its owner files. Runs at exit."""
    with _LOCK:
        st = _current()
        paths = list(st["created"])
    for path in paths:
        unlink(path)
    with _LOCK:  # a segment made after this (another exit handler) gets a new owner file
        owners, fds = st["owners"], st["fds"]
        st["owners"], st["fds"] = {}, []
    for d, token in owners.items():
        try:
            os.unlink(os.path.join(d, OWNER_PREFIX + token))
        except OSError:
            pass
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


atexit.register(cleanup)


# ---------------------------------------------------------------------------------------------- hpdl.comm's node buffer
def new_token() -> str:
    """A short random id for one group's buffers (rank 0 draws it and sends it to the others)."""
    return secrets.token_hex(4)


def _alive(pid: int) -> bool:
    return pid <= 0 or pid_alive(pid)  # pid 0: not registered yet, cannot tell


class _NodeSegment:
    """One segment of a :class:`NodeSharedBuffer`: local rank 0 creates it, the others wait for it and map it;
    ``tensor`` is its uint8 view."""

    def __init__(self, owner: str, tail: str, directory: str, nbytes: int, create_it: bool, deadline: float):
        if create_it:
            self._seg = create("comm", nbytes, tail=tail, directory=directory)
        else:
            path = segment_path("comm", owner, tail, directory)
            while True:  # the creator may not have made (or sized) it yet
                try:
                    self._seg = attach(path, nbytes)
                    break
                except (FileNotFoundError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(f"shared memory segment {path} ({nbytes} B) did not appear: its "
                                                 "creator (local rank 0 of this node) did not create it in time")
                time.sleep(0.001)
        self.path = self._seg.path
        self.tensor = self._seg.tensor()

    def unlink(self) -> None:
        self._seg.unlink()  # only the creator's call removes the name

    def close(self) -> None:
        self.tensor = None  # the mapping cannot be closed while a tensor exports it
        self._seg.close()


class NodeSharedBuffer:
    """Shared memory of the local ranks of one node, for one group, on :func:`create` / :func:`attach`.

    Two segments: a small **control** segment (int64 words): one arrival counter and one pid per local rank
    (node barrier and liveness), then a metadata area of ``meta_words`` words per local rank (e.g. Alltoall
    split sizes); and a **data** segment, created on first use and grown on demand (capacity doubles; every
    local rank must ask for the same size in the same call, which the collectives guarantee).

    Crash safety: a segment's name exists only between its creation and the moment every local rank has mapped
    it; the creator (local rank 0) then unlinks it, so the kernel frees the memory when the last process that
    maps it exits, however it exits. A name left by a creator killed inside that window carries its owner
    token and is removed by the next :func:`sweep` (run by every creator here).

    Ordering: data are written with plain stores (torch copies) before the arrival counter; x86-64 keeps
    stores in program order (TSO), so a peer that sees the counter also sees the data. Waits poll with
    ``os.sched_yield`` then short sleeps, check that the awaited peers are alive (by pid, so the local ranks
    must share a pid namespace; the sweep does not need that), and raise
    :class:`~hpdl.runtime.CollectiveTimeoutError` naming them after ``timeout`` seconds (or at once when a peer
    process has died).

    Args:
        token: id common to the group (see :func:`new_token`), so that groups and jobs never collide.
        node: node index (names the segments).
        local_rank: this process's index among the node's ranks.
        local_ranks: group ranks of the node, ordered by local rank (used in error messages).
        creator: owner token (:func:`owner_token`) of local rank 0 in ``directory``; local rank 0 passes its own.
        meta_words: int64 words of metadata per local rank in the control segment.
        timeout: seconds any wait may block.
        directory: shared-memory directory, default :func:`default_dir`.

    Creation is collective over the node's ranks (all must construct it). Not thread-safe.

    Raises:
        ValueError: ``local_rank`` out of range, or local rank 0 given another process's ``creator`` token.
        CollectiveTimeoutError: a local rank did not attach within ``timeout``.
        NoSpaceError: the directory has no room for a segment.
    """

    def __init__(self, token: str, node: int, local_rank: int, local_ranks: Sequence[int], creator: str,
                 meta_words: int, timeout: float, directory: str | None = None):
        self.g = len(local_ranks)
        if not 0 <= local_rank < self.g:
            raise ValueError(f"local_rank must be in [0, {self.g}), got {local_rank}")
        self.local_rank, self.local_ranks, self.timeout = local_rank, list(local_ranks), float(timeout)
        self.meta_words = int(meta_words)
        self._dir = os.path.abspath(directory or default_dir())
        if local_rank == 0:
            if creator != owner_token(self._dir):
                raise ValueError(f"creator={creator!r}: local rank 0 must pass its own owner token "
                                 f"{owner_token(self._dir)!r}")
            sweep(self._dir)  # segments of creators killed since this process's first sweep
        self._owner, self._tail = creator, f"{token}-n{node}"
        self._seq = 0
        self.broken = False
        words = 2 * self.g + self.g * self.meta_words
        self._ctl = _NodeSegment(creator, self._tail + "-c", self._dir, 8 * words, local_rank == 0,
                                 time.monotonic() + self.timeout)
        self.ctl = self._ctl.tensor.view(torch.int64)
        self._arrive = self._ctl.tensor.numpy().view(np.int64)[: self.g]
        self._pids = self._ctl.tensor.numpy().view(np.int64)[self.g: 2 * self.g]
        self._pids[local_rank] = os.getpid()
        self.meta = self.ctl[2 * self.g:].view(self.g, self.meta_words)
        self.barrier("attaching the control segment")
        self._ctl.unlink()
        self._data: _NodeSegment | None = None
        self._gen = 0
        self.capacity = 0

    # ------------------------------------------------------------------ synchronisation
    def barrier(self, what: str = "node barrier") -> None:
        """Wait until every local rank has reached its matching barrier (counts are per call site order)."""
        if self.broken:
            raise RuntimeError("this node's shared buffer is unusable after a failed call: call hpdl.comm.reset()")
        self._seq += 1
        seq = self._seq
        self._arrive[self.local_rank] = seq
        deadline = time.monotonic() + self.timeout
        spins, next_check = 0, time.monotonic() + 0.02
        while True:
            behind = [i for i in range(self.g) if self._arrive[i] < seq]
            if not behind:
                return
            spins += 1
            if spins < 64:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, 1e-5 * (spins - 63)))
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.02
                dead = [i for i in behind if not _alive(int(self._pids[i]))]
                if dead or now > deadline:
                    self.broken = True
                    ranks = [self.local_ranks[i] for i in (dead or behind)]
                    why = (f"died (pid {[int(self._pids[i]) for i in dead]})" if dead
                           else f"did not arrive within {self.timeout:.0f}s")
                    raise CollectiveTimeoutError(f"{what}: rank(s) {ranks} of this node {why}; rank "
                                                 f"{self.local_ranks[self.local_rank]} stops waiting",
                                                 missing_ranks=ranks)

    # ------------------------------------------------------------------ data segment
    def ensure(self, nbytes: int) -> torch.Tensor:
        """The data segment as a uint8 tensor of at least ``nbytes`` bytes, grown collectively if needed.

        Every local rank must call it with the same ``nbytes`` in the same call; growing costs two barriers.
        Data written before a growth are not carried over.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if self._data is not None and nbytes <= self.capacity:
            return self._data.tensor
        cap = -(-max(nbytes, 2 * self.capacity, MIN_DATA_BYTES) // 4096) * 4096  # whole pages
        self._gen += 1
        old = self._data
        self._data = _NodeSegment(self._owner, f"{self._tail}-d{self._gen}", self._dir, cap, self.local_rank == 0,
                                  time.monotonic() + self.timeout)
        self.capacity = cap
        self.barrier("attaching the grown data segment")
        self._data.unlink()
        if old is not None:
            old.close()  # peers keep their own mappings; the memory goes when the last one unmaps
        return self._data.tensor

    def close(self) -> None:
        """Unmap both segments (local; names were unlinked at creation)."""
        self.meta = self.ctl = None  # type: ignore[assignment]
        self._arrive = self._pids = None  # type: ignore[assignment]
        for seg in (self._data, self._ctl):
            if seg is not None:
                seg.unlink()
                seg.close()
        self._data = None
        self.broken = True


def _pack_owner(token: str) -> tuple[int, int]:
    pid, rand = token.split("x")
    return int(pid), int(rand, 16)


def open_node_buffer(comm, topology, meta_words: int = 0) -> NodeSharedBuffer:
    """Collective over ``comm``'s group: agree on a token and each node's creator (its owner token), then open
    this rank's :class:`NodeSharedBuffer` for the node ``topology`` places it on.

    Args:
        comm: the group's :class:`~hpdl.comm.transport.base.Transport` (one exchange of three int64 per pair).
        topology: :class:`hpdl.runtime.Topology` of the group (``topology.world_size == comm.world_size``).
        meta_words: int64 metadata words per local rank.
    """
    p, me = comm.world_size, comm.rank
    if topology.world_size != p:
        raise ValueError(f"topology has world_size={topology.world_size} but the group has {p} ranks")
    node = topology.node_of[me]
    local = topology.node_ranks(node)
    owner = _pack_owner(owner_token()) if local[0] == me else (0, 0)  # only creators need an owner file
    mine = torch.tensor([int(new_token(), 16), *owner], dtype=torch.int64)
    if comm.device.type != "cpu":
        mine = mine.to(comm.device)
    theirs = comm.exchange_all(mine, tag=97)
    token = f"{int(theirs[0][0]):08x}"
    creator = f"{int(theirs[local[0]][1])}x{int(theirs[local[0]][2]):08x}"
    return NodeSharedBuffer(token, node, local.index(me), local, creator, meta_words, comm.timeout)
