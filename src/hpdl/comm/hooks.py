"""DDP communication hook: gradient buckets all-reduced (averaged) through hpdl.comm.

>>> # model = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
>>> # hpdl.comm.hooks.register(model, algorithm="auto")   # uses model.process_group

The hook averages each bucket like DDP's default (sum, then divide by world size) with the algorithm of
``HookState``. Every bucket's communication is issued inside the hook, on DDP's thread, in bucket order, so
it matches DDP's own collectives (the unused-parameter bitmap of ``find_unused_parameters=True``) across
ranks. CPU buckets return the Work's future at once (``native``: torch's collective in flight; hpdl's
schedules: queued on the group's worker), so backward continues while buckets are reduced; CUDA buckets run on
the current stream (the peer kernels are stream-ordered, so the returned future is complete when the work is
queued, as NCCL's is). The argument check (``HPDL_CHECK``, a blocking exchange) runs on the first call of each
bucket layout only (DDP rebuilds its buckets once, after the first step); later calls of the same bucket skip it.
"""

# no `from __future__ import annotations`: DDP inspects the hook's annotations at registration

import contextlib
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import hpdl.comm as hc


@dataclass
class HookState:
    """Arguments of every bucket's all-reduce: ``algorithm``, ``window`` and ``group``, which must be the DDP
    model's own process group (None means the default world group; :func:`register` fills it in).
    ``checked`` holds the bucket layouts ``(index, numel, dtype)`` whose arguments were verified across ranks."""

    algorithm: str = "auto"
    group: object = None
    window: int | None = None
    checked: set = field(default_factory=set)

    def check_for(self, bucket: dist.GradBucket, buf: torch.Tensor):
        """None (``HPDL_CHECK``) on the first call of this bucket layout, False afterwards: every rank's DDP
        has the same buckets, so once a layout was verified the exchange would only add latency."""
        key = (bucket.index(), buf.numel(), buf.dtype)
        if key in self.checked:
            return False
        self.checked.add(key)
        return None


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` (1-D, the bucket's gradients) over the group; returns a torch Future of it.

    Raises: what :func:`hpdl.comm.all_reduce` raises, directly for CUDA buckets and through the future for CPU.
    """
    buf = bucket.buffer()
    check = state.check_for(bucket, buf)
    if buf.is_cuda:
        hc.all_reduce(buf, op="avg", group=state.group, algorithm=state.algorithm, window=state.window, check=check)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut
    work = hc.all_reduce(buf, op="avg", group=state.group, async_op=True, algorithm=state.algorithm,
                         window=state.window, check=check)
    return work.get_future()


def register(model: torch.nn.parallel.DistributedDataParallel, algorithm: str = "auto",
             window: int | None = None) -> HookState:
    """Register :func:`allreduce_hook` on ``model`` over the model's own process group; returns the state."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"model must be a DistributedDataParallel module, got {type(model).__name__}")
    state = HookState(algorithm=algorithm, group=model.process_group, window=window)
    model.register_comm_hook(state, allreduce_hook)
    return state


# --- gradient-bucket all-reduce for loops without DDP or FSDP --------------------------------------------------

class _Bucket:
    """One flat gradient buffer: ``views[i]`` is parameter ``params[i]``'s gradient inside it, and after the
    gradients ``flags[i]``, 1 where this rank has a gradient for it: averaged with the gradients, a flag is 0
    only where no rank had one (that parameter's ``p.grad`` then stays None, as DDP leaves it)."""

    def __init__(self, params: list, device: torch.device, dtype: torch.dtype):
        self.params = params
        n = sum(p.numel() for p in params)
        self.buffer = torch.zeros(n + len(params), dtype=dtype, device=device)
        self.views, off = [], 0
        for p in params:
            self.views.append(self.buffer[off:off + p.numel()].view(p.shape))
            off += p.numel()
        self.flags = self.buffer[n:]
        self.ready = [False] * len(params)
        self.pending = len(params)
        self.missing: list[int] = []   # parameters without a gradient on this rank this step
        self.work = None


class BucketAllReduce:
    """Average the gradients of ``params`` over ``group`` in size-capped buckets, each all-reduced through
    :func:`hpdl.comm.all_reduce` (``async_op=True``: torch's collective in flight, or hpdl's schedule queued on
    the group's worker thread) as soon as its last gradient is accumulated, so that communication overlaps the
    rest of backward; :meth:`wait` finishes them all before the optimizer step.

    This is what DDP's reducer does (Li et al., "PyTorch Distributed", VLDB 2020), for a loop that keeps the
    plain module: parameters go into buckets in reverse registration order (roughly the order backward
    produces their gradients), the first bucket small (``first_bucket_mb``) so that communication starts
    early, the others up to ``bucket_cap_mb``; buckets are launched in bucket order on every rank, so calls
    on the group match whatever order gradients become ready in. Post-accumulate-grad hooks
    (``Tensor.register_post_accumulate_grad_hook``, torch >= 2.1) copy each gradient into its bucket; after
    :meth:`wait` every ``p.grad`` is a view of its bucket, the average over ranks, bit-identical on every
    rank, so later backward passes accumulate into the bucket directly (no copy) unless the gradients are
    set to None.

    Example (every rank)::

        ctx = hpdl.runtime.init_from_env("cpu")             # torchrun / mpirun environment
        torch.manual_seed(0)
        model = MyModel()
        grads = hpdl.comm.hooks.BucketAllReduce(model.parameters())  # copies rank 0's weights to all
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for x, y in batches:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()                                 # buckets all-reduce while backward runs
            grads.wait()                                    # p.grad = mean over ranks
            opt.step()
            opt.zero_grad()

    Args:
        params: the parameters (an iterable such as ``model.parameters()``); those without ``requires_grad``
            are skipped, repeats are counted once.
        group: process group (None = world).
        bucket_cap_mb: most MiB of gradient per bucket (DDP's default 25).
        first_bucket_mb: MiB cap of the first bucket (DDP's 1).
        algorithm, window: passed to :func:`hpdl.comm.all_reduce` (``"auto"``: the tuning table by size).
        broadcast_from: group rank whose parameter values are copied to every rank at construction (as DDP
            does); None to skip.
        check: :func:`hpdl.comm.all_reduce`'s per-call argument check. The bucket layout is checked once here,
            so the default (False) skips the per-call exchange; None uses ``HPDL_CHECK``.

    With ``group=None`` the buckets are all-reduced on a private copy of the world group (made here, so
    construction is collective over the world), so that the caller's own collectives between ``backward()``
    and :meth:`wait` (a loss all-reduce for logging) are kept apart from the buckets'. (hpdl.comm keeps every
    group's calls in call order, so an explicit ``group`` works too, provided every rank issues its other
    collectives on it in the same order relative to backward.)

    Parameters are tracked as they were at construction. A tracked parameter that gets no gradient on any
    rank in a step (unused, or frozen since) keeps ``p.grad`` None, so optimizers skip it as without
    data parallelism; one that was frozen at construction and has a gradient now is an error (build a new
    BucketAllReduce after changing ``requires_grad``).

    Raises:
        ValueError: no parameter requires grad, or a cap is not positive.
        RuntimeError: torch.distributed is not initialised; the ranks' bucket layouts differ (their models
            differ); a gradient became ready twice before :meth:`wait` (two backward passes: put the first
            under :meth:`no_sync`); a gradient is sparse (``nn.Embedding(sparse=True)``: only dense gradients
            are averaged); in :meth:`wait`, a parameter frozen at construction has a gradient.
    """

    def __init__(self, params, *, group=None, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 algorithm: str = "auto", window: int | None = None, broadcast_from: int | None = 0,
                 check: bool | None = False):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call hpdl.runtime.init_from_env() first")
        if not bucket_cap_mb > 0 or not first_bucket_mb > 0:
            raise ValueError(f"bucket_cap_mb and first_bucket_mb must be > 0, got {bucket_cap_mb} and "
                             f"{first_bucket_mb}")
        seen, plist, frozen = set(), [], []
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                (plist if p.requires_grad else frozen).append(p)
        if not plist:
            raise ValueError("params has no parameter with requires_grad=True")
        self._frozen = frozen
        self.world_size = dist.get_world_size(group)
        if group is None and self.world_size > 1:
            group = dist.new_group(list(range(self.world_size)))   # the buckets' own (see the docstring)
        self.group, self.algorithm, self.window, self.check = group, algorithm, window, check
        self.buckets: list[_Bucket] = []
        members: list = []
        cap, key = first_bucket_mb * 2 ** 20, None
        for p in reversed(plist):
            k = (p.device, p.dtype)
            nbytes = sum(q.numel() * q.element_size() for q in members)
            if members and (k != key or nbytes + p.numel() * p.element_size() > cap):
                self.buckets.append(_Bucket(members, *key))
                members, cap = [], bucket_cap_mb * 2 ** 20
            members.append(p)
            key = k
        self.buckets.append(_Bucket(members, *key))
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._next = 0       # first bucket not yet launched this step
        self._sync = True
        self._verify_layout()
        if broadcast_from is not None and self.world_size > 1:
            src = dist.get_global_rank(group, broadcast_from)
            with torch.no_grad():
                for b in self.buckets:
                    for v, p in zip(b.views, b.params):
                        v.copy_(p)
                    dist.broadcast(b.buffer, src=src, group=group)
                    for v, p in zip(b.views, b.params):
                        p.copy_(v)
                    b.buffer.zero_()
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in plist]

    def _verify_layout(self) -> None:
        """Every rank must have the same buckets (count, sizes, dtypes), or the all-reduces would not match."""
        if self.world_size == 1:
            return
        sig = [len(self.buckets)] + [b.buffer.numel() * 256 + zlib.crc32(str(b.buffer.dtype).encode()) % 256
                                     for b in self.buckets]
        dev = self.buckets[0].buffer.device
        mine = torch.tensor(sig, dtype=torch.int64, device=dev)
        n = torch.tensor([len(sig), -len(sig)], dtype=torch.int64, device=dev)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        same = int(n[0]) == -int(n[1])
        if same:
            both = torch.cat([mine, -mine])
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
            same = bool((both[:len(sig)] == -both[len(sig):]).all())
        if not same:
            raise RuntimeError(f"BucketAllReduce: rank {dist.get_rank(self.group)}'s {len(self.buckets)} buckets "
                               f"({sum(b.buffer.numel() for b in self.buckets)} gradient elements) differ from "
                               "another rank's; every rank must pass the same parameters (same model, same order)")

    @staticmethod
    def _take(b: _Bucket, i: int, p: torch.Tensor) -> None:
        """Copy ``p.grad`` into its bucket view (unless it is that view already)."""
        if p.grad.layout != torch.strided:
            raise RuntimeError(f"the gradient of a parameter of shape {tuple(p.shape)} is {p.grad.layout}; "
                               "BucketAllReduce averages dense gradients only (use nn.Embedding(sparse=False), "
                               "or DDP for sparse gradients)")
        if p.grad.data_ptr() != b.views[i].data_ptr():
            b.views[i].copy_(p.grad)

    def _ready(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        b, i = self._where[id(p)]
        if b.ready[i]:
            raise RuntimeError(f"the gradient of a parameter of shape {tuple(p.shape)} became ready twice before "
                               "BucketAllReduce.wait(); run all but the last backward of a step under no_sync()")
        self._take(b, i, p)
        b.ready[i] = True
        b.pending -= 1
        if b.pending == 0:
            b.flags.fill_(1)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            b = self.buckets[self._next]
            b.work = hc.all_reduce(b.buffer, op="avg", group=self.group, async_op=True, algorithm=self.algorithm,
                                   window=self.window, check=self.check)
            self._next += 1

    def wait(self) -> None:
        """Finish every bucket's all-reduce and point each ``p.grad`` at its averaged view.

        Buckets whose gradients did not all become ready this step (parameters unused on this rank) are
        launched here, in order, with ``p.grad`` (or zeros where it is None) for the missing ones: every rank
        must call wait() once per step. A parameter without a gradient on every rank keeps ``p.grad`` None.
        Raises what :func:`hpdl.comm.all_reduce` raises, and RuntimeError for a parameter that was frozen at
        construction and has a gradient now (it would not be averaged).
        """
        for p in self._frozen:
            if p.requires_grad and p.grad is not None:
                raise RuntimeError(f"a parameter of shape {tuple(p.shape)} had requires_grad=False when "
                                   "BucketAllReduce was built and has a gradient now, which would not be averaged "
                                   "over ranks; after changing requires_grad, remove() this BucketAllReduce and "
                                   "build a new one")
        for b in self.buckets[self._next:]:
            if b.pending:
                have = []
                with torch.no_grad():
                    for i, p in enumerate(b.params):
                        if b.ready[i] or p.grad is not None:
                            if not b.ready[i]:
                                self._take(b, i, p)
                            have.append(1.0)
                        else:
                            b.views[i].zero_()
                            b.missing.append(i)
                            have.append(0.0)
                    b.flags.copy_(torch.tensor(have, dtype=b.flags.dtype))
                b.pending = 0
        self._launch_ready()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            # a host read only where this rank lacked a gradient: did any rank have one?
            unused = {i for i, f in zip(b.missing, b.flags[b.missing].tolist()) if f == 0} if b.missing else ()
            for i, (p, v) in enumerate(zip(b.params, b.views)):
                if i not in unused and (p.grad is None or p.grad.data_ptr() != v.data_ptr()):
                    p.grad = v
            b.work, b.ready, b.pending, b.missing = None, [False] * len(b.params), len(b.params), []
        self._next = 0

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate local gradients only (gradient accumulation, as DDP.no_sync)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def remove(self) -> None:
        """Remove the gradient hooks (the buffers stay referenced by ``p.grad``)."""
        for h in self._handles:
            h.remove()
        self._handles = []
