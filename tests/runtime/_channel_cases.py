"""Rank-side functions and services for test_worker_channel.py (module level: the ranks import them)."""
import os

import torch
import torch.distributed as dist


def speak_protocol(ctx, version):
    """From now on this rank writes frames of channel protocol ``version`` (a stale or newer hpdl)."""
    import hpdl.runtime.channel as ch

    ch.PROTOCOL_VERSION = version
    return ctx.rank


class Counter:
    """A service with state: each call adds ``payload`` to its total and returns (rank, pid, total);
    ``("raise", r)`` / ``("exit", r)`` make rank r raise / exit with code 3; ``("closed-file", path)``: close()
    writes the total to ``path.<rank>``."""

    def __init__(self, ctx, start):
        self.rank, self.total, self.closed_file = ctx.rank, start, None

    def __call__(self, payload):
        if isinstance(payload, tuple):
            what, arg = payload
            if what == "closed-file":
                self.closed_file = arg
            elif arg == self.rank and what == "exit":
                os._exit(3)
            elif arg == self.rank and what == "raise":
                raise ValueError(f"bad payload on rank {self.rank}")
            return None
        self.total += payload
        return self.rank, os.getpid(), self.total

    def close(self):
        if self.closed_file:
            with open(f"{self.closed_file}.{self.rank}", "w") as f:
                f.write(str(self.total))


class SumWithDriver:
    """A service whose every call joins an all-reduce with the driver (rank 0, the test process)."""

    def __init__(self, ctx):
        self.rank = ctx.rank

    def __call__(self, value):
        t = torch.tensor([float(value)])
        dist.all_reduce(t)
        return t.item()


class Sleeper:
    """A service whose calls touch ``ready`` and then sleep (a rank busy in a long step)."""

    def __init__(self, ctx, ready):
        self.ready = ready

    def __call__(self, payload):
        import time

        open(self.ready, "w").close()
        time.sleep(600)
