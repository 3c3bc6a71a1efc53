"""``compile`` and the persistent request: MPI's persistent-request model over hpdl's executors.

    req = hpdl.offload.compile(plan, buffers={"u": u})   # collective, like MPI_Alltoall_init
    for step in range(n):
        req.start()                                     # MPI_Start: returns at once
        compute()                                       # progress happens meanwhile, without test()
        req.wait()                                      # MPI_Wait
    req.free()                                          # MPI_Request_free

``progress`` picks who executes started plans: ``"agent"`` (the node's progress agent, see
:class:`hpdl.offload.Agent`), ``"thread"`` (an in-process progress thread: the fallback when no agent runs),
or ``"auto"`` (``HPDL_OFFLOAD_PROGRESS``; agent when one is connected, else thread).
"""

from __future__ import annotations

import math
import os
import threading
import time
from datetime import timedelta
from typing import Sequence

import numpy as np
import torch

from hpdl.comm.transport.gloo import GlooTransport
from hpdl.offload import client as client_mod
from hpdl.offload import native
from hpdl.offload import control as P
from hpdl.offload import shm
from hpdl.offload.compiler import CompiledPlan, check_plan, compile_group
from hpdl.offload.errors import AgentError, OffloadError, OffloadPeerError, OffloadTimeoutError, PlanError
from hpdl.offload.executor import Executor, Instance, Status
from hpdl.offload.plan import BufferSpec, Plan, PlanData, torch_dtype
from hpdl.runtime import env

PROGRESS = ("auto", "agent", "thread", "graph")


class _ThreadBackend:
    """The in-process fallback: one progress thread per process, a private Gloo group per application group."""

    kind = "thread"
    _executor: Executor | None = None
    _mailboxes: shm.Mailboxes | None = None
    _lock = threading.Lock()
    _groups: dict = {}

    def __init__(self, group, rank: int, world: int, timeout: float):
        cls = type(self)
        with cls._lock:
            if cls._executor is None:
                ex = Executor(spin_us=float(env.get("HPDL_OFFLOAD_SPIN_US")), name=f"hpdl-offload-{os.getpid()}")
                ex.start_thread()
                cls._executor, cls._mailboxes = ex, shm.Mailboxes(1024, shared=False)
        key = "world" if group is None else group
        if key not in cls._groups:  # collective over the group, the first time it compiles a plan
            cls._groups[key] = [_private_gloo(group, rank, world, timeout) if world > 1 else None, 0]
        self.state = cls._groups[key]
        self.transport = self.state[0]
        self.endpoint = rank
        self.executor = cls._executor
        self.mailboxes = cls._mailboxes
        self.rank = rank

    def new_key(self) -> int:
        self.state[1] += 1  # compile is collective on the group: the counter moves in step on every rank
        return self.state[1]

    def register(self, plan: CompiledPlan, tensors: dict, slot: int, done: threading.Event, event=None,
                 native: bool = False):
        inst = Instance(plan, tensors, self.mailboxes.array, slot, self.transport, id(self.state), f"rank {self.rank}")
        inst.on_done = done.set
        inst.ready_event = event
        self.executor.register(inst)
        return inst

    def ring(self, handle=None) -> None:
        self.executor.bell.ring()

    def free(self, inst, slot: int) -> None:
        self.executor.free(inst)
        self.mailboxes.give_back(slot)

    def query(self, inst) -> Status:
        return self.executor.call(inst.status, timeout=5.0)

    def check(self, what: str) -> None:
        if not self.executor.running:
            raise OffloadError(f"the in-process progress thread is not running ({what})")

    def describe(self) -> str:
        return "the in-process progress thread"

    closed = False


def _private_gloo(group, rank: int, world: int, timeout: float) -> GlooTransport:
    """A Gloo group of the group's ranks on a store of its own (hosted by group rank 0): made without
    new_group, so ranks outside the group take no part and the application's groups are not touched."""
    import socket

    import torch.distributed as dist

    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    addr = "127.0.0.1" if all(h == hosts[0] for h in hosts) else hosts[0]
    # group rank 0 listens on a port the OS picks and then names it: a port found free and bound later could be
    # taken in between (EADDRINUSE seen in CI with many jobs on one host)
    store = dist.TCPStore(addr, 0, world, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else None]
    dist.broadcast_object_list(port, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if store is None:
        store = dist.TCPStore(addr, port[0], world, is_master=False, timeout=timedelta(seconds=timeout))
    t = GlooTransport.create(store, rank, world, timeout, prefix="hpdl-offload")
    t.store = store  # group rank 0 hosts it: keep it alive with the transport
    return t


class _AgentBackend:
    kind = "agent"

    def __init__(self, client: client_mod.AgentClient):
        self.client = client
        self.endpoint = client.agent
        self.mailboxes = client.mailboxes
        self.native: set[int] = set()  # slots the agent runs on its native executor

    def new_key(self) -> int:
        return int(self.client.request(P.NewKey()))

    def register(self, plan: CompiledPlan, tensors: dict, slot: int, done, event=None, native: bool = True):
        """``native``: the agent may run it on its native executor (every rank's plan of the group can go there:
        halves of one message must meet in one executor)."""
        handles = {}
        for name, t in tensors.items():
            handles[name] = t if t.is_cuda else shm.handle_of(t)
        ready = None
        if event is not None:
            dev = next(t.device.index for t in tensors.values() if t.is_cuda)
            with torch.cuda.device(dev):  # the event is created on the buffers' GPU
                ready = (dev, event.ipc_handle())
        if self.client.request(P.Register(slot, plan, handles, ready, native)) == "native":
            self.native.add(slot)
        return slot

    def ring(self, handle=None) -> None:
        if handle in self.native:
            self.client.ring_native()
        else:
            self.client.bell.ring()

    def free(self, inst, slot: int) -> None:
        self.native.discard(slot)
        try:
            self.client.request(P.Free(slot))
        finally:
            self.mailboxes.give_back(slot)

    def query(self, inst) -> Status:
        st = self.client.request(P.Query(inst), timeout=5.0)
        return st if st is not None else Status("the agent does not know this request", None, ())

    @property
    def closed(self) -> bool:
        return self.client.closed

    def check(self, what: str) -> None:
        if not self.client.alive():
            how = "was stopped" if self.client.closed else "died"
            raise AgentError(f"{self.client.desc} {how} ({what})", agent=self.client.desc)

    def describe(self) -> str:
        return self.client.desc


def _gather(value, group) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


_ARRIVALS: dict[str, int] = {}  # group name -> compiles this process entered on it (collective: in step)


def _await_arrivals(group, rank: int, world: int, timeout: float) -> None:
    """Wait until every rank of ``group`` has entered this compile, through the job's key-value store, for at
    most ``timeout`` seconds: a rank that never calls compile() is named (``missing_ranks``) instead of
    leaving the others in the gathers below for the process group's own (long) timeout.

    Without a store (an MPI launch) it returns at once. Raises:
        OffloadTimeoutError: ranks that did not arrive in time (the group's compiles are then out of step).
    """
    import torch.distributed as dist

    if world <= 1:
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        name = (group if group is not None else dist.group.WORLD).group_name
    except Exception:  # noqa: BLE001 - no store or no group name: the gathers' own timeout applies
        return
    n = _ARRIVALS.get(name, 0) + 1
    _ARRIVALS[name] = n
    prefix = f"hpdl/offload/arrive/{name}/{n}/"
    keys = [prefix + str(q) for q in range(world)]
    store.set(keys[rank], b"1")
    try:
        store.wait(keys, timedelta(seconds=timeout))
        return
    except Exception:  # noqa: BLE001 - torch raises a DistStoreError/RuntimeError on a timeout
        pass
    missing = [q for q in range(world) if not store.check([keys[q]])]
    if not missing:
        return
    raise OffloadTimeoutError(f"compile on rank {rank}: rank(s) {missing} of the group did not call compile() "
                              f"within {timeout:.1f}s (every rank of the group compiles the plan together)",
                              missing_ranks=missing)


def _check_timeout(timeout) -> tuple[float | None, str | None]:
    """``(seconds or None, error)``: None is ``HPDL_TIMEOUT``; a timedelta is taken in seconds. A timeout of
    zero or less made every ``wait()`` raise OffloadTimeoutError at once (the request could never be waited)."""
    if timeout is None:
        return None, None
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        return None, f"timeout must be a finite number of seconds > 0 (or a timedelta), got {timeout!r}"
    return float(timeout), None


def _bind(specs: Sequence[BufferSpec], buffers: dict | None, mode: str) -> dict[str, torch.Tensor]:
    """Tensors for every registered buffer: the caller's (checked, viewed to the registered shape) or new ones
    (in shared memory for a CPU agent; on the caller's device otherwise)."""
    buffers = dict(buffers or {})
    names = {s.name for s in specs}
    extra = sorted(set(buffers) - names)
    if extra:
        raise PlanError(f"buffers= binds {extra}, which the plan does not register (it registers {sorted(names)})")
    device = next((t.device for t in buffers.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))
    out = {}
    for s in specs:
        t = buffers.get(s.name)
        if t is None:
            if mode == "agent" and device.type == "cpu":
                t = shm.zeros(s.shape, s.dtype)
            else:
                t = torch.zeros(s.shape, dtype=torch_dtype(s.dtype), device=device)
        else:
            if not isinstance(t, torch.Tensor):
                raise PlanError(f"buffer {s.name!r}: expected a torch.Tensor, got {type(t).__name__}")
            if t.layout != torch.strided:
                raise PlanError(f"buffer {s.name!r} must be a dense (strided) tensor, got layout={t.layout}")
            if str(t.dtype).removeprefix("torch.") != s.dtype:
                raise PlanError(f"buffer {s.name!r} is registered as {s.dtype} but bound to a {t.dtype} tensor")
            if t.numel() != s.numel or not t.is_contiguous():
                raise PlanError(f"buffer {s.name!r} is registered with shape {s.shape} but bound to a tensor of "
                                f"shape {tuple(t.shape)} (contiguous={t.is_contiguous()}); bind a contiguous tensor "
                                f"of {s.numel} elements")
            if t.device.type not in ("cpu", "cuda"):  # a meta tensor has no bytes: gloo sent from address 0
                raise PlanError(f"buffer {s.name!r} is on {t.device}; bind CPU or CUDA tensors")
            if t.device != device:
                raise PlanError(f"buffer {s.name!r} is on {t.device}, the others on {device}")
            if mode == "agent" and t.device.type == "cpu" and shm.handle_of(t) is None:
                raise PlanError(f"buffer {s.name!r} is a CPU tensor outside shared memory, which the agent cannot "
                                f"read in place: allocate it with hpdl.offload.empty({s.shape}, torch.{s.dtype}) "
                                "(or use progress='thread')")
            t = t.detach().view(s.shape)  # same storage; autograd must not track the executor's writes
        out[s.name] = t
    return out


def _resolve_progress(progress: str | None) -> tuple[str, client_mod.AgentClient | None]:
    mode = (progress or env.get("HPDL_OFFLOAD_PROGRESS")).strip().lower()
    if mode not in PROGRESS:  # progress=None came from the environment: name the variable that holds it
        raise PlanError(f"progress must be one of {PROGRESS}, got {progress!r}" if progress is not None else
                        f"HPDL_OFFLOAD_PROGRESS must be one of {PROGRESS}, got {mode!r}")
    if mode == "graph":  # the GPU's copy engines, driven by the ranks themselves (hpdl.offload.graph)
        return "graph", None
    c = client_mod.current() if mode in ("auto", "agent") else None
    if mode == "agent" and c is None:
        raise AgentError("progress='agent' but this process has no agent: start one with hpdl.offload.Agent(...) "
                         "or `hpdl offload agent` and set HPDL_OFFLOAD_AGENT")
    return ("agent" if c is not None else "thread"), c


def compile(plan: Plan | PlanData, buffers: dict[str, torch.Tensor] | None = None, *, group=None,
            progress: str | None = None, timeout: float | None = None) -> "PersistentRequest":
    """Validate ``plan`` on every rank of ``group`` and return a :class:`PersistentRequest` for it.

    Collective: every rank of ``group`` calls it with its own part of the same plan (same name), as with
    ``MPI_Alltoall_init``. Nothing is sent or written before every rank's plan has passed validation, and an
    error found on one rank is raised on every rank (naming that rank), so no rank is left waiting.

    Args:
        plan: this rank's :class:`~hpdl.offload.plan.Plan` (or its ``data()``); ranks are group ranks.
        buffers: registered buffer name -> tensor (contiguous, the registered dtype and number of elements;
            viewed to the registered shape). Buffers left out are allocated (zeroed; in shared memory for a
            CPU agent) and exposed as ``request.buffers``. For an agent, CPU tensors must come from
            :func:`hpdl.offload.empty` so that it can read and write them in place. Tensors that require
            grad are bound detached (the executor writes their storage, autograd does not see it).
        group: process group (None = world).
        progress: "agent", "thread" or "auto" (default ``HPDL_OFFLOAD_PROGRESS``).
        timeout: default seconds for ``wait()`` (default ``HPDL_TIMEOUT``).

    Raises:
        PlanError: on every rank, naming the rank and operation: anything
            :func:`~hpdl.offload.compiler.compile_group` rejects (cycles, unmatched or mismatched send/recv,
            out-of-range boxes, deadlocks), a bad buffer binding, a bad ``progress``, or a ``timeout`` that is
            not a finite number of seconds > 0.
        AgentError: ``progress='agent'`` without an agent, an agent that died, or one that refused the
            registration.
        OffloadError: no request mailbox left on some rank (free requests you no longer need).
        ValueError: this process is not a member of ``group``.
    """
    return _compile(plan, buffers, group, progress, timeout, None)


def _compile(plan, buffers, group, progress, timeout, pre_error: str | None) -> "PersistentRequest":
    """compile(); ``pre_error`` is a problem a wrapper found on this rank before the plan existed (raised on
    every rank, as a PlanError naming this one)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call hpdl.runtime.init_from_env() or "
                           "torch.distributed.init_process_group() first")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:  # not a member: the others' collective does not include us, so raising alone is safe
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the group passed to compile()")
    error = pre_error
    data = None
    timeout, timeout_error = _check_timeout(timeout)
    error = error or timeout_error
    if error is None:
        data = plan.data() if isinstance(plan, Plan) else plan
        if not isinstance(data, PlanData):
            error = f"plan must be a hpdl.offload.Plan, got {type(plan).__name__}"
    agent_error = None
    try:
        mode, client = _resolve_progress(progress)
        if client is not None and not client.alive():
            raise AgentError(f"{client.desc} is not running (it died or was stopped)", agent=client.desc)
    except AgentError as exc:
        mode, client, agent_error = "error", None, f"rank {rank}: {exc}"
    except ValueError as exc:
        mode, client = "error", None
        error = error or str(exc)
    _await_arrivals(group, rank, world, float(env.get("HPDL_TIMEOUT") if timeout is None else timeout))
    # before any backend work: every rank learns every rank's early problem, and ranks agree on who executes
    modes = _gather((mode, agent_error, error), group)
    for q, (_, _, e) in enumerate(modes):
        if e:
            raise PlanError(f"rank {q}: {e}", rank=q)
    if any(a for _, a, _ in modes):
        raise AgentError(next(a for _, a, _ in modes if a))
    if len({m for m, _, _ in modes}) > 1:
        raise PlanError("ranks resolved progress differently: " + ", ".join(
            f"rank {q} {m}" for q, (m, _, _) in enumerate(modes)) + " (start the Agent on every rank of the group)")
    tensors = None
    try:
        check_plan(data, world, rank)
        tensors = _bind(data.buffers, buffers, mode)
    except PlanError as exc:
        error = exc
    wait_s = float(env.get("HPDL_TIMEOUT") if timeout is None else timeout)
    # the private transport outlives this plan: its set-up gets the job's timeout, not this request's
    setup_s = max(wait_s, float(env.get("HPDL_TIMEOUT")))
    if mode == "graph":
        backend = None
    else:
        backend = _AgentBackend(client) if mode == "agent" else _ThreadBackend(group, rank, world, setup_s)
    key = 0 if mode == "graph" else None
    if mode != "graph" and (rank == 0 or mode == "thread"):
        try:
            key = backend.new_key()
        except OffloadError as exc:  # e.g. the agent went away: every rank must hear of it
            error = error or OffloadError(str(exc))
    cpu = tensors is not None and all(t.device.type == "cpu" for t in tensors.values())
    infos = _gather({"data": data, "endpoint": backend.endpoint if backend is not None else 0, "key": key,
                     "cpu": cpu, "error": None if error is None else (str(error), getattr(error, "op", None),
                                                          type(error).__name__)}, group)
    for q, info in enumerate(infos):
        if info["error"] is not None:
            msg, op, kind = info["error"]
            msg = msg if msg.startswith("rank ") else f"rank {q}: {msg}"
            if kind == "PlanError":
                raise PlanError(msg, op=op, rank=q)
            raise AgentError(msg) if mode == "agent" else OffloadError(msg)
    if mode == "graph":
        from hpdl.offload.graph import GraphRequest

        every = compile_group([i["data"] for i in infos], 0, [0] * len(infos))
        return GraphRequest(every, rank, tensors, group, wait_s)
    every = compile_group([i["data"] for i in infos], infos[0]["key"], [i["endpoint"] for i in infos])
    compiled = every[rank]
    # the agent's native executor only if it can take every rank's plan: the two halves of a message meet in
    # one executor (a plan with a float16 reduction on one rank only ran that rank on the Python executor
    # and its peers on the native one, and their messages never matched)
    native_ok = all(i["cpu"] for i in infos) and all(native.eligible(c, {}) is None for c in every)
    done = threading.Event()
    error, handle, slot = None, None, None
    cuda = next((t.device for t in tensors.values() if t.is_cuda), None) if tensors else None
    # start() records it on the application's stream; the executor's copies wait for it on the GPU
    event = torch.cuda.Event(interprocess=mode == "agent") if cuda is not None else None
    try:
        slot = backend.mailboxes.take()
        handle = backend.register(compiled, tensors, slot, done, event, native=native_ok)
    except (OffloadError, ValueError) as exc:
        error = f"rank {rank}: {exc}"
    errors = [e for e in _gather(error, group) if e]
    if errors:
        if handle is not None:
            backend.free(handle, slot)
        elif slot is not None:
            backend.mailboxes.give_back(slot)
        raise OffloadError(f"registering plan {data.name!r} failed: " + "; ".join(errors))
    req = PersistentRequest(compiled, tensors, backend, handle, slot, done, timeout)
    req._event = event
    return req


class PersistentRequest:
    """A compiled plan that can be started many times: MPI's persistent request (``MPI_Start``,
    ``MPI_Test``, ``MPI_Wait``, ``MPI_Request_free``; mpi4py's ``Prequest``).

    Between ``start()`` and the ``wait()``/``test()`` that reports completion the request is *active*: the
    plan's executor (agent or progress thread) reads its send boxes and writes its receive boxes; the
    application must not write the former or touch the latter meanwhile. Several requests may be active at
    once. Progress does not depend on calling ``test()``.

    Attributes:
        buffers: registered buffer name -> tensor (the bound and the allocated ones).
        plan: the rank's :class:`~hpdl.offload.compiler.CompiledPlan`.
        progress: "agent" or "thread".
        executor: which executor runs it: "native" (the agent's C executor), "agent" (the agent's Python
            executor: plans spanning nodes, CUDA buffers, or no native executor) or "thread".
    """

    def __init__(self, plan: CompiledPlan, buffers, backend, handle, slot: int, done: threading.Event,
                 timeout: float | None):
        self.plan, self.buffers, self._backend, self._handle, self._slot = plan, buffers, backend, handle, slot
        self._mb = backend.mailboxes.array[slot]
        self._done = done
        self._gen = 0
        self.active = False
        self.freed = False
        self._failed: str | None = None
        self._timed_out = False  # the running start passed its timeout: free() may cancel it
        self._cuda = next((t.device for t in buffers.values() if t.is_cuda), None)
        self._event = None  # set by compile for CUDA buffers
        self.timeout = float(env.get("HPDL_TIMEOUT") if timeout is None else timeout)
        self.progress = backend.kind
        self._t_start = self._next_check = 0.0
        self._start_lock = threading.Lock()  # start/free from two threads: one at a time (one start wins)

    def __repr__(self) -> str:
        state = "freed" if self.freed else "active" if self.active else "inactive"
        return f"PersistentRequest({self.plan.name!r}, rank {self.plan.rank}, {self.progress}, {state})"

    def start(self) -> None:
        """Start the plan (``MPI_Start``): returns at once; the executor takes it up without further calls.

        Raises:
            OffloadError: the request is active (wait first), freed, or failed earlier.
        """
        with self._start_lock:
            self._start()

    def _start(self) -> None:
        if self.freed:
            raise OffloadError(f"plan {self.plan.name!r}: start() of a freed request")
        if self.active:
            raise OffloadError(f"plan {self.plan.name!r}: start() of an active request: wait() for it first")
        if self._failed:
            raise OffloadError(f"plan {self.plan.name!r} failed earlier and cannot restart: {self._failed}")
        if self._cuda is not None:  # the executor's copies wait on the GPU for what this stream queued so far
            if self._event is None:
                torch.cuda.current_stream(self._cuda).synchronize()
            else:
                self._event.record(torch.cuda.current_stream(self._cuda))
        if self._backend.closed:
            raise OffloadError(f"plan {self.plan.name!r}: start() after {self._backend.describe()} was stopped "
                               "(compile the plan again under a running agent)")
        self._gen += 1
        self._timed_out = False
        self._done.clear()
        self.active = True
        self._t_start = time.monotonic()
        self._next_check = self._t_start + 0.01
        self._mb[shm.START] = self._gen
        self._backend.ring(self._handle)

    def test(self) -> bool:
        """True when the last start has completed (and for an inactive request), like ``MPI_Test``. Reads
        the mailbox; it never enters the progress engine. Every 10 ms of polling it also checks that the
        executor lives, and once the request has run for longer than its timeout it raises, so that a
        ``while not req.test(): ...`` loop cannot spin forever on a dead agent or peer.

        Raises:
            OffloadError: the plan failed (the message names the operation and peer).
            AgentError: the agent died (named).
            OffloadTimeoutError: not done ``timeout`` seconds after ``start()``, naming the missing ranks.
        """
        if self._poll():
            return True
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + 0.01
            self._backend.check(f"while rank {self.plan.rank} tested plan {self.plan.name!r}")
            if now - self._t_start > self.timeout:
                self._raise_timeout(self.timeout, "after start()")
        return False

    def _poll(self) -> bool:
        if not self.active:
            return True
        if self._mb[shm.DONE] == self._gen:
            self.active = False
            return True
        if self._mb[shm.FAILED] == self._gen:
            self._raise_failed()
        return False

    def wait(self, timeout: float | None = None) -> None:
        """Block until the last start has completed (``MPI_Wait``).

        Raises:
            OffloadTimeoutError: not done within ``timeout`` (default: the request's); lists the outstanding
                operations and the peers they wait for.
            AgentError: the agent died meanwhile (noticed within milliseconds), naming it.
            OffloadError: the plan failed.
        """
        if self._poll():
            return
        timeout = self.timeout if timeout is None else timeout
        t0 = time.monotonic()
        deadline, next_check, spins = t0 + timeout, t0 + 0.01, 0
        threaded = self._backend.kind == "thread"
        futex = not threaded and native.futex_ok()
        seq_words = self._backend.mailboxes.array.view(np.uint32)
        seq_addr = native.seq_address(self._backend.mailboxes.array, self._slot)
        while True:
            seq = int(seq_words[self._slot, 2 * native.SEQ])  # read before DONE: a later bump wakes the futex
            if self._poll():
                return
            now = time.monotonic()
            if threaded:  # the GIL: sleep on the completion event instead of spinning against the thread
                self._done.wait(min(0.01, max(deadline - now, 0)))
            elif futex:  # block (GIL released, no core burnt) until the executor bumps the word, <= 10 ms
                native.futex_wait(seq_addr, seq, min(0.01, max(deadline - now, 0.0)))
            else:
                spins += 1
                if spins > 20000:
                    time.sleep(0.0002 if now - t0 < 0.1 else 0.002)
                elif spins > 2000:
                    os.sched_yield()
            if now >= next_check:
                next_check = now + 0.01
                self._backend.check(f"while rank {self.plan.rank} waited for plan {self.plan.name!r}")
            if now > deadline:
                self._raise_timeout(timeout)

    def _raise_failed(self) -> None:
        self.active = False
        try:
            st = self._backend.query(self._handle)
            err, culprit, dead = st.error or "unknown error", st.culprit, list(st.dead_ranks)
        except OffloadError as exc:
            err, culprit, dead = f"(its error could not be read: {exc})", None, []
        self._failed = err
        msg = f"plan {self.plan.name!r} failed on rank {self.plan.rank}: {err}"
        if dead:  # a rank's process died (its agent stopped with it): the rank is to blame
            raise OffloadPeerError(msg, missing_ranks=dead)
        if self._backend.kind == "agent" and culprit:  # the agents' network failed: name the agent to blame
            raise AgentError(msg, agent=culprit)
        raise OffloadError(msg)

    def _raise_timeout(self, timeout: float, when: str = "") -> None:
        try:
            pending = self._backend.query(self._handle).pending
        except OffloadError as exc:
            pending = ()
            note = f" ({exc})"
        else:
            note = ""
        self._timed_out = True
        peers = sorted({p.peer for p in pending if p.peer is not None})
        picked = "" if self._mb[shm.PICKED] == self._gen else " The executor never took this start up."
        listing = "; ".join(str(p) for p in pending[:8]) + (f"; ... {len(pending) - 8} more" if len(pending) > 8
                                                            else "")
        raise OffloadTimeoutError(
            f"plan {self.plan.name!r} on rank {self.plan.rank} not done {timeout:.1f}s {when or 'into wait()'} "
            f"({self._backend.describe()}); waiting for ranks {peers}: {listing or 'nothing listed'}{note}.{picked}",
            missing_ranks=peers)

    @property
    def picked_at(self) -> float:
        """CLOCK_MONOTONIC seconds when the executor took the last start up (0 if not yet)."""
        return int(self._mb[shm.T_PICKED]) / 1e9 if self._mb[shm.PICKED] == self._gen else 0.0

    @property
    def executor(self) -> str:
        """``"native"``, ``"agent"`` (the agent's Python executor) or ``"thread"``: decided at compile time."""
        if self._backend.kind == "agent" and self._handle in self._backend.native:
            return "native"
        return self._backend.kind

    @property
    def done_at(self) -> float:
        """CLOCK_MONOTONIC seconds when the executor finished the last start (0 if not yet)."""
        return int(self._mb[shm.T_DONE]) / 1e9 if self._mb[shm.DONE] == self._gen else 0.0

    def free(self) -> None:
        """Release the request (``MPI_Request_free``); allocated buffers go when no tensor refers to them.

        After an :class:`OffloadTimeoutError` the running start may be cancelled by freeing: the executor drops
        its outstanding operations, and the ranks whose messages it would have exchanged fail with an error
        naming this rank (their requests cannot complete any more). Copies already under way may still land
        in this request's receive buffers.

        Raises:
            OffloadError: the request is active and has not timed out (wait for it first).
        """
        with self._start_lock:  # not between another thread's checks in start() and its ring
            self._free()

    def _free(self) -> None:
        if self.freed:
            return
        if self.active and not self._timed_out and not self._poll():
            raise OffloadError(f"plan {self.plan.name!r}: free() of an active request: wait() for it first "
                               "(a request whose wait() or test() raised OffloadTimeoutError may be freed)")
        self.active = False
        self.freed = True
        self._backend.free(self._handle, self._slot)

    def __enter__(self) -> "PersistentRequest":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:  # an error is leaving the block: free if possible, never wait another timeout
            try:
                if not self.active or self._poll():
                    self.free()
            except OffloadError:
                pass
            return
        if self.active:
            self.wait()
        self.free()


def startall(requests: Sequence[PersistentRequest]) -> None:
    """``MPI_Startall``: start every request, in order."""
    for r in requests:
        r.start()


def waitall(requests: Sequence[PersistentRequest], timeout: float | None = None) -> None:
    """``MPI_Waitall``: wait for every request (``timeout`` seconds in all), also past one that fails, so none is
    left active; then raise the first failure (``MPI_ERR_IN_STATUS``), the others named in its notes (Python
    3.11+)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    errors: list[tuple[int, Exception]] = []
    for i, r in enumerate(requests):
        try:
            r.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - every request is waited for; the first failure is raised
            errors.append((i, exc))
    if errors:
        i, first = errors[0]
        note = getattr(first, "add_note", None)
        if note is not None:
            note(f"waitall: request {i} of {len(requests)} failed first; also failed: "
                 f"{[(j, type(e).__name__) for j, e in errors[1:]] or 'none'}")
        raise first


def testall(requests: Sequence[PersistentRequest]) -> bool:
    """``MPI_Testall``: True when every request has completed."""
    return all([r.test() for r in requests])


def alltoall_init(input: torch.Tensor, output: torch.Tensor, *, group=None, window: int | None = None,
                  **kw) -> PersistentRequest:
    """``MPI_Alltoall_init``: a persistent Alltoall of ``input`` into ``output`` (equal splits along the
    flattened tensors, as ``torch.distributed.all_to_all_single``; ``numel`` divisible by the group size).
    Keyword arguments go to :func:`compile`.

    Raises:
        PlanError: on every rank, naming the rank whose tensors are wrong (different numel, not divisible by
            the group size), and everything :func:`compile` raises.
    """
    import torch.distributed as dist

    from hpdl.offload import plans

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    plan, error = None, _not_tensors("alltoall_init", input=input, output=output)
    if error is not None:
        input = output = None
    elif input.numel() != output.numel() or input.numel() % max(world, 1):
        error = (f"alltoall_init: input and output need the same numel, divisible by the group size {world}; "
                 f"got {input.numel()} and {output.numel()}")
    else:
        try:
            plan = plans.alltoall(rank, world, input.numel() // world, input.dtype, window=window)
        except (PlanError, ValueError) as exc:
            error = f"alltoall_init: {exc}"
    return _compile(plan, {"input": input, "output": output}, group, kw.pop("progress", None),
                    kw.pop("timeout", None), error, **kw)


def _not_tensors(what: str, **args) -> str | None:
    """The error for arguments that are not tensors (reported on every rank by compile, not raised here)."""
    bad = [f"{k} must be a torch.Tensor, got {type(v).__name__}" for k, v in args.items()
           if not isinstance(v, torch.Tensor)]
    return f"{what}: " + "; ".join(bad) if bad else None


def allreduce_init(tensor: torch.Tensor, op: str = "sum", *, group=None, algorithm: str = "ring",
                   window: int | None = None, **kw) -> PersistentRequest:
    """``MPI_Allreduce_init`` (in place): a persistent Allreduce of ``tensor`` with ``op`` (sum, prod, min,
    max) by ``algorithm`` ring or direct (:func:`hpdl.offload.plans.allreduce`). Keyword arguments go to
    :func:`compile`.

    Raises:
        PlanError: on every rank, naming the rank with a bad ``op``/``algorithm``/``window``, and everything
            :func:`compile` raises (e.g. different counts on different ranks).
    """
    import torch.distributed as dist

    from hpdl.offload import plans

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    plan, error = None, _not_tensors("allreduce_init", tensor=tensor)
    try:
        if error is None:
            plan = plans.allreduce(rank, world, tensor.numel(), tensor.dtype, op=op, algorithm=algorithm, window=window)
    except (PlanError, ValueError) as exc:
        error = f"allreduce_init: {exc}"
    return _compile(plan, {"data": tensor}, group, kw.pop("progress", None), kw.pop("timeout", None), error, **kw)


def simulate(plans: Sequence[Plan | PlanData], buffers: Sequence[dict[str, torch.Tensor]], *, starts: int = 1,
             timeout: float = 30.0, copy_threads: int = 1, copy_min_bytes: int = 65536,
             stats: dict | None = None, engine: str = "python") -> list[dict[str, torch.Tensor]]:
    """Run a whole group's plans in this process, without processes or a network: ``plans[q]`` and
    ``buffers[q]`` are rank q's (unbound buffers are allocated). One executor serves every rank, as an agent
    serves a node. For testing and debugging plans; returns every rank's bound buffers.

    ``engine`` is ``"python"`` (:class:`~hpdl.offload.executor.Executor`) or ``"native"`` (the C engine of
    :mod:`hpdl.offload.native`, which agents use for intra-node CPU plans; raises
    :class:`~hpdl.offload.native.NativeUnavailable` where it cannot be built). ``copy_threads`` are the
    executor's (an agent's ``threads``; for the Python one, copies of at least ``copy_min_bytes`` bytes run on
    them); ``stats``, if given, is updated with the executor's counters.

    Raises:
        PlanError: as :func:`compile`. OffloadTimeoutError: not done within ``timeout`` (a bug in a plan
        that passed validation, or in the executor), listing the outstanding operations. NativeUnavailable:
        ``engine="native"`` where it cannot be built, or for a plan it cannot run (a reduction of a dtype
        other than float32/float64/int32/int64), naming why.
    """
    if engine not in ("python", "native"):
        raise ValueError(f"engine must be 'python' or 'native', got {engine!r}")
    datas = [p.data() if isinstance(p, Plan) else p for p in plans]
    compiled = compile_group(datas, key=1, endpoints=[0] * len(datas))
    tensors = [_bind(d.buffers, b, "thread") for d, b in zip(datas, buffers)]
    boxes = shm.Mailboxes(max(1, len(datas)), shared=False)
    insts = [Instance(c, t, boxes.array, q, None, "simulate", f"rank {q}") for q, (c, t) in enumerate(zip(compiled,
                                                                                                        tensors))]
    if engine == "native":
        _simulate_native(insts, boxes, datas[0].name, starts, timeout, copy_threads, stats)
        return tensors
    ex = Executor(copy_threads=copy_threads, copy_min_bytes=copy_min_bytes)
    for inst in insts:
        ex.register(inst)
    try:
        for g in range(1, starts + 1):
            boxes.array[:, shm.START] = g
            deadline = time.monotonic() + timeout
            while (boxes.array[:, shm.DONE] != g).any():
                busy = ex.progress()
                if not busy and ex.outstanding:  # let the copy threads have the GIL instead of spinning against them
                    ex.sleep(0.05)
                if not busy and time.monotonic() > deadline:
                    stuck = [f"rank {i.plan.rank}: " + "; ".join(map(str, i.pending())) for i in insts if i.active]
                    raise OffloadTimeoutError(f"simulated plan {datas[0].name!r} start {g} not done after {timeout}s: "
                                              + " | ".join(stuck))
                failed = [i.error for i in insts if i.error]
                if failed:
                    raise OffloadError(failed[0])
    finally:
        ex.close()
        if stats is not None:
            stats.update(ex.stats)
    return tensors


def _simulate_native(insts, boxes, name, starts, timeout, threads, stats) -> None:
    import numpy as np

    from hpdl.offload import native

    lib = native.load()
    if lib is None:
        raise native.NativeUnavailable("the native executor is unavailable here (see the log line above)")
    for q, inst in enumerate(insts):  # what an agent would send to its Python executor instead
        why = native.eligible(inst.plan, inst.tensors)
        if why is not None:
            raise native.NativeUnavailable(f"the native executor cannot run plan {name!r} (rank {q}: {why}); "
                                           "simulate it with engine='python'")
    bell = np.zeros(2, dtype=np.uint32)
    eng = native.NativeEngine(lib, bell.ctypes.data, threads=threads, parallel_min_bytes=0 if threads > 1 else 1 << 62)
    try:
        ids = [eng.register(inst) for inst in insts]
        for g in range(1, starts + 1):
            boxes.array[:, shm.START] = g
            eng.ring()
            deadline = time.monotonic() + timeout
            while (boxes.array[:, shm.DONE] != g).any():
                failed = np.flatnonzero(boxes.array[:, shm.FAILED] == g)
                if len(failed):
                    raise OffloadError(eng.status(ids[int(failed[0])]).error)
                if time.monotonic() > deadline:
                    stuck = [f"rank {q}: " + "; ".join(map(str, eng.status(i).pending)) for q, i in enumerate(ids)]
                    raise OffloadTimeoutError(f"simulated plan {name!r} start {g} not done after {timeout}s: "
                                              + " | ".join(stuck))
                left = np.flatnonzero(boxes.array[:, shm.DONE] != g)
                if not len(left):
                    break
                q = int(left[0])
                seq = int(boxes.array.view(np.uint32)[q, 2 * native.SEQ])
                if boxes.array[q, shm.DONE] != g and boxes.array[q, shm.FAILED] != g:
                    native.futex_wait(native.seq_address(boxes.array, q), seq, 0.05)
        for i in ids:
            eng.free(i)
    finally:
        if stats is not None:
            stats.update(eng.stats())
        eng.close()
