"""The channel between a :class:`hpdl.runtime.WorkerGroup`'s parent and its ranks: typed, versioned records.

Every message is a small frozen dataclass from :data:`MESSAGES`, sent as one frame over a duplex pipe::

    b"HPDL" | protocol version (uint16, big-endian) | len(type name) (uint8) | type name | pickle(field values)

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

import pickle
import struct
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

from hpdl.runtime.errors import ProtocolError

PROTOCOL_VERSION = 1
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


def encode_frame(type_name: str, values: tuple, version: int | None = None) -> bytes:
    """One frame: the header (``version``, default :data:`PROTOCOL_VERSION`), ``type_name`` and the pickled
    ``values``. Low level (tests use it to forge frames); :func:`encode` checks the type.

    Raises:
        what pickling ``values`` raises (e.g. a lambda: only module-level functions can be sent).
    """
    tag = type_name.encode()
    head = _HEADER.pack(_MAGIC, PROTOCOL_VERSION if version is None else version, len(tag))
    return b"".join((head, tag, ForkingPickler.dumps(values)))


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
    return cls(*pickle.loads(memoryview(frame)[_HEADER.size + n:]))


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

    def send_frame(self, frame: bytes) -> None:
        """Send a frame made by :func:`encode` (one encoding for many ranks)."""
        self.conn.send_bytes(frame)

    def recv(self):
        """The next message. Raises EOFError (the other side is gone) and :class:`ProtocolError`."""
        return decode(self.conn.recv_bytes(), self.peer)

    def poll(self, timeout: float = 0.0) -> bool:
        """True when a message (or end of file) is waiting; ``timeout`` seconds at most. Unlike ``select()``,
        works for fds >= 1024 (a long-lived process has them)."""
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()
