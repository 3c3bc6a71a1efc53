import torch
import torch.distributed as dist

from hpdl.comm.hooks import register


def ddp_steps(ctx, algorithm, subgroups=False):
    """Train the same tiny model with DDP's default hook and with hpdl's; parameters must match.

    With ``subgroups``, DDP runs on two disjoint groups (ranks {0, 1} and {2, ...}), which the hook must respect.
    """
    pg = None
    if subgroups:
        halves = [[0, 1], list(range(2, ctx.world_size))]
        groups = [dist.new_group(h) for h in halves]
        pg = groups[0] if ctx.rank < 2 else groups[1]

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    results = []
    for use_hpdl in (False, True):
        m = torch.nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.001, process_group=pg)
        if use_hpdl:
            register(m, algorithm=algorithm)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + ctx.rank)
        for _ in range(3):
            x = torch.randn(8, 16, generator=g)
            loss = m(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        results.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    return float((results[0] - results[1]).abs().max())
