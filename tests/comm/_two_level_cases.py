"""Rank-side bodies for the two-level all-reduce and all-to-all tests (module-level: spawned ranks unpickle them)."""

import hashlib
import os
import time

import torch

import hpdl.comm as hc
from hpdl.bench.verify import expected, make_input
from hpdl.comm.transport.resources import resources_of

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]


_SUBGROUPS: dict = {}


def _sub(ctx, world):
    """``(group, p, r)`` for the first ``world`` ranks of the pool (a gloo subgroup, created once, collectively by
    every pool rank), or None on ranks outside it. Lets one 8-rank pool also test 6- and 5-rank topologies."""
    import torch.distributed as dist

    if world is None or world == ctx.world_size:
        return None, ctx.world_size, ctx.rank
    if world not in _SUBGROUPS:
        _SUBGROUPS[world] = dist.new_group(list(range(world)))
    if ctx.rank >= world:
        return None
    return _SUBGROUPS[world], world, ctx.rank


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def all_reduce_matrix(ctx, ranks_per_node, world=None, algorithm="two_level"):
    """Every dtype with sum and max, floats with avg, a few with min/product; counts around the shard edges."""
    sub = _sub(ctx, world)
    if sub is None:
        return [], ""
    group, p, r = sub
    hc.set_topology(ranks_per_node, group)
    rails = max(resources_of(group).topology.ranks_per_node())
    failures, digests = [], []
    cases = [(d, op) for d in DTYPES for op in ("sum", "max")]
    cases += [(d, "avg") for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)]
    cases += [(torch.int32, "min"), (torch.float32, "product"), (torch.bfloat16, "product")]
    for dtype, op in cases:
        for count in sorted({0, 1, rails - 1, rails + 1, 97, 1031}):
            x = make_input(r, count, op, dtype, seed=count)
            hc.all_reduce(x, op=op, group=group, algorithm=algorithm, check=count == 97)
            wrong = int((x != expected(p, count, op, dtype, seed=count)).sum())
            if wrong:
                failures.append(f"{dtype} {op} count={count}: {wrong} wrong")
            digests.append(digest(x))
    return failures, digests


def all_reduce_pipelined(ctx, ranks_per_node, depth, count, world=None):
    """A tensor large enough that every shard is cut into ``depth`` chunks (early trigger on)."""
    from hpdl.comm.algorithms.two_level import TwoLevel, chunk_bounds

    sub = _sub(ctx, world)
    if sub is None:
        return 0, depth, depth, ""
    group, p, r = sub
    os.environ["HPDL_PIPELINE_DEPTH"] = str(depth)
    hc.set_topology(ranks_per_node, group)
    st = resources_of(group)
    for key in [k for k, a in st._algos.items() if getattr(a, "needs_topology", False)]:
        st._algos.pop(key).close()  # the next call builds a fresh instance, which reads the depth
    wrong = 0
    for dtype, op in ((torch.float32, "sum"), (torch.bfloat16, "avg")):
        x = make_input(r, count, op, dtype, seed=5)
        hc.all_reduce(x, op=op, group=group, algorithm="two_level")
        wrong += int((x != expected(p, count, op, dtype, seed=5)).sum())
    algo = next(a for a in st._algos.values() if isinstance(a, TwoLevel))
    rails = st.topology.num_rails
    chunks = len(chunk_bounds(0, count // rails, algo.depth, 4))
    os.environ.pop("HPDL_PIPELINE_DEPTH")
    return wrong, algo.depth, chunks, digest(x)


def back_to_back(ctx, ranks_per_node, calls=12):
    """Changing sizes (growing past the buffer's capacity twice) and mixed all-reduce / all-to-all calls."""
    hc.set_topology(ranks_per_node)
    p, r = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(99)  # same sizes on every rank
    wrong = 0
    caps = []
    for i in range(calls):
        count = int(torch.randint(0, 4000, (1,), generator=g)) * (64 if i in (4, 9) else 1)
        dtype = DTYPES[i % len(DTYPES)]
        x = make_input(r, count, "sum", dtype, seed=i)
        hc.all_reduce(x, algorithm="two_level", check=False)
        wrong += int((x != expected(p, count, "sum", dtype, seed=i)).sum())
        rows = int(torch.randint(0, 50, (1,), generator=g)) * (200 if i == 6 else 1)
        algo = ("push", "pull")[i % 2]
        wrong += _a2a_once(p, r, rows, dtype, algo, i)
        caps.append(sum(a._shm.capacity for a in resources_of(None)._algos.values()
                        if getattr(a, "_shm", None) is not None))
    return wrong, caps


def block_value(src: int, dst: int, rows: int, cols: int, dtype, seed: int) -> torch.Tensor:
    """Rows sent from ``src`` to ``dst``: distinct small integers (exact in every dtype, bool included)."""
    i = torch.arange(rows * cols, dtype=torch.int64).view(rows, cols)
    v = (i * 5 + src * 11 + dst * 3 + seed) % 97
    if dtype == torch.bool:
        return (v % 2).bool()
    return v.to(dtype)


def split_matrix(p: int, kind: str, seed: int) -> list[list[int]]:
    """rows[src][dst]: equal, uneven, or uneven with many zero-length blocks."""
    if kind == "equal":
        return [[3] * p for _ in range(p)]
    if kind == "uneven":
        return [[(s * 7 + d * 3 + seed) % 6 + 1 for d in range(p)] for s in range(p)]
    return [[0 if (s + d + seed) % 3 == 0 else (s * 5 + d + seed) % 9 for d in range(p)] for s in range(p)]


def _a2a_once(p, r, rows, dtype, algorithm, seed) -> int:
    """One uneven all-to-all whose split matrix every rank derives from ``rows``; returns #wrong."""
    m = [[rows % 7 + ((d * 3 + s) % 4) * (rows // 7) for d in range(p)] for s in range(p)]
    inp = torch.cat([block_value(r, q, m[r][q], 1, dtype, seed) for q in range(p)]).view(-1)
    want = torch.cat([block_value(q, r, m[q][r], 1, dtype, seed) for q in range(p)]).view(-1)
    out = torch.empty_like(want)
    hc.all_to_all_single(out, inp, [m[q][r] for q in range(p)], [m[r][q] for q in range(p)], algorithm=algorithm,
                         check=False)
    return int((out != want).sum())


def alltoall_matrix(ctx, ranks_per_node, algorithm, world=None):
    """Equal / uneven / zero-heavy splits x every dtype (and bool) x 1-D and 2-D rows; exact compare."""
    sub = _sub(ctx, world)
    if sub is None:
        return [], []
    group, p, r = sub
    hc.set_topology(ranks_per_node, group)
    failures, digests = [], []
    seed = 0
    for kind in ("equal", "uneven", "zeros"):
        for dtype in DTYPES + [torch.bool]:
            seed += 1
            cols = 1 if dtype in (torch.float32, torch.uint8) else 3
            m = split_matrix(p, kind, seed)
            inp = torch.cat([block_value(r, q, m[r][q], cols, dtype, seed) for q in range(p)])
            want = torch.cat([block_value(q, r, m[q][r], cols, dtype, seed) for q in range(p)])
            if cols == 1:
                inp, want = inp.view(-1), want.view(-1)
            out = torch.empty_like(want)
            if kind == "equal":
                hc.all_to_all_single(out, inp, group=group, algorithm=algorithm, check=dtype == torch.float32)
            else:
                hc.all_to_all_single(out, inp, [m[q][r] for q in range(p)], [m[r][q] for q in range(p)],
                                     group=group, algorithm=algorithm, check=dtype == torch.float32)
            if not torch.equal(out, want):
                failures.append(f"{algorithm} {kind} {dtype}: {int((out != want).sum())} wrong")
            digests.append(digest(out))
    return failures, digests


def alltoall_views(ctx, ranks_per_node, algorithm):
    """Non-contiguous input and output, async handle, and a large message (several MiB per rank)."""
    hc.set_topology(ranks_per_node)
    p, r = ctx.world_size, ctx.rank
    wrong = 0
    base_in = torch.zeros(4 * p, 6, dtype=torch.int64)
    inp = base_in[:, ::2]  # (4p, 3), not contiguous
    inp.copy_(torch.cat([block_value(r, q, 4, 3, torch.int64, 1) for q in range(p)]))
    base_out = torch.full((3, 4 * p), -1, dtype=torch.int64)
    out = base_out.t()  # (4p, 3), not contiguous
    work = hc.all_to_all_single(out, inp, algorithm=algorithm, async_op=True)
    work.wait()
    wrong += int((out != torch.cat([block_value(q, r, 4, 3, torch.int64, 1) for q in range(p)])).sum())
    rows = (1 << 20) // p  # 4 MiB of float32 per rank
    big = torch.cat([block_value(r, q, rows, 1, torch.float32, 2) for q in range(p)]).view(-1)
    got = torch.empty_like(big)
    hc.all_to_all_single(got, big, algorithm=algorithm)
    wrong += int((got != torch.cat([block_value(q, r, rows, 1, torch.float32, 2) for q in range(p)]).view(-1)).sum())
    return wrong


def alltoall_errors(ctx):
    """Errors raised before communication (same on every rank), then a mismatch found by the split check."""
    from _errors import _catch

    p, r = ctx.world_size, ctx.rank
    out = {}
    x = torch.zeros(2 * p)
    out["indivisible"] = _catch(lambda: hc.all_to_all_single(torch.zeros(2 * p + 1), torch.zeros(2 * p + 1)))
    out["split_len"] = _catch(lambda: hc.all_to_all_single(x, x, [2] * (p - 1), [2] * p))
    out["split_sum"] = _catch(lambda: hc.all_to_all_single(x, x, [2] * p, [1] * p))
    out["dtype"] = _catch(lambda: hc.all_to_all_single(x, x.long()))
    out["scalar"] = _catch(lambda: hc.all_to_all_single(torch.tensor(1.0), torch.tensor(1.0)))
    out["algo"] = _catch(lambda: hc.all_to_all_single(x, x, algorithm="ring"))
    out["ar_pairwise"] = _catch(lambda: hc.all_reduce(torch.ones(4), algorithm="pairwise"))
    out["topology"] = _catch(lambda: hc.set_topology([p, 1]))
    # rank 0 claims one row more from rank 1 than rank 1 sends: every rank must raise, none may hang
    osp = [2] * p
    if r == 0:
        osp[1] = 3
    out["mismatch"] = _catch(lambda: hc.all_to_all_single(torch.zeros(sum(osp)), x, osp, [2] * p))
    return out


def dies_mid_call(ctx, ranks_per_node, victim, timeout):
    """``victim`` exits inside the push all-to-all (after the split-size barrier); the others must raise."""
    import hpdl.comm.algorithms.alltoall as A

    hc.set_topology(ranks_per_node)
    p, r = ctx.world_size, ctx.rank
    x = torch.arange(4 * p, dtype=torch.float32)
    hc.all_to_all_single(torch.empty_like(x), x, algorithm="push", timeout=timeout)  # buffers exist now
    names = sorted(n for n in os.listdir("/dev/shm") if n.startswith("hpdl-comm-"))
    if r == victim:
        orig = A._TwoLevelAlltoall._exchange

        def die(*a, **k):
            os._exit(3)
        A._TwoLevelAlltoall._exchange = die
        hc.all_to_all_single(torch.empty_like(x), x, algorithm="push", timeout=timeout, check=False)
        A._TwoLevelAlltoall._exchange = orig
    t0 = time.monotonic()
    try:
        hc.all_to_all_single(torch.empty_like(x), x, algorithm="push", timeout=timeout, check=False)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc), time.monotonic() - t0, names
    return None, "", time.monotonic() - t0, names


def crash_main(rank, world, port, ranks_per_node, victim, timeout, results):
    """Entry point of one rank of the crash test (its own processes: the victim must really die)."""
    from datetime import timedelta

    import torch.distributed as dist

    from hpdl.runtime.launch import _make_context

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout * 4))
        ctx = _make_context(rank, world, rank, torch.device("cpu"), "gloo", ranks_per_node)
        results.put((rank, os.getpid(), dies_mid_call(ctx, ranks_per_node, victim, timeout)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, os.getpid(), (type(exc).__name__, str(exc), -1.0, [])))
    results.close()
    results.join_thread()  # flush the queue's feeder thread before the hard exit
    os._exit(0)  # the group is broken: skip the teardown that would wait for the dead rank


def dies_mid_call_to_file(ctx, ranks_per_node, victim, timeout, path):
    """:func:`dies_mid_call` inside a rank pool: the survivors write their outcome to ``path/<rank>.json``."""
    import json

    res = dies_mid_call(ctx, ranks_per_node, victim, timeout)
    with open(os.path.join(path, f"{ctx.rank}.json"), "w") as fh:
        json.dump({"pid": os.getpid(), "result": list(res)}, fh)
    return res


def inter_native(ctx, ranks_per_node):
    """inter='native' (one dist.new_group per rail) on the world group: exact; on a subgroup: a clear error."""
    from hpdl.comm.algorithms.two_level import TwoLevel

    hc.set_topology(ranks_per_node)
    p, r = ctx.world_size, ctx.rank
    algo = TwoLevel(resources_of(None), inter="native", depth=2)
    comm = resources_of(None).comm(60.0)
    wrong = 0
    for dtype, op, count in ((torch.float32, "sum", 300_001), (torch.bfloat16, "avg", 1031),
                             (torch.int64, "product", 97), (torch.uint8, "max", 5)):
        x = make_input(r, count, op, dtype, seed=count)
        algo.all_reduce(x, op, comm)
        wrong += int((x != expected(p, count, op, dtype, seed=count)).sum())
    algo.close()
    sub = _sub(ctx, 6)
    err = None
    if sub is not None:
        group, _, _ = sub
        hc.set_topology(3, group)
        bad = TwoLevel(resources_of(group), inter="native")
        try:
            bad.all_reduce(torch.ones(8), "sum", resources_of(group).comm(60.0))
        except ValueError as exc:
            err = str(exc)
        bad.close()
    return wrong, err
