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


def pid_and_sum(ctx, value):
    """(pid, all-reduced value, world_size): shows a WorkerGroup's ranks are the same processes call after call."""
    import os

    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)])
    dist.all_reduce(t)
    return os.getpid(), t.item(), dist.get_world_size()


def standalone_world():
    """init_from_env(standalone=True) without launcher variables: a world of one rank on this process."""
    import os

    import torch.distributed as dist

    from hpdl.runtime import init_from_env

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    ctx = init_from_env("cpu", standalone=True)
    return ctx.rank, ctx.world_size, dist.get_world_size()


def raise_on_rank(ctx, bad):
    """Rank ``bad`` raises, the others return: every rank answers, so the group stays usable."""
    if ctx.rank == bad:
        raise ValueError(f"boom on {ctx.rank}")
    return ctx.rank


def unpicklable_result(ctx):
    """A result the parent cannot receive (a lambda): multiprocessing's feeder thread failed to pickle it,
    printed the error in the rank and dropped the message, and the parent waited for it until its timeout."""
    return lambda: ctx.rank
