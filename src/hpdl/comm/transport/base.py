"""The transport interface every algorithm is written against: post sends and receives, wait with a timeout.

An algorithm sees ranks 0..world_size-1 of its group; the transport maps them to the engine's ranks. The
same algorithm code therefore runs over gloo on CPU, NCCL on GPU or MPI, whichever transport it is given:
:class:`~hpdl.comm.transport.torch_p2p.TorchTransport` (a torch.distributed group),
:class:`~hpdl.comm.transport.gloo.GlooTransport` (a private Gloo group built on a store: hpdl.offload's),
:class:`~hpdl.comm.transport.mpi.MpiTransport` (an mpi4py communicator), and
:class:`~hpdl.comm.transport.sub.SubTransport` (a subset of another transport's ranks).

Backends implement :meth:`Transport.post`; per-message ``isend``/``irecv`` (what hpdl.offload's executor
posts, one tag per message) and the ``describe``/``explain`` hooks its error messages use have defaults here.
"""

from __future__ import annotations

import math
import numbers
import operator
import zlib
from abc import ABC, abstractmethod
from typing import Sequence

import torch

from hpdl.runtime.errors import CollectiveMismatchError

TAG_MAX = 2 ** 31 - 1   # the largest tag every backend takes (Gloo's tags are 31-bit; MPI guarantees >= 32767)
EXCHANGE_MSG_BYTES = 1024   # Transport.exchange_all's message: a 16-byte header and up to 1008 bytes inline


def check_timeout(timeout) -> float:
    """``timeout`` as a float of seconds, > 0 and finite.

    Raises:
        TypeError: not a real number (a bool or a string included).
        ValueError: not > 0, or infinite or NaN.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds > 0, got {timeout!r} ({type(timeout).__name__})")
    timeout = float(timeout)
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout}")
    return timeout


def check_int(name: str, value, lo: int, hi: int, expected: str | None = None) -> int:
    """``value`` as an int in ``[lo, hi]``; a bool or a float is refused, not truncated.

    Raises:
        TypeError: not an int (``operator.index`` refuses it, or a bool).
        ValueError: out of range; the message says "``name`` must be ``expected``, got ``value``".
    """
    expected = expected or f"in [{lo}, {hi}]"
    try:
        if isinstance(value, bool):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int ({expected}), got {value!r} ({type(value).__name__})") from None
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be {expected}, got {v}")
    return v


def check_post(transport: "Transport", sends: Sequence[tuple[torch.Tensor, int]],
               recvs: Sequence[tuple[torch.Tensor, int]], tag: int, *, devices: Sequence[str],
               tag_max: int = TAG_MAX, tag_note: str = "", to_self: bool = True) -> tuple[list, list, int]:
    """The checks every backend's ``post`` makes before posting anything, with the same messages everywhere.

    Each tensor must be a ``torch.Tensor`` that is dense (strided layout), contiguous, not a lazy conjugate or
    negative view (``.resolve_conj()``/``.resolve_neg()`` first: the bytes would not hold the values), on a device
    of type in ``devices``; each peer an int rank in ``[0, world_size)`` (not ``transport.rank`` itself unless
    ``to_self``); ``tag`` an int in ``[0, tag_max]``.

    Returns:
        ``(sends, recvs, tag)`` with peers and tag as Python ints.

    Raises:
        TypeError: a tensor that is not a ``torch.Tensor``, a peer or tag that is not an int.
        ValueError: anything else out of the above, naming the argument and what was expected.
    """
    tag = check_int("tag", tag, 0, tag_max, f"in [0, {tag_max}]{tag_note}")
    p = transport.world_size
    out = []   # (every collective step posts through here: messages are built only on an error)
    for what, pairs in (("send", sends), ("recv", recvs)):
        checked = []
        for t, peer in pairs:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what} tensor must be a torch.Tensor, got {type(t).__name__}")
            if t.layout != torch.strided:
                bad = f"{str(t.layout).replace('torch.', '')} (not dense) "
            elif t.is_conj() or t.is_neg():
                bad = "lazy conjugate/negative view (call .resolve_conj().resolve_neg() first) of a "
            elif not t.is_contiguous():
                bad = "non-contiguous "
            elif t.device.type not in devices:
                bad = ""
            else:
                bad = None
            if bad is not None:
                kinds = " or ".join(d.upper() for d in devices)
                raise ValueError(f"{what} tensor must be a contiguous {kinds} tensor ({type(transport).__name__}), "
                                 f"got a {bad}{t.device} tensor")
            if type(peer) is not int or not 0 <= peer < p or (not to_self and peer == transport.rank):
                rank = "a rank" if to_self else f"another rank than this one ({transport.rank})"
                peer = check_int(f"{what} peer", peer, 0, p - 1, f"{rank} in [0, {p})")
                if not to_self and peer == transport.rank:
                    raise ValueError(f"{what} peer must be {rank} in [0, {p}), got {peer}")
            checked.append((t, peer))
        out.append(checked)
    return out[0], out[1], tag


class Request(ABC):
    """One posted send or receive."""

    @abstractmethod
    def wait(self) -> None:
        """Block until done; raise :class:`hpdl.runtime.CollectiveTimeoutError` naming the peer on timeout."""

    @abstractmethod
    def is_completed(self) -> bool:
        """True once the operation has finished (never blocks)."""


class Transport(ABC):
    """Point-to-point messaging inside one group, with a deadline per wait.

    Attributes:
        rank: this process's rank in the group.
        world_size: ranks in the group.
        device: where tensors passed to ``post`` live.
        timeout: seconds a :meth:`Request.wait` may block.
    """

    rank: int
    world_size: int
    device: torch.device
    timeout: float

    @abstractmethod
    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
             tag: int = 0) -> tuple[list[Request], list[Request]]:
        """Start ``sends`` (tensor, dst) and ``recvs`` (tensor, src) together; return their requests.

        Tensors must be contiguous and stay untouched until their request completes. Messages between one
        pair of ranks with one tag match in the order they were posted.

        A receive's tensor must have exactly the size of the message it gets. Backends differ when it does not:
        MpiTransport raises :class:`hpdl.runtime.CollectiveMismatchError` naming the peer and both sizes (a
        larger buffer is detected from the received count), but Gloo (GlooTransport, TorchTransport on gloo)
        fills a larger buffer's first bytes and reports success, and aborts the process on a smaller one; NCCL
        does not check. Sizes must therefore be agreed beforehand (:meth:`exchange_all` checks its own).

        Raises:
            TypeError, ValueError: a bad tensor, peer or tag (:func:`check_post`), before anything is posted.
            CollectiveMismatchError: a receive's message had another size than its tensor (MpiTransport only).
        """

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Request:
        """Post one send of ``tensor`` to ``dst``; its request's ``wait()`` blocks until it is done."""
        return self.post([(tensor, dst)], [], tag)[0][0]

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Request:
        """Post one receive into ``tensor`` from ``src``; its request's ``wait()`` blocks until it landed."""
        return self.post([], [(tensor, src)], tag)[1][0]

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Blocking :meth:`isend`."""
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        """Blocking :meth:`irecv`."""
        self.irecv(tensor, src, tag).wait()

    def describe(self, peer: int) -> str:
        """Who ``peer`` is, for error messages ("rank 3"; hpdl.offload's agents name their process and host)."""
        return f"rank {peer}"

    def explain(self, peer: int) -> str | None:
        """Why ``peer`` went away, when it said so before going (e.g. "rank 3 (pid 42) on node-b died"), so that
        a failure is blamed on that rank rather than on the peer that relayed it; None when unknown."""
        return None

    def exchange(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
                 tag: int = 0) -> None:
        """Send to ``dst`` and receive from ``src`` at once, and wait for both (a sendrecv)."""
        sends = [(send, dst)] if send is not None else []
        recvs = [(recv, src)] if recv is not None else []
        s, r = self.post(sends, recvs, tag)
        for req in r + s:
            req.wait()

    def exchange_all(self, mine: torch.Tensor, tag: int = 0) -> list[torch.Tensor]:
        """Every rank's copy of a small tensor (same shape and dtype everywhere), sent directly peer to peer.

        Used for metadata (argument signatures, split sizes, segment names). Each rank sends every peer one
        message of :data:`EXCHANGE_MSG_BYTES`: a header of two int64 (the tensor's byte count and a checksum of its
        shape and dtype) and, when it fits, the tensor's bytes; a larger tensor follows in a second message once
        every rank has seen every header. Every message has a size known to all, so ranks that passed different
        tensors get an error rather than garbage or a torn message (Gloo aborts the process when a message is
        larger than its buffer), at no extra round trip for small tensors.

        Returns:
            ``world_size`` tensors of ``mine``'s shape, dtype and device; row ``rank`` is ``mine`` itself.

        Raises:
            TypeError: ``mine`` not a tensor.
            CollectiveMismatchError: on every rank, when the ranks' tensors differ in size, shape or dtype (the
                message names each rank's byte count).
            CollectiveTimeoutError: a peer did not answer (the error names it).
        """
        if not isinstance(mine, torch.Tensor):
            raise TypeError(f"mine must be a torch.Tensor, got {type(mine).__name__}")
        # one layout on every rank: a non-contiguous tensor on some ranks only would pass the header round and then be
        # refused by the send check on those ranks alone, leaving the others waiting for its bytes
        mine = mine.contiguous()
        peers = [q for q in range(self.world_size) if q != self.rank]
        nbytes = mine.numel() * mine.element_size()
        inline = nbytes <= EXCHANGE_MSG_BYTES - 16
        sig = zlib.crc32(f"{mine.dtype}{tuple(mine.shape)}".encode())   # deterministic, unlike hash()
        msg = torch.zeros(EXCHANGE_MSG_BYTES, dtype=torch.uint8, device=mine.device)
        msg[:16].view(torch.int64).copy_(torch.tensor([nbytes, sig], dtype=torch.int64))
        if inline and nbytes:
            msg[16:16 + nbytes] = mine.detach().reshape(-1).view(torch.uint8)
        inbox = {q: torch.empty_like(msg) for q in peers}
        self._post_and_wait([(msg, q) for q in peers], [(inbox[q], q) for q in peers], tag)
        got = [tuple((msg if q == self.rank else inbox[q])[:16].view(torch.int64).tolist())
               for q in range(self.world_size)]
        if len(set(got)) > 1:
            sizes = ", ".join(f"rank {r}: {n} bytes" for r, (n, _) in enumerate(got))
            raise CollectiveMismatchError(
                f"exchange_all (tag {tag}): the ranks' tensors differ in size, shape or dtype ({sizes}; this rank's "
                f"is {mine.dtype} {tuple(mine.shape)}); every rank must pass the same shape and dtype")
        if inline:
            rows = [mine if q == self.rank else inbox[q][16:16 + nbytes].view(mine.dtype).view(mine.shape).clone()
                    for q in range(self.world_size)]
        else:
            rows = [torch.empty_like(mine) for _ in range(self.world_size)]
            rows[self.rank] = mine
            self._post_and_wait([(mine, q) for q in peers], [(rows[q], q) for q in peers], tag)
        return rows

    def _post_and_wait(self, sends, recvs, tag: int) -> None:
        s, r = self.post(sends, recvs, tag)
        for req in r + s:
            req.wait()
