"""The executor: runs compiled plans (a DAG per rank) on their buffers, while the application computes.

One executor serves many ranks and plans at once: the progress agent runs one for all ranks of its node,
the in-process fallback one per process. It issues an operation as soon as its dependencies are done (the
schedule of MPICH's gentran DAGs: a vertex is issued when its dependency count reaches zero), copies messages
between ranks it serves directly from the sender's buffer into the receiver's (no staging), and hands
messages to other endpoints to a :class:`hpdl.comm.transport.base.Transport` (in practice
:class:`~hpdl.comm.transport.gloo.GlooTransport`), whose waits run on I/O threads (torch's Gloo point-to-point
work cannot be polled: its ``is_completed()`` stays False until ``wait()``).

What the executor needs of its transport: ``isend``/``irecv`` post one message and return at once with a request
whose ``wait()`` blocks until it is done (called on the I/O threads). The dispatcher posts every message as soon
as its operation is ready, in issue order, so a message never waits for a free I/O thread to be *posted*: a plan
with more messages in flight than there are I/O threads still completes (a blocking ``send`` taken up by a pool
thread would wait for a ``recv`` queued behind it: a deadlock). Tensors are contiguous and on the CPU; a tag is a
31-bit int unique per message between two endpoints among the live plans. ``describe(endpoint)`` and
``explain(endpoint)`` word its errors.

Requests talk to it through mailboxes (:mod:`hpdl.offload.shm`): a ``start()`` writes the generation number
and rings a doorbell; the executor writes back when it took it up and when it finished. Progress never
depends on the application calling ``test()`` or ``wait()``.

Threading: all plan state is owned by the dispatcher loop (:meth:`Executor.progress`); other threads hand it
work through :meth:`Executor.call` and the completion queue.
"""

from __future__ import annotations

import logging
import math
import select
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from hpdl.comm.transport.base import Transport
from hpdl.offload import native, shm
from hpdl.offload.status import Pending, Status
from hpdl.offload.compiler import CompiledPlan
from hpdl.offload.errors import OffloadError

log = logging.getLogger("hpdl.offload")


def _reshaped(src: torch.Tensor, shape) -> Callable[[], torch.Tensor]:
    """A function returning ``src`` in ``shape`` (C order): a view when possible, else a copy at call time."""
    if tuple(src.shape) == tuple(shape):
        return lambda: src
    try:
        v = src.view(shape)
        return lambda: v
    except RuntimeError:
        return lambda: src.reshape(shape)


_SIDE: dict[int, "torch.cuda.Stream"] = {}  # device index -> the stream of this process's copy-engine copies


def _ce_copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None] | None:
    """With ``HPDL_OFFLOAD_CUDA_COPY=ce``, a copy between contiguous boxes of one GPU as a
    ``cudaMemcpyBatchAsync`` preferring the copy engines (:mod:`hpdl.offload.cecopy`), on a stream of its own
    that waits for the request's ready event (:meth:`Executor._begin`); ``_finish`` synchronises the device.
    None for any other copy or mode.

    Raises:
        OffloadError: a value other than kernel/ce, or ``ce`` where the runtime has no batch copy.
    """
    from hpdl.runtime import env

    if not (dst.is_cuda and src.is_cuda):
        return None
    mode = env.get("HPDL_OFFLOAD_CUDA_COPY").strip().lower()
    if mode not in ("kernel", "ce"):
        raise OffloadError(f"HPDL_OFFLOAD_CUDA_COPY must be kernel or ce, got {mode!r}")
    if mode != "ce" or dst.device != src.device or not dst.numel() or not dst.is_contiguous() \
            or not src.is_contiguous():
        return None
    from hpdl.offload.cecopy import BatchCopy

    idx = dst.device.index
    batch = BatchCopy([dst.data_ptr()], [src.data_ptr()], [dst.numel() * dst.element_size()])
    if idx not in _SIDE:  # made at registration: the first start's ready event must already reach it
        _SIDE[idx] = torch.cuda.Stream(dst.device, priority=-1)
    stream = _SIDE[idx]

    def fn():
        with torch.cuda.device(idx):
            batch.issue(stream.cuda_stream)
    return fn


def _copy_fn(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    """``dst.copy_(src)`` in dst's shape; its ``pair`` attribute is :func:`_copy_pair`'s (for batches)."""
    ce = _ce_copy(dst, src)
    if ce is not None:
        ce.pair = None
        return ce
    get = _reshaped(src, dst.shape)
    fn = lambda: dst.copy_(get())  # noqa: E731 - a function object that carries .pair
    fn.pair = _copy_pair(dst, src)
    return fn


def _copy_pair(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(dst, src viewed in dst's shape)`` when that view exists (no temporary): such copies of a batch go
    through one ``torch._foreach_copy_`` call, one release of the GIL for all of them; else None (CUDA copies too:
    they are asynchronous anyway, and one foreach call must not mix devices)."""
    if dst.is_cuda or src.is_cuda:
        return None
    if tuple(src.shape) == tuple(dst.shape):
        return dst, src
    try:
        return dst, src.view(dst.shape)
    except RuntimeError:
        return None


def _reduce_fn(dst: torch.Tensor, src: torch.Tensor, op: str) -> Callable[[], None]:
    get = _reshaped(src, dst.shape)
    if op == "sum":
        return lambda: dst.add_(get())
    if op == "prod":
        return lambda: dst.mul_(get())
    if op == "min":
        return lambda: torch.minimum(dst, get(), out=dst)
    return lambda: torch.maximum(dst, get(), out=dst)


class _Op:
    __slots__ = ("kind", "index", "name", "peer", "users", "src", "dst", "fn", "remote", "endpoint", "tag", "temp",
                 "match", "numel", "nbytes", "state")

    def describe(self) -> str:
        where = {"send": f" to rank {self.peer}", "recv": f" from rank {self.peer}"}.get(self.kind, "")
        return f"{self.name!r} ({self.kind}{where})"


class _Match:
    """The two halves of a message between ranks of one executor: fired (one copy) when both are ready."""

    __slots__ = ("send", "recv", "fn", "send_ready", "recv_ready", "gone")

    def __init__(self):
        self.send = self.recv = self.fn = None
        self.send_ready = self.recv_ready = False
        self.gone = ""  # who unregistered the other half, and why (for the error of the half left behind)


class Instance:
    """One rank's registered plan: views of its buffers, the DAG, and its mailbox slot.

    Args:
        plan: the rank's :class:`CompiledPlan`.
        tensors: buffer name -> tensor (contiguous, the registered shape and dtype).
        mailbox: the int64 array of a :class:`~hpdl.offload.shm.Mailboxes`; ``slot`` this request's row.
        transport: for messages to other endpoints (None if it has none).
        scope: plans of different scopes never match messages (e.g. one per in-process group).
        label: who this is, for errors ("rank 3").
    """

    def __init__(self, plan: CompiledPlan, tensors: dict[str, torch.Tensor], mailbox: np.ndarray, slot: int,
                 transport: Transport | None, scope, label: str):
        self.plan, self.mailbox, self.slot, self.transport, self.scope, self.label = \
            plan, mailbox, slot, transport, scope, label
        for b in plan.buffers:
            t = tensors.get(b.name)
            if t is None:
                raise OffloadError(f"{label}: buffer {b.name!r} of plan {plan.name!r} is not bound")
            if tuple(t.shape) != b.shape or str(t.dtype).removeprefix("torch.") != b.dtype or not t.is_contiguous():
                raise OffloadError(f"{label}: buffer {b.name!r} must be a contiguous {b.dtype} tensor of shape "
                                   f"{b.shape}, got {t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()}")
        self.tensors = tensors
        self.cuda = any(t.is_cuda for t in tensors.values())
        # every GPU whose streams carry copies into this rank's buffers: its own, and its peers' (a match copy
        # from another device); _finish synchronises all of them before DONE
        self.devices = {t.device.index for t in tensors.values() if t.is_cuda}
        # set by the application's side (api): an event it records on its stream at every start(); the executor
        # makes its copy streams wait for it (no host synchronisation in start())
        self.ready_event = None
        me = plan.endpoints[plan.rank]
        users: list[list[int]] = [[] for _ in plan.ops]
        for op in plan.ops:
            for d in op.deps:
                users[d].append(op.index)
        self.ops: list[_Op] = []
        for c in plan.ops:
            o = _Op()
            o.kind, o.index, o.name, o.peer = c.kind, c.index, c.name, c.peer
            o.users = tuple(users[c.index])
            o.src = tensors[c.src.buffer][c.src.slices()] if c.src is not None else None
            o.dst = tensors[c.dst.buffer][c.dst.slices()] if c.dst is not None else None
            view = o.src if o.src is not None else o.dst
            o.numel, o.nbytes = view.numel(), view.numel() * view.element_size()
            o.fn = _copy_fn(o.dst, o.src) if c.kind == "copy" else \
                _reduce_fn(o.dst, o.src, c.reduce_op) if c.kind == "reduce" else None
            o.remote = c.kind in ("send", "recv") and plan.endpoints[c.peer] != me
            o.endpoint = plan.endpoints[c.peer] if c.peer is not None else None
            o.tag, o.match, o.temp, o.state = c.wire_tag, None, None, ""
            if o.remote and o.numel:
                view = o.src if c.kind == "send" else o.dst
                if view.is_cuda or not view.is_contiguous():  # packed through a persistent host buffer
                    o.temp = torch.empty(o.numel, dtype=view.dtype, pin_memory=view.is_cuda)
            self.ops.append(o)
        self.ndeps = [len(c.deps) for c in plan.ops]
        self.counts = list(self.ndeps)
        self.gen = 0
        self.active = False
        self.left = 0
        self.error: str | None = None
        self.culprit: str | None = None
        self.dead_ranks: tuple[int, ...] = ()
        self.on_done: Callable[[], None] | None = None  # called by the dispatcher after DONE or FAILED

    def status(self) -> Status:
        return Status(self.error, self.culprit, tuple(self.pending()), self.dead_ranks)

    def pending(self) -> list[Pending]:
        """Operations of the running generation that are not done, with what each waits for."""
        if not self.active:
            return []
        out = []
        for o in self.ops:
            if o.state == "done":
                continue
            n = self.counts[o.index]
            what = (f"waits for {n} dependencies" if n else
                    f"in flight with {self.transport.describe(o.endpoint)}" if o.state == "remote" else
                    f"waits for rank {o.peer}'s matching half" if o.state == "match" else
                    "being copied" if o.state == "copying" else "ready")
            out.append(Pending(o.describe(), o.peer, what))
        return out


class _CountedPool:
    """The I/O thread pool, counting its tasks in the executor's ``_outstanding`` (``submit`` is called on the
    dispatcher; a task ends with the int 0 in the completion queue, after its own report)."""

    def __init__(self, pool: ThreadPoolExecutor, ex: "Executor"):
        self.pool, self.ex = pool, ex

    def submit(self, fn, *args):
        fut = self.pool.submit(self._run, fn, args)
        self.ex._outstanding += 1
        return fut

    def _run(self, fn, args) -> None:
        try:
            fn(*args)
        finally:
            self.ex._completions.append(0)
            self.ex._io_bell.ring()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=cancel_futures)


class Executor:
    """Progress engine: a dispatcher loop (:meth:`run` on a thread, or :meth:`progress` called by hand) plus
    I/O threads for transports.

    Args:
        bell: doorbell that starts ring (a pipe by default; an agent passes its FIFO).
        spin_us: after any activity keep polling without sleeping this long (lower wake-up latency on a core
            of its own), but only while no copy or transfer runs on another thread; afterwards sleep until a
            doorbell or ``idle_s``.
        io_threads: most transport calls in flight at once (each blocks a thread).
        copy_threads: threads for local copies and reductions of at least ``copy_min_bytes`` (an agent's
            cores; torch releases the GIL while it copies); 1 = all on the dispatcher.

    Copy threads and the GIL: a Python thread that finishes a copy must take the GIL back before it can
    report, and a thread holding the GIL in pure Python (a spinning dispatcher) gives it up only after the
    interpreter's switch interval (5 ms, ``sys.getswitchinterval()``). One task per copy, with the dispatcher
    spinning meanwhile, queued every 64 KiB copy behind the GIL: an 8-rank Alltoall of 64 KiB per peer took
    6.8 ms on the agent where Gloo takes 0.5 ms. So the large copies a dispatcher pass issues are staged and
    handed out at the end of the pass as at most ``copy_threads`` tasks of about equal bytes (at least
    ``4 * copy_min_bytes`` each where there is less); a task copies its plain copies with one
    ``torch._foreach_copy_`` (one GIL release for all) and reports once; and the dispatcher sleeps on its
    doorbells, GIL released, instead of spinning while any task is out. ``stats`` counts passes, wake-ups,
    tasks and copies (the offload tests bound them).
    """

    def __init__(self, *, bell: shm.Bell | None = None, spin_us: float = 50.0, idle_s: float = 0.01,
                 io_threads: int = 512, copy_threads: int = 1, copy_min_bytes: int = 65536,
                 name: str = "hpdl-offload"):
        self._own_bell = bell is None   # made here, so closed here (close())
        self.bell = bell or shm.Bell()
        self._io_bell = shm.Bell()
        self._bell_poll = None   # select.poll over both doorbells, made on first sleep()
        self.spin_s, self.idle_s, self.name = spin_us * 1e-6, idle_s, name
        self._io = _CountedPool(ThreadPoolExecutor(io_threads, thread_name_prefix=f"{name}-io"), self)
        self._copy = ThreadPoolExecutor(copy_threads, thread_name_prefix=f"{name}-copy") if copy_threads > 1 \
            else None
        self.copy_threads, self.copy_min_bytes = max(1, copy_threads), copy_min_bytes
        self.task_bytes = max(4 * copy_min_bytes, 1)  # fewest bytes worth a task of its own (see _hand_out)
        self._staged: list = []  # large copies of this pass: (pair, fn, ops, nbytes), handed out at its end
        self._outstanding = 0  # tasks on copy or I/O threads; each ends with an int in _completions
        self.stats = {"passes": 0, "passes_out": 0, "wakeups": 0, "copy_tasks": 0, "pooled_copies": 0,
                      "foreach_copies": 0, "inline_copies": 0}
        self._commands: deque = deque()
        self._completions: deque = deque()
        self._ready: deque = deque()
        self._boxes: dict[int, tuple[np.ndarray, np.ndarray, dict[int, Instance]]] = {}  # id(array) -> set
        self._matches: dict[tuple, _Match] = {}
        self._wire_keys: dict[tuple, list] = {}  # (transport, key mod 2**15) -> [(scope, key), name, count]
        self._thread: threading.Thread | None = None  # started by start_thread
        self._runner: threading.Thread | None = None  # whichever thread runs run(): owner of all plan state
        self._stop = threading.Event()
        self.heartbeat: Callable[[], None] | None = None

    # ---- called from any thread -------------------------------------------------------------------------
    def call(self, fn: Callable, *args, timeout: float = 60.0):
        """Run ``fn(*args)`` on the dispatcher (directly when no dispatcher thread runs) and return its result."""
        runner = self._runner
        if runner is None or threading.current_thread() is runner:
            return fn(*args)
        fut: Future = Future()
        self._commands.append((fn, args, fut))
        self._io_bell.ring()
        return fut.result(timeout=timeout)

    def register(self, inst: Instance) -> None:
        self.call(self._register, inst)

    def free(self, inst: Instance, reason: str = "") -> None:
        """Unregister ``inst``. Requests of other ranks that were waiting for one of its messages fail at once
        (``reason`` says why it went: its rank freed it, or its process left), instead of running into
        their timeouts."""
        self.call(self._free, inst, reason)

    def start_thread(self, timeout: float = 30.0) -> None:
        """Start the dispatcher thread and wait until it runs (a progress thread that hangs at start-up
        raises here instead of leaving requests that never start)."""
        if self._thread is not None:
            return
        started = threading.Event()
        t = threading.Thread(target=self.run, args=(started,), name=self.name, daemon=True)
        t.start()
        if not started.wait(timeout):
            raise OffloadError(f"{self.name}: the progress thread did not start within {timeout:.0f}s")
        self._thread = t

    def request_stop(self) -> None:
        """Ask the dispatcher loop to return (safe from any thread and from signal handlers)."""
        self._stop.set()
        self._io_bell.ring()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        self.request_stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        self._io.shutdown(wait=False, cancel_futures=True)
        if self._copy is not None:
            self._copy.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """:meth:`stop`, then close the doorbells this executor made (two pipes: without this every executor
        left four fds open). For an executor nobody rings any more; a dispatcher thread that did not end keeps
        them."""
        self.stop()
        if self._runner is not None and self._runner.is_alive():
            return
        self._bell_poll = None
        self._io_bell.close()
        if self._own_bell:
            self.bell.close()

    @property
    def running(self) -> bool:
        return self._runner is not None and self._runner.is_alive()

    # ---- the dispatcher ---------------------------------------------------------------------------------
    def run(self, started: threading.Event | None = None) -> None:
        """Dispatcher loop until :meth:`stop`: progress, spin briefly, then sleep on the doorbells."""
        self._runner = threading.current_thread()
        if started is not None:
            started.set()
        last_busy = time.monotonic()
        while not self._stop.is_set():
            try:
                busy = self.progress()
            except Exception:  # noqa: BLE001 - a bug here must not silently stop every request: log and go on
                log.exception("%s: dispatcher error", self.name)
                busy = True
            now = time.monotonic()
            if busy:
                last_busy = now
                continue
            if now - last_busy < self.spin_s and not self._outstanding:  # spinning holds the GIL: see above
                continue
            self.sleep(self.idle_s)
        self._runner = None
        while self._commands:  # nobody will run these any more
            _, _, fut = self._commands.popleft()
            fut.set_exception(OffloadError(f"{self.name} stopped"))

    def sleep(self, timeout: float) -> None:
        """Block (GIL released) until a doorbell rings (a start, a command, a finished copy or transfer task)
        or ``timeout`` seconds pass; for whoever drives :meth:`progress` by hand, between idle passes."""
        try:
            if self._bell_poll is None:   # poll, not select: select() refuses fds >= 1024 (a busy process has them)
                self._bell_poll = select.poll()
                for fd in (self.bell.fileno(), self._io_bell.fileno()):
                    self._bell_poll.register(fd, select.POLLIN)
            self._bell_poll.poll(max(0, math.ceil(timeout * 1000)))
        except (OSError, ValueError):
            time.sleep(timeout)
        self.stats["wakeups"] += 1
        self.bell.drain()
        self._io_bell.drain()

    @property
    def outstanding(self) -> int:
        """Copy and transfer tasks handed to other threads and not yet reported back."""
        return self._outstanding

    def progress(self) -> bool:
        """One pass: commands, completions, new starts, ready operations. Returns whether anything happened."""
        busy = False
        self.stats["passes"] += 1
        if self._outstanding:
            self.stats["passes_out"] += 1
        if self.heartbeat is not None:
            self.heartbeat()
        while self._commands:
            fn, args, fut = self._commands.popleft()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                fut.set_exception(exc)
            busy = True
        while self._completions:
            item = self._completions.popleft()
            busy = True
            if type(item) is int:  # a task of a copy or I/O thread has ended (its count of foreach copies)
                self._outstanding -= 1
                self.stats["foreach_copies"] += item
                continue
            inst, i, gen, err = item
            if inst.gen != gen or not inst.active:
                continue
            if err is not None:
                o = inst.ops[i]
                peer = f" talking to {inst.transport.describe(o.endpoint)}" if o.remote else ""
                why = inst.transport.explain(o.endpoint) if o.remote else None
                if why:  # the endpoint stopped because a rank of its node died: blame the rank, not the agent
                    inst.dead_ranks = (o.peer,)
                    err = f"{why}, and {inst.transport.describe(o.endpoint)} stopped with it ({err})"
                elif o.remote:
                    inst.culprit = inst.transport.describe(o.endpoint)
                self._fail(inst, f"{inst.label} plan {inst.plan.name!r} op {o.describe()} failed{peer}: {err}")
            else:
                self._complete(inst, i)
        for arr, seen, slots in self._boxes.values():
            started = np.flatnonzero(arr[:, shm.START] != seen)
            for s in started:
                s = int(s)
                inst = slots.get(s)
                gen = int(arr[s, shm.START])
                if inst is None:
                    seen[s] = gen
                    continue
                if inst.active:  # the previous generation still runs: take this one up when it is done
                    continue
                seen[s] = gen
                self._begin(inst, gen)
                busy = True
        ready = self._ready
        while ready:
            inst, i = ready.popleft()
            busy = True
            if inst.active:
                self._issue(inst, i)
        if self._staged:
            self._hand_out()
        return busy

    def _stage(self, pair, fn, ops, nbytes: int) -> None:
        self._staged.append((pair, fn, ops, nbytes))

    def _hand_out(self) -> None:
        """The pass's large copies as at most ``copy_threads`` tasks of about equal bytes (largest first onto
        the lightest task), and no more tasks than ``task_bytes`` chunks: waking a thread and handing it the GIL
        costs tens of microseconds, what one core copies of 256 KiB."""
        staged, self._staged = self._staged, []
        total = sum(it[3] for it in staged)
        n = max(1, min(self.copy_threads, len(staged), total // self.task_bytes))
        groups: list[list] = [[] for _ in range(n)]
        load = [0] * n
        for item in sorted(staged, key=lambda it: -it[3]):
            k = load.index(min(load))
            groups[k].append(item)
            load[k] += item[3]
        for g in groups:
            self._outstanding += 1
            try:
                self._copy.submit(self._run_batch, g)
            except RuntimeError:  # the pool is shut down (stopping): copy here rather than lose the operations
                self._run_batch(g)
            self.stats["copy_tasks"] += 1
            self.stats["pooled_copies"] += len(g)

    def _register(self, inst: Instance) -> None:
        key = id(inst.mailbox)
        if key not in self._boxes:
            self._boxes[key] = (inst.mailbox, inst.mailbox[:, shm.START].copy(), {})
        arr, seen, slots = self._boxes[key]
        if inst.slot in slots:
            raise OffloadError(f"{inst.label}: mailbox slot {inst.slot} is already registered")
        remote = any(o.remote for o in inst.ops)
        if remote:  # wire tags hold the key modulo 2**15: a live plan with a congruent key would share them
            from hpdl.offload.compiler import TAG_KEY_BITS

            wire = (id(inst.transport), inst.plan.key % (1 << TAG_KEY_BITS))
            other = self._wire_keys.get(wire)
            if other is not None and other[0] != (inst.scope, inst.plan.key):
                raise OffloadError(f"{inst.label}: plan {inst.plan.name!r} (key {inst.plan.key}) would share wire "
                                   f"tags with live plan {other[1]!r} (key {other[0][1]}): free it, or requests "
                                   "kept while 32768 others were compiled since")
            entry = self._wire_keys.setdefault(wire, [(inst.scope, inst.plan.key), inst.plan.name, 0])
            entry[2] += 1
        seen[inst.slot] = arr[inst.slot, shm.START]
        slots[inst.slot] = inst
        for o, c in zip(inst.ops, inst.plan.ops):
            if c.message is None or o.remote or not o.numel:
                continue
            m = self._matches.setdefault((inst.scope, inst.plan.key, c.message), _Match())
            setattr(m, c.kind, (inst, o.index))
            o.match = m
            if m.send is not None and m.recv is not None:
                (si, so), (ri, ro) = m.send, m.recv
                m.fn = _copy_fn(ri.ops[ro].dst, si.ops[so].src)
                ri.devices |= si.devices  # a copy from the sender's GPU lands in the receiver's buffer
                si.devices |= ri.devices

    def _free(self, inst: Instance, reason: str = "") -> None:
        arr, seen, slots = self._boxes.get(id(inst.mailbox), (None, None, {}))
        if slots.get(inst.slot) is not inst:
            return  # not registered (or freed already)
        del slots[inst.slot]
        if any(o.remote for o in inst.ops):
            from hpdl.offload.compiler import TAG_KEY_BITS

            wire = (id(inst.transport), inst.plan.key % (1 << TAG_KEY_BITS))
            entry = self._wire_keys.get(wire)
            if entry is not None and entry[0] == (inst.scope, inst.plan.key):
                entry[2] -= 1
                if entry[2] <= 0:
                    del self._wire_keys[wire]
        if not slots:
            self._boxes.pop(id(inst.mailbox), None)
        inst.active = False
        orphans = []
        for o, c in zip(inst.ops, inst.plan.ops):
            if o.match is None:
                continue
            k = (inst.scope, inst.plan.key, c.message)
            m = self._matches.get(k)
            if m is None:
                continue
            setattr(m, c.kind, None)
            m.fn = None
            m.send_ready = m.recv_ready = False
            other = m.recv if c.kind == "send" else m.send
            m.gone = f"{inst.label} {reason or 'freed its request'}"
            if other is not None:
                oi, oj = other
                if oi.active and oi.ops[oj].state == "match":  # its half waits for ours: it would never come
                    orphans.append((oi, oj))
            if m.send is None and m.recv is None:
                del self._matches[k]
        for oi, oj in orphans:
            if oi.active:
                po = oi.ops[oj]
                why = reason or "freed its request"
                self._fail(oi, f"{oi.label} plan {oi.plan.name!r} op {po.describe()} cannot complete: "
                               f"{inst.label} {why} while this request waited for that message")

    def _begin(self, inst: Instance, gen: int) -> None:
        if inst.error is not None:
            return
        inst.gen, inst.active, inst.left = gen, True, len(inst.ops)
        inst.counts = list(inst.ndeps)
        mb = inst.mailbox[inst.slot]
        mb[shm.T_PICKED] = time.monotonic_ns()
        mb[shm.PICKED] = gen
        if inst.ready_event is not None:  # copies of this start wait (on the GPU) for what the application queued
            for d in inst.devices:
                torch.cuda.current_stream(d).wait_event(inst.ready_event)
                if d in _SIDE:
                    _SIDE[d].wait_event(inst.ready_event)
        for o in inst.ops:
            o.state = ""
        if not inst.ops:
            self._finish(inst)
            return
        for i, n in enumerate(inst.ndeps):
            if n == 0:
                self._ready.append((inst, i))

    def _issue(self, inst: Instance, i: int) -> None:
        o = inst.ops[i]
        try:
            if o.fn is not None:
                if self._copy is not None and o.nbytes >= self.copy_min_bytes:
                    o.state = "copying"
                    self._stage(getattr(o.fn, "pair", None), o.fn, ((inst, i, inst.gen),), o.nbytes)
                else:
                    o.fn()
                    self.stats["inline_copies"] += 1
                    self._complete(inst, i)
            elif not o.numel:
                self._complete(inst, i)
            elif o.remote:
                o.state = "remote"
                self._post(inst, i)
            else:
                self._half_ready(inst, o)
        except Exception as exc:  # noqa: BLE001 - a failed copy or post fails this request, not the executor
            peer = ""
            if o.remote:  # posting failed at once: the connection to that endpoint is already gone
                inst.culprit = inst.transport.describe(o.endpoint)
                peer = f" talking to {inst.culprit}"
            self._fail(inst, f"{inst.label} plan {inst.plan.name!r} op {o.describe()} failed{peer}: "
                             f"{type(exc).__name__}: {exc}")

    def _half_ready(self, inst: Instance, o: _Op) -> None:
        m = o.match
        if (m.recv if o.kind == "send" else m.send) is None:  # every half registers before any start
            raise OffloadError(f"cannot complete: {m.gone or 'the request of the matching half is not registered'} "
                               "(its half of this message will never come)")
        o.state = "match"
        if o.kind == "send":
            m.send_ready = True
        else:
            m.recv_ready = True
        if not (m.send_ready and m.recv_ready):
            return
        m.send_ready = m.recv_ready = False
        if m.fn is None:
            raise OffloadError(f"the other half of message {o.describe()} is no longer registered (freed?)")
        (si, so), (ri, ro) = m.send, m.recv
        if self._copy is not None and o.nbytes >= self.copy_min_bytes:
            si.ops[so].state = ri.ops[ro].state = "copying"
            self._stage(m.fn.pair, m.fn, ((si, so, si.gen), (ri, ro, ri.gen)), o.nbytes)
            return
        m.fn()
        self.stats["inline_copies"] += 1
        self._complete(si, so)
        self._complete(ri, ro)

    def _run_batch(self, group) -> None:
        """Copy thread: one task of local copies and reductions, then all their completions and one ring.

        Plain copies go through one ``torch._foreach_copy_`` (the GIL released once for all of them; torch's
        CPU version copies them one after another); if it fails, each copy is redone alone so that the error
        names its operation (a copy is idempotent). Reductions and copies whose source needs a reshape run
        one by one.
        """
        errs: list[str | None] = [None] * len(group)
        done_foreach = 0
        plain = [j for j, (pair, _, _, _) in enumerate(group) if pair is not None]
        rest = [j for j, (pair, _, _, _) in enumerate(group) if pair is None]
        if len(plain) > 1:
            try:
                torch._foreach_copy_([group[j][0][0] for j in plain], [group[j][0][1] for j in plain])
                done_foreach = len(plain)
            except Exception:  # noqa: BLE001 - redone one by one below, which names the failing operation
                rest = plain + rest
        else:
            rest = plain + rest
        for j in rest:
            try:
                group[j][1]()
            except BaseException as exc:  # noqa: BLE001 - reported through the completion queue
                errs[j] = f"{type(exc).__name__}: {exc}"
        for (_, _, ops, _), err in zip(group, errs):
            for inst, i, gen in ops:
                self._completions.append((inst, i, gen, err))
        self._completions.append(done_foreach)
        self._io_bell.ring()

    def _post(self, inst: Instance, i: int) -> None:
        """Dispatcher: post one message to or from another endpoint (packing a send through ``temp``), and
        hand its wait to an I/O thread."""
        o = inst.ops[i]
        if o.kind == "send":
            if o.temp is not None:
                o.temp.view(o.src.shape).copy_(o.src)
            work = inst.transport.isend(o.temp if o.temp is not None else o.src, o.endpoint, o.tag)
        else:
            work = inst.transport.irecv(o.temp if o.temp is not None else o.dst, o.endpoint, o.tag)
        self._io.submit(self._transfer, inst, i, inst.gen, work)

    def _transfer(self, inst: Instance, i: int, gen: int, work) -> None:
        """I/O thread: wait for one posted message (and unpack a receive through ``temp``)."""
        o = inst.ops[i]
        err = None
        try:
            work.wait()
            if o.kind == "recv" and o.temp is not None:
                o.dst.copy_(o.temp.view(o.dst.shape))
                if o.dst.is_cuda:
                    torch.cuda.current_stream(o.dst.device).synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported through the completion queue
            err = f"{type(exc).__name__}: {exc}"
        self._completions.append((inst, i, gen, err))
        self._io_bell.ring()

    def _complete(self, inst: Instance, i: int) -> None:
        if not inst.active:  # failed or freed meanwhile
            return
        o = inst.ops[i]
        o.state = "done"
        inst.left -= 1
        counts = inst.counts
        for u in o.users:
            counts[u] -= 1
            if counts[u] == 0:
                self._ready.append((inst, u))
        if inst.left == 0:
            self._finish(inst)

    def _finish(self, inst: Instance) -> None:
        for d in sorted(inst.devices):  # each GPU the copies ran on, not only this thread's current device
            torch.cuda.synchronize(d)
        inst.active = False
        mb = inst.mailbox[inst.slot]
        mb[shm.T_DONE] = time.monotonic_ns()
        mb[shm.DONE] = inst.gen
        native.signal(inst.mailbox, inst.slot)  # wake the rank blocked on its futex
        if inst.on_done is not None:
            inst.on_done()

    def _fail(self, inst: Instance, msg: str) -> None:
        log.warning("%s", msg)
        inst.error = msg
        inst.active = False
        inst.mailbox[inst.slot][shm.FAILED] = inst.gen
        native.signal(inst.mailbox, inst.slot)
        if inst.on_done is not None:
            inst.on_done()

    def find(self, mailbox_key: int, slot: int) -> Instance | None:
        box = self._boxes.get(mailbox_key)
        return box[2].get(slot) if box else None
