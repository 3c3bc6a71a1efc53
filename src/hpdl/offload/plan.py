"""The plan API: a communication pattern described once, as plain data.

A :class:`Plan` holds buffers registered by name (shape, dtype) and operations on boxes of them, with explicit
dependencies (``after=``): ``send``/``recv`` (matched across ranks by peer and tag, in the order they are
declared, as MPI's non-overtaking rule), ``put``/``get`` (one-sided: the origin names a box of the target's
buffer; the target declares nothing), and local ``copy`` and ``reduce`` (``dst = dst op src``, as
``MPI_Reduce_local``). Operations without a dependency path between them may run in any order or at once.

Everything here is plain data and pure functions; :func:`hpdl.offload.compile` validates a plan on every rank
of a group and turns it into a persistent request.

    >>> import torch
    >>> p = Plan("shift", rank=0, world_size=2)
    >>> x = p.buffer("x", (2, 4), torch.float32)
    >>> s = p.send(x[0], peer=1, name="to_right")
    >>> r = p.recv(x[1], peer=1, name="from_left")
    >>> p.copy(x[0, 0:2], x[1, 2:4], after=[r, s], name="fold")
    OpRef(plan='shift', index=2, name='fold')
    >>> str(p.data().ops[2].src)
    'x[1:2, 2:4]'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from hpdl.offload.errors import PlanError

KINDS = ("send", "recv", "put", "get", "copy", "reduce")
REDUCE_OPS = ("sum", "prod", "min", "max")


def dtype_name(dtype) -> str:
    """'float32' for ``torch.float32`` or ``"float32"``. Raises PlanError for anything else."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return dtype
    raise PlanError(f"dtype must be a torch dtype such as torch.float32 (or its name), got {dtype!r}")


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def element_size(name: str) -> int:
    return torch.empty((), dtype=torch_dtype(name)).element_size()


@dataclass(frozen=True)
class BufferSpec:
    """A registered buffer: a C-contiguous array ``shape`` of ``dtype`` (a torch dtype name)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(self.dtype)


@dataclass(frozen=True)
class Region:
    """A box of a buffer: ``[start, stop)`` per dimension, as given (validated at compile time, never clamped).

    Its elements travel in C order, so a send and its recv must agree on the number of elements and the dtype,
    not on the shape (like MPI's type signatures).
    """

    buffer: str
    box: tuple[tuple[int, int], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(max(0, b - a) for a, b in self.box)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.box)

    def __str__(self) -> str:
        return f"{self.buffer}[" + ", ".join(f"{a}:{b}" for a, b in self.box) + "]"


def _region(spec: BufferSpec, index) -> Region:
    """Box of ``spec`` selected by ``index`` (ints, step-1 slices, Ellipsis); negative indices count from the
    end as in Python, but nothing is clamped: an out-of-range box is kept and rejected at compile time."""
    if not isinstance(index, tuple):
        index = (index,)
    if sum(1 for i in index if i is Ellipsis) > 1:
        raise PlanError(f"buffer {spec.name!r}: at most one ... in an index, got {index!r}")
    if Ellipsis in index:
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (len(spec.shape) - len(index) + 1) + index[k + 1:]
    if len(index) > len(spec.shape):
        raise PlanError(f"buffer {spec.name!r} has {len(spec.shape)} dimensions (shape {spec.shape}), "
                        f"got {len(index)} indices {index!r}")
    index = index + (slice(None),) * (len(spec.shape) - len(index))
    box = []
    for d, (i, n) in enumerate(zip(index, spec.shape)):
        if isinstance(i, slice):
            if i.step not in (None, 1):
                raise PlanError(f"buffer {spec.name!r} dim {d}: slice step {i.step} is not supported "
                                "(a region is a box; describe strided data as several regions)")
            a = 0 if i.start is None else _int(i.start, spec, d)
            b = n if i.stop is None else _int(i.stop, spec, d)
            box.append((a + n if a < 0 else a, b + n if b < 0 else b))
        else:
            a = _int(i, spec, d)
            a = a + n if a < 0 else a
            box.append((a, a + 1))
    return Region(spec.name, tuple(box))


def _int(v, spec: BufferSpec, d: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        try:
            return int(v.__index__())
        except (AttributeError, TypeError):
            raise PlanError(f"buffer {spec.name!r} dim {d}: index must be an int or a slice of ints, "
                            f"got {v!r}") from None
    return v


class BufferRef:
    """What :meth:`Plan.buffer` returns: index it (``x[0]``, ``x[:, 1:3]``, ``x[...]``) to get a :class:`Region`."""

    def __init__(self, spec: BufferSpec):
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    def __getitem__(self, index) -> Region:
        return _region(self.spec, index)

    def all(self) -> Region:
        return _region(self.spec, ...)

    def __repr__(self) -> str:
        return f"BufferRef({self.spec.name!r}, shape={self.spec.shape}, dtype={self.spec.dtype})"


@dataclass(frozen=True)
class OpRef:
    """Handle of a declared operation, for ``after=`` (an operation's name works too)."""

    plan: str
    index: int
    name: str


@dataclass(frozen=True)
class Op:
    """One operation of a plan, as declared (``after`` holds names or indices, resolved at compile time).

    Fields by kind: send ``src, peer, tag``; recv ``dst, peer, tag``; put ``src`` (local) ``dst`` (the peer's
    buffer) ``peer``; get ``dst`` (local) ``src`` (the peer's buffer) ``peer``; copy ``dst, src``;
    reduce ``dst, src, reduce_op``.
    """

    index: int
    kind: str
    name: str
    after: tuple = ()
    src: Region | None = None
    dst: Region | None = None
    peer: int | None = None
    tag: int = 0
    reduce_op: str | None = None

    def describe(self) -> str:
        where = {"send": f" to rank {self.peer}", "recv": f" from rank {self.peer}",
                 "put": f" to rank {self.peer}", "get": f" from rank {self.peer}"}.get(self.kind, "")
        return f"op {self.name!r} ({self.kind}{where})"


@dataclass(frozen=True)
class PlanData:
    """A plan as plain data: what ranks exchange at compile time."""

    name: str
    buffers: tuple[BufferSpec, ...]
    ops: tuple[Op, ...]
    rank: int | None = None
    world_size: int | None = None


class Plan:
    """Builder of one rank's part of a communication pattern (see the module docstring).

    Args:
        name: shown in errors and by the agent.
        rank, world_size: the group rank and size the plan was written for; when given, compile checks them.
    """

    def __init__(self, name: str = "plan", *, rank: int | None = None, world_size: int | None = None):
        self.name, self.rank, self.world_size = name, rank, world_size
        self._buffers: dict[str, BufferSpec] = {}
        self._ops: list[Op] = []
        self._names: set[str] = set()

    def buffer(self, name: str, shape: int | Sequence[int], dtype) -> BufferRef:
        """Register buffer ``name`` (C-contiguous ``shape`` of ``dtype``); the tensor is bound at compile time.

        Raises:
            PlanError: a repeated name, a negative or non-integer dimension, an unknown dtype.
        """
        if not isinstance(name, str) or not name:
            raise PlanError(f"buffer name must be a non-empty string, got {name!r}")
        if name in self._buffers:
            raise PlanError(f"plan {self.name!r}: buffer {name!r} is registered twice")
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in dims):
            raise PlanError(f"buffer {name!r}: shape must be non-negative ints, got {shape!r}")
        spec = BufferSpec(name, dims, dtype_name(dtype))
        self._buffers[name] = spec
        return BufferRef(spec)

    def send(self, src: Region, peer: int, *, tag: int = 0, after: Iterable = (), name: str | None = None) -> OpRef:
        """Send box ``src`` to group rank ``peer``; matched with ``peer``'s recv from this rank with ``tag``."""
        return self._add("send", name, after, src=src, peer=peer, tag=tag)

    def recv(self, dst: Region, peer: int, *, tag: int = 0, after: Iterable = (), name: str | None = None) -> OpRef:
        """Receive into box ``dst`` what group rank ``peer`` sends with ``tag``."""
        return self._add("recv", name, after, dst=dst, peer=peer, tag=tag)

    def put(self, src: Region, peer: int, dst: Region, *, after: Iterable = (), name: str | None = None) -> OpRef:
        """Write local box ``src`` into box ``dst`` of ``peer``'s buffer (named as in ``peer``'s plan).

        Like ``MPI_Put`` inside a fence epoch: the target's request completes only once the data has arrived,
        and the target must not touch ``dst`` between its ``start()`` and ``wait()``.
        """
        return self._add("put", name, after, src=src, dst=dst, peer=peer)

    def get(self, dst: Region, peer: int, src: Region, *, after: Iterable = (), name: str | None = None) -> OpRef:
        """Read box ``src`` of ``peer``'s buffer into local box ``dst`` (``MPI_Get``; the target's request
        completes once the data has been read)."""
        return self._add("get", name, after, src=src, dst=dst, peer=peer)

    def copy(self, dst: Region, src: Region, *, after: Iterable = (), name: str | None = None) -> OpRef:
        """Local copy of box ``src`` into box ``dst`` (same dtype and element count; C order)."""
        return self._add("copy", name, after, src=src, dst=dst)

    def reduce(self, dst: Region, src: Region, op: str = "sum", *, after: Iterable = (),
               name: str | None = None) -> OpRef:
        """Local reduction ``dst = dst op src`` elementwise, ``op`` in sum, prod, min, max."""
        return self._add("reduce", name, after, src=src, dst=dst, reduce_op=op)

    def _add(self, kind: str, name, after, **fields) -> OpRef:
        index = len(self._ops)
        name = f"{kind}{index}" if name is None else name
        if not isinstance(name, str) or not name:
            raise PlanError(f"plan {self.name!r}: op name must be a non-empty string, got {name!r}")
        if name in self._names:
            raise PlanError(f"plan {self.name!r}: op name {name!r} is used twice", op=name)
        if isinstance(after, (OpRef, str, int)):
            after = (after,)
        deps = []
        for a in after:
            if isinstance(a, OpRef):
                if a.plan != self.name:
                    raise PlanError(f"op {name!r}: after= names {a.name!r} of plan {a.plan!r}", op=name)
                deps.append(a.name)
            elif isinstance(a, (str, int)) and not isinstance(a, bool):
                deps.append(a)
            else:
                raise PlanError(f"op {name!r}: after= takes OpRefs or op names, got {a!r}", op=name)
        for key in ("src", "dst"):
            if key in fields and not isinstance(fields[key], Region):
                raise PlanError(f"op {name!r} ({kind}): {key} must be a Region (index a BufferRef, e.g. x[0:4]), "
                                f"got {fields[key]!r}", op=name)
        self._names.add(name)
        self._ops.append(Op(index, kind, name, tuple(deps), **fields))
        return OpRef(self.name, index, name)

    @property
    def buffers(self) -> tuple[BufferSpec, ...]:
        return tuple(self._buffers.values())

    @property
    def ops(self) -> tuple[Op, ...]:
        return tuple(self._ops)

    def data(self) -> PlanData:
        """This plan as plain, picklable data."""
        return PlanData(self.name, self.buffers, self.ops, self.rank, self.world_size)

    def __repr__(self) -> str:
        return f"Plan({self.name!r}, {len(self._buffers)} buffers, {len(self._ops)} ops)"
