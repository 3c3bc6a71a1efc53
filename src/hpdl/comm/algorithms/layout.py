"""The byte layout of one rank's ``all_to_all_single`` call, shared by every Alltoall algorithm (host and peer
kernel): torch's argument checks, the per-peer byte offsets and lengths, and the collective cross-check of the
splits every rank gave.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hpdl.comm.transport.base import Transport
from hpdl.runtime.errors import CollectiveMismatchError


@dataclass(frozen=True)
class Layout:
    """Byte offsets and lengths of the blocks one rank sends to / receives from each peer."""

    send_off: tuple[int, ...]
    send_len: tuple[int, ...]
    recv_off: tuple[int, ...]
    recv_len: tuple[int, ...]


def _splits(name: str, t: torch.Tensor, splits, p: int) -> list[int]:
    rows = t.size(0)
    if splits is None:
        if rows % p:
            raise ValueError(f"{name}.size(0)={rows} must be divisible by world_size={p} when {name}_split_sizes "
                             "is None")
        return [rows // p] * p
    out = [int(s) for s in splits]
    if len(out) != p or any(s < 0 for s in out):
        raise ValueError(f"{name}_split_sizes must be {p} non-negative ints (one per rank), got {list(splits)}")
    if sum(out) != rows:
        raise ValueError(f"{name}_split_sizes must sum to {name}.size(0)={rows}, got sum {sum(out)}")
    return out


def make_layout(output: torch.Tensor, input: torch.Tensor, output_split_sizes, input_split_sizes,
                world_size: int, rank: int | None = None) -> tuple[Layout, list[int], list[int]]:
    """Validate torch's ``all_to_all_single`` arguments; return the byte layout and both split lists (rows).

    ``rank`` (this rank in the group), when given, also checks the one pair a rank can check alone: the rows
    it keeps, ``input_split_sizes[rank]``, must equal ``output_split_sizes[rank]``.

    Raises:
        ValueError: a 0-d tensor, different dtypes, devices or row shapes, splits of the wrong length, negative,
            or not summing to ``size(0)``, equal splits requested for a size not divisible by ``world_size``,
            or different own-block sizes.
    """
    for name, t in (("output", output), ("input", input)):
        if t.dim() == 0:
            raise ValueError(f"{name} must have at least one dimension (rows are split along dim 0)")
    if output.dtype != input.dtype:
        raise ValueError(f"output and input must have the same dtype, got {output.dtype} and {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"output and input must be on the same device, got {output.device} and {input.device}")
    if tuple(output.shape[1:]) != tuple(input.shape[1:]):
        raise ValueError(f"output and input must have the same shape after dim 0, got {tuple(output.shape)} and "
                         f"{tuple(input.shape)}")
    osp = _splits("output", output, output_split_sizes, world_size)
    isp = _splits("input", input, input_split_sizes, world_size)
    if rank is not None and osp[rank] != isp[rank]:
        raise ValueError(f"rank {rank} keeps input_split_sizes[{rank}]={isp[rank]} rows of its own input but "
                         f"expects output_split_sizes[{rank}]={osp[rank]}: they must be equal")
    row = math.prod(input.shape[1:]) * input.element_size()
    soff = np.concatenate([[0], np.cumsum(isp)[:-1]]) * row
    roff = np.concatenate([[0], np.cumsum(osp)[:-1]]) * row
    lay = Layout(tuple(int(x) for x in soff), tuple(s * row for s in isp), tuple(int(x) for x in roff),
                 tuple(s * row for s in osp))
    return lay, osp, isp


def verify_splits(comm: Transport, osp: Sequence[int], isp: Sequence[int], tag: int = 98) -> None:
    """Collective: every rank checks that rank i's output split j equals rank j's input split i, for all i, j.

    Raises:
        CollectiveMismatchError: on every rank, naming the first inconsistent pair.
    """
    p = comm.world_size
    mine = torch.tensor(list(isp) + list(osp), dtype=torch.int64)
    rows = comm.exchange_all(mine, tag=tag)
    m = torch.stack(rows)  # m[i, :p] = input splits of rank i, m[i, p:] = output splits of rank i
    bad = (m[:, p:] != m[:, :p].t()).nonzero()
    if len(bad):
        i, j = (int(x) for x in bad[0])
        raise CollectiveMismatchError(f"all_to_all_single: rank {i} expects output_split_sizes[{j}]={int(m[i, p + j])}"
                                      f" rows from rank {j}, but rank {j} sends input_split_sizes[{i}]="
                                      f"{int(m[j, i])}; every pair must agree")
