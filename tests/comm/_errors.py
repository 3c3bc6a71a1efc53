"""Rank-side bodies for the error tests."""

import torch

import hpdl.comm as hc
from hpdl.runtime.errors import CollectiveMismatchError, CollectiveTimeoutError


def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return type(exc).__name__, str(exc)
    return None, ""


def mismatched_count(ctx, algorithm):
    x = torch.ones(10 + ctx.rank % 2)
    before = x.clone()
    err = _catch(lambda: hc.all_reduce(x, algorithm=algorithm))
    return err, bool(torch.equal(x, before))


def mismatched_dtype(ctx, algorithm):
    x = torch.ones(10, dtype=torch.float32 if ctx.rank == 0 else torch.float64)
    return _catch(lambda: hc.all_reduce(x, algorithm=algorithm))


def mismatched_op(ctx, algorithm):
    x = torch.ones(10)
    return _catch(lambda: hc.all_reduce(x, op="sum" if ctx.rank else "max", algorithm=algorithm))


def mismatched_algorithm(ctx):
    x = torch.ones(10)
    return _catch(lambda: hc.all_reduce(x, algorithm="direct" if ctx.rank == 0 else "ring", timeout=20))


def local_errors(ctx):
    """Errors raised before any communication, identically on every rank."""
    out = {}
    out["bool"] = _catch(lambda: hc.all_reduce(torch.ones(3, dtype=torch.complex128)))
    out["avg_int"] = _catch(lambda: hc.all_reduce(torch.ones(3, dtype=torch.int32), op="avg"))
    out["bad_op"] = _catch(lambda: hc.all_reduce(torch.ones(3), op="xor"))
    out["bad_algo"] = _catch(lambda: hc.all_reduce(torch.ones(3), algorithm="butterfly"))
    out["not_tensor"] = _catch(lambda: hc.all_reduce([1.0, 2.0]))
    out["bad_window"] = _catch(lambda: hc.all_reduce(torch.ones(3), algorithm="direct", window=-2))
    out["rs_size"] = _catch(lambda: hc.reduce_scatter(torch.empty(3), torch.empty(3 * ctx.world_size + 1)))
    out["ag_dtype"] = _catch(lambda: hc.all_gather(torch.empty(3 * ctx.world_size), torch.empty(3, dtype=torch.int64)))
    out["one_shot_cpu"] = _catch(lambda: hc.all_reduce(torch.ones(3), algorithm="one_shot"))
    out["push_ar"] = _catch(lambda: hc.all_reduce(torch.ones(3), algorithm="push"))
    out["window0"] = _catch(lambda: hc.all_reduce(torch.ones(3), algorithm="direct", window=0))
    out["rs_rd"] = _catch(lambda: hc.reduce_scatter(torch.empty(2), torch.ones(2 * ctx.world_size),
                                                     algorithm="recursive_doubling"))
    x = torch.ones(4)
    hc.all_reduce(x)  # the group still works after all of the above
    out["after"] = x.tolist()
    return out


def missing_rank(ctx, absent, timeout):
    if ctx.rank == absent:
        return None, 0.0
    import time

    t0 = time.monotonic()
    err = _catch(lambda: hc.all_reduce(torch.ones(8), timeout=timeout))
    return err, time.monotonic() - t0
