"""Dispatch planning for expert parallelism: pure functions of routing decisions (no processes).

A rank holding ``n`` token copies with destination ranks ``dest [n]`` sends them, grouped by destination, in one
``all_to_all_single``. :func:`plan` gives the stable order (copies keep their relative order within each
destination, so the receiver sees rows ordered by (source rank, source order) and the combine Alltoall can undo
the permutation exactly) and the send counts. The counts are exchanged before the payload so that every rank
sizes its receive buffer from what the senders will really send: with a locally computed capacity
(DeepSpeed-MoE's ``ceil(capacity_factor * tokens * k / E)``) ranks with different token counts disagree, and an
Alltoall with mismatched sizes hangs or mis-sizes. Dispatch is dropless: capacity is exactly the counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hpdl.moe.errors import MoEError


@dataclass
class DispatchPlan:
    """``order [n]`` int64 (rows of the payload in send order), ``send_counts [G]`` (rows per destination)."""

    order: torch.Tensor
    send_counts: list[int]


def plan(dest: torch.Tensor, world_size: int) -> DispatchPlan:
    """Stable grouping of ``dest [n]`` (int64 ranks in ``[0, world_size)``) by destination."""
    if dest.numel() and (int(dest.min()) < 0 or int(dest.max()) >= world_size):
        raise MoEError(f"destination ranks must be in [0, world_size={world_size}), got "
                       f"[{int(dest.min())}, {int(dest.max())}]")
    order = torch.sort(dest, stable=True).indices
    counts = torch.bincount(dest, minlength=world_size).tolist()
    return DispatchPlan(order, counts)


def local_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float = 1.25) -> int:
    """DeepSpeed-MoE / GShard per-expert capacity computed from one rank's own token count. Shown (and tested)
    to differ between ranks with different loads, which is why :func:`plan`'s counts are exchanged instead."""
    return int(np.ceil(capacity_factor * n_tokens * top_k / n_experts))


def inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``x[order]``: ``y[inverse(order)] == x`` for ``y = x[order]``."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(len(order), dtype=order.dtype, device=order.device)
    return inv


@dataclass
class DevicePlan:
    """Device-side dispatch plan (no host value): ``spos [n]`` int64, each row's index in the send buffer
    (``trash`` for pad rows and rows past capacity); ``counts [G]`` int64 valid rows per destination (before
    capacity); ``overflow`` 0-d int64, rows that did not fit ``capacity`` (always 0 when capacity is None)."""

    spos: torch.Tensor
    counts: torch.Tensor
    overflow: torch.Tensor
    trash: int


def plan_device(dest: torch.Tensor, valid: torch.Tensor, world_size: int, capacity: int | None = None
                ) -> DevicePlan:
    """Group rows by destination on the device, without a host sync (CUDA-graph capturable).

    ``dest [n]`` int64 ranks in ``[0, world_size)`` (from a device placement table, so in range by construction),
    ``valid [n]`` bool (pad rows are not sent). The slot of a row within its destination is its stable rank among
    that destination's valid rows (a cumulative sum of the one-hot destination matrix; ``torch.bincount`` and
    ``F.one_hot`` are avoided because on CUDA they read the maximum on the host).

    * ``capacity=None`` (exact): rows packed by destination, ``spos = offset[dest] + slot`` with the exclusive
      cumulative counts; the send buffer needs ``n + 1`` rows (``trash = n``).
    * ``capacity=C``: a fixed ``[G*C]`` buffer, ``spos = dest*C + slot``; rows with ``slot >= C`` go to
      ``trash = G*C`` and are counted in ``overflow``.
    """
    G, n = world_size, dest.shape[0]
    d = torch.where(valid, dest, G)
    onehot = (d[:, None] == torch.arange(G + 1, device=dest.device)[None, :]).long()  # [n, G+1]
    cum = onehot.cumsum(0)
    slot = cum.gather(1, d[:, None])[:, 0] - 1
    counts = onehot.sum(0)[:G]
    dc = d.clamp_max(G - 1)
    if capacity is None:
        off = counts.cumsum(0) - counts
        spos = torch.where(valid, off[dc] + slot, n)
        return DevicePlan(spos, counts, torch.zeros((), dtype=torch.int64, device=dest.device), n)
    ok = valid & (slot < capacity)
    spos = torch.where(ok, dc * capacity + slot, G * capacity)
    return DevicePlan(spos, counts, (counts - capacity).clamp_min(0).sum(), G * capacity)
