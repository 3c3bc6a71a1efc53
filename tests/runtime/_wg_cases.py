"""Rank-side functions, services and scripts for test_worker_group_faults.py (module level: the ranks import them).

Run as a script (``python _wg_cases.py orphan PIDFILE`` / ``python _wg_cases.py mpi``) it is a parent process for the
tests that need one of their own.
"""
import os
import sys
import time


def rank_of(ctx, *args):
    return ctx.rank


def nap_then_rank(ctx, seconds):
    time.sleep(seconds)
    return ctx.rank


def environment_of(ctx, names):
    return {n: os.environ.get(n) for n in names}


def _boom(*args):
    raise ValueError("boom while unpickling")


class Unpicklable:
    """Pickles anywhere; unpickling it raises (a class whose rebuild fails on the other side)."""

    def __reduce__(self):
        return (_boom, ())


def unpicklable_here(ctx):
    return Unpicklable()


class Echo:
    def __init__(self, ctx):
        self.rank = ctx.rank

    def __call__(self, payload):
        return self.rank, payload


class StopsReadingOn:
    """A service whose rank ``rank`` sleeps in its first call (a rank busy in a long step: it reads nothing)."""

    def __init__(self, ctx, rank):
        self.asleep = ctx.rank == rank

    def __call__(self, payload):
        if self.asleep:
            time.sleep(600)


def write_pid_and_sleep(ctx, path):
    with open(f"{path}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{path}.tmp", path)
    time.sleep(600)


def mpi_world_size(ctx):
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _wg_cases as cases   # the ranks import the functions by this name, not as __mp_main__
    from hpdl.runtime import WorkerGroup

    if sys.argv[1] == "orphan":   # the test SIGKILLs this process while its rank runs the task
        with WorkerGroup(1, timeout=60) as group:
            group.run(cases.write_pid_and_sleep, sys.argv[2])
    elif sys.argv[1] == "mpi":   # started by `mpiexec -n 1`
        with WorkerGroup(1, timeout=60) as group:
            print("world sizes", group.run(cases.mpi_world_size, timeout=120), flush=True)
