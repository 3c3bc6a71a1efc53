"""The channel between a :class:`hpdl.runtime.WorkerGroup`'s parent and its ranks: typed, versioned records.

Every message is a small frozen dataclass from :data:`MESSAGES`, sent as one frame over a duplex pipe::

    b"HPDL" | protocol version (uint16, big-endian) | len(type name) (uint8) | type name
           | pickle(head field values) | pickle(body field values)

The body holds what user code supplies (a task's function and arguments, a service's factory, arguments and
payloads, a result's value), the head the rest (ids, ranks, flags). The two are pickled apart so that a body
that pickles but cannot be unpickled on the other side (a class missing there, a ``__reduce__`` that raises)
fails as a :class:`BodyError` that still knows the message's id: the receiver answers that one message with a
failure instead of losing the channel.

The header is read before anything is unpickled, so a peer that speaks another protocol version (a stale rank, a
different hpdl installation on the other side) or sends a type this side does not know fails at once with a
:class:`~hpdl.runtime.errors.ProtocolError` naming the sender and both versions, instead of a confusing unpickling
error or a wait. Field values are pickled with multiprocessing's ``ForkingPickler`` (tensors travel as shared
memory, as through a ``multiprocessing.Queue``). Frames are written synchronously by the caller: no feeder thread
(a ``Queue``'s feeder must win the GIL first, adding up to a switch interval to every message), and a pickling
error raises in the sender instead of being printed and dropped.

Bump :data:`PROTOCOL_VERSION` whenever a message type or its fields change.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import select
import struct
import time
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

from hpdl.runtime.errors import ProtocolError

PROTOCOL_VERSION = 2   # 2: head and body pickled apart
POLL_MS_MAX = 2**31 - 1   # poll()'s limit (about 24.8 days): a longer wait is made of several


def poll_ms(seconds: float) -> int:
    """``seconds`` as a ``poll()`` timeout in ms: at least 1, at most :data:`POLL_MS_MAX` (a caller that waits longer
    polls again until its deadline; a larger value raised OverflowError)."""
    return int(min(POLL_MS_MAX, max(1, math.ceil(seconds * 1000)))) if seconds < POLL_MS_MAX else POLL_MS_MAX


_MAGIC = b"HPDL"
_HEADER = struct.Struct("!4sHB")   # magic, protocol version, length of the type name


@dataclass(frozen=True, slots=True)
class Ready:
    """rank -> parent: the rank joined the process group and waits for work."""
    rank: int
    pid: int
    hpdl_version: str


@dataclass(frozen=True, slots=True)
class Task:
    """parent -> rank: run ``fn(ctx, *args)`` once and answer with a :class:`Result` or :class:`Failure`."""
    id: int
    fn: Callable[..., Any]
    args: tuple


@dataclass(frozen=True, slots=True)
class StartService:
    """parent -> rank: build the rank's service ``factory(ctx, *args)``; answered like a :class:`Task`."""
    id: int
    factory: Callable[..., Any]
    args: tuple


@dataclass(frozen=True, slots=True)
class Call:
    """parent -> rank: ``service(payload)``; answered with a :class:`Result` only when ``reply`` (a failure always
    answers)."""
    id: int
    payload: Any
    reply: bool


@dataclass(frozen=True, slots=True)
class StopService:
    """parent -> rank: ``service.close()`` (when it has one); answered with a :class:`Result`."""
    id: int


@dataclass(frozen=True, slots=True)
class Stop:
    """parent -> rank: leave the loop, destroy the process group and exit."""


@dataclass(frozen=True, slots=True)
class Result:
    """rank -> parent: message ``id`` done, with its value."""
    id: int
    rank: int
    value: Any


@dataclass(frozen=True, slots=True)
class Failure:
    """rank -> parent: message ``id`` raised (``error``: the traceback). ``fatal``: the rank exits after it."""
    id: int
    rank: int
    error: str
    fatal: bool


MESSAGES: dict[str, type] = {c.__name__: c for c in (Ready, Task, StartService, Call, StopService, Stop, Result,
                                                     Failure)}
_FIELDS = {name: tuple(f.name for f in fields(cls)) for name, cls in MESSAGES.items()}
_BY_TAG = {name.encode(): cls for name, cls in MESSAGES.items()}
# the fields user code supplies: pickled after the others, so that a failure to unpickle them still names the message
_BODY = {"Task": ("fn", "args"), "StartService": ("factory", "args"), "Call": ("payload",), "Result": ("value",)}
_HEAD = {name: tuple(f for f in names if f not in _BODY.get(name, ())) for name, names in _FIELDS.items()}


class BodyError(Exception):
    """A frame whose head was read but whose body (user data) could not be unpickled here.

    Attributes:
        cls: the message type; head: its head fields (``id``, ``rank``, ``reply`` ...) by name; cause: the error.
    """

    def __init__(self, cls: type, head: dict, cause: BaseException, sender: str):
        self.cls, self.head, self.cause = cls, head, cause
        super().__init__(f"the {cls.__name__} message {head.get('id')} from {sender} cannot be unpickled here "
                         f"({type(cause).__name__}: {cause})")


def encode_frame(type_name: str, values: tuple, version: int | None = None) -> bytes:
    """One frame: the header (``version``, default :data:`PROTOCOL_VERSION`), ``type_name`` and the pickled
    field ``values`` (in the dataclass's order; head fields, then body fields, each pickled apart for a known
    type). Low level (tests use it to forge frames); :func:`encode` checks the type.

    Raises:
        what pickling ``values`` raises (e.g. a lambda: only module-level functions can be sent).
    """
    tag = type_name.encode()
    header = _HEADER.pack(_MAGIC, PROTOCOL_VERSION if version is None else version, len(tag))
    names = _FIELDS.get(type_name)
    if names is None or len(names) != len(values):   # a forged frame: one pickle
        return b"".join((header, tag, ForkingPickler.dumps(tuple(values))))
    by_name = dict(zip(names, values))
    head = tuple(by_name[f] for f in _HEAD[type_name])
    body = tuple(by_name[f] for f in _BODY.get(type_name, ()))
    return b"".join((header, tag, ForkingPickler.dumps(head), ForkingPickler.dumps(body)))


def encode(msg) -> bytes:
    """The frame of message ``msg`` (an instance of a :data:`MESSAGES` class).

    Raises:
        TypeError: ``msg`` is not a channel message.
    """
    name = type(msg).__name__
    if MESSAGES.get(name) is not type(msg):
        raise TypeError(f"msg must be one of the channel's messages {sorted(MESSAGES)}, got {type(msg).__name__}")
    return encode_frame(name, tuple(getattr(msg, f) for f in _FIELDS[name]))


def decode(frame: bytes, sender: str):
    """The message in ``frame``, received from ``sender`` (words for errors, e.g. "rank 1").

    Raises:
        ProtocolError: not an hpdl frame, another protocol version (both are named), or an unknown type.
        BodyError: the head was read, the body (user data) could not be unpickled; it names the message.
    """
    if len(frame) < _HEADER.size or frame[:4] != _MAGIC:
        raise ProtocolError(f"{sender} sent {len(frame)} bytes that are not an hpdl channel frame "
                            f"(starting {bytes(frame[:8])!r})")
    _, version, n = _HEADER.unpack_from(frame)
    if version != PROTOCOL_VERSION:
        from hpdl import __version__

        raise ProtocolError(f"{sender} speaks hpdl channel protocol {version}, this process protocol "
                            f"{PROTOCOL_VERSION} (hpdl {__version__}): a stale worker or a different hpdl version on "
                            f"the other side; start both sides from one hpdl installation")
    tag = bytes(frame[_HEADER.size:_HEADER.size + n])
    cls = _BY_TAG.get(tag)
    if cls is None:
        raise ProtocolError(f"{sender} sent an unknown message type {tag.decode(errors='replace')!r} (channel "
                            f"protocol {version}); known: {sorted(MESSAGES)}")
    name = cls.__name__
    stream = io.BytesIO(frame)
    stream.seek(_HEADER.size + n)
    head = dict(zip(_HEAD[name], pickle.load(stream)))
    try:
        body = dict(zip(_BODY.get(name, ()), pickle.load(stream)))
    except Exception as exc:  # noqa: BLE001 - whatever the user's __reduce__ / a missing class raises
        raise BodyError(cls, head, exc, sender) from exc
    return cls(**head, **body)


def write_frame(fd: int, frame: bytes, deadline: float | None) -> bool:
    """Write ``frame`` to the pipe ``fd`` as ``Connection.send_bytes`` frames it (the peer's ``recv_bytes`` reads
    it), giving up at ``deadline`` (``time.monotonic()`` seconds; None: no limit). Non-blocking writes and
    ``poll()`` on the fd (not ``select()``: it refuses fds >= 1024). The fd's blocking mode is restored.

    Returns True when written, False when the deadline passed first (the frame may be cut: the pipe is then
    unusable). Raises OSError (BrokenPipeError: the peer is gone).
    """
    n = len(frame)
    prefix = struct.pack("!i", -1) + struct.pack("!Q", n) if n > 0x7fffffff else struct.pack("!i", n)
    data = memoryview(prefix + frame) if n <= 16384 else None
    parts = [data] if data is not None else [memoryview(prefix), memoryview(frame)]
    was_blocking = os.get_blocking(fd)
    if was_blocking:
        os.set_blocking(fd, False)
    try:
        poller = None
        for part in parts:
            while part:
                try:
                    part = part[os.write(fd, part):]
                    continue
                except BlockingIOError:
                    pass
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if poller is None:
                    poller = select.poll()
                    poller.register(fd, select.POLLOUT)
                poller.poll(None if left is None else poll_ms(left))
        return True
    finally:
        if was_blocking:
            os.set_blocking(fd, True)


class Endpoint:
    """One side of a duplex pipe speaking the channel: ``send(msg)`` and ``recv()`` (typed messages).

    Args:
        conn: a ``multiprocessing`` duplex connection.
        peer: the other side in words ("rank 2", "the parent"), for errors.
    """

    __slots__ = ("conn", "peer")

    def __init__(self, conn: Connection, peer: str):
        self.conn, self.peer = conn, peer

    def send(self, msg) -> None:
        """Send ``msg`` (blocks only while the pipe is full). Raises TypeError, pickling errors, OSError."""
        self.conn.send_bytes(encode(msg))

    def send_frame(self, frame: bytes, deadline: float | None = None) -> bool:
        """Send a frame made by :func:`encode` (one encoding for many ranks), by ``deadline`` (``time.monotonic()``
        seconds; None: no limit). Returns False when the deadline passed first (see :func:`write_frame`)."""
        if deadline is None:
            self.conn.send_bytes(frame)
            return True
        return write_frame(self.conn.fileno(), frame, deadline)

    def recv(self):
        """The next message. Raises EOFError (the other side is gone), :class:`ProtocolError` and
        :class:`BodyError`."""
        return decode(self.conn.recv_bytes(), self.peer)

    def poll(self, timeout: float = 0.0) -> bool:
        """True when a message (or end of file) is waiting; ``timeout`` seconds at most. Unlike ``select()``,
        works for fds >= 1024 (a long-lived process has them)."""
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()
