"""Exact-result inputs (nccl-tests' verifiable idea): integer-valued data whose reduction is exact in any order.

Element ``i`` of rank ``r`` is a small integer computed from ``(seed, r, i)``; sums over up to 16 ranks stay
within the range where bfloat16 (8-bit mantissa) is exact, and products are at most 2^4 in magnitude, so any
correct algorithm, in any reduction order, produces exactly the expected value and ``#wrong`` counts bugs,
not rounding.
"""

from __future__ import annotations

import torch


def rank_values(rank: int, count: int, op: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: ``count`` integer values as int64 (cast to ``dtype`` by the caller)."""
    i = torch.arange(count, dtype=torch.int64)
    if op == "product":
        two = (i + rank + seed) % 5 == 0
        neg = ((i * 3 + rank + seed) % 7 == 0) & (dtype != torch.uint8)
        return torch.where(two, torch.full_like(i, 2), torch.where(neg, torch.full_like(i, -1), torch.ones_like(i)))
    v = (i * 7 + rank * 13 + seed) % 17
    return v if dtype == torch.uint8 else v - 8


def make_input(rank: int, count: int, op: str, dtype: torch.dtype, seed: int = 0,
               device: str | torch.device = "cpu") -> torch.Tensor:
    return rank_values(rank, count, op, dtype, seed).to(dtype).to(device)


def expected(world_size: int, count: int, op: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """The exact reduction over all ranks' inputs, rounded once to ``dtype`` (uint8 sums wrap mod 256)."""
    acc = rank_values(0, count, op, dtype, seed).clone()
    for r in range(1, world_size):
        v = rank_values(r, count, op, dtype, seed)
        if op in ("sum", "avg"):
            acc += v
        elif op == "product":
            acc *= v
        elif op == "min":
            acc = torch.minimum(acc, v)
        elif op == "max":
            acc = torch.maximum(acc, v)
    if op == "avg":
        return (acc.double() / world_size).to(dtype)
    if dtype == torch.uint8:
        acc = torch.remainder(acc, 256)
    return acc.to(dtype)


def count_wrong(out: torch.Tensor, want: torch.Tensor) -> int:
    """Elements of ``out`` that differ from ``want`` (bitwise for floats: NaN counts as wrong)."""
    out = out.reshape(-1).cpu()
    want = want.reshape(-1)
    if out.numel() != want.numel():
        return max(out.numel(), want.numel())
    return int((out != want).sum())
