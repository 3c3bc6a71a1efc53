"""Rank functions for test_comm_buckets.py: hpdl.comm.hooks.BucketAllReduce against torch's DDP."""

import torch

from hpdl.comm.hooks import BucketAllReduce


def _mlp(seed=0, integer=False):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 24), torch.nn.Tanh(),
                            torch.nn.Linear(24, 3))
    if integer:  # small integer weights and a linear model: every gradient is an exact small integer
        m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randint(-3, 4, p.shape, generator=g).float())
    return m


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def train_vs_ddp(ctx, algorithm, cap_mb, first_mb, steps=3):
    """Three SGD-with-momentum steps with DDP's default reducer and with BucketAllReduce from the same
    weights; returns (max |param diff|, max |grad diff|, number of buckets)."""
    out = []
    nb = 0
    for use_hpdl in (False, True):
        model = _mlp(seed=ctx.rank if use_hpdl else 0)  # the helper must broadcast rank 0's weights
        if use_hpdl:
            sync = BucketAllReduce(model.parameters(), bucket_cap_mb=cap_mb, first_bucket_mb=first_mb,
                                   algorithm=algorithm)
            nb = len(sync.buckets)
            net = model
        else:
            net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap_mb)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(100 + ctx.rank)
        for _ in range(steps):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g)
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            if use_hpdl:
                sync.wait()
            grads = _flat(p.grad for p in model.parameters())
            opt.step()
            opt.zero_grad()
        if use_hpdl:
            sync.remove()
        out.append((_flat(model.parameters()), grads))
    (p0, g0), (p1, g1) = out
    return float((p0 - p1).abs().max()), float((g0 - g1).abs().max()), nb


def integer_grads_vs_ddp(ctx, algorithm, cap_mb, accumulate):
    """Integer-valued gradients (exact in any summation order): with a power-of-two world size (DDP scales each
    rank's gradient by 1/world before summing, exact only then) the averaged gradients must equal DDP's bit for
    bit whatever the schedule; with ``accumulate`` the first micro-batch runs under no_sync. Returns #wrong."""
    res = []
    for use_hpdl in (False, True):
        model = _mlp(seed=3, integer=True)
        if use_hpdl:
            sync = BucketAllReduce(model.parameters(), bucket_cap_mb=cap_mb, first_bucket_mb=cap_mb,
                                   algorithm=algorithm)
            net, no_sync = model, sync.no_sync
        else:
            net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap_mb)
            no_sync = net.no_sync
        g = torch.Generator().manual_seed(7 + ctx.rank)
        xs = [torch.randint(-2, 3, (4, 8), generator=g).float() for _ in range(2)]
        if accumulate:
            with no_sync():
                net(xs[0]).sum().backward()
        net(xs[1]).sum().backward()
        if use_hpdl:
            sync.wait()
            sync.remove()
        res.append(_flat(p.grad for p in model.parameters()))
    return int((res[0] != res[1]).sum())


def unused_parameter(ctx):
    """A parameter with a gradient on rank 0 only: every rank ends with rank 0's gradient / world_size."""
    a = torch.nn.Parameter(torch.full((5,), 1.0))
    b = torch.nn.Parameter(torch.full((3,), 2.0))
    sync = BucketAllReduce([a, b], bucket_cap_mb=1e-5, first_bucket_mb=1e-5)
    loss = (a * torch.arange(5.0)).sum()
    if ctx.rank == 0:
        loss = loss + (b * 4.0).sum()
    loss.backward()
    sync.wait()
    want_b = torch.full((3,), 4.0 / ctx.world_size)
    return bool(torch.equal(a.grad, torch.arange(5.0)) and torch.equal(b.grad, want_b))


def mismatched_layout(ctx):
    """Rank 0 passes one parameter more than the others: construction raises on every rank."""
    params = [torch.nn.Parameter(torch.zeros(10))] + ([torch.nn.Parameter(torch.zeros(4))] if ctx.rank == 0 else [])
    try:
        BucketAllReduce(params)
    except RuntimeError as exc:
        return str(exc)
    return None


def ready_twice(ctx):
    """Two backward passes without wait() raise a clear error; wait() afterwards still completes the step."""
    w = torch.nn.Parameter(torch.ones(4))
    sync = BucketAllReduce([w])
    (w * 2).sum().backward()
    try:
        (w * 3).sum().backward()
        msg = None
    except RuntimeError as exc:
        msg = str(exc)
    sync.wait()
    return msg


def collective_between_backward_and_wait(ctx, steps=4):
    """A loss all-reduce between backward() and wait() (on the world group, a bucket's size, so that a mix-up
    would not even fail on sizes): both results stay exact. Returns #wrong elements over the steps."""
    import torch.distributed as dist

    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 512)              # a 1 MiB bucket: "auto" is torch's own all_reduce on CPU
    sync = BucketAllReduce(lin.parameters())
    wrong = 0
    for _ in range(steps):
        lin(torch.full((1, 512), float(ctx.rank + 1))).sum().backward()
        t = torch.full((512 * 512 + 512 + 2,), float(ctx.rank + 1))
        dist.all_reduce(t)
        sync.wait()
        want = sum(range(1, ctx.world_size + 1))
        wrong += int((t != want).sum()) + int((lin.weight.grad != want / ctx.world_size).sum())
        lin.zero_grad()
    sync.remove()
    return wrong


def frozen_unused_unfrozen_sparse(ctx):
    """Parameters whose requires_grad changed after construction, unused everywhere, or with sparse gradients.

    Returns (frozen layer unchanged by AdamW and its grad None, unused-everywhere grad None, message for a
    parameter unfrozen after construction, message for a sparse gradient)."""
    m = _mlp()
    sync = BucketAllReduce(m.parameters(), bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1)
    g = torch.Generator().manual_seed(ctx.rank)
    m(torch.randn(4, 16, generator=g)).sum().backward()
    sync.wait()
    opt.step()
    opt.zero_grad()
    for p in m[0].parameters():                  # freeze the first layer after construction
        p.requires_grad_(False)
    w0 = m[0].weight.detach().clone()
    m(torch.randn(4, 16, generator=g)).sum().backward()
    sync.wait()
    frozen_ok = m[0].weight.grad is None and m[0].bias.grad is None and m[2].weight.grad is not None
    opt.step()
    frozen_ok = frozen_ok and torch.equal(m[0].weight, w0)
    sync.remove()

    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    sync = BucketAllReduce([a, b])
    (a * 2).sum().backward()
    sync.wait()
    unused_ok = b.grad is None and torch.equal(a.grad, torch.full((3,), 2.0))
    sync.remove()

    m = _mlp()
    for p in m[0].parameters():
        p.requires_grad_(False)
    sync = BucketAllReduce(m.parameters())
    for p in m[0].parameters():                  # unfrozen after construction: would train unsynchronised
        p.requires_grad_(True)
    m(torch.randn(4, 16, generator=g)).sum().backward()
    try:
        sync.wait()
        unfrozen = None
    except RuntimeError as exc:
        unfrozen = str(exc)
    sync.remove()

    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    sync = BucketAllReduce(emb.parameters())
    try:
        emb(torch.tensor([1, 2])).sum().backward()
        sparse = None
    except RuntimeError as exc:
        sparse = str(exc)
    sync.remove()
    return bool(frozen_ok), bool(unused_ok), unfrozen, sparse


def backward_overlaps_buckets(ctx, key, algorithm):
    """Rank 0 finishes ``backward()`` before any other rank starts its own (a store key orders them): only a
    bucket launch that does not block inside the gradient hook lets that happen (before issue 41 the first
    bucket's schedule ran inside backward and waited for the others). The averaged buckets must equal, bit for
    bit, the same schedule run synchronously on copies of the local gradients. Returns #wrong."""
    import copy

    import torch.distributed as dist

    import hpdl.comm as hc

    store = dist.distributed_c10d._get_default_store()
    model = _mlp(seed=0)
    twin = copy.deepcopy(model)
    sync = BucketAllReduce(model.parameters(), bucket_cap_mb=0.001, first_bucket_mb=0.0005, algorithm=algorithm)
    assert len(sync.buckets) >= 3
    g = torch.Generator().manual_seed(100 + ctx.rank)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g)
    for m in (twin, ):
        torch.nn.functional.cross_entropy(m(x), y).backward()
    local = {id(p): q.grad.clone() for p, q in zip(model.parameters(), twin.parameters())}
    if ctx.rank != 0:
        store.wait([key])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    if ctx.rank == 0:
        store.set(key, "backward done")
    sync.wait()
    wrong = 0
    for b in sync.buckets:   # the synchronous schedule on the same bucket layout
        ref = torch.cat([local[id(p)].reshape(-1) for p in b.params] + [torch.ones(len(b.params))])
        hc.all_reduce(ref, op="avg", group=sync.group, algorithm=algorithm)
        wrong += int((ref != b.buffer).sum())
    sync.remove()
    return wrong


def ddp_hook_checks_once(ctx, algorithm, steps=4):
    """DDP with hpdl's hook: the argument check (a blocking exchange) runs on the first step (and after DDP's
    bucket rebuild), never in later steps. Returns the verify exchanges per step."""
    import hpdl.comm.api as api
    from hpdl.comm.hooks import register

    calls = [0]
    real = api._verify_same

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)
    api._verify_same = counting
    try:
        model = torch.nn.parallel.DistributedDataParallel(_mlp(seed=0), bucket_cap_mb=0.001)
        register(model, algorithm=algorithm)
        g = torch.Generator().manual_seed(100 + ctx.rank)
        per_step = []
        for _ in range(steps):
            before = calls[0]
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            per_step.append(calls[0] - before)
    finally:
        api._verify_same = real
    return per_step
