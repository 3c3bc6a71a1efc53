"""Rank-side bodies for test_comm_review.py (a hostile review of the comm redesign)."""

import time

import torch

import hpdl.comm as hc
from _errors import _catch


def _poll(work, limit=5.0) -> bool:
    """torch's polling idiom: ``while not work.is_completed(): ...``, bounded here so a bug cannot hang CI."""
    deadline = time.monotonic() + limit
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def is_completed_polls(ctx):
    """Polling is_completed() without wait(): it must turn True, and the result must be in place then, for
    collectives whose native form has finishing steps (avg division, copies back)."""
    p, r = ctx.world_size, ctx.rank
    out = {}
    x = torch.full((10,), float(r + 1))
    w = hc.all_reduce(x, "avg", None, True, algorithm="native")
    out["avg"] = (_poll(w), x.tolist())
    w.wait()
    ag = torch.zeros(2 * p)
    w = hc.all_gather_into_tensor(ag, torch.full((2,), float(r)), None, True, algorithm="native")
    out["all_gather"] = (_poll(w), ag.tolist())
    w.wait()
    rs = torch.zeros(2)
    w = hc.reduce_scatter_tensor(rs, torch.arange(2.0 * p) + r, "sum", None, True, algorithm="native")
    out["reduce_scatter"] = (_poll(w), rs.tolist())
    w.wait()
    nc = torch.zeros(4, 3).t()   # non-contiguous: copied back after the wait
    nc.fill_(float(r))
    w = hc.all_reduce(nc, "sum", None, True, algorithm="native")
    out["non_contiguous"] = (_poll(w), nc.reshape(-1).tolist())
    w.wait()
    return out


def bad_timeouts(ctx):
    """timeout <= 0 or NaN was accepted: the argument check's receives gave up at once, gloo closed the
    group's pairs ("Application timeout caused pair closure") and every later call on the group failed."""
    p = ctx.world_size
    errors = []
    for t in (-1, 0, float("nan"), float("inf")):
        errors.append(_catch(lambda: hc.all_reduce(torch.ones(4), algorithm="direct", timeout=t)))
        errors.append(_catch(lambda: hc.all_to_all_single(torch.zeros(p), torch.ones(p), timeout=t)))
        errors.append(_catch(lambda: hc.all_gather_into_tensor(torch.zeros(p), torch.ones(1), timeout=t)))
    x = torch.ones(4)
    hc.all_reduce(x, algorithm="direct", timeout=30)   # the group still works
    return errors, x.tolist()
