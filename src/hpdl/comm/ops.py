"""Reduction ops and dtypes hpdl.comm supports, and the element-wise kernels every algorithm shares.

16-bit floats are accumulated in float32 and rounded once at the end (NCCL and TensorRT-LLM do the same;
accumulating in bf16 loses accuracy, see NVIDIA/TensorRT-LLM PR #16753).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

REDUCE_OPS = ("sum", "avg", "min", "max", "product")
# Appended at the end only: a dtype's index is its code in the HPDL_CHECK argument exchange.
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                    torch.uint8, torch.int8, torch.bool, torch.complex64)
_FLOAT16 = (torch.float16, torch.bfloat16)

_FROM_TORCH = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MIN: "min",
               dist.ReduceOp.MAX: "max", dist.ReduceOp.PRODUCT: "product"}
_ALIASES = {"prod": "product", "mean": "avg"}


def normalize_op(op) -> str:
    """``op`` as one of :data:`REDUCE_OPS`; accepts the strings and ``torch.distributed.ReduceOp`` values.

    Raises:
        ValueError: unknown op, naming the valid ones.
    """
    if isinstance(op, str):
        name = _ALIASES.get(op.lower(), op.lower())
        if name in REDUCE_OPS:
            return name
    else:
        for key, name in _FROM_TORCH.items():
            if op == key:
                return name
    raise ValueError(f"op must be one of {REDUCE_OPS} (or a torch.distributed.ReduceOp), got {op!r}")


def check_dtype(dtype: torch.dtype, op: str) -> None:
    """Raise ValueError naming ``dtype`` or ``op`` when the pair is not supported."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"tensor dtype must be one of {names}; got {dtype}")
    if dtype.is_complex and op not in ("sum", "avg"):  # torch.distributed's rule for complex tensors
        raise ValueError(f"op={op!r} is not defined here for complex tensors (dtype {dtype}); use 'sum' or 'avg'")
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"op='avg' needs a floating-point tensor (the mean of integers is not an integer); "
                         f"got dtype {dtype}: use op='sum' and divide")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:  # bool sums saturate (or), as gloo's
    """Accumulation dtype: float32 for float16/bfloat16, the dtype itself otherwise."""
    return torch.float32 if dtype in _FLOAT16 else dtype


def combine_(acc: torch.Tensor, x: torch.Tensor, op: str) -> None:
    """``acc = acc (op) x`` in place; ``x`` may have a narrower dtype than ``acc``. ``avg`` sums here."""
    if op in ("sum", "avg"):
        acc.add_(x)
    elif op == "product":
        acc.mul_(x)
    elif op == "min":
        torch.minimum(acc, x.to(acc.dtype), out=acc)
    elif op == "max":
        torch.maximum(acc, x.to(acc.dtype), out=acc)
    else:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")


def finalize_(acc: torch.Tensor, out: torch.Tensor, op: str, world_size: int) -> None:
    """Write the reduced ``acc`` into ``out`` (cast to its dtype), dividing by ``world_size`` for avg."""
    if op == "avg":
        acc.div_(world_size)
    if out.data_ptr() != acc.data_ptr() or out.dtype != acc.dtype:
        out.copy_(acc)


def to_torch_op(op: str):
    """The ``torch.distributed.ReduceOp`` for ``op`` (avg maps to SUM; callers divide)."""
    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX, "product": dist.ReduceOp.PRODUCT}[op]


def shard_bounds(count: int, world_size: int) -> list[tuple[int, int]]:
    """``world_size`` contiguous ``(start, stop)`` ranges covering ``count`` elements, sizes differing by <= 1.

    The first ``count % world_size`` shards get one extra element; shards may be empty when count < world_size.
    """
    base, extra = divmod(count, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
