"""Rank-side bodies of test_comm_shared_gpu.py: every multi-rank CUDA path of hpdl.comm with N ranks sharing
GPUs (``ranks_per_gpu``), exact against closed forms and gloo on host copies (integer-valued inputs, #wrong
counted), results bit-identical on every rank. Each function returns a dict ``case -> #wrong`` (or an error
string) so that one failing case does not hide the others."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import hpdl.comm as hc
from hpdl.bench.verify import expected, make_input
from hpdl.runtime.errors import CollectiveTimeoutError, PeerFailedError

SIZES = [0, 1, 3, 1025, 65537, (1 << 20) + 3]   # the last runs several rounds of every registered slot


def _case(res: dict, name: str, fn) -> None:
    try:
        res[name] = fn()
    except Exception as exc:  # noqa: BLE001 - a failing case is reported, the others still run
        res[name] = f"error {exc!r}"[:300]


def _same_on_every_rank(t: torch.Tensor) -> bool:
    """True when ``t``'s bytes are identical on every rank (gathered over gloo on the host)."""
    mine = t.detach().reshape(-1).cpu().view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], x) for x in everyone[1:])


def _agree(res: dict) -> dict:
    """Sum every case's #wrong over ranks (a rank's error shows as -1 in the sum, its text kept on rank 0)."""
    out = {}
    for name, v in res.items():
        t = torch.tensor([v if isinstance(v, int) else -1], dtype=torch.int64)
        dist.all_reduce(t)
        out[name] = v if isinstance(v, str) else int(t.item())
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, {k: v for k, v in res.items() if isinstance(v, str)})
    for q, errs in enumerate(errors):
        for k, v in errs.items():
            out[k] = f"rank {q}: {v}"
    return out


def environment(ctx):
    """What the launch mode gave this rank: device, backend, topology, no NCCL."""
    return {"device": str(ctx.device), "backend": ctx.backend, "ranks_per_gpu": ctx.ranks_per_gpu,
            "shares_gpus": ctx.topology.shares_gpus, "env": os.environ.get("HPDL_RANKS_PER_GPU"),
            "nccl": dist.is_nccl_available() and dist.get_backend() == "nccl",
            "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))}


def all_reduce_matrix(ctx):
    """all_reduce through the public API: every algorithm, the peer kernels with throttle windows 1, 2 and
    world-1, dtypes, ops, sizes 0..past the registered buffer; bf16 with random data bit-identical on every
    rank; in-place non-contiguous views."""
    p, r, dev = ctx.world_size, ctx.rank, ctx.device
    res: dict = {}
    windows = sorted({1, min(2, p - 1), p - 1}) if p > 1 else [None]
    plans = [("one_shot", None), ("two_shot", None), ("auto", None), ("native", None), ("ring", None),
             ("recursive_doubling", None), ("staged", None)]
    plans += [(a, k) for a in ("one_shot", "two_shot", "direct") for k in windows]
    for algo, k in plans:
        def run(algo=algo, k=k):
            bad = 0
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                for op in (("sum", "max", "avg") if dtype.is_floating_point else ("sum", "product")):
                    for n in SIZES:
                        if algo in ("direct", "ring", "recursive_doubling", "staged", "native") and n > 70000 \
                                and dtype != torch.float32:
                            continue   # host-staged paths: one large size is enough, they are slow over gloo
                        x = make_input(r, n, op, dtype, seed=n % 7, device=dev)
                        hc.all_reduce(x, op=op, algorithm=algo, window=k)
                        bad += int((x.cpu() != expected(p, n, op, dtype, seed=n % 7)).sum())
            return bad
        _case(res, f"all_reduce {algo}" + (f" window={k}" if k else ""), run)

    def random_bf16_identical():
        bad = 0
        for algo in ("one_shot", "two_shot", "auto", "native", "direct"):
            g = torch.Generator().manual_seed(100 + r)
            x = torch.randn(40_003, generator=g).to(torch.bfloat16).to(dev)
            hc.all_reduce(x, algorithm=algo)
            bad += 0 if _same_on_every_rank(x) else 1
        return bad
    _case(res, "bf16 random data bit-identical on every rank", random_bf16_identical)

    def strided_inplace():
        bad = 0
        for algo in ("one_shot", "two_shot", "direct", "native"):
            base = make_input(r, 4 * 513, "sum", torch.float32, seed=3, device=dev).view(4, 513)
            want = expected(p, 4 * 513, "sum", torch.float32, seed=3).view(4, 513)
            view = base.t()                  # non-contiguous: written back through a copy
            hc.all_reduce(view, algorithm=algo)
            bad += int((base.cpu() != want).sum())
            y = make_input(r, 2 * 1001, "sum", torch.float32, seed=4, device=dev)
            half = y[::2]                    # strided; the other half must stay untouched
            before = y[1::2].cpu().clone()
            hc.all_reduce(half, algorithm=algo)
            bad += int((half.cpu() != expected(p, 2 * 1001, "sum", torch.float32, seed=4)[::2]).sum())
            bad += int((y[1::2].cpu() != before).sum())
        return bad
    _case(res, "in-place strided and transposed views", strided_inplace)

    def async_side_stream():
        xs = [make_input(r, 1 << 18, "sum", torch.bfloat16, seed=i, device=dev) for i in range(3)]
        works = [hc.all_reduce(x, async_op=True, algorithm="two_shot") for x in xs]
        a = torch.randn(512, 512, device=dev)
        a @ a
        for w in works:
            w.wait()
        torch.cuda.synchronize()
        return sum(int((x.cpu() != expected(p, 1 << 18, "sum", torch.bfloat16, seed=i)).sum())
                   for i, x in enumerate(xs))
    _case(res, "async on the side stream beside a matmul", async_side_stream)

    def async_waited_on_another_stream():
        """wait() on stream s2, the next call on the current stream: that call must still come after the async
        one (same peer buffer). The side stream sleeps before the async kernel, so right after the next call is
        issued the current stream must still be busy (waiting); then both results are exact."""
        from hpdl.comm.transport.resources import resources_of

        n = 1 << 16
        x = make_input(r, n, "sum", torch.float32, seed=8, device=dev)
        y = make_input(r, n, "sum", torch.float32, seed=9, device=dev)
        hc.all_reduce(torch.ones(n, device=dev), async_op=True, algorithm="two_shot").wait()   # side stream made
        hc.all_reduce(torch.ones(n, device=dev), algorithm="two_shot")
        torch.cuda.synchronize()
        dist.barrier()
        side = resources_of(None).side_stream
        with torch.cuda.stream(side):
            torch.cuda._sleep(500_000_000)   # ~0.25 s of GPU clock before the async kernel runs
        w = hc.all_reduce(x, async_op=True, algorithm="two_shot")
        s2 = torch.cuda.Stream()
        with torch.cuda.stream(s2):
            w.wait()
        hc.all_reduce(y, algorithm="two_shot")
        not_ordered = int(torch.cuda.current_stream().query())   # done already: y's kernel ran beside x's
        torch.cuda.synchronize()
        return (not_ordered + int((x.cpu() != expected(p, n, "sum", torch.float32, seed=8)).sum())
                + int((y.cpu() != expected(p, n, "sum", torch.float32, seed=9)).sum()))
    _case(res, "async waited on another stream, next call ordered after it", async_waited_on_another_stream)

    def graph_replay():
        from hpdl.comm.algorithms import peer

        bad = 0
        for algo in ("one_shot", "two_shot"):
            peer.register()
            x = make_input(r, 70_001, "sum", torch.float32, seed=5, device=dev)
            hc.all_reduce(x.clone(), algorithm=algo)   # first call outside capture: registers, plans
            torch.cuda.synchronize()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                hc.all_reduce(x, algorithm=algo)
            for seed in (6, 7):
                x.copy_(make_input(r, 70_001, "sum", torch.float32, seed=seed, device=dev))
                g.replay()
                torch.cuda.synchronize()
                bad += int((x.cpu() != expected(p, 70_001, "sum", torch.float32, seed=seed)).sum())
        return bad
    _case(res, "CUDA graph capture and replay (one_shot, two_shot)", graph_replay)
    return _agree(res)


def phases_matrix(ctx):
    """reduce_scatter_tensor and all_gather_into_tensor (incl. in-place all-gather) on CUDA tensors."""
    p, r, dev = ctx.world_size, ctx.rank, ctx.device
    res: dict = {}
    for algo in ("auto", "direct", "ring", "native"):
        def rs(algo=algo):
            bad = 0
            for dtype in (torch.float32, torch.bfloat16):
                for m in (0, 1, 3, 1025, 65537):
                    inp = make_input(r, m * p, "sum", dtype, seed=m % 5, device=dev)
                    out = torch.full((m,), -7, dtype=dtype, device=dev)
                    hc.reduce_scatter_tensor(out, inp, algorithm=algo)
                    want = expected(p, m * p, "sum", dtype, seed=m % 5)[r * m:(r + 1) * m]
                    bad += int((out.cpu() != want).sum())
            return bad

        def ag(algo=algo):
            bad = 0
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                for m in (0, 1, 3, 1025, 65537):
                    inp = make_input(r, m, "sum", dtype, seed=r, device=dev)
                    out = torch.full((m * p,), -7, dtype=dtype, device=dev)
                    hc.all_gather_into_tensor(out, inp, algorithm=algo)
                    want = torch.cat([make_input(q, m, "sum", dtype, seed=q) for q in range(p)])
                    bad += int((out.cpu() != want).sum())
                    inplace = torch.full((m * p,), -7, dtype=dtype, device=dev)   # input aliases its block
                    inplace[r * m:(r + 1) * m] = inp
                    hc.all_gather_into_tensor(inplace, inplace[r * m:(r + 1) * m], algorithm=algo)
                    bad += int((inplace.cpu() != want).sum())
            return bad
        _case(res, f"reduce_scatter {algo}", rs)
        _case(res, f"all_gather {algo}", ag)
    return _agree(res)


def _split_matrix(rank: int, world: int, seed: int, big: bool) -> list[list[int]]:
    hi = 200_000 if big else 3000
    m = []
    for q in range(world):
        g = torch.Generator().manual_seed(seed * 131 + q)
        row = torch.randint(0, hi, (world,), generator=g).tolist()
        row[(q + seed) % world] = 0   # a zero-length block in every layout
        m.append(row)
    return m


def _a2a_inputs(rank, world, seed, big, row, dtype, dev):
    m = _split_matrix(rank, world, seed, big)
    isp, osp = m[rank], [m[q][rank] for q in range(world)]
    n = sum(isp)
    x = torch.arange(n * row, dtype=torch.int64).view(n, row)
    inp = ((x * 7 + rank * 1009 + seed * 31) % 251).to(dtype)
    want = torch.empty((sum(osp), row), dtype=dtype)
    dist.all_to_all_single(want, inp, osp, isp)   # the oracle: gloo on host tensors
    return inp.to(dev), want, isp, osp


def all_to_all_matrix(ctx):
    """all_to_all_single with uneven splits (zero blocks, several rounds), push/pull peer kernels, window 1,
    host algorithms, a non-contiguous output, async, and CUDA-graph replay."""
    p, r, dev = ctx.world_size, ctx.rank, ctx.device
    res: dict = {}
    for algo in ("push", "pull", "auto", "native", "pairwise", "direct"):
        def run(algo=algo):
            bad = 0
            for seed, big in ((0, False), (1, True), (2, False)):
                for dtype, row in ((torch.float32, 3), (torch.bfloat16, 5), (torch.uint8, 7)):
                    if big and algo in ("pairwise", "direct", "native") and dtype != torch.float32:
                        continue
                    inp, want, isp, osp = _a2a_inputs(r, p, seed, big, row, dtype, dev)
                    for window in ((None, 1) if algo in ("push", "pull") else (None,)):
                        out = torch.full((sum(osp), row), 3, dtype=dtype, device=dev)
                        hc.all_to_all_single(out, inp, osp, isp, algorithm=algo, window=window)
                        torch.cuda.synchronize()
                        bad += int((out.cpu() != want).sum())
            return bad
        _case(res, f"all_to_all {algo} uneven", run)

    def equal_noncontig():
        inp = torch.arange(4 * p * 6, dtype=torch.float32, device=dev).view(4 * p, 6) + 1000 * r
        want = torch.empty(4 * p, 6)
        dist.all_to_all_single(want, inp.cpu())
        base = torch.zeros(6, 4 * p, device=dev)
        out = base.t()
        hc.all_to_all_single(out, inp, algorithm="push")
        torch.cuda.synchronize()
        return int((out.cpu() != want).sum())
    _case(res, "all_to_all equal splits, non-contiguous output", equal_noncontig)

    def async_and_graph():
        inp, want, isp, osp = _a2a_inputs(r, p, 4, True, 2, torch.bfloat16, dev)
        out = torch.full((sum(osp), 2), 1, dtype=torch.bfloat16, device=dev)
        hc.all_to_all_single(out, inp, osp, isp, algorithm="push")   # registers outside capture
        w = hc.all_to_all_single(out, inp, osp, isp, algorithm="push", async_op=True)
        w.wait()
        torch.cuda.synchronize()
        bad = int((out.cpu() != want).sum())
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(2):
                hc.all_to_all_single(out, inp, osp, isp, algorithm="push")
        out.fill_(0)
        g.replay()
        g.replay()
        torch.cuda.synchronize()
        return bad + int((out.cpu() != want).sum())
    _case(res, "all_to_all async and CUDA graph (push)", async_and_graph)
    return _agree(res)


def two_level_matrix(ctx, ranks_per_node: int):
    """two_level all-reduce and push/pull all-to-all over emulated nodes of ``ranks_per_node`` ranks."""
    p, r, dev = ctx.world_size, ctx.rank, ctx.device
    res: dict = {}
    hc.set_topology(ranks_per_node)
    try:
        def ar():
            bad = 0
            for dtype in (torch.float32, torch.bfloat16):
                for op in ("sum", "max"):
                    for n in (0, 1, 3, 1025, 65537, (1 << 19) + 5):
                        x = make_input(r, n, op, dtype, seed=n % 3, device=dev)
                        hc.all_reduce(x, op=op, algorithm="two_level")
                        bad += int((x.cpu() != expected(p, n, op, dtype, seed=n % 3)).sum())
            return bad
        _case(res, f"two_level all_reduce, nodes of {ranks_per_node}", ar)
        for algo in ("push", "pull"):
            def a2a(algo=algo):
                bad = 0
                for seed, big in ((0, False), (1, True)):
                    inp, want, isp, osp = _a2a_inputs(r, p, seed, big, 3, torch.float32, dev)
                    out = torch.full((sum(osp), 3), 3.0, device=dev)
                    hc.all_to_all_single(out, inp, osp, isp, algorithm=algo)
                    torch.cuda.synchronize()
                    bad += int((out.cpu() != want).sum())
                return bad
            _case(res, f"two_level all_to_all {algo}, nodes of {ranks_per_node}", a2a)
    finally:
        hc.set_topology(p)   # one node again for the cases that follow
    return _agree(res)


def subgroup_matrix(ctx):
    """Peer kernels and host algorithms on sub-groups: even ranks, and the first half (both made by all)."""
    p, r, dev = ctx.world_size, ctx.rank, ctx.device
    res: dict = {}
    evens = list(range(0, p, 2))
    half = list(range(max(1, p // 2)))
    groups = [("even ranks", evens, dist.new_group(evens)), ("first half", half, dist.new_group(half))]
    for label, members, g in groups:
        if r not in members:
            res[f"sub-group {label}"] = 0
            continue

        def run(members=members, g=g):
            bad = 0
            q = members.index(r)
            for algo in ("one_shot", "two_shot", "direct", "native"):
                for n in (1, 1025, 65537):
                    x = make_input(q, n, "sum", torch.float32, seed=2, device=dev)
                    hc.all_reduce(x, group=g, algorithm=algo)
                    bad += int((x.cpu() != expected(len(members), n, "sum", torch.float32, seed=2)).sum())
            if len(members) > 1:
                inp = torch.arange(4 * len(members), dtype=torch.float32, device=dev) + 100 * q
                out = torch.empty_like(inp)
                hc.all_to_all_single(out, inp, group=g, algorithm="push")
                want = torch.cat([torch.arange(4 * len(members), dtype=torch.float32)[4 * q:4 * q + 4] + 100 * s
                                  for s in range(len(members))])
                torch.cuda.synchronize()
                bad += int((out.cpu() != want).sum())
            return bad
        _case(res, f"sub-group {label}", run)
    return _agree(res)


def ddp_hook_losses(ctx, steps: int, hook: str):
    """nanoGPT-small-shaped training steps under DDP (gloo group, CUDA model) with the gradient all-reduce
    done by ``hook``: "gloo" (DDP's own), "hpdl" (hpdl.comm's DDP hook) or "bucket" (BucketAllReduce).
    Returns the losses (rank 0's view) and whether parameters are bit-identical on every rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpdl.comm.hooks import BucketAllReduce, register
    from hpdl.models.nanogpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=128, dropout=0.0)
    model = GPT(cfg).to(ctx.device)
    losses = []
    if hook == "bucket":
        step_model = model
        reducer = BucketAllReduce(model.parameters(), bucket_cap_mb=1.0)
    else:
        step_model = DDP(model, device_ids=[ctx.device.index], bucket_cap_mb=1)
        if hook == "hpdl":
            register(step_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    for _ in range(steps):
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g).to(ctx.device)
        _, loss = step_model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if hook == "bucket":
            reducer.wait()
        opt.step()
        t = loss.detach().float().cpu().reshape(1)
        dist.all_reduce(t)
        losses.append(float(t.item()) / ctx.world_size)
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    return losses, _same_on_every_rank(flat)


def missing_and_dead(ctx, mode: str, outdir: str):
    """A rank that never arrives (``mode="stuck"``: it sleeps) or dies (``"killed"``: it exits) while the
    others call the peer kernel with the argument check on, and a host algorithm: the others must raise
    CollectiveTimeoutError / PeerFailedError naming it within the timeout, not hang."""
    culprit = ctx.world_size - 1
    if ctx.rank == culprit:
        if mode == "killed":
            os._exit(7)
        time.sleep(15)   # past the others' 8 s timeout
        return {"culprit": True}
    import json

    out = {}
    for algo in ("two_shot",):   # after a timed-out exchange the group's posted receives stay: one call
        x = torch.ones(1025, device=ctx.device)
        t0 = time.monotonic()
        try:
            hc.all_reduce(x, algorithm=algo, timeout=8.0, check=True)
            out[algo] = {"type": None, "names": [], "seconds": time.monotonic() - t0}
        except (CollectiveTimeoutError, PeerFailedError) as exc:
            out[algo] = {"type": type(exc).__name__, "names": exc.missing_ranks, "seconds": time.monotonic() - t0,
                         "message": str(exc)[:200]}
    with open(os.path.join(outdir, f"rank{ctx.rank}.json"), "w") as fh:
        json.dump(out, fh)
    return out
