"""``async_op=True`` for hpdl's own CPU schedules is asynchronous (issue 41): queued on the group's worker in
call order, overlapping the caller's computation, exact, with errors at ``wait()``."""

import threading
import uuid

import pytest
import torch

from hpdl.comm.transport.worker import GroupWorker, Job, WorkerClosedError
from hpdl.testing import get_pool

import _async_cases as A


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["direct", "ring", "recursive_doubling"])
def test_async_call_returns_before_peers_join(algorithm):
    # before the worker, rank 0's call ran the schedule to completion and waited 30 s for the others
    assert get_pool(3).run(A.returns_before_peer_calls, f"async-{uuid.uuid4().hex}", algorithm) == [True] * 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_async_overlaps_compute_exactly(world):
    results = get_pool(world).run(A.overlap_exact, ["direct", "ring", "recursive_doubling", "auto"],
                                  [2, 1000, 65536])
    assert results == [(0, True)] * world


@pytest.mark.timeout(120)
def test_many_outstanding_calls_stay_ordered():
    assert get_pool(3).run(A.many_outstanding, 60) == [0] * 3


@pytest.mark.timeout(120)
def test_errors_surface_at_wait_on_every_rank():
    assert get_pool(3).run(A.error_at_wait) == [(True, [True, True], True, True)] * 3


@pytest.mark.timeout(120)
def test_torch_call_between_async_call_and_wait():
    # the first async two_level call discovered the topology on the worker, racing the caller's dist.all_reduce
    assert get_pool(2, timeout=60).run(A.torch_call_between) == [True, True]


def test_worker_runs_in_order_and_close_fails_queued_jobs():
    w = GroupWorker("unit")
    started, release, order = threading.Event(), threading.Event(), []

    def blocker():
        started.set()
        release.wait(10)
        order.append("first")
    first = w.submit(Job(blocker, "first"))
    second = w.submit(Job(lambda: order.append("second"), "second", result=torch.ones(1)))
    assert started.wait(10)
    assert not first.is_completed() and w.outstanding == 2
    release.set()
    second.wait(10)
    assert order == ["first", "second"] and second.get_future().wait().tolist() == [1.0]

    def boom():
        raise ValueError("bad call")
    bad = w.submit(Job(boom, "bad"))
    with pytest.raises(ValueError, match="bad call"):
        bad.wait(10)
    with pytest.raises(ValueError, match="bad call"):   # every wait raises it
        bad.wait(10)
    with pytest.raises(ValueError):
        bad.get_future().wait()

    release2, started2 = threading.Event(), threading.Event()
    running = w.submit(Job(lambda: (started2.set(), release2.wait(10)), "running"))
    queued = w.submit(Job(lambda: order.append("never"), "queued"))
    assert started2.wait(10)
    threading.Timer(0.2, release2.set).start()
    w.close(join_s=10)
    with pytest.raises(WorkerClosedError):
        queued.wait(1)
    running.wait(1)
    assert "never" not in order and w.outstanding == 0
    late = w.submit(Job(lambda: None, "late"))
    with pytest.raises(WorkerClosedError):
        late.wait(1)


@pytest.mark.timeout(120)
def test_cpu_all_reduce_skips_gpu_count_and_caches_native_calls():
    # before: every call's selection asked torch.cuda.device_count() (5 calls -> 5 NVML queries)
    want = {"device_count_calls": 0, "cached": True, "hot_exact": True, "new_table": True}
    assert get_pool(2).run(A.cpu_call_path) == [want] * 2


@pytest.mark.timeout(120)
def test_timeout_surfaces_at_wait_naming_the_missing_rank():
    results = get_pool(2).run(A.timeout_at_wait, f"timeout-{uuid.uuid4().hex}")
    assert results == [([1], True), (None, True)]


@pytest.mark.timeout(120)
def test_future_callback_may_issue_a_call_on_the_same_group():
    # before the drain guard the callback waited for the worker it was running on
    assert get_pool(2).run(A.callback_issues_call, timeout=60) == [True] * 2


EXIT_SCRIPT = """
import sys
import torch
import hpdl.comm as hc
from hpdl.runtime import init_from_env

ctx = init_from_env("cpu")
x = torch.full((1000,), float(ctx.rank + 1))
hc.all_reduce(x, async_op=True, algorithm="direct").wait()
assert x[0].item() == 3.0
# leave one in flight and exit: rank 0 at once, before rank 1 has issued its own
works = [hc.all_reduce(torch.ones(1 << 16), async_op=True, algorithm="ring") for _ in range(3)]
if ctx.rank == 1:
    works[-1].wait()
print(f"rank {ctx.rank} exits", flush=True)
"""


@pytest.mark.timeout(180)
def test_exit_with_async_work_in_flight_is_clean(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", HPDL_TIMEOUT="20")
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script)], capture_output=True, text=True, timeout=150, env=env)
    out = r.stdout + r.stderr
    # rank 0 leaves at once; rank 1 finishes, or its wait() names rank 0 as gone; nothing hangs or aborts
    assert "rank 0 exits" in out and "terminate called" not in out and "Segmentation" not in out, out[-3000:]
    assert "rank 1 exits" in out or "PeerFailedError" in out and "lost rank(s) [0]" in out, out[-3000:]


@pytest.mark.timeout(120)
def test_hot_path_timeout_names_the_missing_rank():
    assert get_pool(2).run(A.hot_path_timeout, f"hot-{uuid.uuid4().hex}") == [(True, [1]), (True, None)]


def test_ctrl_c_in_wait_is_not_the_calls_error():
    # a KeyboardInterrupt that ended one wait() was kept as the Work's error: every later wait() raised it
    # again although the call went on and completed on the worker
    import signal

    from hpdl.comm.api import Work

    w = GroupWorker("ctrl-c")
    release = threading.Event()
    result = torch.zeros(2)
    work = Work(result, job=w.submit(Job(lambda: (release.wait(30), result.fill_(7.0)), "blocked", result)))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # whatever an earlier test left
    try:
        threading.Timer(0.3, lambda: signal.raise_signal(signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            work.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    release.set()
    assert work.wait(10) is True and result.tolist() == [7.0, 7.0]
    w.close()
