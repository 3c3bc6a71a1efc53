import torch
import torch.distributed as dist

from hpdl.comm.hooks import HookState, allreduce_hook


def ddp_steps(ctx, algorithm):
    """Train the same tiny model with DDP's default hook and with hpdl's; parameters must match exactly."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    results = []
    for use_hpdl in (False, True):
        m = torch.nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.001)
        if use_hpdl:
            m.register_comm_hook(HookState(algorithm=algorithm), allreduce_hook)
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
