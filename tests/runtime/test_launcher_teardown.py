"""A script run under torchrun that never destroys its process group must not leave it to interpreter exit (gloo's
threads then can abort a rank after the job succeeded): init_from_env tears it down at exit."""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit
    import torch.distributed as dist
    # registered first, so it runs after hpdl's handler (atexit is last-in first-out)
    atexit.register(lambda: print(f"rank-exit initialized={dist.is_initialized()}", flush=True))
    import torch
    from hpdl.runtime import init_from_env
    ctx = init_from_env("cpu")
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == ctx.world_size
""")


@pytest.mark.timeout(180)
def test_init_from_env_destroys_its_group_at_exit(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script)], capture_output=True, text=True, timeout=150, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("rank-exit initialized=False") == 2, r.stdout[-2000:]


def _sleep_forever(ctx, ready):
    import time

    import torch.distributed as dist

    dist.barrier()
    if ctx.rank == 0:
        open(ready, "w").close()
    time.sleep(600)


def test_ctrl_c_of_spawn_ends_the_ranks_at_once(tmp_path):
    """Ctrl-C reaching only the parent (a scheduler's SIGINT; ranks stuck in C code, such as a peer kernel on a
    shared GPU, see no KeyboardInterrupt either): spawn kills its ranks and returns (MPS is stopped after them).
    Each rank used to get 5 s of join in turn: 20 s for these 4; 10 s leaves a loaded host its margin."""
    from hpdl.runtime import spawn

    import signal
    import threading
    import time

    ready = tmp_path / "ready"
    when: list = []

    def interrupt():
        while not ready.exists():
            time.sleep(0.05)
        when.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            spawn(_sleep_forever, 4, args=(str(ready),), timeout=60, job_timeout=120)
        took = time.monotonic() - when[0]
    finally:
        signal.signal(signal.SIGINT, previous)
    assert took < 15.0, f"spawn returned {took:.1f}s after Ctrl-C"   # one 0.5 s deadline; it was 5 s per rank (>= 20 s)


def _stuck(ctx):
    import time

    time.sleep(600)


def test_rank_pool_tears_down_stuck_ranks_at_once():
    """A call whose ranks never answer: the pool names them after ``timeout`` and kills them together (each
    stuck rank used to get 2 s of join in turn: 8 s for these 4, 1 + 8 s in all; now 1 + 2 s)."""
    import time

    from hpdl.runtime import CollectiveTimeoutError
    from hpdl.testing.pool import RankPool

    pool = RankPool(4, timeout=60)
    try:
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match=r"ranks still running: \[0, 1, 2, 3\]"):
            pool.run(_stuck, timeout=1.0)
        took = time.monotonic() - t0
        assert not any(p.is_alive() for p in pool._procs)
    finally:
        pool.close()
    assert took < 7.5, f"run returned {took:.1f}s after it began (timeout 1 s)"   # about 3 s now; >= 9 s before
