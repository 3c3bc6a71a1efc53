"""MpiTransport (hpdl.comm.transport.mpi) under ``mpiexec -n 2``: the Transport conformance cases (every dtype,
tags, hpdl.comm's algorithms over it), then its own: the deadline that names the peer, argument checks, the
algorithms against MPI's own Allreduce bit for bit, and the apps' MpiComm halos. One mpiexec run serves every
case (_mpi_transport_cases.py); skipped where mpi4py or mpiexec is missing (``pip install mpi4py mpich``: the dev
extra has both)."""

import ast
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_mpi_transport_cases.py")
# the script runs the conformance cases and its own: their names, read without importing mpi4py here
CASES = [f.name for path in (Path(__file__).with_name("_transport_cases.py"), SCRIPT)
         for f in ast.parse(path.read_text()).body if isinstance(f, ast.FunctionDef)
         and any(isinstance(d, ast.Name) and d.id == "case" for d in f.decorator_list)]


@functools.lru_cache(maxsize=None)
def _mpi_missing() -> str | None:
    if shutil.which("mpiexec") is None:
        return "no mpiexec on PATH"
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], capture_output=True, text=True,
                           timeout=60)
    return None if probe.returncode == 0 else f"mpi4py unusable: {probe.stderr.strip().splitlines()[-1:]}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("mpi_transport")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(["mpiexec", "-n", "2", sys.executable, str(SCRIPT), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # mpiexec and both ranks
        log, _ = proc.communicate()
        pytest.fail(f"mpiexec -n 2 did not finish within 150 s:\n{log[-4000:]}")
    assert proc.returncode == 0, f"mpiexec -n 2 exited {proc.returncode}:\n{log[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_case_list_is_read_from_the_script():
    assert len(CASES) == len(set(CASES)) >= 9
    assert {"a_wait_past_its_deadline_names_the_peer", "hpdl_algorithms_run_over_it_exactly"} <= set(CASES)


@pytest.mark.timeout(200)
@pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
@pytest.mark.parametrize("name", CASES)
def test_mpi_transport_case(results, name):
    for rank, res in enumerate(results):
        assert res.get(name) == "ok", f"rank {rank}, case {name}:\n{res.get(name, 'did not run')}"
