"""CPU latency of WorkerGroup's channel against the queues serve's TP executor used before it (issue 40).

    PYTHONPATH=src python3 benchmarks/runtime_channel_latency.py            # ~1 min on 2 cores
    PYTHONPATH=src python3 benchmarks/runtime_channel_latency.py --smoke    # a few seconds

Both sides carry one decode-step plan (``hpdl.serve.scheduler.StepPlan``, ``--rows`` rows) to one spawned rank:
- ``queues``: the old TPExecutor's plumbing, rebuilt here: the plan over a one-way ``multiprocessing.Pipe``,
  answers over a ``multiprocessing.Queue`` (its errors queue, the only way back).
- ``channel``: ``WorkerGroup.start_service`` with ``Service.post`` (one-way) and ``Service.request``
  (round trip), typed frames with a protocol header.
- ``run``: ``WorkerGroup.run`` of a no-op task (a round trip through a task, not a service).
Columns: median and p90 microseconds of the round trip (plan out, answer back), and of the parent's side of a
one-way post (what a TP step pays before its forward: old: send + a non-blocking errors check; new: post,
which also checks every rank's pipe and process). CPU only, host timers; no device numbers.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import time

from hpdl.runtime import WorkerGroup
from hpdl.serve.scheduler import StepPlan


def _plan(rows: int) -> StepPlan:
    return StepPlan(start=0, n=rows, decode_tokens=list(range(rows)), decode_positions=[100 + i for i in range(rows)])


def _old_worker(inbox, answers) -> None:
    """The old TP worker's loop: plans from the pipe; here it answers each one (True) on the queue, or not."""
    while True:
        item = inbox.recv()
        if item is None:
            return
        plan, answer = item
        if answer:
            answers.put((1, None))


class Echo:
    """A service that returns the number of rows of each plan."""

    def __init__(self, ctx):
        pass

    def __call__(self, plan):
        return plan.n


def _noop(ctx):
    return None


def _stats(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s) * 1e6, s[int(0.9 * (len(s) - 1))] * 1e6


def measure_queues(plan, n: int, pause: float) -> dict:
    ctx = mp.get_context("spawn")
    recv_end, send_end = ctx.Pipe(duplex=False)
    answers = ctx.Queue()
    p = ctx.Process(target=_old_worker, args=(recv_end, answers), daemon=True)
    p.start()
    try:
        rtt, post = [], []
        for i in range(n + n // 10):
            t = time.perf_counter()
            send_end.send((plan, True))
            answers.get()
            if i >= n // 10:
                rtt.append(time.perf_counter() - t)
        for i in range(n + n // 10):
            t = time.perf_counter()
            send_end.send((plan, False))
            try:
                answers.get_nowait()
            except queue.Empty:
                pass
            if i >= n // 10:
                post.append(time.perf_counter() - t)
            time.sleep(pause)   # the worker's forward
        return {"rtt": _stats(rtt), "post": _stats(post)}
    finally:
        send_end.send(None)
        p.join(5)


def measure_channel(plan, n: int, pause: float) -> dict:
    with WorkerGroup(1, threads=1, timeout=60) as g:
        svc = g.start_service(Echo)
        svc.wait_started()
        rtt, post, run = [], [], []
        for i in range(n + n // 10):
            t = time.perf_counter()
            svc.request(plan)
            if i >= n // 10:
                rtt.append(time.perf_counter() - t)
        for i in range(n + n // 10):
            t = time.perf_counter()
            svc.post(plan)
            if i >= n // 10:
                post.append(time.perf_counter() - t)
            time.sleep(pause)
        svc.stop()
        for i in range(n + n // 10):
            t = time.perf_counter()
            g.run(_noop)
            if i >= n // 10:
                run.append(time.perf_counter() - t)
        return {"rtt": _stats(rtt), "post": _stats(post), "run": _stats(run)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64, help="decode rows of the plan (default 64)")
    ap.add_argument("-n", type=int, default=2000, help="messages per measurement (default 2000)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds of both (default 3)")
    ap.add_argument("--smoke", action="store_true", help="200 messages, one round")
    a = ap.parse_args()
    n, repeats = (200, 1) if a.smoke else (a.n, a.repeats)
    plan, pause = _plan(a.rows), 0.0005
    rows = []
    for r in range(repeats):   # alternated, so that a change in the machine's load hits both
        rows.append(("queues (old TP executor)", r, measure_queues(plan, n, pause)))
        rows.append(("channel (WorkerGroup service)", r, measure_channel(plan, n, pause)))
    print(f"CPU, 1 spawned rank, a {a.rows}-row decode StepPlan, {n} messages per cell; microseconds, median / p90")
    print(f"{'plumbing':32} {'round':>5} {'round trip':>16} {'post (parent side)':>20} {'run() no-op':>16}")
    for name, r, m in rows:
        run = "%7.1f / %6.1f" % m["run"] if "run" in m else "-"
        print(f"{name:32} {r:>5} {'%7.1f / %6.1f' % m['rtt']:>16} {'%7.1f / %6.1f' % m['post']:>20} {run:>16}")


if __name__ == "__main__":
    main()
