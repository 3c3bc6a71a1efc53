"""--comm mpi (mpi4py) gives the single-process numbers; skipped where mpi4py or mpirun is missing."""

import functools
import os
import shutil
import subprocess
import sys

import pytest
import torch

from hpdl.apps import cg, fft3d
from hpdl.apps.comm import LocalComm

HERE = os.path.dirname(__file__)


@functools.lru_cache(maxsize=None)
def _mpi_missing() -> str | None:
    if shutil.which("mpirun") is None:
        return "no mpirun on PATH"
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"mpi4py unusable: {probe.stderr.strip().splitlines()[-1:]}"


@pytest.mark.timeout(300)
@pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
def test_cg_and_fft_over_mpi_equal_single_process(tmp_path):
    n, iters, shape = 10, 30, (6, 10, 7)
    subprocess.run(["mpirun", "-n", "2", sys.executable, os.path.join(HERE, "_mpi_ranks.py"), str(tmp_path), str(n),
                    str(iters), ",".join(map(str, shape))], check=True, timeout=240,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ref = cg.solve(LocalComm(), n, iters)
    assert got[0]["residuals"] == got[1]["residuals"]
    torch.testing.assert_close(torch.tensor(got[0]["residuals"]), torch.tensor(ref.residuals), rtol=1e-10, atol=0)
    torch.testing.assert_close(torch.cat([g["x"] for g in got]), ref.x, rtol=1e-10, atol=1e-12)
    x = fft3d.global_input(shape)
    seq = torch.fft.fft(torch.fft.fft(torch.fft.fft(x, dim=2), dim=1), dim=0)
    assert all(torch.equal(g["y"], seq[g["box"]]) for g in got)
