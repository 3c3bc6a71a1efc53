import os

import torch
import torch.distributed as dist


def allreduce_rank(ctx):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return t.item(), ctx.topology.node_of, ctx.local_rank


def fail_on_rank(ctx, bad):
    if ctx.rank == bad:
        raise ValueError(f"boom on {ctx.rank}")
    dist.barrier()  # the healthy ranks wait here for the failed one
    return ctx.rank


def hang_on_rank(ctx, bad):
    if ctx.rank == bad:
        import time

        time.sleep(600)
    return ctx.rank


def exit_on_rank(ctx, bad):
    if ctx.rank == bad:
        os._exit(3)
    return ctx.rank
