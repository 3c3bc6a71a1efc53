"""Direct all-reduce over peer GPU memory on one node: one-shot and two-shot, one kernel launch per call.

Algorithm (Direct Sendrecv with throttling, Chen et al., ICPP 2025, read as in docs/comm.md, "GPUs of one
host"; the kernel pattern follows vLLM's and TensorRT-LLM's custom all-reduce):

* ``one_shot``: every rank stores its whole tensor into a slot of every peer's registered buffer and reduces
  the W copies in rank order; (W-1)·n bytes out per rank, best for small n. Up to :data:`LL_MAX_BYTES` it runs
  the LL variant (8-byte payload + epoch flag per 16-byte packet, the reader polls the flags: no barrier, one
  NVLink crossing; NCCL's LL protocol), above it the barrier variant.
* ``two_shot``: the tensor is cut into W shards. Reduce-scatter: rank r stores shard p into peer p's buffer;
  barrier; rank r reduces shard r in rank order, writes it and stores it into every peer's all-gather slot;
  barrier; each rank copies the gathered shards out. 2·(W-1)/W·n bytes out per rank: best for large n.
* Peers are visited in windows of ``window`` (k) starting at rank+1, so at most k links are loaded at once.
* Pipelining: each of ``grid`` thread blocks works through rounds of ``chunk`` units, with its own barriers, so
  one block's copy-out overlaps another block's transfer; the registered buffer holds one round per block,
  hence a fixed size (64 KiB + 4 MiB + 8 MiB + 132 MiB at W=2 on 132-SM GPUs) whatever the tensor size.

:func:`reference_all_reduce` runs the same schedule (same :func:`schedule`, same slots, same rank order, same
float32 accumulation) on CPU tensors; CI tests it against torch.distributed, the device benchmark tests the
kernels against it bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hpdl.comm.algorithms.base import AllReduce
from hpdl.comm.transport.resources import GroupResources, all_resources, lookup, resources_of

OPS = {"sum": 0, "avg": 1, "min": 2, "max": 3, "product": 4}
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int32: 3, torch.int64: 4}
ALGORITHMS = ("one_shot", "two_shot")
# Kernel variants and their codes in the extension. "one_shot" resolves to the LL variant up to LL_MAX_BYTES
# and to the barrier variant above; the variants can be asked for by name (benchmarks, tuning).
VARIANTS = {"one_shot_barrier": 0, "two_shot": 1, "one_shot_ll": 2}
UNIT_BYTES = {"one_shot_barrier": 16, "two_shot": 16, "one_shot_ll": 8}   # payload per 16-byte store
LL_MAX_BYTES = 256 * 1024        # measured on 2 x H200: LL wins up to 256 KiB, the barrier variant above
MAX_RANKS = 8
MAX_BLOCKS = 256                   # flag slots per variant in the header (kMaxBlocks)
ONE_SHOT_MAX_BLOCKS = 64
ONE_SHOT_SLOT_BYTES = 32 * 1024
LL_SLOT_BYTES = 16 * 1024          # 1024 packets of 16 bytes, 8 payload bytes each
HEADER_BYTES = 64 * 1024
MIN_CHUNK_UNITS = 512              # one unit per thread of a 512-thread block
# Per-variant cap of the per-block chunk (in units), to study pipelining depth; None = the slot size.
# Change it through set_chunk_cap(), which also drops the cached schedules.
CHUNK_CAP_VECS: dict[str, int | None] = {v: None for v in VARIANTS}
BUFFER_BACKEND = "auto"       # "auto" | "symm" | "ipc", for buffers registered from now on (see transport.symm)


def two_shot_slot_bytes(world: int) -> int:
    """Per-block slot of the two-shot region: 512 KiB split over the ranks, at least 32 KiB."""
    return max(32 * 1024, (512 * 1024) // max(world, 1))


def variant(algorithm: str, nbytes: int) -> str:
    """Kernel variant for ``algorithm`` ("one_shot", "two_shot" or a variant name) at ``nbytes``.

    Raises:
        ValueError: unknown algorithm.
    """
    if algorithm == "one_shot":
        return "one_shot_ll" if nbytes <= LL_MAX_BYTES else "one_shot_barrier"
    if algorithm not in VARIANTS:
        raise ValueError(f"algorithm must be one of {list(ALGORITHMS) + list(VARIANTS)}, got {algorithm!r}")
    return algorithm


def schedule(n: int, itemsize: int, world: int, variant_name: str, max_blocks: int, slot_units: int,
             chunk_cap: int | None = None) -> tuple[int, int]:
    """Grid and per-block chunk (in units: 16 bytes, 8 for one_shot_ll) for ``n`` elements of ``itemsize``.

    The span is the whole tensor (one-shot) or one shard of ceil(units / world) (two-shot). The chunk spreads
    the span over up to ``max_blocks`` blocks, at least :data:`MIN_CHUNK_UNITS`, at most ``slot_units``
    (and ``chunk_cap``); larger spans take several rounds. Returns ``(grid, chunk)``, grid 0 when n == 0.
    """
    units = -(-n // (UNIT_BYTES[variant_name] // itemsize))
    span = -(-units // world) if variant_name == "two_shot" else units
    if span == 0:
        return 0, 1
    cap = min(slot_units, chunk_cap or slot_units)
    chunk = max(1, min(cap, max(MIN_CHUNK_UNITS, -(-span // max_blocks))))
    return min(max_blocks, -(-span // chunk)), chunk


KIND = "peer_all_reduce"   # registration kind in the group's GroupResources


class _Comm:
    """Registered buffer + extension handle of one (group, device): a registration owned by the group's
    :class:`~hpdl.comm.transport.resources.GroupResources` (made by :func:`communicator`)."""

    def __init__(self, group, device: torch.device):
        from hpdl.comm.transport.kernels import load_peer_allreduce
        from hpdl.comm.transport.symm import PeerBuffer, device_census
        from hpdl.runtime import env

        self.ext = load_peer_allreduce()
        self.world = dist.get_world_size(group)
        if self.world > MAX_RANKS:
            raise ValueError(f"peer all-reduce supports groups of at most {MAX_RANKS} ranks, got {self.world}")
        slots = {"one_shot_ll": LL_SLOT_BYTES, "one_shot_barrier": ONE_SHOT_SLOT_BYTES,
                 "two_shot": two_shot_slot_bytes(self.world)}
        # two-shot: one block per SM of the smallest GPU of the group (all blocks must be co-resident); ranks
        # sharing a GPU share its SMs (device_census), so each takes its part
        sms, sharing = device_census(group, device)
        self.max_blocks = {"one_shot_ll": max(1, ONE_SHOT_MAX_BLOCKS // sharing),
                           "one_shot_barrier": max(1, ONE_SHOT_MAX_BLOCKS // sharing),
                           "two_shot": max(1, min(sms // sharing, MAX_BLOCKS))}
        # layout: header (flags, counters), then one region per variant of blocks x 2 x world slots
        regions, offset = {}, HEADER_BYTES
        for name in ("one_shot_ll", "one_shot_barrier", "two_shot"):
            regions[name] = offset
            offset += self.max_blocks[name] * 2 * self.world * slots[name]
        self.buffer = PeerBuffer(group, device, offset, header_bytes=HEADER_BYTES, backend=BUFFER_BACKEND)
        self.slot_units = {k: v // 16 for k, v in slots.items()}
        self.window = int(env.get("HPDL_DIRECT_WINDOW")) or self.world - 1
        timeout_ns = int(float(env.get("HPDL_TIMEOUT")) * 1e9)
        order = sorted(VARIANTS, key=VARIANTS.get)
        self.handle = self.ext.create(self.buffer.ptrs, self.buffer.rank, self.world, device.index,
                                      [regions[k] for k in order], [self.slot_units[k] for k in order], timeout_ns)
        self.plans: dict[tuple, tuple] = {}

    def plan(self, tensor: torch.Tensor, op: str, algorithm: str, window: int | None) -> tuple:
        """Launch arguments after the pointer, (n, dtype, op, variant, window, grid, chunk), or () for a no-op.

        Cached per (numel, dtype, op, algorithm, window) in ``self.plans``, which the fast path reads.
        """
        n, dtype = tensor.numel(), tensor.dtype
        if n == 0 or self.world == 1:
            got: tuple = ()
        else:
            v = variant(algorithm, n * tensor.element_size())
            grid, chunk = schedule(n, tensor.element_size(), self.world, v, self.max_blocks[v], self.slot_units[v],
                                   CHUNK_CAP_VECS.get(v))
            got = (n, DTYPES[dtype], OPS[op], VARIANTS[v], window or self.window, grid, chunk)
        self.plans[(n, dtype, op, algorithm, window)] = got
        return got

    def close(self) -> None:
        """Free the handle and the buffer (collective over the group)."""
        self.ext.release(self.handle)
        self.buffer.close()

    def forget(self) -> None:
        """Drop the handle without communicating (the group is gone; the mapping is freed at exit)."""
        self.ext.release(self.handle)


def communicator(resources: GroupResources, device: torch.device) -> _Comm:
    """The group's registered all-reduce buffer on ``device`` (registered at first use: collective)."""
    return resources.registration(KIND, device, lambda: _Comm(resources.group, device))


def set_chunk_cap(variant_name: str, units: int | None) -> None:
    """Cap the per-block chunk of ``variant_name`` at ``units`` (None = slot size); for benchmarks and tests."""
    if variant_name not in VARIANTS or (units is not None and units < 1):
        raise ValueError(f"variant must be one of {list(VARIANTS)} and units None or >= 1, got "
                         f"{variant_name!r}, {units!r}")
    CHUNK_CAP_VECS[variant_name] = units
    for res in all_resources():
        for (kind, _), comm in res.registered.items():
            if kind == KIND:
                comm.plans.clear()


def register(group=None, device: torch.device | None = None) -> None:
    """Create the group's registered buffer now (collective). Call it before CUDA-graph capture."""
    communicator(resources_of(group),
                 torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device))


def release(group=None) -> None:
    """Free the registered buffers of ``group`` (collective over the group; call before destroying it)."""
    res = lookup(group)
    if res is not None:
        res.release(KIND)


def peer_available(tensor: torch.Tensor, group) -> bool:
    """True when :func:`peer_all_reduce` can take ``tensor`` over ``group`` (no communication, no build).

    Needs a CUDA tensor of float32/float16/bfloat16/int32/int64, a CUDA build of torch and a group of at most
    8 ranks. That the ranks share a host is checked at the first call (collective), which raises otherwise.
    """
    if not (isinstance(tensor, torch.Tensor) and tensor.is_cuda and tensor.dtype in DTYPES):
        return False
    if torch.version.cuda is None or not dist.is_initialized():
        return False
    return 1 <= dist.get_world_size(group) <= MAX_RANKS


def peer_all_reduce(tensor: torch.Tensor, op: str, group, algorithm: str = "two_shot",
                    window: int | None = None) -> None:
    """All-reduce ``tensor`` in place over ``group`` through peer memory, with one kernel on the current stream.

    Args:
        tensor: CUDA tensor, any shape, float32/float16/bfloat16/int32/int64; non-contiguous or non-16-byte-
            aligned views are reduced through a contiguous copy. Every rank passes the same numel and dtype.
        op: "sum", "avg" (floats only), "min", "max" or "product". 16-bit floats accumulate in float32.
        group: process group of ranks on one host (None = default group), at most 8 ranks.
        algorithm: "one_shot" or "two_shot".
        window: peers visited at once (k >= 1); None = ``HPDL_DIRECT_WINDOW`` or all peers.

    Results are bit-identical on every rank. The first call per (group, device) registers the buffer and is
    collective and must not be inside CUDA-graph capture (call :func:`register` first); later calls capture
    and replay safely. Calls on one group must be ordered (one stream, or streams joined by events).

    Raises:
        ValueError: unsupported dtype, op, algorithm or window, or a CPU tensor.
        RuntimeError: the kernel launch failed or the ranks are not on one host.
    """
    _reduce(lookup(group), group, tensor, op, algorithm, window)


def _reduce(res: GroupResources | None, group, tensor: torch.Tensor, op: str, algorithm: str,
            window: int | None) -> None:
    """:func:`peer_all_reduce` on the group's resources ``res`` (None: not made yet)."""
    comm = res.registered.get((KIND, tensor.get_device())) if res is not None else None
    if comm is not None:   # fast path: a cached plan, a contiguous 16-byte aligned tensor -> one launch
        plan = comm.plans.get((tensor.numel(), tensor.dtype, op, algorithm, window))
        if plan is not None:
            if not plan:
                return
            if tensor.is_contiguous():
                ptr = tensor.data_ptr()
                if not ptr % 16:
                    comm.ext.all_reduce(comm.handle, ptr, *plan)
                    return
    _peer_all_reduce_checked(res, group, tensor, op, algorithm, window)


def _peer_all_reduce_checked(res: GroupResources | None, group, tensor: torch.Tensor, op: str, algorithm: str,
                             window: int | None) -> None:
    """The first call of a (numel, dtype, op, algorithm, window), or a view that needs a contiguous copy."""
    dt = DTYPES.get(tensor.dtype) if isinstance(tensor, torch.Tensor) else None
    if dt is None or op not in OPS or not tensor.is_cuda or (window is not None and window < 1) or \
            (algorithm not in VARIANTS and algorithm != "one_shot"):
        _raise_bad_args(tensor, op, algorithm, window)
    if op == "avg" and not tensor.dtype.is_floating_point:
        raise ValueError(f"op='avg' needs a floating-point tensor, got dtype {tensor.dtype}")
    comm = communicator(res if res is not None else resources_of(group), tensor.device)
    plan = comm.plan(tensor, op, algorithm, window)
    if not plan:
        return
    work = tensor
    if not tensor.is_contiguous() or tensor.data_ptr() % 16:
        work = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)   # fresh: 512-byte aligned
        work.copy_(tensor)
    comm.ext.all_reduce(comm.handle, work.data_ptr(), *plan)
    if work is not tensor:
        tensor.copy_(work)


def _raise_bad_args(tensor, op, algorithm, window) -> None:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        raise ValueError(f"tensor must be a CUDA tensor, got {getattr(tensor, 'device', type(tensor))}")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"tensor dtype must be one of {[str(d) for d in DTYPES]}, got {tensor.dtype}")
    if op not in OPS:
        raise ValueError(f"op must be one of {list(OPS)}, got {op!r}")
    variant(algorithm, 0)   # raises for an unknown algorithm
    raise ValueError(f"window must be None or >= 1, got {window!r}")


# ----------------------------------------------------------------------------------------------------------
# CPU reference of the kernels' schedule
# ----------------------------------------------------------------------------------------------------------

def _combine(acc: torch.Tensor, x: torch.Tensor, op: str) -> torch.Tensor:
    if op in ("sum", "avg"):
        return acc + x
    if op == "product":
        return acc * x
    if op == "min":
        return torch.where(x < acc, x, acc)
    return torch.where(x > acc, x, acc)


def _reduce_ranks(parts: list[torch.Tensor], op: str, dtype: torch.dtype, world: int) -> torch.Tensor:
    """``parts[q]`` from rank q, combined in rank order in the accumulation type, as the kernel does."""
    acc_t = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc = parts[0].to(acc_t)
    for x in parts[1:]:
        acc = _combine(acc, x.to(acc_t), op)
    if op == "avg":
        acc = acc / world
    return acc.to(dtype)


def reference_all_reduce(inputs: list[torch.Tensor], op: str, algorithm: str, window: int | None = None, *,
                         max_blocks: int | None = None, slot_bytes: int | None = None) -> list[torch.Tensor]:
    """Run the kernels' schedule on CPU tensors: ``inputs[r]`` is rank r's tensor; returns each rank's output.

    ``algorithm`` is "one_shot", "two_shot" or a kernel variant name; "one_shot" resolves by size exactly as
    :func:`peer_all_reduce` does (:func:`variant`). Simulates every block's rounds with per-rank slot buffers:
    pushes in window order (with LL flags for one_shot_ll, checked on read), reduction in rank order with
    float32 accumulation for 16-bit floats, the two-shot owner-only reduction and gather. ``max_blocks`` and
    ``slot_bytes`` default to small values (4 blocks, 1 KiB slots) so that rounds, partial chunks and several
    blocks occur on small tensors; pass the device's values to mirror a device run exactly.

    Raises:
        ValueError: empty list, more than 8 ranks, mismatched shapes/dtypes, or an unsupported op/dtype/algorithm.
    """
    world = len(inputs)
    if not 1 <= world <= MAX_RANKS:
        raise ValueError(f"inputs must hold 1..{MAX_RANKS} tensors, got {world}")
    shape, dtype = inputs[0].shape, inputs[0].dtype
    if any(x.shape != shape or x.dtype != dtype for x in inputs):
        raise ValueError("every rank's tensor must have the same shape and dtype")
    if dtype not in DTYPES or op not in OPS:
        raise ValueError(f"unsupported dtype/op: {dtype}, {op!r}")
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(f"op='avg' needs a floating-point tensor, got dtype {dtype}")
    k = window or world - 1
    if k < 1 and world > 1:
        raise ValueError(f"window must be >= 1, got {window!r}")
    n, itemsize = inputs[0].numel(), inputs[0].element_size()
    v = variant(algorithm, n * itemsize)
    lanes = UNIT_BYTES[v] // itemsize
    nu = math.ceil(n / lanes)
    grid, chunk = schedule(n, itemsize, world, v, max_blocks or 4, (slot_bytes or 1024) // 16, CHUNK_CAP_VECS.get(v))
    # data[r]: rank r's tensor as (units, lanes), zero-padded like the kernels' partial loads
    data = [torch.cat([x.detach().reshape(-1).cpu(), x.new_zeros(nu * lanes - n, device="cpu")]).view(nu, lanes)
            for x in inputs]
    if world == 1 or n == 0:
        return [d.reshape(-1)[:n].clone().view(shape) for d in data]
    # slots[q][block, kind, src] holds `chunk` units, as in rank q's registered buffer; flags: LL packet flags
    slots = [torch.zeros(grid, 2, world, chunk, lanes, dtype=dtype) for _ in range(world)]
    flags = [torch.zeros(grid, 2, world, chunk, dtype=torch.int64) for _ in range(world)]
    order = [[(r + j) % world for j in range(1, world)] for r in range(world)]
    windows = [[o[i:i + k] for i in range(0, world - 1, k)] for o in order]
    one_shot = v != "two_shot"
    span = nu if one_shot else math.ceil(nu / world)
    stride = 0 if one_shot else span
    epoch = [0] * grid
    for b in range(grid):
        for first in range(b * chunk, span, grid * chunk):
            cnt = min(chunk, span - first)
            epoch[b] += 1
            kind = epoch[b] & 1 if one_shot else 0
            for r in range(world):   # push (reduce-scatter for two-shot)
                for win in windows[r]:
                    for p in win:
                        lo, hi = first + p * stride, min(first + p * stride + cnt, nu)
                        if hi > lo:
                            slots[p][b, kind, r, : hi - lo] = data[r][lo:hi]
                            flags[p][b, kind, r, : hi - lo] = epoch[b]
            # --- barrier (one_shot_barrier, two_shot) or per-packet flag wait (one_shot_ll) ---
            if one_shot:
                for r in range(world):
                    if v == "one_shot_ll" and not bool((flags[r][b, kind, :, :cnt][torch.arange(world) != r]
                                                        == epoch[b]).all()):
                        raise RuntimeError(f"LL packet with a stale flag: rank {r}, block {b}, epoch {epoch[b]}")
                    parts = [data[q][first:first + cnt] if q == r else slots[r][b, kind, q, :cnt] for q in range(world)]
                    data[r][first:first + cnt] = _reduce_ranks(parts, op, dtype, world)
                continue
            for r in range(world):   # reduce my shard, push it to every peer's all-gather slot
                lo, hi = r * span + first, min(r * span + first + cnt, nu)
                if hi <= lo:
                    continue
                parts = [data[q][lo:hi] if q == r else slots[r][b, 0, q, : hi - lo] for q in range(world)]
                data[r][lo:hi] = _reduce_ranks(parts, op, dtype, world)
                for win in windows[r]:
                    for p in win:
                        slots[p][b, 1, r, : hi - lo] = data[r][lo:hi]
            # --- barrier ---
            for r in range(world):   # gather
                for p in order[r]:
                    lo, hi = p * span + first, min(p * span + first + cnt, nu)
                    if hi > lo:
                        data[r][lo:hi] = slots[r][b, 1, p, : hi - lo]
    return [d.reshape(-1)[:n].clone().view(shape) for d in data]


class _PeerAlgorithm(AllReduce):
    """Registry entry of ``algorithm="one_shot"|"two_shot"`` (:func:`hpdl.comm.all_reduce`, CUDA tensors of
    one node): ``all_reduce(buf, op, comm)`` launches the kernel over the group's registered buffer (a
    registration of its :class:`~hpdl.comm.transport.resources.GroupResources`); ``all_reduce_launcher`` is the
    API's hot path (one launch per call, no lookup but the registration's)."""

    name = "two_shot"

    @classmethod
    def fits(cls, device_type, world_size, *, dtype=None, gpus=None, topology=None) -> bool:
        """CUDA, a CUDA build, 1..8 ranks, a kernel dtype, a GPU of this host per rank, one node (facts given)."""
        return (device_type == "cuda" and torch.version.cuda is not None and 1 <= world_size <= MAX_RANKS
                and (dtype is None or dtype in DTYPES) and (gpus is None or world_size <= gpus)
                and (topology is None or getattr(topology, "single_node", True)))

    @classmethod
    def runs_kernel(cls, resources, tensor, timeout) -> bool:
        return tensor.is_cuda

    def all_reduce(self, buf: torch.Tensor, op: str, comm) -> None:
        if not buf.is_cuda:
            raise ValueError(f"algorithm={self.name!r} reduces CUDA tensors of one node; got a {buf.device} tensor")
        if self.resources is None:
            raise ValueError(f"algorithm={self.name!r} needs its group's GroupResources (the registered buffer)")
        _reduce(self.resources, self.resources.group, buf, op, self.name, self.window)

    def all_reduce_launcher(self, op: str, device: torch.device):
        """``fn(tensor)``: the cached plan's one launch when the tensor is contiguous and 16-byte aligned, else
        the checked path (a contiguous copy, or a registration after :func:`release`)."""
        res, name, window, key = self.resources, self.name, self.window, (KIND, device.index)
        registered, group = res.registered, res.group

        def fn(tensor: torch.Tensor) -> None:
            # _reduce's fast path, inlined on purpose: this runs on every collective, one Python call less
            comm = registered.get(key)
            if comm is not None:
                plan = comm.plans.get((tensor.numel(), tensor.dtype, op, name, window))
                if plan is not None:
                    if not plan:
                        return
                    if tensor.is_contiguous():
                        ptr = tensor.data_ptr()
                        if not ptr % 16:
                            comm.ext.all_reduce(comm.handle, ptr, *plan)
                            return
            _peer_all_reduce_checked(res, group, tensor, op, name, window)

        return fn


class OneShot(_PeerAlgorithm):
    name = "one_shot"


class TwoShot(_PeerAlgorithm):
    name = "two_shot"
