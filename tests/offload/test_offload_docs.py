"""docs/offload.md's first example (the overlapped Jacobi a new user copies) runs as printed on 2 ranks and
matches a single-process periodic Jacobi of the same global array to float32 rounding."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)

CHECK = """
import torch
from hpdl.runtime import spawn
import offload_doc_example as ex
n, steps, world = 6, 5, 2
out = torch.cat(spawn(ex.jacobi, world, args=(n, steps), job_timeout=200))
g = torch.cat([torch.rand(n, n, n, generator=torch.Generator().manual_seed(r)) for r in range(world)])
for _ in range(steps):
    g = sum(torch.roll(g, k, d) for d in range(3) for k in (-1, 1)) / 6
err = float((out - g).abs().max())
assert err < 1e-5, err
print("ok", err)
"""


def test_the_first_offload_example_runs_as_printed(tmp_path):
    text = (ROOT / "docs" / "offload.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, flags=re.S).group(1)
    assert "def jacobi(ctx" in code, "the first example of docs/offload.md is no longer the Jacobi"
    (tmp_path / "offload_doc_example.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=230)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
