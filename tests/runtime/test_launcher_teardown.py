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
