"""torch.distributed-shaped collectives with c10d's signatures: ``all_reduce``, ``reduce_scatter(_tensor)``,
``all_gather(_into_tensor)``, ``all_to_all_single``, ``broadcast``, ``reduce``, ``barrier``.

Each call is validate -> resolve -> run -> Work: it validates its arguments locally, picks the algorithm
(``"auto"`` asks :func:`hpdl.comm.tuning.resolve`, the one selection table), checks (``HPDL_CHECK``) that every
rank passed the same count, dtype, op, device and algorithm, and runs the registry's algorithm instance, built
from the group's :class:`~hpdl.comm.transport.resources.GroupResources` (its one per-group state), over the
group's transport. The only other cache is the hot path ``_FAST``: identical later calls of a kernel algorithm
go straight to the launcher it handed out after a first checked call. Results are in place, like
``torch.distributed``; non-contiguous tensors are handled through a contiguous copy written back into the
caller's tensor.

Ordering and asynchrony: torch's own collectives (``native``) are issued on the caller's thread, at the call,
in call order, as torch does, so hpdl's calls and torch's own on the same group match across ranks in program
order; ``async_op=True`` returns a :class:`Work` holding torch's Work in flight. hpdl's own point-to-point
schedules on CPU tensors with ``async_op=True`` are queued on the group's worker
(:mod:`hpdl.comm.transport.worker`: one thread per group, first in first out, so every rank runs them in call
order) and return at once; ``Work.wait()`` blocks until the result is in place and raises the call's error on
every rank that waits. A synchronous hpdl schedule first waits for the group's queued ones, then runs on the
caller's thread. The CUDA peer kernels run on a side stream (:class:`CudaWork`). A failed collective runs a
post-mortem (:mod:`hpdl.comm.transport.failure`) so that the error names the rank that is gone or stuck.
"""

from __future__ import annotations

import math
import numbers
import os
from datetime import timedelta
from typing import Callable

import torch

from hpdl.comm import tuning
from hpdl.comm.algorithms import alltoall as a2a
from hpdl.comm.algorithms.base import (BASES, REGISTRY, algorithms_for, canonical, get_class, implements,
                                      phase_algorithms)
from hpdl.comm.algorithms.direct import window_size
from hpdl.comm.algorithms.native import Pending
from hpdl.comm.ops import check_dtype, normalize_op, REDUCE_OPS, SUPPORTED_DTYPES
from hpdl.comm.transport import resources as _resources
from hpdl.comm.transport.resources import GroupResources
from hpdl.comm.transport.worker import Job
from hpdl.runtime import env
from hpdl.runtime.errors import CollectiveMismatchError, CollectiveTimeoutError

_DTYPE_CODE = {d: i for i, d in enumerate(SUPPORTED_DTYPES)}


class Work:
    """Handle of an ``async_op=True`` collective, like torch.distributed's Work.

    ``wait(timeout=None)`` blocks until the result is in the caller's tensor (re-raising the collective's
    error, a typed one naming the rank where the post-mortem can tell); ``is_completed()`` polls;
    ``get_future()`` returns a ``torch.futures.Future`` of the result tensor (for DDP communication hooks).
    A Work of hpdl's own CPU schedules holds the :class:`~hpdl.comm.transport.worker.Job` queued on the group's
    worker; the tensor must not be modified before ``wait()`` returns (as with torch's async collectives).
    """

    def __init__(self, result: torch.Tensor | None = None, pending: Pending | None = None, guard=None,
                 job: Job | None = None):
        self._result, self._pending, self._guard, self._job = result, pending, guard, job
        self._error: BaseException | None = None

    def _then(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` once the collective succeeded (now when it already has)."""
        if self._job is not None:
            self._job.then(fn)
        elif self._pending is not None:
            self._pending.then(fn)
        elif self._error is None:
            fn()

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Block until the collective finished; raises what it raised. ``timeout`` in seconds (or a
        timedelta) bounds the wait (default: the call's timeout). Returns True."""
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        if self._error is not None:
            raise self._error
        if self._job is not None:
            job = self._job
            try:
                job.wait(timeout)
            except BaseException as exc:
                # only the call's own error is kept: after this wait's timeout or a Ctrl-C (KeyboardInterrupt
                # in the waiting thread) the call still runs on the worker, and a later wait() may succeed
                if job.is_completed() and exc is job.error:
                    self._error = exc
                raise
            self._job = None
            return True
        pending = self._pending
        if pending is None:
            return True
        try:
            if self._guard is not None:
                self._guard(lambda: pending.wait(timeout))
            else:
                pending.wait(timeout)
        except BaseException as exc:
            if isinstance(exc, Exception):   # a Ctrl-C interrupted this wait, not torch's collective
                self._error = exc
            raise
        self._pending = None
        return True

    def is_completed(self) -> bool:
        """True once the result is in the caller's tensor (or the collective failed: ``wait()`` raises its
        error). When torch's collective has completed, the finishing steps (avg division, copies back) run here,
        on the polling thread, so that ``while not work.is_completed(): ...`` ends with the result in place."""
        if self._job is not None:
            if not self._job.is_completed():
                return False
            try:
                self.wait()
            except BaseException:  # noqa: BLE001 - kept in self._error; wait() raises it
                pass
            return True
        pending = self._pending
        if pending is None:
            return True
        if not pending.work.is_completed():
            return False
        try:
            self.wait()
        except BaseException:  # noqa: BLE001 - kept in self._error; wait() raises it, as torch's Work does
            pass
        return True

    def get_future(self) -> torch.futures.Future:
        """A Future completed with the result tensor once the collective finished (its finishing steps, the
        avg division and copy-back, run in the callback)."""
        if self._job is not None:
            return self._job.get_future()
        pending = self._pending
        if pending is None:
            fut: torch.futures.Future = torch.futures.Future()
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                fut.set_result(self._result)
            return fut
        result = self._result

        def done(f):
            f.value()  # raises the collective's error into the chained future
            pending.run_finish()
            return result
        return pending.work.get_future().then(done)


class CudaWork:
    """Handle of an async peer-memory all-reduce on the group's side stream (like NCCL's Work):
    ``wait()`` makes the caller's current stream wait for it; ``is_completed()`` polls its event.

    Once waited for on a stream, the group's later calls on that stream (or under CUDA-graph capture, where
    waiting on an event recorded before the capture invalidates it; ``torch.cuda.graph`` synchronises the
    device first) need not wait for it again; a later call on another stream still does, or its kernel would
    run beside this one on the group's peer buffer."""

    def __init__(self, event, resources: GroupResources | None = None):
        self._event, self._res = event, resources

    def wait(self, timeout: float | None = None) -> bool:
        stream = torch.cuda.current_stream()
        stream.wait_event(self._event)
        if self._res is not None and self._res.side_pending is self._event:
            self._res.side_pending = None
            self._res.side_waited = (self._event, stream)
        return True

    def is_completed(self) -> bool:
        return self._event.query()


def _group(group) -> GroupResources:
    """The group's one :class:`GroupResources` (transports, topology, algorithms, peer buffers, failure board)."""
    return _resources.resources_of(group)


def _execute(res: GroupResources, what: str, timeout: float, run: Callable[[], "Pending | None"], async_op: bool,
             result: torch.Tensor | None, schedule: bool = False, cpu: bool = True,
             algo: tuple | None = None) -> Work | None:
    """Issue ``run`` (it returns a :class:`Pending` torch collective, or None when done) and wait for it unless
    ``async_op``. torch's collectives (``schedule`` False) are issued now, on this thread. hpdl's own schedules
    (``schedule`` True) run after the group's queued async calls: an async one on CPU tensors is queued on the
    group's worker, a synchronous one waits for the queue and runs here. Peer failures are diagnosed by the
    group's failure board. ``algo`` is the ``(name, window)`` the schedule runs: a queued call builds it here,
    on the caller's thread, because a first build may communicate over the group with torch's collectives
    (two_level's topology discovery is an all-gather): on the worker it would race the caller's own torch calls
    on the group, and ranks whose threads interleaved differently would match different collectives (a hang)."""
    res.calls += 1
    guard = res.guard(what, res.calls, timeout)
    if schedule and async_op and cpu and res.world_size > 1:
        if algo is not None:
            guard(lambda: res.algorithm(algo[0], algo[1], timeout))
        def job() -> None:
            pending = guard(run)
            if pending is not None:
                guard(lambda: pending.wait(timeout))
        return Work(result, job=res.worker.submit(Job(job, what, result)))
    if schedule:
        res.drain()
    pending = guard(run)
    if not async_op:
        if pending is not None:
            guard(lambda: pending.wait(timeout))
        return None
    return Work(result, pending, guard)


def _check_async(async_op, what: str) -> None:
    """c10d's positional order is (..., group, async_op); an algorithm name in that place is a call written
    for the old signature."""
    if isinstance(async_op, str):
        raise TypeError(f"{what}: async_op must be a bool, got {async_op!r}; the algorithm is keyword-only "
                        f"(algorithm={async_op!r}), as the signature follows torch.distributed's")


def forget_group(group) -> None:
    """Drop everything hpdl.comm caches for ``group`` (its :class:`GroupResources`: transports, algorithms,
    peer-memory registrations; and its hot-path entries) without communicating, so that a destroyed group can
    be freed with its sockets. Call it on every rank after the group's last collective; peer-memory buffers
    are unmapped at process exit."""
    res = _resources.forget(group)
    for k in [k for k, v in _FAST.items() if res is not None and v[0] is res]:
        del _FAST[k]
    _CPU_NATIVE.clear()


def reset() -> None:
    """Drop cached transports and buffers of every group (call after destroying process groups)."""
    _FAST.clear()
    _CPU_NATIVE.clear()
    _resources.forget_all()


def set_topology(topology, group=None) -> None:
    """Tell the two-level algorithms where the ranks of ``group`` live (nodes, local ranks, rails).

    Args:
        topology: a :class:`hpdl.runtime.Topology` of the group's ranks (``ctx.topology`` from
            :func:`hpdl.runtime.spawn` / ``init_from_env``), or ``ranks_per_node`` as an int (equal nodes of
            consecutive ranks) or a list such as ``[3, 2]`` (emulated uneven nodes).
        group: process group (None = world).

    Without it, ``HPDL_RANKS_PER_NODE`` is used, else the hostnames (one all-gather at first use). Local call;
    every rank must set the same topology before its first two-level call on ``group``.

    Raises:
        ValueError: the topology's world size is not the group's size.
    """
    from hpdl.runtime.topology import Topology

    res = _group(group)
    topo = topology if isinstance(topology, Topology) else Topology.emulate(res.world_size, topology,
                                                                           res.ranks_per_gpu)
    if topo.world_size != res.world_size:
        raise ValueError(f"topology has world_size={topo.world_size}, but the group has {res.world_size} ranks")
    if res.topology != topo:
        res.drop_topology_algorithms()
        _FAST.clear()  # cached calls chose their path (one-node peer kernel or not) under the old topology
    res.topology = topo


def _timeout(timeout) -> float:
    """The call's timeout in seconds (``HPDL_TIMEOUT`` when None), checked before any communication: a wait
    of zero or less gives up at once and leaves the group's receives posted, which closes gloo's pairs and
    breaks every later call on the group."""
    value = env.get("HPDL_TIMEOUT") if timeout is None else timeout
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        source = "HPDL_TIMEOUT" if timeout is None else "timeout"
        raise ValueError(f"{source} must be a finite number of seconds > 0 (or a timedelta), got {value!r}")
    return float(value)


def _check_tensor(name: str, t, res: GroupResources) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout={t.layout}")
    if t.device.type == "cuda" and res.backend == "gloo" and not res.cuda_over_gloo:
        raise ValueError(f"{name} is on {t.device} but the group's backend is gloo; pass a CPU tensor or use an "
                         "NCCL group (or, for ranks that share a GPU, HPDL_RANKS_PER_GPU > 1)")
    if t.device.type == "cpu" and res.backend == "nccl":
        raise ValueError(f"{name} is on the CPU but the group's backend is nccl; pass a CUDA tensor")


def _verify_same(res: GroupResources, what: str, fields: dict[str, int], timeout: float) -> None:
    """Exchange the call's signature with every peer; raise on any difference, naming the field and ranks."""
    host = res.host(timeout)
    try:
        # the worker's exchanges use their own tag: a native call's check may run on the caller's thread meanwhile
        theirs = host.exchange_all(torch.tensor(list(fields.values()), dtype=torch.int64),
                                   tag=199 if res.on_worker() else 99)
    except CollectiveTimeoutError as exc:
        missing = exc.missing_ranks[:1]
        raise CollectiveTimeoutError(f"{what}: rank {host.rank} waited {timeout:.0f}s for rank {missing[0]}, which "
                                     f"never called {what}", missing_ranks=missing) from None
    names = list(fields)
    for i, name in enumerate(names):
        values = [int(t[i]) for t in theirs]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {_decode(name, v)}" for r, v in enumerate(values))
            raise CollectiveMismatchError(f"{what}: argument {name!r} differs across ranks ({shown}); every rank "
                                          f"must pass the same value")


def _decode(field: str, value: int) -> str:
    if field == "dtype":
        return str(SUPPORTED_DTYPES[value]) if 0 <= value < len(SUPPORTED_DTYPES) else str(value)
    if field == "op":
        return REDUCE_OPS[value]
    if field == "algorithm":
        names = list(REGISTRY)
        return names[value] if 0 <= value < len(names) else str(value)
    if field == "device":
        return {0: "cpu", 1: "cuda"}.get(value, str(value))
    return str(value)


def _resolve(res: GroupResources, algorithm: str, tensor: torch.Tensor, window: int | None, collective: str,
             timeout: float):
    """``(name, window)`` of the algorithm that runs: ``auto`` through :func:`hpdl.comm.resolve` with every fact
    the call knows; an explicit name checked against the collective and the call (before any communication)."""
    name = canonical(algorithm)
    # ranks sharing a GPU count as that many GPUs: the same code paths run as on a real node (the topology
    # records the sharing; benchmarks say the timings are not multi-GPU performance)
    # the GPU count only matters to CUDA tensors; on a CPU tensor it is not asked for, because
    # torch.cuda.device_count() is not cached before CUDA is initialised: every call would load and query NVML
    # (74 us here without a driver, more with one), which was most of a CPU all-reduce call's overhead
    facts = {"dtype": tensor.dtype, "gpus": torch.cuda.device_count() * res.ranks_per_gpu if tensor.is_cuda else None,
             "topology": res.topology}
    nbytes = tensor.numel() * tensor.element_size()
    if name == "auto":
        name, tuned = tuning.resolve(collective, nbytes, res.world_size, tensor.device.type, **facts)
        if res.topology is None and tensor.is_cuda and get_class(name).needs_topology:
            # the pick depends on where the ranks are (peer kernel on one host, host staging across nodes)
            facts["topology"] = res.get_topology(timeout)
            name, tuned = tuning.resolve(collective, nbytes, res.world_size, tensor.device.type, **facts)
        window = window if window is not None or collective == "all_to_all" else tuned
    elif not implements(name, collective):
        has = [c for c in BASES if implements(name, c)]
        raise ValueError(f"algorithm={algorithm!r} is an {' and '.join(has)} algorithm; for {collective} use 'auto' "
                         f"or one of {algorithms_for(collective)}")
    elif collective == "all_reduce" and not get_class(name).fits(tensor.device.type, res.world_size, **facts):
        raise ValueError(f"algorithm={algorithm!r} reduces CUDA tensors of float32/float16/bfloat16/int32/int64 on "
                         f"one node of at most 8 GPUs; got a {tensor.dtype} tensor on {tensor.device} in a group "
                         f"of {res.world_size}")
    if window is None and collective != "all_to_all":
        window = env.get("HPDL_DIRECT_WINDOW") or None
    return name, window


def _prepare(what: str, tensor: torch.Tensor, op, group, algorithm: str, window, timeout, check):
    """Validate, resolve ``auto`` through the selection table (collective ``what``) and build the optional
    argument check; nothing is communicated yet."""
    res = _group(group)
    _check_tensor("tensor", tensor, res)
    op = normalize_op(op)
    check_dtype(tensor.dtype, op)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be an int >= 1 (or None for the tuned value), got {window!r}")
    timeout = _timeout(timeout)
    name, window = _resolve(res, algorithm, tensor, window, what, timeout)
    mode = env.get("HPDL_CHECK") if check is None else check
    verify = None
    if (mode is True or (mode == "auto" and tensor.device.type == "cpu")) and res.world_size > 1:
        effective = window_size(window, res.world_size) if name == "direct" else 0  # None and 4 are the same k
        fields = {"count": tensor.numel(), "dtype": _DTYPE_CODE.get(tensor.dtype, 100 + tensor.element_size()),
                  "op": REDUCE_OPS.index(op),
                  "device": int(tensor.device.type == "cuda"), "algorithm": list(REGISTRY).index(name),
                  "window": effective}

        def verify() -> None:  # runs in order with the group's other calls (inside async work too)
            _verify_same(res, what, fields, timeout)
    return res, op, name, window, timeout, verify


_FAST: dict[tuple, object] = {}
_FAST_MAX = 4096
# CPU all-reduces that resolved to native without a check: (arguments) -> (issue function, table it was resolved by)
_CPU_NATIVE: dict[tuple, tuple] = {}


def _after_side_calls(res: GroupResources, device: torch.device) -> None:
    """Order the current stream after the group's last async peer call (``side_pending``), unless a
    ``CudaWork.wait`` already did so on this stream, or we are capturing a CUDA graph (see :class:`CudaWork`)."""
    if res.side_pending is None and res.side_waited is None:
        return
    current = torch.cuda.current_stream(device)
    if res.side_pending is not None:
        current.wait_event(res.side_pending)
    elif res.side_waited is not None:
        event, stream = res.side_waited
        if stream != current and not torch.cuda.is_current_stream_capturing():
            current.wait_event(event)
    res.side_pending = res.side_waited = None


def _kernel_call(res: GroupResources, tensor: torch.Tensor, op: str, name: str, window, async_op: bool, fast_key,
                 timeout: float):
    """An all-reduce that is kernel launches (the peer-memory algorithms): on the current stream, after the
    group's last async call; or on the group's side stream when ``async_op``. A first synchronous call leaves
    the algorithm's launcher in the hot-path cache."""
    algo = res.algorithm(name, window, timeout)
    _after_side_calls(res, tensor.device)   # keep calls on this group in order: after the last async one
    if async_op:
        return _on_side_stream(res, lambda: algo.all_reduce(tensor, op, res.comm(timeout)), tensor.device, (tensor,))
    algo.all_reduce(tensor, op, res.comm(timeout))
    if fast_key is not None and str(env.get("HPDL_CHECK")) == "auto":
        fn = algo.all_reduce_launcher(op, tensor.device)
        if fn is not None:
            _FAST[fast_key] = (res, fn)
    return None


def all_reduce(tensor: torch.Tensor, op="sum", group=None, async_op: bool = False, *, algorithm: str = "auto",
               window: int | None = None, timeout: float | None = None, check: bool | None = None):
    """Reduce ``tensor`` across all ranks of ``group``, in place; every rank gets the bitwise-identical result.

    Signature of ``torch.distributed.all_reduce(tensor, op, group, async_op)``; hpdl's options are keyword-only.

    Args:
        tensor: any shape, contiguous or not; dtype float32, float64, float16, bfloat16 (accumulated in
            float32), int32, int64, uint8, int8 (integer sums wrap like C), bool (sum = or, product = and) or
            complex64 (sum and avg only, as torch.distributed); CPU with gloo, CUDA with NCCL.
        op: "sum", "avg" (floating dtypes only), "min", "max", "product", or a ``torch.distributed.ReduceOp``.
        group: process group (None = world).
        async_op: return a :class:`Work` handle at once (for the peer kernels a :class:`CudaWork`: the call runs
            on a side stream and ``wait()`` orders the caller's current stream after it). ``native`` issues
            torch's collective now, on this thread; hpdl's schedules on CPU tensors are queued on the group's
            worker thread, in call order, and run while the caller computes; ``wait()`` raises their errors.
        algorithm: "auto" (tuning table), "direct" (throttled Direct Sendrecv), "ring",
            "recursive_doubling", "staged" (CPU staging), "two_level", "native" (torch.distributed), or for CUDA
            tensors of one node "one_shot" / "two_shot" (peer-memory kernels, one launch per call).
        window: throttle of the direct algorithm (peers in flight); None = tuned default.
        timeout: seconds any wait may block (default ``HPDL_TIMEOUT``).
        check: verify that all ranks passed the same arguments (default ``HPDL_CHECK``: on for CPU tensors).

    Returns:
        None, or a :class:`Work` when ``async_op`` is True.

    Raises:
        TypeError / ValueError: bad tensor, dtype, op, algorithm or window (nothing has been written).
        CollectiveMismatchError: ranks passed different counts, dtypes, ops, devices or algorithms.
        CollectiveTimeoutError: a peer did not answer within ``timeout``; the message names it.
        PeerFailedError: a peer's process is gone; the message names it.
    """
    # key of the hot path, from the arguments as given (_prepare normalises op, window and timeout)
    fast_key = (group, op, algorithm, window, tensor.dtype, tensor.numel(), tensor.device.index) \
        if isinstance(tensor, torch.Tensor) and check is None and timeout is None and isinstance(op, str) else None
    if tensor.__class__ is torch.Tensor and tensor.is_cuda and not async_op and check is None and timeout is None \
            and isinstance(op, str):
        fast = _FAST.get(fast_key)
        if fast is not None and fast[0].side_pending is None and fast[0].side_waited is None:
            fast[1](tensor)  # hot path: arguments validated by an earlier identical call; one kernel launch
            return None
    cpu_key = None
    if tensor.__class__ is torch.Tensor and not tensor.is_cuda and timeout is None and isinstance(op, str) \
            and check is not True and async_op.__class__ is bool:
        cpu_key = (group, op, algorithm, window, tensor.dtype, tensor.numel(), check, os.environ.get("HPDL_CHECK"),
                   os.environ.get("HPDL_TIMEOUT"))
        hot = _CPU_NATIVE.get(cpu_key)
        if hot is not None and hot[1] is tuning.active_table() and tensor.is_contiguous():
            return hot[0](tensor, async_op)
    _check_async(async_op, "all_reduce")
    res, op, name, window, timeout, verify = _prepare("all_reduce", tensor, op, group, algorithm, window, timeout,
                                                      check)
    if cpu_key is not None and verify is None and name == "native" and op != "avg" and res.world_size > 1 \
            and res.backend == "gloo" and tensor.numel() > 0 and not tensor.is_complex() and tensor.dtype != torch.bool:
        if len(_CPU_NATIVE) > _FAST_MAX:
            _CPU_NATIVE.clear()
        _CPU_NATIVE[cpu_key] = (_native_call(res, op, timeout), tuning.active_table())
    if get_class(name).runs_kernel(res, tensor, timeout):
        if verify is not None:   # host exchange: a dead or missing peer is named by the group's post-mortem
            res.calls += 1
            res.guard("all_reduce", res.calls, timeout)(verify)
        return _kernel_call(res, tensor, op, name, window, async_op, fast_key, timeout)

    def run() -> Pending | None:
        if verify is not None:
            verify()
        if tensor.numel() == 0 or res.world_size == 1:
            return None
        algo = res.algorithm(name, window, timeout)
        buf = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        pending = algo.all_reduce(buf, op, res.comm(timeout))
        if not tensor.is_contiguous():
            return _then(pending, lambda: tensor.copy_(buf.view(tensor.shape)))
        return pending

    return _execute(res, "all_reduce", timeout, run, async_op, tensor, name != "native", not tensor.is_cuda,
                    (name, window))


def _native_call(res: GroupResources, op: str, timeout: float):
    """The hot path of a CPU all-reduce that resolved to ``native`` without an argument check: the group's
    ``ProcessGroup.allreduce`` issued at once, as DDP's reducer does (validation, selection and c10d's Python
    wrapper were done by an identical earlier call), waited for within ``timeout``; an error goes through the
    general path's conversion and the group's post-mortem."""
    import torch.distributed as dist

    from hpdl.comm.algorithms.native import wait_native
    from hpdl.comm.ops import to_torch_op

    pg = res.group if res.group is not None else dist.group.WORLD
    opts = dist.AllreduceOptions()
    opts.reduceOp = to_torch_op(op)
    comm, limit = res.comm(timeout), timedelta(seconds=timeout)

    def call(tensor: torch.Tensor, async_op: bool):
        res.calls += 1
        work = None
        try:
            work = pg.allreduce([tensor], opts)
            if async_op:
                return Work(tensor, Pending(work, comm, "all_reduce"), res.guard("all_reduce", res.calls, timeout))
            work.wait(limit)
            return None
        except Exception as exc:  # noqa: BLE001 - the general path's conversion (timeout) and post-mortem
            error, issued = exc, work

            def again():
                if issued is None:
                    raise error
                wait_native(issued, comm, "all_reduce", timeout)   # a failed Work raises its error again
            res.guard("all_reduce", res.calls, timeout)(again)
            raise
    return call


def _then(pending: Pending | None, fn: Callable[[], object]) -> Pending | None:
    """Run ``fn`` after ``pending`` finished (now, when the algorithm already ran to completion)."""
    if pending is None:
        fn()
        return None
    return pending.then(fn)


def _check_pair(group, output: torch.Tensor, input: torch.Tensor, big: str, small: str) -> None:
    """Validate the two tensors of reduce_scatter / all_gather: ``big`` holds world_size times ``small``."""
    res = _group(group)
    _check_tensor("output", output, res)
    _check_tensor("input", input, res)
    t = {"output": output, "input": input}
    if t[big].numel() != res.world_size * t[small].numel():
        raise ValueError(f"{big}.numel() must be world_size * {small}.numel() = {res.world_size} * "
                         f"{t[small].numel()}, got {t[big].numel()}")
    if input.dtype != output.dtype or input.device != output.device:
        raise ValueError(f"input and output must share dtype and device, got {input.dtype}/{input.device} and "
                         f"{output.dtype}/{output.device}")


def _phase_algorithm(algorithm: str) -> str:
    """Reject, before any communication, an explicit algorithm that has no reduce-scatter / all-gather."""
    name = canonical(algorithm)
    if name != "auto" and not (implements(name, "reduce_scatter") and implements(name, "all_gather")):
        raise ValueError(f"algorithm={algorithm!r} has no reduce_scatter/all_gather; use 'auto' or one of "
                         f"{phase_algorithms()}")
    return algorithm


def _phase_resolved(name: str) -> str:
    """What ``auto`` picked for an all-reduce of this size, mapped to a schedule that has the two phases."""
    return name if implements(name, "reduce_scatter") and implements(name, "all_gather") else "direct"


def _blocks_of(flat: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    n = flat.numel() // world_size
    return [flat[q * n:(q + 1) * n] for q in range(world_size)]


def _flat_list(tensors, what: str, world_size: int, like: torch.Tensor) -> torch.Tensor:
    """c10d's list form (``input_list`` / ``tensor_list``): ``world_size`` tensors shaped like ``like``."""
    tensors = list(tensors)
    if len(tensors) != world_size or any(not isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"{what} must be a list of world_size={world_size} tensors, got {len(tensors)} items")
    for q, t in enumerate(tensors):
        if t.numel() != like.numel() or t.dtype != like.dtype or t.device != like.device:
            raise ValueError(f"{what}[{q}] must have {like.numel()} elements of {like.dtype} on {like.device}, "
                             f"got {t.numel()} of {t.dtype} on {t.device}")
    return torch.cat([t.reshape(-1) for t in tensors])


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op="sum", group=None, async_op: bool = False,
                          *, algorithm: str = "auto", window: int | None = None, timeout: float | None = None,
                          check: bool | None = None):
    """``output = reduce over ranks of input[rank*m:(rank+1)*m]`` with ``m = output.numel()``.

    Signature and contract of ``torch.distributed.reduce_scatter_tensor(output, input, op, group, async_op)``
    (``input.numel() == world_size * m``, same dtype and device); ``input`` is not modified. Dtypes as
    :func:`all_reduce`. Algorithms: "auto", "direct", "ring", "native".

    Returns: None, or a :class:`Work` when ``async_op`` is True.

    Raises: as :func:`all_reduce`, plus ValueError on mismatched sizes.
    """
    _check_async(async_op, "reduce_scatter_tensor")
    _check_pair(group, output, input, big="input", small="output")
    res, op, name, window, timeout, verify = _prepare("reduce_scatter", input, op, group,
                                                      _phase_algorithm(algorithm), window, timeout, check)
    name = _phase_resolved(name)

    def run() -> Pending | None:
        if verify is not None:
            verify()
        if output.numel() == 0:
            return None
        flat = input.contiguous().view(-1)
        blocks = _blocks_of(flat, res.world_size)
        out = output.view(-1) if output.is_contiguous() else torch.empty_like(blocks[0])
        pending = None
        if res.world_size == 1:
            out.copy_(flat)
        else:
            pending = res.algorithm(name, window, timeout).reduce_scatter(blocks, out, op, res.comm(timeout))
        if not output.is_contiguous():
            return _then(pending, lambda: output.copy_(out.view(output.shape)))
        return pending

    return _execute(res, "reduce_scatter", timeout, run, async_op, output, name != "native", not input.is_cuda,
                    (name, window))


def reduce_scatter(output: torch.Tensor, input, op="sum", group=None, async_op: bool = False, *,
                   algorithm: str = "auto", window: int | None = None, timeout: float | None = None,
                   check: bool | None = None):
    """:func:`reduce_scatter_tensor`, also taking c10d's ``reduce_scatter(output, input_list, ...)`` form:
    ``input`` may be a list of ``world_size`` tensors shaped like ``output`` (block q goes to rank q)."""
    if isinstance(input, (list, tuple)):
        _check_tensor("output", output, _group(group))
        input = _flat_list(input, "input_list", _group(group).world_size, output)
    return reduce_scatter_tensor(output, input, op, group, async_op, algorithm=algorithm, window=window,
                                 timeout=timeout, check=check)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False, *,
                           algorithm: str = "auto", window: int | None = None, timeout: float | None = None,
                           check: bool | None = None):
    """``output[q*m:(q+1)*m] = input of rank q`` with ``m = input.numel()``.

    Signature of ``torch.distributed.all_gather_into_tensor(output, input, group, async_op)``. No reduction,
    so every dtype of :data:`SUPPORTED_DTYPES` (bool and complex64 included). Algorithms: "auto", "direct",
    "ring", "native".

    Returns: None, or a :class:`Work` when ``async_op`` is True.

    Raises: as :func:`all_reduce`, plus ValueError on mismatched sizes, dtypes or devices.
    """
    _check_async(async_op, "all_gather_into_tensor")
    _check_pair(group, output, input, big="output", small="input")
    res, _, name, window, timeout, verify = _prepare("all_gather", input, "sum", group, _phase_algorithm(algorithm),
                                                     window, timeout, check)
    name = _phase_resolved(name)

    def run() -> Pending | None:
        if verify is not None:
            verify()
        if input.numel() == 0:
            return None
        flat = output.view(-1) if output.is_contiguous() else torch.empty(output.numel(), dtype=output.dtype,
                                                                            device=output.device)
        blocks = _blocks_of(flat, res.world_size)
        blocks[res.rank].copy_(input.reshape(-1))
        pending = None
        if res.world_size > 1:
            pending = res.algorithm(name, window, timeout).all_gather(blocks, res.comm(timeout))
        if not output.is_contiguous():
            return _then(pending, lambda: output.copy_(flat.view(output.shape)))
        return pending

    return _execute(res, "all_gather", timeout, run, async_op, output, name != "native", not input.is_cuda,
                    (name, window))


def all_gather(output, input: torch.Tensor, group=None, async_op: bool = False, *, algorithm: str = "auto",
               window: int | None = None, timeout: float | None = None, check: bool | None = None):
    """:func:`all_gather_into_tensor`, also taking c10d's ``all_gather(tensor_list, tensor, ...)`` form:
    ``output`` may be a list of ``world_size`` tensors shaped like ``input`` (entry q receives rank q's)."""
    if not isinstance(output, (list, tuple)):
        return all_gather_into_tensor(output, input, group, async_op, algorithm=algorithm, window=window,
                                      timeout=timeout, check=check)
    res = _group(group)
    _check_tensor("input", input, res)
    _flat_list(output, "tensor_list", res.world_size, input)   # validates the list
    flat = torch.empty(res.world_size * input.numel(), dtype=input.dtype, device=input.device)
    work = all_gather_into_tensor(flat, input, group, async_op, algorithm=algorithm, window=window,
                                  timeout=timeout, check=check)

    def scatter() -> None:
        for q, t in enumerate(output):
            t.copy_(flat[q * input.numel():(q + 1) * input.numel()].view(t.shape))
    if work is None:
        scatter()
        return None
    work._then(scatter)
    return work


def _flat_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bytes as a flat uint8 view when ``t`` is dense with unit inner stride, else None (a one-element
    tensor counts as contiguous whatever its stride, but cannot be viewed as bytes then)."""
    if not t.is_contiguous() or t.numel() == 0:
        return None
    flat = t.view(-1)
    return flat.view(torch.uint8) if flat.stride(0) == 1 else None


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False, *, algorithm: str = "auto", window: int | None = None,
                      timeout: float | None = None, check: bool | None = None):
    """Split ``input`` along dim 0, send block ``q`` to rank ``q``; ``output`` receives block ``q`` from rank q.

    Exactly ``torch.distributed.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group,
    async_op)`` (hpdl's options keyword-only): with split sizes None the rows are split equally
    (``size(0)`` divisible by the world size); otherwise ``input_split_sizes[q]`` rows go to rank ``q`` and
    ``output_split_sizes[q]`` rows come from it (zero allowed), and rank i's ``output_split_sizes[j]`` must
    equal rank j's ``input_split_sizes[i]``. Any dtype, any trailing shape (same for both tensors);
    non-contiguous tensors are copied. ``input`` is not modified.

    Args:
        algorithm: "auto", "pairwise", "direct" (throttled, ``window`` peers in flight), "push" or "pull"
            (two-level over the node's shared buffer; CPU tensors need :func:`set_topology`; CUDA tensors of
            ranks on one host run the one-kernel peer-memory Alltoall, :mod:`hpdl.comm.algorithms.peer_alltoall`),
            or "native". "auto": NCCL/gloo, except CUDA tensors of 2 ranks on one host (the measured case):
            the peer push kernel.
        window, timeout, check, async_op, group: as :func:`all_reduce`; ``check`` also verifies that the split
            sizes of all ranks agree.

    Returns:
        None, or a :class:`Work` when ``async_op`` is True.

    Raises:
        TypeError / ValueError: bad tensors, splits or algorithm (before any communication).
        CollectiveMismatchError: ranks disagree on dtype, row shape, algorithm or split sizes.
        CollectiveTimeoutError: a peer did not answer (or died) within ``timeout``; the message names it.
    """
    fast_key = None
    if output.__class__ is torch.Tensor and input.__class__ is torch.Tensor and input.is_cuda and not async_op \
            and check is None and timeout is None:
        fast_key = ("a2a", group, algorithm, window, output.shape, input.shape, input.dtype, input.device.index,
                    output.device.index, output.dtype, _split_key(output_split_sizes),
                    _split_key(input_split_sizes), os.environ.get("HPDL_CHECK"))
        fast = _FAST.get(fast_key)
        if fast is not None and fast[0].side_pending is None and fast[0].side_waited is None \
                and fast[1](output, input):
            return None  # hot path: arguments validated by an earlier identical call; one kernel launch
    _check_async(async_op, "all_to_all_single")
    res = _group(group)
    _check_tensor("output", output, res)
    _check_tensor("input", input, res)
    lay, osp, isp = a2a.make_layout(output, input, output_split_sizes, input_split_sizes, res.world_size, res.rank)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be an int >= 1 (or None for all peers), got {window!r}")
    timeout = _timeout(timeout)
    name, window = _resolve(res, algorithm, input, window, "all_to_all", timeout)
    mode = env.get("HPDL_CHECK") if check is None else check
    verify = None
    if (mode is True or (mode == "auto" and input.device.type == "cpu")) and res.world_size > 1:
        fields = {"dtype": _DTYPE_CODE.get(input.dtype, 100 + input.element_size()),
                  "row": math.prod(input.shape[1:]), "device": int(input.device.type == "cuda"),
                  "algorithm": list(REGISTRY).index(name), "window": window or 0}

        def verify() -> None:
            _verify_same(res, "all_to_all_single", fields, timeout)
            a2a.verify_splits(res.host(timeout), osp, isp, tag=198 if res.on_worker() else 98)

    def run() -> Pending | None:
        if verify is not None:
            verify()
        return a2a.execute(res.algorithm(name, window, timeout), res, output, input, lay, timeout)

    peer = get_class(name).runs_kernel(res, input, timeout)
    if input.is_cuda:  # after the last async peer call on this group
        _after_side_calls(res, input.device)
    if peer and async_op and verify is None:
        return _on_side_stream(res, run, input.device, (output, input))
    work = _execute(res, "all_to_all_single", timeout, run, async_op, output, name != "native", not input.is_cuda,
                    (name, window))
    if fast_key is not None and peer and verify is None and str(env.get("HPDL_CHECK")) == "auto":
        if len(_FAST) > _FAST_MAX:  # uneven splits that change every call would grow it without bound
            _FAST.clear()
        fn = res.algorithm(name, window, timeout).all_to_all_launcher(lay, input.device)
        if fn is not None:
            _FAST[fast_key] = (res, fn)
    return work


def _split_key(splits):
    """Hashable form of a split-size argument (None, a sequence of ints, or a tensor)."""
    if splits is None:
        return None
    return tuple(splits.tolist()) if isinstance(splits, torch.Tensor) else tuple(int(x) for x in splits)


def _on_side_stream(res: GroupResources, fn: Callable[[], None], device: torch.device, tensors) -> CudaWork:
    """Run ``fn`` (kernel launches only) on the group's side stream after the caller's current stream; the
    returned :class:`CudaWork` orders a later stream after it, like NCCL's async work."""
    current = torch.cuda.current_stream(device)
    if res.side_stream is None:
        res.side_stream = torch.cuda.Stream(device)
    side = res.side_stream
    side.wait_stream(current)
    with torch.cuda.stream(side):
        fn()
        done = torch.cuda.Event()
        done.record(side)
    for t in tensors:
        t.record_stream(side)
    res.side_pending = done
    return CudaWork(done, res)


# ---------------------------------------------------------------- broadcast, reduce, barrier (rooted / no data)

def _outside(group, what: str) -> bool:
    """True (with c10d's warning) when this rank is not a member of ``group``: c10d's collectives return None
    there without communicating, and a drop-in must too."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return False
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        import warnings

        warnings.warn(f"hpdl.comm.{what}: global rank {dist.get_rank()} is not in the given group; nothing to do "
                      "(as torch.distributed)", UserWarning, stacklevel=3)
        return True
    return False


def _root(name: str, value, group_name: str, group_value, group, res: GroupResources) -> int:
    """The root as a rank of the group from c10d's pair (``src``: a global rank; ``group_src``: a rank of
    ``group``); exactly one of them, in range. Checked before any communication."""
    import torch.distributed as dist

    if (value is None) == (group_value is None):
        raise ValueError(f"give exactly one of {name} (a global rank) or {group_name} (a rank of the group), got "
                         f"{name}={value!r}, {group_name}={group_value!r}")
    given, which = (group_value, group_name) if value is None else (value, name)
    if isinstance(given, bool) or not isinstance(given, numbers.Integral):  # numpy ints too, as c10d
        raise TypeError(f"{which} must be an int rank, got {given!r}")
    given = int(given)
    if value is not None:
        value = given
    if value is not None and group is not None and group is not dist.group.WORLD:
        try:
            root = dist.get_group_rank(group, value)
        except (ValueError, RuntimeError):
            root = None
        if root is None or root < 0:
            raise ValueError(f"{name}={value} is not a rank of the group (its global ranks are {res.global_ranks()}); "
                             f"pass a member, or {group_name} for a rank counted inside the group")
        return int(root)
    if not 0 <= given < res.world_size:
        raise ValueError(f"{which} must be a rank in [0, {res.world_size - 1}] of the group, got {given}")
    return given


def _rooted(what: str, tensor: torch.Tensor, root: int, op: str, res: GroupResources, algorithm: str, timeout,
            check):
    """validate -> resolve for broadcast / reduce; returns ``(name, timeout, verify)``."""
    _check_tensor("tensor", tensor, res)
    check_dtype(tensor.dtype, op)
    timeout = _timeout(timeout)
    name, _ = _resolve(res, algorithm, tensor, None, what, timeout)
    mode = env.get("HPDL_CHECK") if check is None else check
    verify = None
    if (mode is True or (mode == "auto" and tensor.device.type == "cpu")) and res.world_size > 1:
        fields = {"count": tensor.numel(), "dtype": _DTYPE_CODE.get(tensor.dtype, 100 + tensor.element_size()),
                  "op": REDUCE_OPS.index(op), "device": int(tensor.device.type == "cuda"),
                  "algorithm": list(REGISTRY).index(name), "root": root}

        def verify() -> None:
            _verify_same(res, what, fields, timeout)
    return name, timeout, verify


def _run_rooted(res: GroupResources, tensor: torch.Tensor, call: Callable[[torch.Tensor], "Pending | None"],
                write_back: bool) -> "Pending | None":
    """Run ``call`` on a flat contiguous view of ``tensor`` (a copy for a strided one, written back after when
    ``write_back``)."""
    if tensor.numel() == 0 or res.world_size == 1:
        return None
    buf = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    pending = call(buf)
    if write_back and not tensor.is_contiguous():
        return _then(pending, lambda: tensor.copy_(buf.view(tensor.shape)))
    return pending


def broadcast(tensor: torch.Tensor, src: int | None = None, group=None, async_op: bool = False,
              group_src: int | None = None, *, algorithm: str = "auto", timeout: float | None = None,
              check: bool | None = None):
    """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank of ``group``, in place.

    Signature of ``torch.distributed.broadcast(tensor, src, group, async_op, group_src)``; hpdl's options are
    keyword-only. Afterwards every rank's tensor is bitwise rank ``src``'s.

    Args:
        tensor: any shape, contiguous or not, any dtype of :data:`SUPPORTED_DTYPES`; the same count and dtype
            on every rank. CPU with gloo, CUDA with NCCL.
        src: the source as a global rank (as c10d); or ``group_src``, the source counted inside ``group``.
            Exactly one of them.
        group, async_op, timeout, check: as :func:`all_reduce`.
        algorithm: "auto" (the tuning table; native until a measured table says otherwise), "binomial"
            (binomial tree, :mod:`hpdl.comm.algorithms.tree`) or "native" (torch.distributed).

    Returns:
        None, or a :class:`Work` when ``async_op`` is True.

    Raises:
        TypeError / ValueError: bad tensor, dtype, root or algorithm (nothing has been communicated).
        CollectiveMismatchError: ranks passed different counts, dtypes, roots or algorithms (``check``).
        CollectiveTimeoutError / PeerFailedError: a peer did not answer in ``timeout`` or is gone; named.
    """
    _check_async(async_op, "broadcast")
    if _outside(group, "broadcast"):
        return None
    res = _group(group)
    _check_tensor("tensor", tensor, res)
    root = _root("src", src, "group_src", group_src, group, res)
    name, timeout, verify = _rooted("broadcast", tensor, root, "sum", res, algorithm, timeout, check)

    def run() -> Pending | None:
        if verify is not None:
            verify()
        return _run_rooted(res, tensor, lambda buf: res.algorithm(name, None, timeout).broadcast(
            buf, root, res.comm(timeout)), write_back=res.rank != root)

    return _execute(res, "broadcast", timeout, run, async_op, tensor, name != "native", not tensor.is_cuda,
                    (name, None))


def reduce(tensor: torch.Tensor, dst: int | None = None, op="sum", group=None, async_op: bool = False,
           group_dst: int | None = None, *, algorithm: str = "auto", timeout: float | None = None,
           check: bool | None = None):
    """Reduce ``tensor`` across all ranks of ``group`` into ``tensor`` of rank ``dst``, in place.

    Signature of ``torch.distributed.reduce(tensor, dst, op, group, async_op, group_dst)``; hpdl's options are
    keyword-only. Only rank ``dst`` receives the result; the other ranks' tensors are left unchanged (torch
    leaves them unspecified).

    Args:
        tensor: as :func:`all_reduce` (dtypes, ops, 16-bit floats accumulated in float32).
        dst: the destination as a global rank (as c10d); or ``group_dst``, counted inside ``group``.
            Exactly one of them.
        op: "sum", "avg" (floating dtypes), "min", "max", "product", or a ``torch.distributed.ReduceOp``.
        group, async_op, timeout, check: as :func:`all_reduce`.
        algorithm: "auto" (the tuning table; native until a measured table says otherwise), "binomial"
            (binomial tree, :mod:`hpdl.comm.algorithms.tree`) or "native" (torch.distributed).

    Returns:
        None, or a :class:`Work` when ``async_op`` is True.

    Raises:
        As :func:`broadcast`, plus ValueError for an op the dtype does not support.
    """
    _check_async(async_op, "reduce")
    if _outside(group, "reduce"):
        return None
    res = _group(group)
    _check_tensor("tensor", tensor, res)
    root = _root("dst", dst, "group_dst", group_dst, group, res)
    op = normalize_op(op)
    name, timeout, verify = _rooted("reduce", tensor, root, op, res, algorithm, timeout, check)

    def run() -> Pending | None:
        if verify is not None:
            verify()
        return _run_rooted(res, tensor, lambda buf: res.algorithm(name, None, timeout).reduce(
            buf, root, op, res.comm(timeout)), write_back=res.rank == root)

    return _execute(res, "reduce", timeout, run, async_op, tensor, name != "native", not tensor.is_cuda,
                    (name, None))


def barrier(group=None, async_op: bool = False, device_ids: list[int] | None = None, *, algorithm: str = "auto",
            timeout: float | None = None):
    """Return once every rank of ``group`` has called ``barrier``.

    Signature of ``torch.distributed.barrier(group, async_op, device_ids)`` (``timeout`` is keyword-only here,
    in seconds as everywhere in hpdl.comm). ``device_ids`` is accepted for c10d compatibility (NCCL uses it to
    pick the device) and checked, not used: the group's transport already knows its device.

    Args:
        algorithm: "auto" (the tuning table; native until a measured table says otherwise),
            "dissemination" (:mod:`hpdl.comm.algorithms.tree`) or "native" (``torch.distributed.barrier``).

    Returns:
        None, or a :class:`Work` when ``async_op`` is True.

    Raises:
        TypeError / ValueError: bad ``device_ids``, ``algorithm`` or ``timeout``.
        CollectiveTimeoutError / PeerFailedError: a rank did not arrive within ``timeout``; named.
    """
    _check_async(async_op, "barrier")
    if device_ids is not None and (not isinstance(device_ids, (list, tuple)) or
                                   any(isinstance(d, bool) or not isinstance(d, int) for d in device_ids)):
        raise TypeError(f"device_ids must be None or a list of int GPU indices, got {device_ids!r}")
    if _outside(group, "barrier"):
        return None
    res = _group(group)
    timeout = _timeout(timeout)
    device = "cuda" if res.backend == "nccl" else "cpu"
    name = canonical(algorithm)
    if name == "auto":
        name, _ = tuning.resolve("barrier", 0, res.world_size, device)
    elif not implements(name, "barrier"):
        raise ValueError(f"algorithm={algorithm!r} has no barrier; use 'auto' or one of {algorithms_for('barrier')}")

    def run() -> Pending | None:
        if res.world_size == 1:
            return None
        return res.algorithm(name, None, timeout).barrier(res.comm(timeout))

    return _execute(res, "barrier", timeout, run, async_op, None, name != "native", device == "cpu", (name, None))
