"""The GPU copy engines as the offload engine (``progress="graph"``): a plan on CUDA buffers of ranks of one
host becomes, on every rank, one CUDA graph of device-to-device copies that *pull* its receive boxes straight
from its peers' buffers (CUDA IPC), replayed on a copy stream; ``start()`` and ``wait()`` are stream events,
never a synchronisation of the GPU with the host.

Per rank r and generation g:

- ``start()``: record ``ready[r]`` on the application's current stream (its buffers are written), publish
  ``g`` in r's shared flag word and wake r's peers; returns at once.
- r's launcher thread (GIL released while it sleeps on futexes): once every rank r pulls from has published
  ``g`` (their ``ready`` events hold generation g), the copy stream waits for those events and for r's own,
  replays the graph and records ``pulled[r]``, then publishes "enqueued g".
- ``wait()``: waits on the host only until r and every rank that pulls from r have *enqueued* generation g
  (microseconds after the last start), then makes the application's stream wait for their ``pulled`` events:
  receive boxes are filled and send boxes free for reuse in stream order, with no host synchronisation.

A stale event is never waited: a peer re-records ``ready`` only after its own ``wait(g)``, which requires
every puller of its data to have enqueued generation g first, and re-records ``pulled`` only after all its
sources started g + 1. Plans must be single-phase: sends, receives and copies without ``after=`` dependencies
whose read boxes no operation of the plan writes (Alltoall, halo exchanges without corners, the FFT's
transposes); multi-step plans (ring Allreduce) need the agent.
"""

from __future__ import annotations

import inspect
import threading
import time
from dataclasses import dataclass

import torch

from hpdl.offload import native, shm
from hpdl.offload.compiler import CompiledPlan
from hpdl.offload.errors import OffloadError, OffloadTimeoutError, PlanError

COPY_MODES = ("kernel", "ce")  # how the pulls run: captured cudaMemcpyAsync (SM copies) or the copy engines
START, ENQUEUED = 0, 1  # int64 words of a rank's flag block (shared memory); futexes on their low halves


def check_single_phase(plans: list[CompiledPlan]) -> None:
    """Raise :class:`PlanError` unless every rank's plan is single-phase (see the module docstring)."""
    from hpdl.offload.compiler import _overlap

    for p in plans:  # the most fundamental problem first: kinds, then dependencies, then hazards
        for o in p.ops:
            if o.kind not in ("send", "recv", "copy"):
                raise PlanError(f"rank {p.rank} op {o.describe()}: progress='graph' runs sends, receives and copies "
                                "only (reductions need progress='agent' or 'thread')", op=o.name, rank=p.rank)
    for p in plans:
        for o in p.ops:
            if o.deps:
                raise PlanError(f"rank {p.rank} op {o.describe()}: progress='graph' runs single-phase plans, without "
                                "after= dependencies (use progress='agent' for multi-step plans)", op=o.name,
                                rank=p.rank)
    for p in plans:
        writes = [o.dst for o in p.ops if o.kind in ("recv", "copy")]
        for o in p.ops:
            src = o.src if o.kind in ("send", "copy") else None
            if src is not None and any(_overlap(src, w) for w in writes):
                raise PlanError(f"rank {p.rank} op {o.describe()}: reads {src}, which the plan also writes; "
                                "progress='graph' needs read boxes that no operation writes", op=o.name, rank=p.rank)


@dataclass(frozen=True)
class BufferLayout:
    """Where a registered buffer lies in its storage, in the units torch uses: ``shape`` and ``stride`` in
    elements, ``offset`` the tensor's storage offset in elements, ``itemsize`` bytes per element,
    ``storage_nbytes`` the storage's size in bytes and ``storage_offset_bytes`` the storage's offset inside the
    CUDA allocation that an IPC handle opens (``cudaIpcOpenMemHandle`` maps the caching allocator's whole
    segment; torch sub-allocates blocks in it). 0 for a local tensor (its storage is not opened by handle)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    itemsize: int
    storage_nbytes: int
    storage_offset_bytes: int = 0

    @classmethod
    def of_tensor(cls, t: torch.Tensor) -> "BufferLayout":
        return cls(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.element_size(),
                   t.untyped_storage().nbytes())

    @classmethod
    def of_ipc(cls, rebuild, args) -> "BufferLayout":
        """From ``torch.multiprocessing.reductions.reduce_tensor``'s ``(rebuild, args)`` of a CUDA tensor: the
        arguments are read by name (``tensor_size``, ``tensor_stride``, ``tensor_offset``, ``dtype``,
        ``storage_size_bytes``, ``storage_offset_bytes``), not by position, so a reordering across torch
        versions cannot shift them. Raises OffloadError if ``rebuild`` does not take those names."""
        try:
            a = inspect.signature(rebuild).bind(*args).arguments
            return cls(tuple(a["tensor_size"]), tuple(a["tensor_stride"]), int(a["tensor_offset"]),
                       torch.empty((), dtype=a["dtype"]).element_size(), int(a["storage_size_bytes"]),
                       int(a["storage_offset_bytes"]))
        except (TypeError, KeyError) as exc:
            raise OffloadError(f"cannot read a CUDA IPC handle made by {getattr(rebuild, '__name__', rebuild)!r} "
                               f"({type(exc).__name__}: {exc}); progress='graph' expects torch's "
                               "rebuild_cuda_tensor arguments") from exc

    def extent(self, box: tuple[tuple[int, int], ...]) -> tuple[int, int]:
        """``(first byte, bytes spanned)`` of ``box`` (``[start, stop)`` per dimension), counted from the start of
        the storage; an empty box spans 0 bytes at its first element's position."""
        first = self.offset + sum(a * s for (a, _), s in zip(box, self.stride))
        if any(b <= a for a, b in box):
            return first * self.itemsize, 0
        last = first + sum((b - a - 1) * s for (a, b), s in zip(box, self.stride))
        return first * self.itemsize, (last - first + 1) * self.itemsize


@dataclass(frozen=True)
class Pull:
    """One copy of a rank's graph: ``nbytes`` from ``src_buffer`` of rank ``src_rank`` (bytes
    ``[src_off, src_off + src_span)`` of its storage, which starts ``src_storage_offset_bytes`` into the opened
    allocation) into ``dst_buffer`` of this rank (``[dst_off, dst_off + dst_span)`` of its storage). ``op`` is
    the plan operation (recv or copy) that the copy completes. Spans equal ``nbytes`` for contiguous boxes."""

    op: str
    src_rank: int
    src_buffer: str
    src_box: tuple[tuple[int, int], ...]
    src_off: int
    src_span: int
    src_storage_offset_bytes: int
    dst_buffer: str
    dst_box: tuple[tuple[int, int], ...]
    dst_off: int
    dst_span: int
    nbytes: int


def plan_pulls(plans: list[CompiledPlan], rank: int, layouts: dict[int, dict[str, BufferLayout]]) -> list[Pull]:
    """The copies of ``rank``'s graph with their byte ranges, every one checked to lie inside its storage
    (so inside the peer's allocation that the IPC handle opened) before anything is captured.

    Args:
        plans: every rank's compiled plan (single-phase, see :func:`check_single_phase`).
        layouts: ``layouts[q][buffer]`` for ``rank`` and every rank it receives from.

    Returns: one :class:`Pull` per non-empty receive or local copy, in plan order.
    Raises: PlanError (naming the rank, the operation, the buffer, the byte range and the storage size) when a
    box leaves its buffer's shape or storage, when both ends disagree on bytes, or a layout is missing.
    """
    sends = {o.message: (q, o) for q in range(len(plans)) for o in plans[q].ops if o.kind == "send"}
    out = []
    for o in plans[rank].ops:
        if o.kind == "copy":
            q, src = rank, o.src
        elif o.kind == "recv":
            q, so = sends[o.message]
            src = so.src
        else:
            continue
        ends = []
        for who, region, role in ((q, src, "src"), (rank, o.dst, "dst")):
            lay = layouts.get(who, {}).get(region.buffer)
            if lay is None:
                raise PlanError(f"rank {rank} op {o.describe()}: no layout of rank {who}'s buffer {region.buffer!r}",
                                op=o.name, rank=rank)
            if len(region.box) != len(lay.shape) or any(not 0 <= a <= b <= n for (a, b), n in
                                                        zip(region.box, lay.shape)):
                raise PlanError(f"rank {rank} op {o.describe()}: {role} {region} of rank {who} leaves its buffer "
                                f"of shape {lay.shape}", op=o.name, rank=rank)
            off, span = lay.extent(region.box)
            if off < 0 or off + span > lay.storage_nbytes:
                raise PlanError(f"rank {rank} op {o.describe()}: {role} {region} of rank {who} covers bytes "
                                f"[{off}, {off + span}) of a storage of {lay.storage_nbytes} bytes (at byte "
                                f"{lay.storage_offset_bytes} of its allocation)", op=o.name, rank=rank)
            ends.append((lay, off, span, region.numel * lay.itemsize))
        (sl, soff, sspan, sbytes), (dl, doff, dspan, dbytes) = ends
        if sbytes != dbytes:
            raise PlanError(f"rank {rank} op {o.describe()}: {sbytes} bytes from rank {q}'s {src} into {dbytes} "
                            f"bytes of {o.dst}", op=o.name, rank=rank)
        if dbytes:
            out.append(Pull(o.name, q, src.buffer, src.box, soff, sspan, sl.storage_offset_bytes, o.dst.buffer,
                            o.dst.box, doff, dspan, dbytes))
    return out


def _gather(value, group):
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


class GraphRequest:
    """A persistent request run by the GPU's copy engines (``compile(..., progress="graph")``); the same
    interface as :class:`~hpdl.offload.api.PersistentRequest` (``start``, ``test``, ``wait``, ``free``,
    ``buffers``, ``plan``, ``progress``). Collective to build (inside ``compile``).

    Raises (at build): PlanError: buffers not all on one CUDA device, or a plan that is not single-phase.
    """

    progress = "graph"

    def __init__(self, plans: list[CompiledPlan], rank: int, tensors: dict[str, torch.Tensor], group,
                 timeout: float, copy: str | None = None):
        from torch.multiprocessing.reductions import reduce_tensor

        from hpdl.runtime import env

        self.copy = (copy or env.get("HPDL_OFFLOAD_CUDA_COPY")).strip().lower()
        self.plan = plans[rank]
        self.buffers = tensors
        self.timeout = timeout
        self.active = self.freed = False
        self._gen = 0
        self._t_start = 0.0
        devs = {t.device for t in tensors.values()}
        err = None
        if self.copy not in COPY_MODES:
            err = f"rank {rank}: HPDL_OFFLOAD_CUDA_COPY must be one of {COPY_MODES}, got {self.copy!r}"
        elif self.copy == "ce":
            from hpdl.offload.cecopy import unavailable_reason

            if torch.cuda.is_available() and unavailable_reason():
                err = f"rank {rank}: HPDL_OFFLOAD_CUDA_COPY=ce: {unavailable_reason()}"
        if err is None and (len(devs) != 1 or next(iter(devs)).type != "cuda"):
            err = f"rank {rank}: progress='graph' needs every buffer on one CUDA device, got {sorted(map(str, devs))}"
        elif err is None:
            try:
                check_single_phase(plans)
            except PlanError as exc:
                err = str(exc)
        import socket

        got = _gather((err, socket.gethostname()), group)
        errs = [e for e, _ in got if e]
        if not errs and len({h for _, h in got}) > 1:
            errs = [f"progress='graph' needs every rank on one host (CUDA IPC), got hosts {sorted({h for _, h in got})}"]
        if errs:
            raise PlanError(errs[0])
        self.device = next(iter(devs))
        torch.cuda.set_device(self.device)
        self._flags = shm.empty((4,), torch.int64)
        self.ready = torch.cuda.Event(interprocess=True)
        self.pulled = torch.cuda.Event(interprocess=True)
        with torch.cuda.device(self.device):
            mine = {"buffers": {n: reduce_tensor(t) for n, t in tensors.items()},
                    "flags": shm.handle_of(self._flags), "ready": self.ready.ipc_handle(),
                    "pulled": self.pulled.ipc_handle()}
        everyone = _gather(mine, group)
        self._mapper = shm.Mapper()
        self._peer_flags, self._peer_ready, self._peer_pulled = {}, {}, {}
        # the peers' buffers opened by CUDA IPC: held for the request's life. The graph keeps raw addresses
        # only; dropping the last tensor of an opened allocation closes its mapping (cudaIpcCloseMemHandle), and
        # a replay then reads unmapped memory (the illegal memory access of the first device run)
        self._peer_bufs: dict[int, dict[str, torch.Tensor]] = {}
        sources = sorted({o.peer for o in self.plan.ops if o.kind == "recv" and o.peer != rank})
        pullers = sorted({o.peer for o in self.plan.ops if o.kind == "send" and o.peer != rank})
        layouts = {rank: {n: BufferLayout.of_tensor(t) for n, t in tensors.items()}}
        for q in set(sources) | set(pullers):
            info = everyone[q]
            self._peer_flags[q] = self._mapper.tensor(info["flags"])
            if q in sources:  # its buffers are opened below, where a failure reaches every rank
                self._peer_ready[q] = torch.cuda.Event.from_ipc_handle(self.device, info["ready"])
            if q in pullers:  # _order waits for the pulls of our buffers by every puller
                self._peer_pulled[q] = torch.cuda.Event.from_ipc_handle(self.device, info["pulled"])
        self.sources, self.pullers = sources, pullers
        # high priority: where the pulls run on SMs (copy="kernel"), their blocks are scheduled before the
        # application's next ones instead of queueing behind a whole matmul
        self._stream = torch.cuda.Stream(self.device, priority=-1)
        self._graph = None
        self._batch = None
        self._pulls: list[Pull] = []
        self._go = threading.Event()
        self._stop = False
        self._error: str | None = None
        err = None
        try:
            for q in sources:
                bufs = everyone[q]["buffers"]
                layouts[q] = {n: BufferLayout.of_ipc(fn, args) for n, (fn, args) in bufs.items()}
                self._peer_bufs[q] = {n: fn(*args) for n, (fn, args) in bufs.items()}
                for n, t in self._peer_bufs[q].items():  # the opened tensor is the one the handle describes
                    want = layouts[q][n]
                    got = BufferLayout.of_tensor(t)
                    if (got.shape, got.stride, got.offset, got.storage_nbytes) != \
                            (want.shape, want.stride, want.offset, want.storage_nbytes):
                        raise OffloadError(f"rank {q}'s buffer {n!r} opened by CUDA IPC as {got}, its handle "
                                           f"says {want}")
            self._pulls = plan_pulls(plans, rank, layouts)
            views = [self._views(p, tensors) for p in self._pulls]
            if self.copy == "ce":  # contiguous pulls go to the copy engines in one batch; strided ones stay below
                ce = [p.src_span == p.nbytes == p.dst_span and d.is_contiguous() and s_.is_contiguous()
                      for (d, s_), p in zip(views, self._pulls)]
                flat = [v for v, c in zip(views, ce) if c]
                views = [v for v, c in zip(views, ce) if not c]
                if flat:
                    from hpdl.offload.cecopy import BatchCopy

                    self._batch = BatchCopy([d.data_ptr() for d, _ in flat], [s_.data_ptr() for _, s_ in flat],
                                            [d.numel() * d.element_size() for d, _ in flat])
            if views:
                self._graph = torch.cuda.CUDAGraph()
                # thread_local: other requests' launcher threads may touch CUDA while this one captures
                with torch.cuda.graph(self._graph, stream=self._stream, capture_error_mode="thread_local"):
                    for d, src in views:
                        d.copy_(src.reshape(d.shape))
        except (PlanError, OffloadError, RuntimeError) as exc:
            msg = str(exc) if str(exc).startswith("rank ") else f"rank {rank}: {exc}"
            err = (msg, isinstance(exc, PlanError))
        self._npulls = len(self._pulls)
        errs = [e for e in _gather(err, group) if e]  # every rank learns of any rank's failure, none hangs
        if errs:
            self._graph, self._batch, self._peer_bufs = None, None, {}
            raise (PlanError if errs[0][1] else OffloadError)(errs[0][0])
        self._thread = threading.Thread(target=self._launcher, name=f"hpdl-offload-graph-{rank}", daemon=True)
        self._thread.start()
        _gather(None, group)  # every rank's graph is captured and its launcher runs before any start

    def _views(self, p: Pull, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The (dst, src) tensor views of one planned copy, checked against the planned byte offsets (torch's
        view arithmetic and :func:`plan_pulls` must agree before a raw address enters a graph)."""
        src_t = tensors if p.src_rank == self.plan.rank else self._peer_bufs[p.src_rank]
        pairs = ((tensors[p.dst_buffer], p.dst_box, p.dst_off, "dst"),
                 (src_t[p.src_buffer], p.src_box, p.src_off, "src"))
        out = []
        for t, box, off, role in pairs:
            v = t[tuple(slice(a, b) for a, b in box)]
            got = v.data_ptr() - v.untyped_storage().data_ptr()
            if got != off:
                raise OffloadError(f"op {p.op!r}: {role} view starts at byte {got} of its storage, planned {off}")
            out.append(v)
        return out[0], out[1]

    # ---- the launcher thread ---------------------------------------------------------------------------
    def _wait_word(self, t: torch.Tensor, word: int, g: int, deadline: float) -> bool:
        addr = t.data_ptr() + 8 * word
        while int(t[word]) < g:
            if self._stop or time.monotonic() > deadline:
                return False
            native.futex_wait(addr, int(t[word]) & 0xFFFFFFFF, 0.01)
        return True

    def _launcher(self) -> None:
        torch.cuda.set_device(self.device)
        done = 0
        while not self._stop:
            self._go.wait(0.1)
            self._go.clear()  # before reading _gen: a start after this sets it again (no lost wake-up)
            while not self._stop and done < self._gen:
                g = done + 1  # generations strictly in order: start(g + 1) needs wait(g), which needs this one
                deadline = time.monotonic() + max(self.timeout, 1.0)
                if not all(self._wait_word(self._peer_flags[q], START, g, deadline) for q in self.sources):
                    break  # a late source: try again on the next round (wait() reports the timeout)
                try:
                    for q in self.sources:
                        self._stream.wait_event(self._peer_ready[q])
                    self._stream.wait_event(self.ready)
                    if self._batch is not None:
                        self._batch.issue(self._stream.cuda_stream)
                    if self._graph is not None:
                        with torch.cuda.stream(self._stream):
                            self._graph.replay()
                    self.pulled.record(self._stream)
                except Exception as exc:  # noqa: BLE001 - reported by wait()/test()
                    self._error = f"{type(exc).__name__}: {exc}"
                done = g
                self._publish(ENQUEUED, g)

    def _publish(self, word: int, g: int) -> None:
        self._flags[word] = g
        if native.futex_ok():
            native.futex_wake(self._flags.data_ptr() + 8 * word)

    # ---- the request -----------------------------------------------------------------------------------
    def start(self) -> None:
        """``MPI_Start``: record the application stream's ready event and publish the generation; at once."""
        if self.freed:
            raise OffloadError(f"plan {self.plan.name!r}: start() of a freed request")
        if self.active:
            raise OffloadError(f"plan {self.plan.name!r}: start() of an active request: wait() for it first")
        self._gen += 1
        self.active = True
        self._t_start = time.monotonic()
        self.ready.record(torch.cuda.current_stream(self.device))
        self._publish(START, self._gen)
        self._go.set()

    def _enqueued(self, deadline: float | None) -> bool:
        g = self._gen
        for t in [self._flags] + [self._peer_flags[q] for q in self.pullers]:
            if deadline is None:
                if int(t[ENQUEUED]) < g:
                    return False
            elif not self._wait_word(t, ENQUEUED, g, deadline):
                missing = [q for q in self.pullers if int(self._peer_flags[q][ENQUEUED]) < g] + \
                    [q for q in self.sources if int(self._peer_flags[q][START]) < g]
                raise OffloadTimeoutError(f"plan {self.plan.name!r} on rank {self.plan.rank} (progress='graph'): "
                                          f"ranks {sorted(set(missing))} did not start or enqueue generation {g} "
                                          "in time", missing_ranks=sorted(set(missing)))
        return True

    def _order(self) -> None:
        if self._error:
            raise OffloadError(f"plan {self.plan.name!r} on rank {self.plan.rank}: {self._error}")
        s = torch.cuda.current_stream(self.device)
        s.wait_event(self.pulled)
        for q in self.pullers:
            s.wait_event(self._peer_pulled[q])
        self.active = False

    def wait(self, timeout: float | None = None) -> None:
        """``MPI_Wait`` in stream order: the application's current stream waits for this rank's pulls and for
        its peers' pulls of its send boxes. The host waits only for the peers to *enqueue* them."""
        if not self.active:
            return
        self._enqueued(time.monotonic() + (self.timeout if timeout is None else timeout))
        self._order()

    def test(self) -> bool:
        """True when every copy of the last start has run on the GPU (then as :meth:`wait`)."""
        if not self.active:
            return True
        if not self._enqueued(None):
            return False
        if not self.pulled.query() or not all(self._peer_pulled[q].query() for q in self.pullers):
            return False
        self._order()
        return True

    def free(self) -> None:
        if self.freed:
            return
        if self.active:
            raise OffloadError(f"plan {self.plan.name!r}: free() of an active request: wait() for it first")
        self.freed = True
        self._stop = True
        self._go.set()
        self._thread.join(timeout=5)
        # the last replay may still be reading the peers' memory: let it finish before their mappings close
        self._stream.synchronize()
        self._graph = self._batch = None
        self._peer_bufs = {}

    def __enter__(self) -> "GraphRequest":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self.active:
            self.wait()
        if not self.active:
            self.free()
