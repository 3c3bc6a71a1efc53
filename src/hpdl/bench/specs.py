"""Per-collective plug-ins for the harness (nccl-tests' testColl): buffers, exact data, busbw factor, run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import hpdl.comm as hc
from hpdl.bench.verify import expected, make_input


@dataclass(frozen=True)
class Spec:
    """One collective.

    ``setup(rank, p, count, dtype, op, device, seed)`` returns ``(args, result_fn, want)``: the tensors the call
    takes, a function returning the tensor to check, and the exact expected result (or None to skip checking).
    ``run(args, op, algorithm, window)`` performs one call.
    """

    name: str
    busbw_factor: Callable[[int], float]
    count_multiple_of_world: bool
    setup: Callable
    run: Callable


def _check(t: torch.Tensor):
    """Timed calls skip the argument check: off explicitly on CPU, and on CUDA the default (off), so that the
    API's cached fast path is what gets measured, as users run it."""
    return None if t.is_cuda else False


def _ar_setup(rank, p, count, dtype, op, device, seed):
    x = make_input(rank, count, op, dtype, seed, device)
    return (x,), (lambda: x), expected(p, count, op, dtype, seed)


def _ar_run(args, op, algorithm, window):
    hc.all_reduce(args[0], op=op, algorithm=algorithm, window=window, check=_check(args[0]))


def _rs_setup(rank, p, count, dtype, op, device, seed):
    m = count // p
    inp = make_input(rank, count, op, dtype, seed, device)
    out = torch.empty(m, dtype=dtype, device=device)
    return (out, inp), (lambda: out), expected(p, count, op, dtype, seed)[rank * m:(rank + 1) * m]


def _rs_run(args, op, algorithm, window):
    hc.reduce_scatter(args[0], args[1], op=op, algorithm=algorithm, window=window, check=_check(args[0]))


def _ag_setup(rank, p, count, dtype, op, device, seed):
    m = count // p
    full = [make_input(q, m, "max", dtype, seed) for q in range(p)]
    out = torch.empty(count, dtype=dtype, device=device)
    inp = full[rank].to(device)
    return (out, inp), (lambda: out), torch.cat(full)


def _ag_run(args, op, algorithm, window):
    hc.all_gather(args[0], args[1], algorithm=algorithm, window=window, check=_check(args[0]))


def _a2a_block(src: int, dst: int, n: int, dtype) -> torch.Tensor:
    """Elements rank ``src`` sends to ``dst``: small integers, exact in every dtype."""
    i = torch.arange(n, dtype=torch.int64)
    return ((i * 5 + src * 11 + dst * 3) % 97).to(dtype)


def _a2a_setup(rank, p, count, dtype, op, device, seed):
    m = count // p
    inp = torch.cat([_a2a_block(rank, q, m, dtype) for q in range(p)]).to(device)
    out = torch.empty(count, dtype=dtype, device=device)
    return (out, inp), (lambda: out), torch.cat([_a2a_block(q, rank, m, dtype) for q in range(p)])


def _a2a_run(args, op, algorithm, window):
    hc.all_to_all_single(args[0], args[1], algorithm=algorithm, window=window, check=False)


SPECS: dict[str, Spec] = {
    "allreduce": Spec("allreduce", lambda p: 2 * (p - 1) / p, False, _ar_setup, _ar_run),
    "reduce_scatter": Spec("reduce_scatter", lambda p: (p - 1) / p, True, _rs_setup, _rs_run),
    "all_gather": Spec("all_gather", lambda p: (p - 1) / p, True, _ag_setup, _ag_run),
    # size = bytes each rank sends in total (nccl-tests alltoall_perf); busbw factor (p-1)/p
    "alltoall": Spec("alltoall", lambda p: (p - 1) / p, True, _a2a_setup, _a2a_run),
}
